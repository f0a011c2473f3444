"""Planning: trace, annotate, propagate, decide, and the resulting `Plan`.

`make_plan` runs the stages in order. After the fixed point, dims no hint reached are
decided: arguments' open dims become replicated and propagate, then any dim still open
is replicated. A final pass over every application records the reshards (a tensor whose
layout differs from the one the equation works in) and the pending partial sums, with
the collectives and bytes the cost model predicts. The Plan holds a complete spec for
every value, the in/out specs as pytrees, and explains itself.

The package holds one idea per module and this file only re-exports: `record` (the
`Plan` record and what a saved plan records), `apps` (what each equation moves),
`pins` (pins and storage layouts), `decide` (settling open dims, `split_for_memory`),
`memory` (the plan's memory estimate, a mixin of `Plan`) and `make` (the pipeline end
to end).
"""

from jaxshard.graph import contracts
from jaxshard.plan.apps import analyzed_apps, app_moves, dead_apps, duplicate_app, read_values
from jaxshard.plan.decide import UNREACHED, decide, settle_open, split_for_memory
from jaxshard.plan.make import (
    gc_paused,
    make_plan,
    plan_from_graph,
    propagate_hints,
    trace_graph,
)
from jaxshard.plan.pins import hint_pins, propagate_pins, split_storage, store_updates
from jaxshard.plan.record import Plan, Reshard, mesh_axis_sizes, record_of, register_stage
from jaxshard.saved import SavedPlan
from jaxshard.trace import auto_view

__all__ = [
    "UNREACHED",
    "Plan",
    "Reshard",
    "SavedPlan",
    "analyzed_apps",
    "app_moves",
    "auto_view",
    "contracts",
    "dead_apps",
    "read_values",
    "decide",
    "duplicate_app",
    "gc_paused",
    "hint_pins",
    "make_plan",
    "mesh_axis_sizes",
    "plan_from_graph",
    "propagate_hints",
    "propagate_pins",
    "record_of",
    "register_stage",
    "settle_open",
    "split_for_memory",
    "split_storage",
    "store_updates",
    "trace_graph",
]
