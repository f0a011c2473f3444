"""The keyword options of `auto_shard`, checked once when given: a misspelled option
is named as Python would name it, and an option that would be silently ignored (a
memory budget without the search, a search beside a saved plan) or is not a positive
number is an error that says the fix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from jaxshard.cost import CostModel
from jaxshard.errors import ShardingError
from jaxshard.flax_meta import (
    Rules,
)
from jaxshard.pipeline import Pipeline
from jaxshard.plan import SavedPlan


@dataclass(frozen=True)
class Options:
    """The keyword options of `auto_shard` (documented there), checked once when made.

    Example:
        >>> Options(search=True, memory_budget=2**30).search_time_limit
        30.0
    """

    logical_axis_rules: Rules | None = None
    flax_metadata: bool = True
    static_argnums: int | Sequence[int] = ()
    static_argnames: str | Sequence[str] = ()
    donate_argnums: int | Sequence[int] = ()
    donate_argnames: str | Sequence[str] = ()
    donate_state: bool = False
    plan: SavedPlan | None = None
    search: bool = False
    memory_budget: float | None = None
    cost_model: CostModel | None = None
    search_time_limit: float = 30.0
    calibrate_memory: bool = False
    static_leaves: bool = False
    pipeline: Pipeline | None = None
    fsdp_axes: str | Sequence[str] | None = None

    @classmethod
    def of(cls, caller: str, keywords: Mapping[str, Any]) -> Options:
        """Options from keyword arguments, a misspelled one named as Python would."""
        names = [f.name for f in fields(cls)]
        for key in keywords:
            if key not in names:
                raise TypeError(
                    f"{caller}() got an unexpected keyword argument {key!r}; its options are "
                    + ", ".join(names)
                )
        return cls(**keywords)

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, SavedPlan):
            raise ShardingError(
                "plan= takes a saved plan (jaxshard.Plan.from_json(text)), got "
                f"{type(self.plan).__name__}"
            )
        _check_search_options(
            self.search, self.memory_budget, self.cost_model, self.search_time_limit, self.plan
        )
        if not isinstance(self.calibrate_memory, bool):
            raise ShardingError(f"calibrate_memory is True or False, got {self.calibrate_memory!r}")
        if self.calibrate_memory and self.memory_budget is None:
            raise ShardingError(
                "calibrate_memory=True checks the search's plan against memory_budget in the "
                "compiled program: give memory_budget (bytes per device) with it"
            )
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            raise ShardingError(
                f"pipeline= takes a jaxshard.Pipeline(axis=..., microbatches=...), got "
                f"{type(self.pipeline).__name__}: {self.pipeline!r}"
            )
        _check_fsdp_axes(self.fsdp_axes, self.search, self.plan)
        if not isinstance(self.static_leaves, bool):
            raise ShardingError(
                f"static_leaves is True or False, got {self.static_leaves!r}; True treats every "
                "non-array leaf as static, like eqx.filter_jit"
            )


def _check_search_options(search, memory_budget, cost_model, time_limit, plan) -> None:
    """Reject search options that would be silently ignored or are not numbers."""
    if memory_budget is not None:
        if not search:
            raise ShardingError(
                "memory_budget is honoured by the search only: pass search=True with it "
                "(propagation from hints alone does not choose layouts to fit memory)"
            )
        if not _positive_number(memory_budget):
            raise ShardingError(
                f"memory_budget is bytes per device, a positive number; got {memory_budget!r}"
            )
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ShardingError(
            f"cost_model must be a jaxshard.CostModel, got {type(cost_model).__name__}"
        )
    if not _positive_number(time_limit):
        raise ShardingError(f"search_time_limit is seconds, a positive number; got {time_limit!r}")
    if search and plan is not None:
        raise ShardingError(
            "search=True and plan= both given: a saved plan already fixes every layout; "
            "drop search=True to reuse it, or drop plan= to search again"
        )


# the axis name that stores the state by default: MaxText's and Flax's meshes name the
# batch axis that parameters are also stored over so
FSDP_AXIS = "fsdp"


def _check_fsdp_axes(fsdp_axes, search: bool, plan) -> None:
    """Reject an ``fsdp_axes`` that is not axis names, or that would be ignored."""
    if fsdp_axes is None:
        return
    axes = (fsdp_axes,) if isinstance(fsdp_axes, str) else fsdp_axes
    if not isinstance(axes, Sequence) or not all(isinstance(a, str) for a in axes):
        raise ShardingError(
            f"fsdp_axes takes mesh axis names (a name or a tuple of names), got {fsdp_axes!r}"
        )
    if axes and search:
        raise ShardingError(
            f"fsdp_axes={fsdp_axes!r} with search=True: the search chooses what to store over "
            "which axes itself, within memory_budget; drop fsdp_axes, or drop search=True"
        )
    if axes and plan is not None:
        raise ShardingError(
            f"fsdp_axes={fsdp_axes!r} with plan=: a saved plan already fixes where the state "
            "is stored; drop fsdp_axes to reuse it, or drop plan= to plan again"
        )


def fsdp_axes_on(options: Options, axis_sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes `auto_shard` stores the step's state over (``fsdp_axes``): the
    ones given, or by default the mesh's axis named `FSDP_AXIS` (unless the search or a
    saved plan lays the state out); axes of size 1 dropped. A name the mesh lacks is an
    error that lists its axes.

    Example:
        >>> fsdp_axes_on(Options(), {"data": 2, "fsdp": 4, "tensor": 1})
        ('fsdp',)
        >>> fsdp_axes_on(Options(fsdp_axes=()), {"fsdp": 4})
        ()
    """
    given = options.fsdp_axes
    if given is None:
        if options.search or options.plan is not None:
            return ()
        return tuple(a for a in axis_sizes if a == FSDP_AXIS and axis_sizes[a] > 1)
    axes = (given,) if isinstance(given, str) else tuple(given)
    for a in axes:
        if a not in axis_sizes:
            raise ShardingError(
                f"fsdp_axes names {a!r}, an axis the mesh lacks; its axes are "
                f"{tuple(axis_sizes)}: name those to store the state over"
            )
    return tuple(dict.fromkeys(a for a in axes if axis_sizes[a] > 1))


def _positive_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
