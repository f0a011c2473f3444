"""Verification: what XLA actually inserted, read from the compiled program, against the plan.

`hlo_collectives` counts collective instructions of ``compiled.as_text()`` by kind.
`verify` compiles a plan's program, parses every collective (kind, the mesh axes its
replica groups span, the bytes of each operand — XLA's combiners pack several into one
tuple instruction, so each element counts), matches them to the collectives the plan
predicts, and reports every surprise: a collective not predicted, a predicted one
missing, and XLA's own warnings (involuntary full rematerialization, replication of a
non-divisible dim) captured from its log during the compile.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from jaxshard.cost import nbytes, shards

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_INSTRUCTION = re.compile(r"=\s*[^=]*?\b(" + "|".join(KINDS) + r")(?:-start)?\(")
_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(?:-start)?\((.*)$"
)
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32,
         "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}  # fmt: skip
_WARNINGS = re.compile(
    r"(involuntary full rematerialization|[Ii]nvoluntary|replicat\w+ .*not divisible)"
)


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


@dataclass(frozen=True)
class Collective:
    """One collective transfer: kind, the mesh axes it spans, per-device bytes of one operand."""

    kind: str
    axes: frozenset[str]
    bytes: int

    def __str__(self) -> str:
        return f"{self.kind} over {','.join(sorted(self.axes)) or '?'} of {self.bytes} B"


@dataclass
class Verification:
    """What `verify` found: predicted and compiled collectives, and every surprise."""

    predicted: list[Collective]
    found: list[Collective]
    unpredicted: list[Collective] = field(default_factory=list)
    missing: list[Collective] = field(default_factory=list)
    xla_warnings: list[str] = field(default_factory=list)

    @property
    def surprises(self) -> list[str]:
        """Every mismatch, one line each (empty when the program is what the plan said)."""
        return (
            [f"not predicted: {c}" for c in self.unpredicted]
            + [f"predicted but missing: {c}" for c in self.missing]
            + [f"XLA warning: {w}" for w in self.xla_warnings]
        )

    @property
    def ok(self) -> bool:
        """True when there are no surprises."""
        return not self.surprises

    def __str__(self) -> str:
        head = f"{len(self.found)} compiled collectives, {len(self.predicted)} predicted"
        return "\n".join([head + (": as planned" if self.ok else ":"), *self.surprises])


def _groups_to_axes(groups: list[list[int]], mesh) -> frozenset[str] | None:
    """The mesh axes whose device groups (flat mesh positions) are exactly ``groups``."""
    names, shape = list(mesh.axis_names), mesh.devices.shape
    ids = np.arange(math.prod(shape)).reshape(shape)
    target = sorted(sorted(g) for g in groups)
    for r in range(len(names) + 1):
        for axes in itertools.combinations(range(len(names)), r):
            rest = [i for i in range(len(names)) if i not in axes]
            moved = np.transpose(ids, rest + list(axes)).reshape(
                -1, math.prod(shape[i] for i in axes) or 1
            )
            if sorted(sorted(row.tolist()) for row in moved) == target:
                return frozenset(names[i] for i in axes)
    return None


def _parse_groups(rest: str, n_devices: int) -> list[list[int]] | None:
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", rest)
    if m:
        return [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        out_shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")]
        )
        if m.group(3):
            ids = np.transpose(ids, [int(x) for x in m.group(3).split(",")])
        return ids.reshape(out_shape).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        rest_axes = [i for i in range(len(names)) if i not in chosen]
        return (
            np.transpose(ids, rest_axes + chosen)
            .reshape(-1, math.prod(sizes[i] for i in chosen) or 1)
            .tolist()
        )
    if "replica_groups={}" in rest:
        return [list(range(n_devices))]
    return None


def compiled_collectives(hlo_text: str, mesh) -> list[Collective]:
    """Every collective transfer in compiled HLO text: one per (tuple) operand.

    Example:
        >>> compiled_collectives(compiled.as_text(), mesh)  # doctest: +SKIP
        [Collective(kind='all-reduce', axes=frozenset({'model'}), bytes=16384), ...]
    """
    out = []
    n = mesh.devices.size
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        result, kind, rest = m.groups()
        groups = _parse_groups(rest, n)
        axes = _groups_to_axes(groups, mesh) if groups else frozenset({"?"})
        for dtype, dims in _SHAPE.findall(result):
            size = math.prod(int(d) for d in dims.split(",") if d) * _BITS[dtype] // 8
            out.append(Collective(kind, axes, size))
    return out


def predicted_collectives(plan) -> list[Collective]:
    """The collectives a plan's reshards and pending reductions call for, per device.

    Example:
        >>> predicted_collectives(plan)[0]  # doctest: +SKIP
        Collective(kind='all-reduce', axes=frozenset({'model'}), bytes=16384)
    """
    out = []
    g, sizes = plan.graph, plan.axis_sizes
    for r in plan.reshards:
        total = nbytes(g.shapes[r.vid], g.dtypes[r.vid])
        before, after = total // shards(r.src, sizes), total // shards(r.dst, sizes)
        for op in r.collectives:
            kind, axes = op.split(" over ")
            local = after if kind == "all-gather" else before
            out.append(Collective(kind, frozenset(axes.split(",")), local))
    return out


def _decomposed(c: Collective, unmatched: Counter, sizes) -> bool:
    """Match a multi-axis collective XLA split into one step per axis (e.g. an all-gather
    over data,model done as all-gather over data then over model); consumes the steps."""
    if len(c.axes) < 2:
        return False
    axes = sorted(c.axes)
    for order in itertools.permutations(axes):
        steps, size = [], c.bytes
        for axis in reversed(order):  # the last step produces the full result
            steps.append(Collective(c.kind, frozenset({axis}), size))
            if c.kind == "all-gather":
                size //= sizes[axis]
        if all(unmatched[s] > 0 for s in steps):
            for s in steps:
                unmatched[s] -= 1
            return True
    return False


@contextlib.contextmanager
def _captured_stderr():
    """Capture what native code (XLA) writes to file descriptor 2."""
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        lines: list[str] = []
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            os.write(2, text.encode())  # still shown to the user
            lines.extend(text.splitlines())


def verify(plan, lowered=None) -> Verification:
    """Compile a plan's program and compare its collectives with the plan's predictions.

    ``lowered`` is a `jax.stages.Lowered` of the plan's program (e.g. ``step.lower(...)``);
    without it, the program is lowered from the plan with abstract arguments.

    Example:
        >>> result = verify(step.plan(params, opt_state, batch), step.lower(params, opt_state, batch))  # doctest: +SKIP
        >>> result.ok, result.surprises  # doctest: +SKIP
        (True, [])
    """
    import jax

    from jaxshard.lower import Lowered

    if lowered is None:
        program = Lowered(plan)
        avals = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(plan.traced.in_avals, program.in_shardings)
        ]
        lowered = program.lower(avals)
    with _captured_stderr() as log:
        text = lowered.compile().as_text()
    found = compiled_collectives(text, plan.mesh)
    predicted = predicted_collectives(plan)
    unmatched = Counter(found)
    missing = []
    for c in predicted:
        if unmatched[c] > 0:
            unmatched[c] -= 1
        else:
            missing.append(c)
    missing = [c for c in missing if not _decomposed(c, unmatched, plan.axis_sizes)]
    unpredicted = list(unmatched.elements())
    warnings = [line.strip() for line in log if _WARNINGS.search(line)]
    return Verification(predicted, found, unpredicted, missing, warnings)
