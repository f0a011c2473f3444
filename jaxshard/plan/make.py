"""The planning pipeline end to end: trace the function (`trace_graph`), match hints to
pins and propagate them (`propagate_hints`), settle and record (`plan_from_graph`),
or replay a saved plan; `make_plan` runs it all with Python's cyclic collector paused
(`gc_paused`)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Mapping

import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxshard.annotate import Pin
from jaxshard.cost import (
    CostModel,
    has_reduce_scatter,
    nbytes,
    shards,
)
from jaxshard.errors import ShardingError
from jaxshard.graph import Graph, build_graph, contracts, moved_back, view_dims
from jaxshard.plan.decide import decide
from jaxshard.plan.pins import (
    SEARCH_ORIGIN,
    _compute_part,
    batch_axes,
    hint_pins,
    propagate_pins,
    split_storage,
    store_updates,
)
from jaxshard.plan.record import Plan, mesh_axis_sizes, record_of
from jaxshard.propagate import (
    Propagator,
)
from jaxshard.saved import (
    SavedPlan,
    dims_from_json,
)
from jaxshard.trace import Traced, trace_on_mesh


def make_plan(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    mesh: Mesh,
    hints: Mapping[str, PartitionSpec] | None = None,
    saved: SavedPlan | None = None,
    cost_model: CostModel | None = None,
    fsdp_axes: tuple[str, ...] = (),
) -> Plan:
    """Run every planning stage for ``fn(*args, **kwargs)`` on ``mesh``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> plan = make_plan(lambda x, w: x @ w, (jnp.ones((8, 4)), jnp.ones((4, 16))), {}, mesh,
        ...                  {"x": P("data"), "w": P(None, "model")})
        >>> plan.out_specs
        P('data', 'model')

    With ``saved`` (from `Plan.from_json`), nothing is propagated: every value takes
    its saved layout, after checking the mesh, shapes and dtypes match. ``cost_model``
    (`jaxshard.cost.CostModel`) prices conflicts in time over the mesh axes instead of
    bytes moved. ``fsdp_axes``: mesh axes the step's state is stored over (`stored_over`).
    """
    traced, graph = trace_graph(fn, args, kwargs, mesh)
    with gc_paused():
        if saved is not None:
            return _replan(traced, graph, mesh, saved)
        plan = plan_from_graph(traced, graph, mesh, hints, cost_model)
        if fsdp_axes:
            plan = stored_over(traced, graph, mesh, plan, hints, fsdp_axes, cost_model)
        return plan


def trace_graph(fn: Callable, args: tuple, kwargs: dict, mesh: Mesh) -> tuple[Traced, Graph]:
    """Trace ``fn(*args, **kwargs)`` on ``mesh`` (`trace_on_mesh`: its Auto view, as the
    lowered program will replay it, or the Explicit mesh for code in explicit-sharding
    style) and build its graph: the first stages of every plan and search.

    Example:
        >>> traced, graph = trace_graph(lambda x: x * 2, (jnp.ones(4),), {}, mesh)  # doctest: +SKIP
    """
    traced = trace_on_mesh(fn, args, kwargs, mesh)
    with gc_paused():
        return traced, build_graph(traced, mesh_axis_sizes(mesh))


def plan_from_graph(
    traced: Traced,
    graph: Graph,
    mesh: Mesh,
    hints: Mapping[str, PartitionSpec] | None = None,
    cost_model: CostModel | None = None,
    storage: Mapping[int, bool] | None = None,
    chosen: Mapping[int, PartitionSpec] | None = None,
    chosen_origin: str = SEARCH_ORIGIN,
) -> Plan:
    """Propagate hints over an already built graph and decide what is left (no tracing):
    the planning half of `make_plan`, for callers that plan one graph several times.

    A hint that `split_storage` reads as a storage layout is also planned with its axes
    on the computation (expert parallelism puts the experts dim on the batch's axis on
    purpose); the plan that moves fewer bytes is kept. ``storage`` maps value ids whose
    choice the caller has priced itself to it (per dim, the mesh axes that are storage
    alone, the rest of the hint being the computation's layout, whole on a dim storage
    axes alone split; True: a storage layout as `split_storage` reads it; False: all on
    the computation); they are not tried
    (the search's hints name one leaf each: trying them would re-plan once per leaf).
    Each pinned weight's gradient may then be computed where the weight is stored
    (`_gradients_where_stored`), where that raises neither bytes nor memory.
    ``chosen``: full specs for arguments by their index among the arguments (the
    search's layouts, `hint_pins`), pinned beside the hints, named ``chosen_origin``.

    Example:
        >>> plan = plan_from_graph(traced, graph, mesh, {"x": P("data")})  # doctest: +SKIP
    """
    sizes = mesh_axis_sizes(mesh)
    pins = hint_pins(traced, graph, hints or {}, sizes, chosen, chosen_origin)
    decided = storage or {}
    compute, storage = split_storage(pins, graph)
    for vid, apart in decided.items():
        pin = pins.get(vid)
        if pin is None:
            continue
        if apart is False:
            if vid in storage:
                compute[vid] = pin
                del storage[vid]
            continue
        if apart is True:  # stored apart, on the axes `split_storage` finds
            continue
        # the caller's own split: which axes the computation spends is not guessed from
        # the batch's (an axis the batch leaves free would otherwise split the compute)
        axes = ", ".join(repr(a) for d in apart for a in d)
        note = f" (storage: {axes} apart from the computation, gathered at its uses)"
        storage[vid] = Pin(pin.dims, pin.source + note, pin.kind, pin.parts, pin.hint)
        # the caller decided the computation's layout too: a dim only storage axes split
        # is whole there, not open (propagation would give it whatever reaches it first)
        kept = tuple(
            d if d is None else _compute_part(d, set(a)) or () for d, a in zip(pin.dims, apart)
        )
        compute.pop(vid, None)
        if any(d is not None for d in kept):
            compute[vid] = Pin(kept, pin.source, pin.kind, pin.parts, pin.hint)
    prop = propagate_pins(graph, sizes, compute, storage, cost_model)
    plan, free = decide(traced, graph, prop, mesh), True
    if prop.swapped:  # unhinted weights took column layouts (`Propagator.free_factors`)
        plan, compute, free = _columns_or_rows(
            traced, graph, mesh, plan, prop, compute, storage, cost_model
        )
    groups: dict[str, list[int]] = {}  # storage pins by the hint that made them
    for vid in storage:
        if vid not in decided:
            groups.setdefault(pins[vid].hint or pins[vid].source, []).append(vid)
    for vids in groups.values():  # this hint's axes on the computation instead?
        trial_compute = {**compute, **{v: pins[v] for v in vids}}
        trial_storage = {v: p for v, p in storage.items() if v not in vids}
        prop = propagate_pins(graph, sizes, trial_compute, trial_storage, cost_model, free)
        trial = decide(traced, graph, prop, mesh)
        if trial.predicted_bytes < plan.predicted_bytes:
            plan, compute, storage = trial, trial_compute, trial_storage
    # the search's layouts too: its model prices a weight stored apart (FSDP) with its
    # gradient in the computation's layout, which for a scanned stack holds every layer's
    # gradient unsplit over the storage axes until the loop ends
    return _gradients_where_stored(
        traced, graph, mesh, plan, compute, storage, cost_model, free, searched=bool(decided)
    )


# a state leaf smaller than this is not stored apart: a norm's scale, a bias or a step
# counter would cost a collective's latency twice a step to save almost nothing
STORED_MIN_BYTES = 4096


def stored_over(
    traced: Traced,
    graph: Graph,
    mesh: Mesh,
    plan: Plan,
    hints: Mapping[str, PartitionSpec] | None,
    axes: tuple[str, ...],
    cost_model: CostModel | None = None,
) -> Plan:
    """``plan`` with the step's state stored over the mesh ``axes`` (FSDP, ZeRO-3:
    `auto_shard`'s ``fsdp_axes``), where that lowers the memory estimate.

    Each floating state leaf (an argument the step returns a new value of: parameters
    and optimizer state) of at least `STORED_MIN_BYTES` whose layout in ``plan`` leaves
    some of ``axes`` unused is stored split over those, on its largest dim that nothing
    splits and no hint pins (ties: the last), which they divide; the rest of its layout
    stays as ``plan`` has it, which is how the computation uses it. A parameter and its
    optimizer moments, of one shape and layout, are stored alike. Planned again with
    those layouts pinned (``chosen``): each leaf is gathered at its uses, its update
    computed on its shards, the gradient summed onto them. Where the batch spends the
    axes, `split_storage` reads them as storage and each layout is also tried with the
    axes on the computation, as a storage hint is, keeping what moves fewer bytes
    (MaxText's tiny llama2: 1577 KiB, 1849 KiB with every leaf stored apart); elsewhere
    they are storage alone (``storage``). That moves more bytes than keeping the state
    where the computation uses it, for a fraction of its memory: the trade the user
    asked for by naming the axes, kept only where the estimate says memory falls.

    Example:
        >>> stored_over(traced, graph, mesh, plan, {"batch": P("fsdp")}, ("fsdp",))  # doctest: +SKIP
    """
    sizes = mesh_axis_sizes(mesh)
    pins = hint_pins(traced, graph, hints or {}, sizes)
    batch = batch_axes(pins, graph)
    chosen: dict[int, PartitionSpec] = {}
    apart: dict[int, tuple[tuple[str, ...], ...]] = {}
    for i, _ in graph.ties:
        vid = graph.in_vids[i]
        shape, dtype = graph.shapes[vid], graph.dtypes[vid]
        if not jnp.issubdtype(dtype, jnp.floating) or nbytes(shape, dtype) < STORED_MIN_BYTES:
            continue
        dims = [tuple(d) for d in plan.dims[vid]]
        free = tuple(a for a in axes if not any(a in d for d in dims))
        n = shards((free,), sizes)
        pin = pins.get(vid)
        whole = [
            d
            for d, size in enumerate(shape)
            if not dims[d] and size % n == 0 and (pin is None or pin.dims[d] is None)
        ]
        if not free or not whole:
            continue
        d = max(whole, key=lambda d: (shape[d], d))
        dims[d] = free
        chosen[i] = PartitionSpec(*(x or None for x in dims))
        if not set(free) <= batch:  # else `split_storage` reads it so, and tries it both ways
            apart[vid] = tuple(free if k == d else () for k in range(len(shape)))
    if not chosen:
        return plan
    names = ", ".join(map(repr, axes))
    stored = plan_from_graph(
        traced, graph, mesh, hints, cost_model, apart, chosen, f"stored over {names} (fsdp_axes)"
    )
    if stored.estimated_memory.total < plan.estimated_memory.total:
        return stored
    return plan


def _columns_or_rows(
    traced: Traced,
    graph: Graph,
    mesh: Mesh,
    plan: Plan,
    prop: Propagator,
    compute: dict[int, Pin],
    storage: dict[int, Pin],
    cost_model: CostModel | None,
) -> tuple[Plan, dict[int, Pin], bool]:
    """The cheapest of three plans where propagation gave unhinted weights a column
    layout (`Propagator.free_factors`): none taken, each contraction following its
    activations (row parallel); the weights pinned to those layouts from the start, so
    that their gradients and every other use are planned for them; and ``plan`` itself,
    where each took it as propagation reached it. Each choice was priced at its own
    contraction only; the plans' predicted bytes weigh all of them. Returns the plan,
    its computation's pins, and whether it takes column layouts where propagation
    finds them."""
    sizes = mesh_axis_sizes(mesh)
    pinned = dict(compute)
    for vid, (dims, a, arg) in prop.swapped.items():
        if vid not in pinned:
            name = graph.value_name(arg)
            if arg != vid:
                name += " (as the loop or transpose passes it on)"
            pinned[vid] = Pin(
                dims, f"column layout for {name} at {graph.apps[a].describe()}: gathering "
                      "its input moves fewer bytes than summing its result"
            )  # fmt: skip
    options = []
    for pins in (compute, pinned):
        prop = propagate_pins(graph, sizes, pins, storage, cost_model, free_factors=False)
        options.append((decide(traced, graph, prop, mesh), pins, False))
    options.append((plan, compute, True))
    # on a tie in bytes the smaller memory estimate, then the first: a column layout is
    # taken where it saves something, and pinned where propagation's own choice is no
    # better (the weight's gradient is then computed in its layout)
    ranked = sorted(
        enumerate(options),
        key=lambda io: (io[1][0].predicted_bytes, io[1][0].estimated_memory.total, io[0]),
    )
    return ranked[0][1]


def _gradients_where_stored(
    traced: Traced,
    graph: Graph,
    mesh: Mesh,
    plan: Plan,
    compute: dict[int, Pin],
    storage: dict[int, Pin],
    cost_model: CostModel | None,
    free: bool,
    searched: bool = False,
) -> Plan:
    """``plan``, or the plan that computes each pinned weight's gradient in the weight's
    layout, where that moves fewer bytes (or as many, in less memory); for the search's
    layouts (``searched``), only where neither rises: the search traded bytes against
    memory under its budget already.

    Propagation reaches a gradient's contraction from the activations in a round or two,
    and from the weight's layout only back through the optimizer's whole update (and, for
    a scanned layer stack, the loop's stacked result). Where the activations' feature
    axis differs from the weight's (MaxText's rules: embeddings on ``tensor`` in the
    activations, on ``fsdp`` in the weights), the gradient takes the activations' and
    keeps it to the update: summed whole (an all-reduce), moved (an all-to-all) and, in
    a loop, held unsplit for every layer. Here the plan is made again with the update,
    the stacked gradient and the body's slice of it back to the contraction laid out as
    the weight (`store_updates` with ``overwrite``): the contraction's sum then lands on
    the weight's shards (a reduce-scatter) and the loop carries one shard per layer.

    That propagation prices a reduce-scatter as the mesh's devices run it
    (`has_reduce_scatter`: on a CPU, the all-reduce of its input): the gather an
    activation's matmul shared with the gradient's is no longer shared, and priced as a
    reduce-scatter the partial sum that replaces it looks cheaper than it runs. The
    first plan keeps the usual price: with the mesh's, greedy choices elsewhere (Flax's
    Gemma FSDP + tensor-parallel example) came out worse by the plan's own count."""
    state = {graph.in_vids[i] for i, _ in graph.ties}
    pinned = {v: p for v, p in compute.items() if v in state and v not in storage}
    pinned.update((v, p) for v, p in storage.items() if v in state)
    differ = any(
        tuple(plan.dims[v]) != layout
        for v, layout in gradient_contractions(graph, plan.dims, set(pinned)).items()
    )
    if not differ:
        return plan
    sizes = mesh_axis_sizes(mesh)
    prop = propagate_pins(
        graph, sizes, compute, storage, cost_model, free, has_reduce_scatter(mesh)
    )
    store_updates(graph, prop, pinned, overwrite=True)
    trial = decide(traced, graph, prop, mesh)
    before = (plan.predicted_bytes, plan.estimated_memory.total)
    after = (trial.predicted_bytes, trial.estimated_memory.total)
    if searched:  # the search weighed bytes against memory: kept where neither rises
        better = after != before and after[0] <= before[0] and after[1] <= before[1]
        return trial if better else plan
    return trial if after < before else plan


def gradient_contractions(graph: Graph, dims, args: set[int]) -> dict[int, tuple]:
    """The contraction results that become the gradient of an argument in ``args``,
    each with the layout that puts it where the argument is (``dims``, carried through
    layout moves): walking back from the argument's new value (the result tied to it)
    through the equations that treat each element alone (the optimizer's update),
    layout moves (a transpose) and a loop's stacked results into its body, to the
    contractions that make them.

    Example:
        >>> gradient_contractions(plan.graph, plan.dims, {19})  # doctest: +SKIP
        {412: (('tensor',), ('fsdp',))}
    """
    producer = graph.producers()
    out_link = {graph.apps[a].operands[0]: a for a in graph.out_links}
    found: dict[int, tuple] = {}
    for i, o in graph.ties:
        arg = graph.in_vids[i]
        if arg not in args:
            continue
        work, seen = [(graph.out_vids[o], tuple(dims[arg]))], set()
        while work:
            v, layout = work.pop()
            if v in seen or v in args:
                continue
            seen.add(v)
            a = out_link.get(v)
            if a is not None:  # a loop's stacked result: its body's value, per iteration
                piece = graph.apps[a].results[0]
                if len(graph.shapes[v]) == len(graph.shapes[piece]) + 1 and not layout[0]:
                    work.append((piece, layout[1:]))
                continue
            a = producer.get(v)
            if a is None:
                continue
            app = graph.apps[a]
            moved = view_dims(app)
            if moved is not None:
                work.append((app.operands[0], moved_back(moved, layout)))
            elif contracts(app):
                found.setdefault(v, layout)
            elif app.rule.plain:
                work.extend((u, layout) for u in app.operands if graph.shapes[u] == graph.shapes[v])
    return found


def propagate_hints(
    traced: Traced,
    graph: Graph,
    mesh: Mesh,
    hints: Mapping[str, PartitionSpec] | None = None,
    cost_model: CostModel | None = None,
) -> Propagator:
    """Pin the hints (`hint_pins`) and propagate them to a fixed point: the computation's
    layout first, then the storage layouts (`split_storage`).

    Example:
        >>> prop = propagate_hints(traced, graph, mesh, {"x": P("data")})  # doctest: +SKIP
    """
    sizes = mesh_axis_sizes(mesh)
    compute, storage = split_storage(hint_pins(traced, graph, hints or {}, sizes), graph)
    return propagate_pins(graph, sizes, compute, storage, cost_model)


def _replan(traced: Traced, graph: Graph, mesh: Mesh, saved: SavedPlan) -> Plan:
    diffs = saved.differences(record_of(traced, graph, mesh))
    if diffs:
        raise ShardingError(
            "the saved plan does not match this function, arguments or mesh:\n  "
            + "\n  ".join(diffs)
            + "\nPlan again (drop plan=...) or load the plan made for this program."
        )
    saved.check(graph)
    prop = Propagator(graph, mesh_axis_sizes(mesh))
    for vid, dims in enumerate(saved.record["dims"]):
        prop.pin(vid, Pin(dims_from_json(dims), "saved plan"))
    out_dims = [dims_from_json(d) for d in saved.record["out_dims"]]
    return Plan(traced, graph, prop, mesh, out_dims)


@contextlib.contextmanager
def gc_paused():
    """Planning allocates many small, long-lived objects; Python's cyclic collector would
    rescan them over and over (a third of planning time on a 12-layer GPT).

    Example:
        >>> import gc
        >>> with gc_paused():
        ...     gc.isenabled()
        False
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
