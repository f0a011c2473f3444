"""Pins and storage layouts: hints matched to argument leaves become pins, split into
the layout the computation uses and the layout the state is stored in (FSDP/ZeRO:
`split_storage`); propagation runs from the first, then the second, and the update of
stored state is laid out in its storage layout (`store_updates`), as are its copies
moved for a layer loop (`store_moved_stacks`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from jaxshard.annotate import Pin, PinKind, exact_pin, match_hints, merge_pins
from jaxshard.cost import (
    CostModel,
    xla_scope,
)
from jaxshard.errors import ShardingError
from jaxshard.graph import (
    AppKind,
    Graph,
    contracts,
    find_root,
    moved_back,
    readers,
    slices_stack,
    view_dims,
)
from jaxshard.lattice import DimSharding, spec_entry
from jaxshard.propagate import (
    STORAGE_RANK,
    DimState,
    OriginKind,
    Propagator,
)
from jaxshard.rule import FactorKind
from jaxshard.trace import Traced

SEARCH_ORIGIN = "jaxshard search"  # how pins of the search's chosen layouts are named


def hint_pins(
    traced: Traced,
    graph: Graph,
    hints: Mapping[str, PartitionSpec],
    axis_sizes: Mapping[str, int],
    chosen: Mapping[int, PartitionSpec] | None = None,
    chosen_origin: str = SEARCH_ORIGIN,
) -> dict[int, Pin]:
    """Per value id, what is pinned: the graph's own pins (`jaxshard.hint` and sharding
    constraints inside the function) merged with the ``hints`` matched on argument and
    result paths and the layouts the search ``chosen`` for arguments (by their index
    among the arguments, no path matched; named ``chosen_origin``); two pins of one dim
    that disagree are an error naming both.

    Example:
        >>> pins = hint_pins(traced, graph, {"x": P("data")}, {"data": 2})  # doctest: +SKIP
    """
    names = list(traced.in_names) + list(traced.out_names)
    vids = list(graph.in_vids) + list(graph.out_vids)
    shapes = [graph.shapes[v] for v in vids]
    matched = match_hints(hints, names, shapes, axis_sizes)
    for i, spec in (chosen or {}).items():
        pin = exact_pin(spec, shapes[i], axis_sizes, names[i], chosen_origin)
        matched[i] = merge_pins(matched[i], pin, names[i]) if i in matched else pin
    pins: dict[int, Pin] = dict(graph.pins)
    for i, pin in matched.items():
        vid = vids[i]
        pins[vid] = merge_pins(pins[vid], pin, names[i]) if vid in pins else pin
    _stack_on_stages(graph, pins)
    return pins


def _stack_on_stages(graph: Graph, pins: dict[int, Pin]) -> None:
    """A pipeline splits a stacked argument's layer dim over its stage axis: where a hint
    pins that argument's layer dim unsharded (``P(None, None, 'model')`` written for the
    unpipelined step), the stage axis goes there; a hint that puts another axis there
    is an error naming both. An argument no hint pins gets the stage axis on its layer
    dim and the rest open."""
    producer = {r: a for a, app in enumerate(graph.apps) for r in app.results}
    arguments = set(graph.in_vids)
    for vid, pin in list(pins.items()):
        if pin.kind is not PinKind.PIPELINE or not pin.dims or not pin.dims[0]:
            continue
        stacked = vid
        for _ in range(8):  # back through the reshape (and a flip or cast) to the argument
            a = producer.get(stacked)
            if stacked in arguments or a is None or len(graph.apps[a].operands) != 1:
                break
            stacked = graph.apps[a].operands[0]
        hinted = pins.get(stacked)
        if stacked in arguments and hinted is None:
            # pinned here too, so that no layout choice (the search's) puts another
            # axis on the layer dim the pipeline splits
            rest = (None,) * (len(graph.shapes[stacked]) - 1)
            pins[stacked] = Pin((pin.dims[0], *rest), pin.source, PinKind.PIPELINE)
            continue
        if stacked not in arguments or hinted is None or hinted.kind is not PinKind.HINTS:
            continue
        layer = hinted.dims[0]
        if layer == ():
            dims = (pin.dims[0], *hinted.dims[1:])
            source = f"{hinted.source}, its layer dim on {pin.source}"
            pins[stacked] = Pin(dims, source, hinted.kind)
        elif layer is not None and layer != pin.dims[0]:
            raise ShardingError(
                f"{graph.value_name(stacked)}: {hinted.source} puts {spec_entry(layer)!r} on "
                f"the layer dim, which the pipeline splits over {spec_entry(pin.dims[0])!r} "
                f"({pin.source}); leave that dim to the pipeline (None or P.UNCONSTRAINED) "
                "or drop pipeline="
            )


def propagate_pins(
    graph: Graph,
    axis_sizes: Mapping[str, int],
    compute: Mapping[int, Pin],
    storage: Mapping[int, Pin],
    cost_model: CostModel | None = None,
    free_factors: bool = True,
    reduce_scatter: bool = True,
) -> Propagator:
    """Propagation from the computation's pins to a fixed point, then from the storage
    pins at `STORAGE_RANK` into what is still open. ``free_factors`` and
    ``reduce_scatter``: see `Propagator`.

    Example:
        >>> prop = propagate_pins(graph, {"data": 2}, {0: pin}, {})  # doctest: +SKIP
    """
    prop = Propagator(graph, axis_sizes, cost_model, free_factors, reduce_scatter)
    for vid, pin in compute.items():
        prop.pin(vid, pin)
    prop.run()  # the computation's layout first: it outranks every storage layout
    for vid, pin in storage.items():
        prop.pin(vid, pin, STORAGE_RANK)
    prop.run()
    if storage:
        store_updates(graph, prop, storage)
        store_moved_stacks(graph, prop, storage)
    return prop


def store_moved_stacks(graph: Graph, prop: Propagator, storage: Mapping[int, Pin]) -> None:
    """Keep a stored leaf's moved copies that only loops slice in its storage layout.

    A step may move a stacked weight before its layer loop (MaxText stores the layer dim
    second and transposes it first for `lax.scan`). The loop's body needs each layer
    gathered, and that layout reaches the moved copy from inside the loop during the
    computation's propagation, before the storage layout arrives: the whole stack was
    then gathered before the loop (three 7 GiB expert stacks of Mixtral-8x7B on every
    device). Here every value that moves a stored leaf (a transpose, a cast: `view_dims`)
    and that only further moves and loops' stacked inputs read takes the leaf's layout,
    moved with it, where that refines the one it has; the loop's slice then keeps it too
    and is gathered in the body, one layer per iteration (`sink_stacked_gathers`).

    Example:
        >>> store_moved_stacks(graph, prop, storage)  # doctest: +SKIP
    """
    dims, layouts, uses = prop.state.dims, prop.state.layouts, prop.uses
    apps = graph.apps

    def slices_only(v: int) -> bool:  # read by moves and loops' stacked inputs alone
        for b in uses[v]:
            app = apps[b]
            if v not in app.operands:
                continue
            if app.kind is AppKind.LINK:
                if not slices_stack(graph, b):
                    return False
            elif view_dims(app) is None or not slices_only(app.results[0]):
                return False
        return True

    for vid, pin in storage.items():
        work = [(vid, tuple(dims[vid]))]
        while work:
            v, layout = work.pop()
            for b in uses[v]:
                app = apps[b]
                moved = view_dims(app) if v in app.operands else None
                if moved is None:
                    continue
                r = app.results[0]
                if any(graph.shapes[r][i] != graph.shapes[v][d] for i, d in enumerate(moved)):
                    continue  # a slice of the leaf, not the leaf moved: its layout may not fit
                want = tuple(layout[d] for d in moved)
                if r in prop.hinted or not slices_only(r) or not _refines(want, dims[r]):
                    continue
                _store(layouts[r], want, f"{pin.source}, moved for a loop")
                work.append((r, want))


def store_updates(
    graph: Graph, prop: Propagator, storage: Mapping[int, Pin], overwrite: bool = False
) -> None:
    """Lay out the update of stored state in its storage layout (ZeRO/FSDP: the
    optimizer update on shards, reading the gradient sliced), where propagation left it
    in a coarser compute layout.

    From the new value of each stored leaf, back through the elementwise equations that
    make it (the optimizer's update) to the gradient: every value that only the step's
    new state depends on (not the loss or any other result) and whose layout the storage
    layout refines (adds axes to replicated dims) takes the storage layout. So do the
    unpinned state leaves the update reads (the optimizer's moments: argument and new
    value) and a loop's stacked gradient (each iteration's slice is cut where it is
    stored). The first propagation run can leave such a chain replicated on the storage
    axis (a dim the activations' hints replicate reaches the gradient and the update):
    the plan then kept the moments whole on every device and gathered them for the
    results. A value a non-scalar result of the step depends on keeps its layout; a
    scalar result (a norm of the gradients or of the new parameters, as a training
    step's metrics) does not hold it. With ``overwrite``, the chain takes the layout
    whether or not it refines the one propagation gave it (a gradient that took the
    activations' feature axis on another dim: `jaxshard.plan.make` prices that plan
    against the one without), and so does a stacked gradient's slice in the loop's body
    back to the contraction that sums it (`_sum_where_stored`: a reduce-scatter into the
    shards per iteration). Without it the slice keeps its layout: laid out as stored on
    its own, with the rest of the plan as it is, XLA ran a searched 8B step otherwise
    than planned (1.4x the predicted bytes).

    Example:
        >>> store_updates(graph, prop, storage)  # doctest: +SKIP
    """
    dims, layouts = prop.state.dims, prop.state.layouts
    producer: dict[int, int] = {}
    for a, app in enumerate(graph.apps):
        for v in app.results if app.kind is not AppKind.TIE else ():
            producer.setdefault(v, a)
    makers = None  # the equation making each value, once a loop's body is entered
    state_out = {graph.out_vids[o] for _, o in graph.ties}
    # values some other result depends on: the computation's, never touched. A scalar
    # result (the loss, a gradient's or the new parameters' norm) reads what it reduces
    # in any layout, for a scalar's all-reduce: it does not hold the update in its own.
    needed = {v for v in graph.out_vids if v not in state_out and graph.shapes[v]}
    for app in reversed(graph.apps):
        if any(r in needed for r in app.results):
            needed.update(app.operands)
    args = set(graph.in_vids)
    # a loop's stacked results (a scanned gradient): each iteration's slice is cut from
    # the body's value where it is stored, so the stack can take the storage layout
    stacked_results = {
        graph.apps[a].operands[0]: graph.apps[a].results[0]
        for a in graph.out_links
        if len(graph.shapes[graph.apps[a].operands[0]])
        == len(graph.shapes[graph.apps[a].results[0]]) + 1
    }
    # the unpinned state leaves (optimizer moments): they follow the parameter whose
    # update reads them, argument and new value alike
    followers = {
        graph.out_vids[o]: graph.in_vids[i]
        for i, o in graph.ties
        if graph.in_vids[i] not in prop.hinted and graph.out_vids[o] not in prop.hinted
    }
    for i, o in graph.ties:
        pin = storage.get(graph.in_vids[i])
        new = graph.out_vids[o]
        if pin is None or new in args:
            continue
        work, seen = [(new, tuple(pin.dims))], set()
        while work:
            v, layout = work.pop()
            if v in seen or v in needed or v in args:
                continue
            if v in state_out and v != new and v not in followers:
                continue  # another pinned state leaf's new value keeps its own layout
            if not (overwrite or _refines(layout, dims[v])) or not _divides(
                layout, graph.shapes[v], prop.axis_sizes
            ):
                continue
            seen.add(v)
            arg = followers.get(v)
            if arg is not None and v != new:
                if arg in seen or arg in prop.hinted or not _refines(layout, dims[arg]):
                    continue
                seen.add(arg)
                _store(layouts[arg], layout, f"{pin.source}, its optimizer state")
                prop.hinted.add(arg)
                prop.hinted.add(v)
            if v in stacked_results:
                _store(layouts[v], layout, f"{pin.source}, its update")
                if overwrite and not layout[0]:
                    makers = makers if makers is not None else graph.producers()
                    _sum_where_stored(
                        graph, prop, makers, stacked_results[v], layout[1:], pin.source
                    )
                continue
            a = producer.get(v)
            if a is None or xla_scope(graph.apps[a].where):
                continue  # made inside a loop or a branch: left as propagated
            app = graph.apps[a]
            if not app.rule.plain:
                continue  # the gradient: sliced where the update reads it
            _store(layouts[v], layout, f"{pin.source}, its update")
            work.extend(zip(app.operands, _operand_layouts(app, v, layout)))


def _sum_where_stored(
    graph: Graph,
    prop: Propagator,
    producer: Mapping[int, int],
    v: int,
    layout: Sequence[DimSharding],
    source: str,
) -> None:
    """Inside a loop body, lay out the slice of a stacked gradient (``v``, one
    iteration's value) in its storage ``layout``, back through layout moves (a
    transpose) to the contraction that sums it: the sum then lands on its shards (a
    reduce-scatter per iteration) instead of being summed whole (an all-reduce) and
    sliced, and the loop carries one shard per layer. Each value on the way has no use
    but the next; one that has another keeps its layout. Whatever layout propagation
    gave the slice is replaced (`store_updates` with ``overwrite``)."""
    layouts, uses = prop.state.layouts, prop.uses
    while readers(graph, uses, v) <= 1:
        if not _divides(layout, graph.shapes[v], prop.axis_sizes):
            return
        a = producer.get(v)
        if a is None:
            return
        app = graph.apps[a]
        moved = view_dims(app)
        if moved is None and not contracts(app):
            return
        _store(layouts[v], layout, f"{source}, its gradient summed where it is stored")
        if moved is None:
            return
        v, layout = app.operands[0], moved_back(moved, layout)


def _store(row: list[DimState], layout: Sequence[DimSharding], text: str) -> None:
    """Write a storage layout's set dims into one value's state."""
    for d, axes in enumerate(layout):
        if axes is not None and row[d].axes != axes:
            row[d] = DimState(axes, OriginKind.HINT, text, rank=STORAGE_RANK)


def _operand_layouts(app, v: int, layout) -> list[tuple[DimSharding, ...]]:
    """The layout of each operand of an elementwise-like equation (every factor passes
    through: elementwise, transpose, broadcast) that puts result ``v`` in ``layout``:
    each operand dim takes the axes of the result dim its factor maps to, open where it
    maps to none or to several factors."""
    rule = app.rule
    by_factor = {}
    for d, fl in enumerate(rule.results[app.results.index(v)]):
        if len(fl) == 1:
            by_factor[fl[0]] = layout[d]
    return [
        tuple(by_factor.get(fl[0]) if len(fl) == 1 else None for fl in dims)
        for dims in rule.operands
    ]


def _divides(layout: Sequence[DimSharding], shape: Sequence[int], sizes: Mapping[str, int]) -> bool:
    """Whether each dim of ``shape`` splits evenly over its axes in ``layout``."""
    return all(
        axes is None or n % math.prod(sizes[a] for a in axes) == 0
        for axes, n in zip(layout, shape, strict=True)
    )


def _refines(layout: Sequence[DimSharding], dims: Sequence[DimSharding]) -> bool:
    """Whether ``layout`` only adds minor axes to each dim of ``dims`` (its shards are
    slices of theirs) and no axis another dim keeps; a dim ``layout`` leaves open keeps
    what it has.

    Example:
        >>> _refines([("data", "model"), None], [("data",), ()])
        True
        >>> _refines([("data",), None], [(), ("data",)])  # "data" on both dims
        False
    """
    merged = [have if want is None else want for want, have in zip(layout, dims, strict=True)]
    used = [a for axes in merged for a in axes or ()]
    return len(used) == len(set(used)) and all(
        want is None or tuple(want[: len(have or ())]) == tuple(have or ())
        for want, have in zip(layout, dims, strict=True)
    )


def split_storage(
    pins: Mapping[int, Pin], graph: Graph, classes: bool = True
) -> tuple[dict[int, Pin], dict[int, Pin]]:
    """Split the pins into the computation's layout and storage layouts (FSDP/ZeRO).

    The state of a step (the arguments whose new value it returns: parameters,
    optimizer state) is where a layout can be a *storage* layout: a mesh axis that the
    pins on the other arguments (the batch) spend on the computation is, on a state
    leaf, only where that leaf lives between steps (with no such pin, the in-function
    hints count instead: the step lays its batch out inside), unless the computation
    spends it on that very dim: an axis that a pin on anything else puts on a dim one
    factor ties to the leaf's dim (`_dim_classes`) stays on the computation (MaxText's
    layout puts the MLP's hidden dim on "tensor" both in the activations and in the
    weight; only the weight's "fsdp" is storage). ``classes=False`` skips that test
    (for graphs whose apps are not rules, as in the example). Propagation runs the
    returned compute pins to a fixed point first; the storage pins follow at
    `STORAGE_RANK` into what is still open (the optimizer update, the gradient), and
    where they meet the computation's layout they lose: the parameter is gathered at its
    use and its gradient reduce-scattered back. Returns ``(compute, storage)``: a state
    leaf's compute pin keeps its dims' other axes, its storage pin is the whole pin.
    Whether a hint's axes are better spent on the computation after all (expert
    parallelism puts the experts dim on the batch's axis on purpose) is priced by
    `plan_from_graph`: it plans each storage hint both ways and keeps the plan that
    moves fewer bytes.

    Example (FSDP: ``w`` on the batch's axis; ``x`` is data, ``w`` is state):
        >>> from types import SimpleNamespace
        >>> g = SimpleNamespace(in_vids=[0, 1], out_vids=[2], ties=[(1, 0)])
        >>> pins = {0: Pin((("data",), None), "batch"), 1: Pin((("data",), ("model",)), "w")}
        >>> compute, storage = split_storage(pins, g, classes=False)
        >>> compute[1].dims, storage[1].dims
        ((None, ('model',)), (('data',), ('model',)))
    """
    state = _state(graph)
    spent = _spent(pins)
    used = batch_axes(pins, graph)
    stored = [
        vid
        for vid, pin in pins.items()
        if vid in state and any(ax in used for d in pin.dims for ax in d or ())
    ]
    # per (value, dim) class of dims one factor ties together: the axes the pins on
    # everything else put there
    spent_on: dict[int, set[str]] | None = None
    root = None
    if stored and classes:
        parent, offset = _dim_classes(graph)

        def root(vid: int, d: int) -> int:
            return find_root(parent, offset[vid] + d)

        spent_on = {}
        for vid, pin in spent.items():
            if vid not in state:
                for d, axes in enumerate(pin.dims):
                    if axes:
                        spent_on.setdefault(root(vid, d), set()).update(axes)
    compute, storage = {}, {}
    for vid, pin in pins.items():
        if vid not in stored:
            compute[vid] = pin
            continue
        apart = [
            {
                ax
                for ax in d or ()
                if ax in used and (root is None or ax not in spent_on.get(root(vid, i), ()))
            }
            for i, d in enumerate(pin.dims)
        ]
        axes = sorted(set().union(*apart))
        if not axes:  # the computation spends these axes on these very dims
            compute[vid] = pin
            continue
        note = f" (storage: the computation spends {', '.join(map(repr, axes))} elsewhere)"
        storage[vid] = Pin(pin.dims, pin.source + note, pin.kind, pin.parts, pin.hint)
        kept = tuple(_compute_part(d, a) for d, a in zip(pin.dims, apart))
        if any(d is not None for d in kept):
            compute[vid] = Pin(kept, pin.source, pin.kind, pin.parts, pin.hint)
    return compute, storage


def _state(graph: Graph) -> set[int]:
    """The step's state: the arguments it returns new values of, and those values."""
    return {graph.in_vids[i] for i, _ in graph.ties} | {graph.out_vids[o] for _, o in graph.ties}


def _spent(pins: Mapping[int, Pin]) -> dict[int, Pin]:
    """The pins that spend axes on the computation: not the pipeline's stage pins, which
    spend their axis on the layer stack the state leaves hold."""
    pipeline = (PinKind.PIPELINE, PinKind.MICROBATCHES)
    return {vid: pin for vid, pin in pins.items() if pin.kind not in pipeline}


def batch_axes(pins: Mapping[int, Pin], graph: Graph) -> set[str]:
    """The mesh axes the batch spends (`split_storage`): those of the pins on the step's
    arguments that are not state, else (no such pin: the step lays its data out inside)
    those of every pin on a value that is not state.

    Example:
        >>> from types import SimpleNamespace
        >>> g = SimpleNamespace(in_vids=[0, 1], out_vids=[2], ties=[(1, 0)])
        >>> batch_axes({0: Pin((("data",), None), "batch")}, g)
        {'data'}
    """
    state, spent, args = _state(graph), _spent(pins), set(graph.in_vids)
    data = [pin for vid, pin in spent.items() if vid not in state and vid in args]
    if not data:
        data = [pin for vid, pin in spent.items() if vid not in state]
    return {ax for pin in data for d in pin.dims for ax in d or ()}


def _dim_classes(graph: Graph) -> tuple[list[int], list[int]]:
    """Union-find over every (value, dim): the dims each factor of each application ties
    together (a need-replication factor ties nothing: its dims are never split), as
    ``(parent, offset)``; dim ``d`` of value ``v`` is element ``offset[v] + d``.

    Example:
        >>> parent, offset = _dim_classes(graph)  # doctest: +SKIP
        >>> find_root(parent, offset[x] + 1) == find_root(parent, offset[w] + 0)  # doctest: +SKIP
        True
    """
    offset = [0]
    for shape in graph.shapes:
        offset.append(offset[-1] + len(shape))
    parent = list(range(offset[-1]))
    for app in graph.apps:
        rule = app.rule
        vids = (*app.operands, *app.results)
        first: dict[int, int] = {}
        for t, dims in enumerate((*rule.operands, *rule.results)):
            for d, fl in enumerate(dims):
                big = [f for f in fl if rule.factors[f].size > 1]  # the major factor
                if not big or rule.factors[big[0]].kind is FactorKind.NEED_REPLICATION:
                    continue
                k = find_root(parent, offset[vids[t]] + d)
                other = find_root(parent, first.setdefault(big[0], k))
                if other != k:
                    parent[k] = other
    return parent, offset


def _compute_part(dim: DimSharding, used: set[str]) -> DimSharding:
    """A pinned dim less the storage axes: open when only those pinned it.

    Example:
        >>> _compute_part(("data", "model"), {"data"}), _compute_part(("data",), {"data"})
        (('model',), None)
    """
    if dim is None or not used.intersection(dim):
        return dim
    rest = tuple(ax for ax in dim if ax not in used)
    return rest or None
