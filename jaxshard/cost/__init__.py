"""The cost model: bytes each device moves to turn one layout of a tensor into another,
what that costs in time, and how much memory a plan needs per device.

Ring volumes per device, with S the per-device size of the tensor after the collective:
local slice 0; all-gather (n-1)/n·S; all-to-all (n-1)/n·S; reduce-scatter (n-1)/n·S of
the input; all-reduce of a partial 2(n-1)/n·S. A `CostModel` turns bytes into seconds
per mesh axis (bandwidth and latency, e.g. a slow cross-host "data" axis). Memory of a
layout is the per-device share of the tensor's bytes; `memory_estimate` adds up a whole
plan: arguments, results, and the largest set of intermediates alive at once.

The package holds one idea per module and this file only re-exports: `sizes`,
`collectives` (of a reshard), `steptime` (the `CostModel`, executions, FLOPs),
`schedule` (order and liveness) and `memory` (the estimate).
"""

from jaxshard.cost.collectives import (  # noqa: F401
    Collective,
    PartialSum,
    _order_changed,
    _platform,
    _step_collectives,
    combines_all_reduces,
    copies_result_transposes,
    copies_transposed_operands,
    halo_collectives,
    has_reduce_scatter,
    moved_dtype,
    partial_groups,
    pending_sums,
    recomputes_remat,
    reduces_in_place,
    reshard_collectives,
    reshard_cost,
    reshard_steps,
    unhaloed,
    without_unit_axes,
)
from jaxshard.cost.memory import (  # noqa: F401
    EXPENSIVE,
    MemoryCurve,
    MemoryEstimate,
    buffer_bytes,
    fused_liveness,
    memory_estimate,
    peak_buffers,
    transient_peaks,
    transposed_operands,
)
from jaxshard.cost.schedule import (  # noqa: F401
    _INLINED_CALLS,
    LOWERED_IN_PLACE,
    Liveness,
    Schedule,
    _common_subexpressions,
    _is_identity,
    _literal_key,
    _same_type,
    bitcasts,
    flow,
    liveness,
    loop_ends,
    reads_of,
    schedule,
    xla_scope,
)
from jaxshard.cost.sizes import (  # noqa: F401
    CollectiveKind,
    dtype_name,
    human_bytes,
    itemsize,
    nbytes,
    per_device_bytes,
    per_device_shape,
    ring_bytes,
    shards,
)
from jaxshard.cost.steptime import (  # noqa: F401
    _CONTRACTIONS,
    _WRITTEN,
    CostModel,
    StepTime,
    _body_sources,
    _contractions,
    _in_scan,
    _loops,
    compute_flops,
    executions,
    in_while_loop,
    loop_counter,
    program_flops,
    step_bytes,
    step_time,
    written_collectives,
)
