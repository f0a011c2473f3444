"""What the search reports: `SearchResult`, and the error for a budget nothing meets."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
from jax.sharding import PartitionSpec

from jaxshard.cost import (
    MemoryEstimate,
    human_bytes,
)
from jaxshard.errors import ShardingError
from jaxshard.plan import (
    Plan,
)


@dataclass
class SearchResult:
    """What `search_hints` chose and what it costs.

    ``hints`` maps exact argument paths (``re.escape``\\d) to full PartitionSpecs for the
    leaves the search decided; together with the user's hints, and the search's choice
    of which of them are storage layouts (FSDP), they give ``plan``, which
    ``auto_shard(..., search=True)`` runs. Planned again from the hints alone, a layout
    that could be either storage or computation is decided again (`plan_from_graph`)
    and the plan can differ, its memory too.
    ``predicted_bytes`` and ``memory_bytes`` are read from that plan: collective bytes per
    device per step (``plan.predicted_bytes``: a scan body's reshards count once per
    iteration) and `jaxshard.cost.memory_estimate`'s
    per-device total;
    ``estimated_bytes``/``estimated_seconds`` are the integer program's own estimate (the
    seconds of communication, plus compute when the cost model has ``flops``).
    ``optimal`` is False when the time limit stopped the solver (the best layout found
    is returned). ``seconds`` is the wall time of the whole search. ``memory_budget``
    is the budget searched within; ``compiled_memory`` the compiled program's per-device
    memory when the search checked it (``calibrate_memory``), else None.
    """

    hints: dict[str, PartitionSpec]
    predicted_bytes: float
    memory_bytes: int
    seconds: float
    optimal: bool
    explanation: str
    estimated_bytes: float = 0.0
    estimated_seconds: float = 0.0
    memory: MemoryEstimate | None = None
    plan: Plan | None = field(default=None, repr=False)
    memory_budget: float | None = None
    compiled_memory: int | None = None

    def __str__(self) -> str:
        return self.explanation


def raise_over_budget(problem, budget, memory: MemoryEstimate, plan: Plan) -> None:
    """Raise a ShardingError naming the smallest per-device footprint found (measured
    after propagation), its layout and the largest buffers at its peak
    (`Plan.peak_buffers`)."""
    specs = jax.tree.leaves(plan.in_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    shown = [f"{n}: {s}" for n, s in zip(problem.traced.in_names, specs) if tuple(s)]
    size = lambda n: human_bytes(n, 2)  # noqa: E731
    held = "; ".join(f"{size(b)} {what}" for b, what in plan.peak_buffers()[:3])
    error = ShardingError(
        f"no layout fits the memory budget of {size(budget)} per device: the smallest "
        f"footprint jaxshard finds on this mesh is {size(memory.total)} ({memory.total} bytes) "
        f"per device (arguments {size(memory.arguments)}, results {size(memory.results)}, "
        f"peak activations {size(memory.activations)}; estimated "
        "by jaxshard.cost.memory_estimate), with "
        + ", ".join(shown[:6])
        + (", ..." if len(shown) > 6 else "")
        + (f"; at its peak: {held}" if held else "")
        + ". Raise the budget to at least that, use a larger mesh, or shrink the batch."
    )
    error.footprint = memory  # the smallest estimate found, for callers that weigh meshes
    raise error from None
