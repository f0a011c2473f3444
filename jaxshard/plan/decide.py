"""Settling what propagation left open: large state no hint reached is split where that
saves memory for few more collective bytes (`split_for_memory`, priced by `_Pricing`),
the rest is replicated (`settle_open`), stacked slices keep their stack's layout, a
scalar sum (a norm) reads what it sums where it lies (`sum_where_it_lies`), and the
`Plan` is made (`decide`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property

from jax.sharding import Mesh

from jaxshard.annotate import Pin
from jaxshard.cost import (
    CollectiveKind,
    MemoryCurve,
    executions,
    has_reduce_scatter,
    human_bytes,
    liveness,
    nbytes,
    per_device_bytes,
    recomputes_remat,
    reshard_collectives,
)
from jaxshard.graph import AppKind, Graph, readers, slices_stack
from jaxshard.lattice import DimSharding, slices_locally
from jaxshard.plan.apps import app_moves, dead_apps, duplicate_app, moved_array
from jaxshard.plan.record import Plan
from jaxshard.propagate import (
    DEFAULT_RANK,
    DimState,
    OriginKind,
    Propagator,
)
from jaxshard.rule import FactorKind
from jaxshard.trace import Traced

UNREACHED = "replicated: no hint or propagation reached it"


def decide(traced: Traced, graph: Graph, prop: Propagator, mesh: Mesh) -> Plan:
    """Settle what propagation left open and make the `Plan`: large state that no hint
    reached is split where that saves memory for few collective bytes
    (`split_for_memory`), the rest is replicated (arguments first, then everything else).

    Example:
        >>> plan = decide(traced, graph, propagate_hints(traced, graph, mesh), mesh)  # doctest: +SKIP
    """
    _, settled = _split_for_memory(graph, prop, has_reduce_scatter(mesh), recomputes_remat(mesh))
    if settled is None:
        settle_open(prop)
    else:  # pricing the splits settled this very state already: one pass less
        prop.adopt(settled)
    return Plan(traced, graph, prop, mesh)


def settle_open(prop: Propagator) -> None:
    """Replicate what propagation left open (the arguments first, then everything else)
    and keep stacked slices in their stack's layout (`sink_stacked_gathers`).

    Example:
        >>> settle_open(prop)  # doctest: +SKIP
    """
    g = prop.graph
    prop.default(g.in_vids, UNREACHED)
    prop.default(range(len(g.shapes)), UNREACHED)
    sink_stacked_gathers(g, prop)
    sum_where_it_lies(g, prop)


def sum_where_it_lies(graph: Graph, prop: Propagator) -> None:
    """Sum a value to a scalar in the layout it has, not in one it is moved to first.

    A norm (a gradient's global norm for clipping, the metrics' norms of the gradients
    and the new parameters) squares each leaf and sums it to a scalar. Propagation may
    leave the squares in another layout than the leaf's (the layout the gradient had
    before its update was laid out as stored): the plan then gathered a whole gradient
    (7 GiB of a Mixtral-8x7B expert stack per device) to square it. Where a scalar
    reduction reads elementwise values that nothing else reads (the square, a cast, a
    scaling by a scalar, optax's ``x.real**2 + x.imag**2`` with its broadcast zeros),
    made from values that all have one layout, those values take it: each device squares
    and sums its own shard, and one scalar is all-reduced.

    Example:
        >>> sum_where_it_lies(plan.graph, prop)  # doctest: +SKIP
    """
    layouts, uses = prop.state.layouts, prop.uses
    shapes, apps = graph.shapes, graph.apps
    kept = set(graph.out_vids) | set(prop.hinted)  # returned or pinned: their layout stays
    producer = None
    for app in apps:
        if (
            app.kind is not AppKind.EQN
            or len(app.results) != 1
            or shapes[app.results[0]] != ()
            or len(app.operands) != 1
            or not any(f.kind is FactorKind.REDUCTION for f in app.rule.factors)
        ):
            continue
        producer = producer if producer is not None else graph.producers()
        members, sources, todo = [], set(), [app.operands[0]]
        while todo:
            v = todo.pop()
            made = producer.get(v)
            step = None if made is None else apps[made]
            if step is None or v in kept or readers(graph, uses, v) != 1 or len(step.results) != 1:
                sources.add(v)
                continue
            arrays = {o for o in step.operands if shapes[o] != ()}
            if not step.rule.plain or any(shapes[o] != shapes[v] for o in arrays):
                sources.add(v)
                continue
            members.append((made, v))  # made from scalars alone, it takes any layout
            todo.extend(arrays)
        layout = {tuple(s.axes for s in layouts[v]) for v in sources}
        if not members or len(layout) != 1 or None in next(iter(layout)):
            continue
        source = min(sources)
        row = layouts[source]
        for made, c in members:
            here = layouts[c]
            for d, s in enumerate(row):
                if here[d].axes != s.axes:
                    here[d] = DimState(s.axes, OriginKind.PROPAGATED, app=made, source=source,
                                       source_dim=d, rank=s.rank)  # fmt: skip


def sink_stacked_gathers(graph: Graph, prop: Propagator) -> None:
    """Gather a scanned stack one slice per iteration, not whole before the loop.

    Where a loop body needs a stacked input (layer weights under `lax.scan`) in a
    coarser layout than the stack's (FSDP: stored split, used whole), the slice the body
    reads keeps the stack's layout and is gathered at its uses inside the body, once per
    iteration. That moves the same bytes as gathering the whole stack at the loop, holds
    one gathered layer instead of all of them, and is what XLA does with the stack left
    in its stored layout (a dynamic slice, then the all-gather).

    Example:
        >>> sink_stacked_gathers(plan.graph, prop)  # doctest: +SKIP
    """
    dims, layouts = prop.state.dims, prop.state.layouts
    for a, app in enumerate(graph.apps):
        if not slices_stack(graph, a):
            continue  # only a loop's stacked inputs
        stack, piece = app.operands[0], app.results[0]
        factors = app.rule.factors
        if not factors or factors[0].kind is not FactorKind.NEED_REPLICATION:
            continue
        stored, used = dims[stack][1:], dims[piece]
        if tuple(stored) == tuple(used) or not slices_locally(stored, used):
            continue  # not a gather: the body's layout is not coarser than the stack's
        for d, axes in enumerate(stored):
            if axes != used[d]:
                layouts[piece][d] = DimState(
                    axes, OriginKind.PROPAGATED, app=a, source=stack, source_dim=d + 1,
                    rank=layouts[stack][d + 1].rank,
                )  # fmt: skip


# A state leaf is worth pricing a split for when it holds at least this share of the
# arguments' per-device bytes; together, the splits kept may add at most this share to
# the plan's collective cost (bytes per device, or seconds under a cost model).
MEMORY_SHARE, COST_ALLOWANCE = 0.01, 0.02


class _Pricing:
    """The plan `decide` would make from a propagation (its open dims replicated by
    propagating defaults) and what it costs: per application the collective cost, and
    the memory estimate. `price` costs the same plan with some values laid out
    otherwise: only the applications around them are priced again, and ``moved`` says
    whether those applications gather more than before (the new layout is then a
    storage layout, gathered again for its use or its results). `keep` makes such a change
    part of the plan."""

    def __init__(
        self, prop: Propagator, dead: set[int], runs: list[int], apps: list[int],
        reduce_scatter: bool, remat_barriers: bool = True,
    ):  # fmt: skip
        g = prop.graph
        self.reduce_scatter, self._dead = reduce_scatter, dead
        self._remat_barriers = remat_barriers
        final = prop.fork()
        settle_open(final)
        self.final, self.runs, self.apps = final, runs, set(apps)
        # pricing records the conflicts it meets in `final`; `unchanged` drops them
        self._settled_conflicts = dict(final.state.conflicts)
        # per application (cost, gathered bytes), priced when first needed
        self.costs: dict[int, tuple[float, float]] = {}
        self._cost: float | None = None
        self._tied = dict((g.out_vids[o], g.in_vids[i]) for i, o in g.ties)
        # a new value returned in its argument's layout (`Plan._returned`), priced as a
        # move at the end of the step: result -> argument
        self.returned = {r: i for r, i in self._tied.items() if r not in prop.hinted and r != i}

    @cached_property
    def memory(self) -> MemoryCurve:
        """The memory estimate, made when a change first needs it (the buffers' lifetimes
        cost as much as a propagation; a change that moves too many bytes needs none)."""
        g = self.final.graph
        sources = [self._tied.get(v, v) for v in g.out_vids]
        live = liveness(g, self._dead, remat_barriers=self._remat_barriers)
        return MemoryCurve(g, self.final.state.dims, self.final.axis_sizes, sources, live)

    @property
    def cost(self) -> float:
        """The plan's collective cost (every application priced once, on first use)."""
        if self._cost is None:
            self._cost = sum(self._app(a)[0] for a in self.apps)
            self._cost += sum(self._app(("returned", r))[0] for r in self.returned)
        return self._cost

    def _app(self, a) -> tuple[float, float]:
        """The cost of application ``a``, or of returning value ``v`` for ``a = ("returned",
        v)``."""
        found = self.costs.get(a)
        if found is None:
            found = self.costs[a] = self._price_of(a)
        return found

    def _price_of(self, a) -> tuple[float, float]:
        if isinstance(a, tuple):
            return _return_cost(self.final, a[1], self.returned[a[1]], self.reduce_scatter)
        return _app_cost(self.final, a, self.runs[a], self.reduce_scatter)

    def affords(self, changed: dict[int, list[DimSharding]], spent: float):
        """``(extra collective cost, memory, per-application costs)`` with the values in
        ``changed`` laid out as given there, when that is a split to keep: it gathers
        nothing more than before, its extra cost with the ``spent`` of the splits kept
        before stays within `COST_ALLOWANCE` of the plan's cost, and the memory is below
        this plan's (the splits kept so far included). Else None. Memory is estimated
        last, only for a change that passes the rest."""
        extra, moved, costs = self.price(changed)
        if moved or (spent + extra > 0 and spent + extra > COST_ALLOWANCE * self.cost):
            return None
        total = self.memory.total_with(changed)
        if total >= self.memory.total:
            return None
        return extra, total, costs

    def price(self, changed: dict[int, list[DimSharding]]) -> tuple[float, bool, dict]:
        """``(extra collective cost, moved, per-application costs)`` with the values in
        ``changed`` laid out as given there."""
        layouts = self.final.state.layouts
        touched: set = {a for v in changed for a in self.final.uses[v] if a in self.apps}
        touched |= {
            ("returned", r) for r, i in self.returned.items() if r in changed or i in changed
        }
        before = {a: self._app(a) for a in touched}
        old = {v: layouts[v] for v in changed}
        costs = {}
        try:
            for v, new in changed.items():
                layouts[v] = _with_axes(layouts[v], new)
            for a in touched:
                costs[a] = self._price_of(a)
        finally:
            for v, row in old.items():
                layouts[v] = row
        extra = sum(c[0] - before[a][0] for a, c in costs.items())
        moved = sum(c[1] - before[a][1] for a, c in costs.items()) > 0
        return extra, moved, costs

    def unchanged(self) -> Propagator:
        """This plan's propagation, settled: valid until a change is kept."""
        self.final.state.conflicts = dict(self._settled_conflicts)
        return self.final

    def settled_changes(self, prop: Propagator) -> tuple[dict[int, list[DimSharding]], Propagator]:
        """The values whose layout differs from this plan's once ``prop`` (this plan's
        propagation with a decision added) is settled as `decide` settles it, and that
        settled fork."""
        final = prop.fork()
        settle_open(final)
        now, old = final.state.layouts, self.final.state.layouts
        return {
            v: [s.axes for s in now[v]]
            for v in range(len(now))
            if any(s.axes != t.axes for s, t in zip(now[v], old[v]))
        }, final

    def keep(
        self, changed: dict[int, list[DimSharding]], costs: dict[int, tuple[float, float]]
    ) -> None:
        """Make a priced change part of the plan."""
        layouts = self.final.state.layouts
        for v, new in changed.items():
            layouts[v] = _with_axes(layouts[v], new)
        self.cost  # noqa: B018 - the total before the change, then moved by the delta
        self._cost += sum(c[0] - self._app(a)[0] for a, c in costs.items())
        self.costs.update(costs)
        if "memory" in self.__dict__:  # else made from the layouts as they are now
            self.memory.update(changed)


def _with_axes(row: list[DimState], axes: Sequence[DimSharding]) -> list[DimState]:
    """``row`` with its dims' axes replaced by ``axes`` (origins and ranks kept: the pricing
    of a layout change decides no conflict by them differently)."""
    return [s._replace(axes=x) for s, x in zip(row, axes)]


def _return_cost(prop: Propagator, r: int, arg: int, reduce_scatter: bool) -> tuple[float, float]:
    """What returning value ``r`` in argument ``arg``'s layout costs, once per call (as
    `_app_cost`)."""
    g, dims = prop.graph, prop.state.dims
    src = [() if d is None else d for d in dims[r]]
    dst = [() if d is None else d for d in dims[arg]]
    steps = reshard_collectives(g.shapes[r], g.dtypes[r], src, dst, prop.axis_sizes,
                                frozenset(), reduce_scatter)  # fmt: skip
    return _steps_cost(prop, steps, 1)


def _steps_cost(prop: Propagator, steps, runs: int) -> tuple[float, float]:
    """Collectives run ``runs`` times: their cost (bytes per device, or seconds under the
    propagator's cost model) and the bytes of it that gather or rearrange a layout."""
    total = gathered = 0.0
    for step in steps:
        if prop.cost_model is None:
            total += step.ring_bytes * runs
        else:
            total += prop.cost_model.collective_time(step.axes, step.ring_bytes) * runs
        if step.kind in (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL):
            gathered += step.ring_bytes * runs
    return total, gathered


def _app_cost(prop: Propagator, a: int, runs: int, reduce_scatter: bool) -> tuple[float, float]:
    """The collective cost of application ``a`` run ``runs`` times per call (bytes per
    device, or seconds under the propagator's cost model), and the bytes of it that
    gather or rearrange a layout (all-gathers, all-to-alls) rather than sum partials."""
    if prop.settled(a):
        return 0.0, 0.0
    g, sizes = prop.graph, prop.axis_sizes
    steps = [step for _, step in prop.halos(a)]
    for vid, src, dst, partial in app_moves(prop, sizes, a)[0]:
        shape, times = g.shapes[vid], 1
        if not partial:
            shape, src, dst, times = moved_array(g, prop.state.dims, a, vid, src, dst)
        move = reshard_collectives(shape, g.dtypes[vid], src, dst, sizes, partial, reduce_scatter)
        steps += move * times
    return _steps_cost(prop, steps, runs)


def split_for_memory(
    graph: Graph, prop: Propagator, reduce_scatter: bool = True, remat_barriers: bool = True
) -> list[tuple[int, Pin]]:
    """Split large state no hint pinned where that saves memory for few more bytes.

    After propagation a parameter (or optimizer state) that no hint pinned may have open
    dims, and `decide` would replicate them: every device then holds the whole of it, its
    optimizer state and its new value (an embedding table and the output head, the
    largest weights of a language model, under tensor-parallel hints on the blocks).
    For each such leaf holding at least `MEMORY_SHARE` of the arguments' memory,
    largest first, each way of splitting one open dim over one mesh axis it does not
    use yet is propagated and priced like the rest of the plan: the collectives it
    changes (`app_moves`, times their executions) and the memory estimate
    (`jaxshard.cost.memory_estimate`). The split that saves the most memory is kept
    when it saves some, all kept splits together add at most `COST_ALLOWANCE` of the
    plan's collective cost, the leaf is used in its split layout (a split its uses
    gather again is a storage layout, FSDP, whose gathered copies the memory estimate
    does not see: those come from hints or the search), and no leaf a hint pinned
    changes. A vocabulary-parallel head and embedding pass: splitting the head's
    vocabulary dim shards the logits and their softmax for a few all-reduces of
    per-token scalars, and a lookup in a split table is summed once per token instead
    of the table's gradient once per step. ``reduce_scatter``: whether the backend has
    one (`jaxshard.cost.has_reduce_scatter`); ``remat_barriers``: whether it recomputes a
    rematerialized layer (`jaxshard.cost.liveness`). Returns the ``(value, pin)`` kept;
    their origin names the memory saved and the cost.

    Example:
        >>> split_for_memory(graph, prop)  # doctest: +SKIP
        [(3, Pin(dims=(('model',), None), source='split to save memory: ...'))]
    """
    return _split_for_memory(graph, prop, reduce_scatter, remat_barriers)[0]


def _split_for_memory(
    graph: Graph, prop: Propagator, reduce_scatter: bool, remat_barriers: bool = True
) -> tuple[list[tuple[int, Pin]], Propagator | None]:
    """`split_for_memory`, and a fork of ``prop`` settled as `settle_open` would settle
    it afterwards (None when nothing was priced): pricing settles that state anyway.

    A split is priced against the plan as propagation left it. A trial that also gave
    other unhinted weights column layouts (`Propagator.free_factors`) would count their
    gathers as the split's and refuse it (an expert stack split over its experts, 4x
    less memory for fewer bytes); those layouts are weighed by whole plans
    (`jaxshard.plan.make`), so the splits' propagation takes none."""
    free, prop.free_factors = prop.free_factors, False
    try:
        kept, settled = _split_for_memory_rows(graph, prop, reduce_scatter, remat_barriers)
    finally:
        prop.free_factors = free
    if settled is not None:
        settled.free_factors = free
    return kept, settled


def _split_for_memory_rows(
    graph: Graph, prop: Propagator, reduce_scatter: bool, remat_barriers: bool
) -> tuple[list[tuple[int, Pin]], Propagator | None]:
    """`_split_for_memory` with ``prop``'s free factors off."""
    sizes = prop.axis_sizes
    state = dict.fromkeys(graph.in_vids[i] for i, _ in graph.ties)
    dims = prop.state.dims
    open_state = [
        v
        for v in state
        if v not in prop.hinted and None in dims[v] and _split_options(graph, dims, v, sizes)
    ]
    if not open_state:
        return [], None

    # the arguments alone (open dims replicated) bound the plan's memory from below
    floor = MEMORY_SHARE * sum(
        per_device_bytes(graph.shapes[v], graph.dtypes[v], dims[v], sizes)
        for v in set(graph.in_vids)
    )
    big = sorted(
        (v for v in open_state if nbytes(graph.shapes[v], graph.dtypes[v]) >= floor),
        key=lambda v: -nbytes(graph.shapes[v], graph.dtypes[v]),
    )
    if not big:
        return [], None
    dead = dead_apps(graph)
    seen: dict = {}
    apps = [a for a, app in enumerate(graph.apps) if a not in dead and not duplicate_app(app, seen)]
    base = _Pricing(prop, dead, executions(graph), apps, reduce_scatter, remat_barriers)
    spent = 0.0
    hinted = set(prop.hinted)  # the user's leaves keep their layout, open dims included
    kept, settled = [], None
    for vid in big:
        if None not in dims[vid]:
            continue  # a split kept before reached it
        options = []
        for d, axis in _split_options(graph, dims, vid, sizes):
            pin = Pin(tuple((axis,) if i == d else None for i in range(len(dims[vid]))), "")
            changed = None  # stays so if it would change a leaf the user pinned
            with prop.trying(stop=hinted) as written:  # first priced as propagation leaves it
                prop.pin(vid, pin, DEFAULT_RANK)
                prop.run()
                changed = {
                    v: [() if x is None else x for x in dims[v]]
                    for v in dict.fromkeys(v for v, *_ in written)
                }
            priced = None if changed is None else base.affords(changed, spent)
            if priced is not None:
                options.append((priced[1], d, axis, pin))
        best = None
        for _, _, _, pin in sorted(options):  # then as `decide` would settle it
            with prop.trying():
                prop.pin(vid, pin, DEFAULT_RANK)
                prop.run()
                changed, final = base.settled_changes(prop)
            if not hinted.isdisjoint(changed):
                continue
            priced = base.affords(changed, spent)
            if priced is not None:
                best = (*priced, pin, changed, final)
                break
        if best is None:
            continue
        extra, total, costs, pin, changed, settled = best
        shown = f"{extra:.0f} B" if prop.cost_model is None else f"{extra * 1e6:.2f} µs"
        saved = human_bytes(base.memory.total - total)
        pin = Pin(pin.dims, f"split to save memory: {saved} less per device for {shown} "
                            "more collectives per step")  # fmt: skip
        prop.pin(vid, pin, DEFAULT_RANK)
        prop.run()
        _relabel(settled, vid, pin)  # it was settled with the pin's text still unknown
        kept.append((vid, pin))
        spent += extra
        base.keep(changed, costs)  # its memory is now ``total``
    return kept, settled if kept else base.unchanged()


def _relabel(prop: Propagator, vid: int, pin: Pin) -> None:
    """Give the dims ``pin`` set on ``vid`` the pin's text as their origin."""
    row = prop.state.layouts[vid]
    for d, axes in enumerate(pin.dims):
        if axes is not None:
            row[d] = row[d]._replace(text=pin.source)


def _split_options(graph: Graph, dims, vid: int, sizes: Mapping[str, int]) -> list[tuple[int, str]]:
    """``(dim, mesh axis)`` for each open dim of ``vid`` and each mesh axis of size > 1 it
    does not use yet that divides the dim."""
    used = {x for d in dims[vid] if d for x in d}
    shape = graph.shapes[vid]
    return [
        (d, x)
        for d, have in enumerate(dims[vid])
        if have is None
        for x, n in sizes.items()
        if n > 1 and x not in used and shape[d] % n == 0
    ]
