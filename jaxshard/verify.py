"""Verification: what XLA actually inserted, read from the compiled program's text.

`hlo_collectives` counts the collective instructions of ``compiled.as_text()`` by kind
(async ``-start`` forms counted once), so a test or a user can compare them with the
collectives a plan predicts.
"""

from __future__ import annotations

import re
from collections import Counter

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_INSTRUCTION = re.compile(r"=\s*[^=]*?\b(" + "|".join(KINDS) + r")(?:-start)?\(")


def hlo_collectives(hlo_text: str) -> Counter:
    """Collective instructions in compiled HLO text, by kind.

    Example:
        >>> hlo_collectives("%ar = f32[8]{0} all-reduce(f32[8]{0} %x), to_apply=%sum")
        Counter({'all-reduce': 1})
    """
    return Counter(m.group(1) for m in _INSTRUCTION.finditer(hlo_text))


def predicted_kinds(plan) -> set[str]:
    """Kinds of collective a plan's reshards and pending reductions call for.

    Example:
        >>> predicted_kinds(plan)  # doctest: +SKIP
        {'all-reduce'}
    """
    return {op.split(" over ")[0] for r in plan.reshards for op in r.collectives}
