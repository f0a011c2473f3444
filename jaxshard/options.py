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


def _positive_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
