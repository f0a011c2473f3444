"""What each equation of a finished propagation does: which equations are dead or
duplicates XLA merges, which need a look in the final pass (`analyzed_apps`), and the
operands and results each moves into or out of the layout it works in (`app_moves`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from jaxshard.cost import executions, per_device_bytes
from jaxshard.graph import AppKind, Graph, contracts, slices_stack
from jaxshard.lattice import DimSharding, slices_locally
from jaxshard.propagate import (
    Propagator,
    _copies_operand,
)
from jaxshard.rule import FactorKind


def read_values(g: Graph) -> frozenset[int]:
    """Values something reads: an application `dead_apps` keeps, the step's results, an
    equation outside its regions (a cond's branch index).

    Example:
        >>> read_values(plan.graph)  # doctest: +SKIP
        frozenset({0, 1, 4})
    """
    cached = g.memo.get("read_values")
    if cached is not None and cached[0] == len(g.apps):
        return cached[1]
    dead = dead_apps(g)
    found = {v for a, app in enumerate(g.apps) if a not in dead for v in app.operands}
    found = frozenset(found.union(g.out_vids, g.read_outside))
    g.memo["read_values"] = (len(g.apps), found)
    return found


def dead_apps(g: Graph) -> set[int]:
    """Equations whose results nothing uses (JAX's tracing keeps them; XLA removes them).

    Example:
        >>> dead_apps(plan.graph)  # doctest: +SKIP
        {12, 13}
    """
    cached = g.memo.get("dead_apps")
    if cached is not None and cached[0] == len(g.apps):  # planning asks more than once
        return cached[1]
    readers = [0] * len(g.shapes)
    for app in g.apps:
        for v in app.operands:
            readers[v] += 1
        if app.kind is not AppKind.EQN:  # links and ties read their results too
            for v in app.results:
                readers[v] += 1
    for v in (*g.out_vids, *g.read_outside):
        readers[v] += 1
    producer = g.producers()
    dead: set[int] = set()
    work = [
        a
        for a, app in enumerate(g.apps)
        if app.kind is AppKind.EQN and not any(readers[v] for v in app.results)
    ]
    while work:
        a = work.pop()
        if a in dead:
            continue
        dead.add(a)
        for v in g.apps[a].operands:
            readers[v] -= 1
            p = producer.get(v)
            if readers[v] == 0 and p is not None and not any(readers[r] for r in g.apps[p].results):
                work.append(p)
    g.memo["dead_apps"] = (len(g.apps), frozenset(dead))
    return g.memo["dead_apps"][1]


def duplicate_app(app, seen: dict) -> bool:
    """True for an equation identical to an earlier one (same primitive, operands and
    params), which XLA's common-subexpression elimination merges; ``seen`` collects the
    equations met so far.

    Example:
        >>> seen = {}
        >>> [duplicate_app(app, seen) for app in plan.graph.apps]  # doctest: +SKIP
        [False, False, True]
    """
    if app.eqn is None:
        return False
    head = (app.eqn.primitive, app.operands)
    # the params are compared only between equations of one primitive on the same
    # operands (sorting every equation's params was a tenth of `decide`)
    earlier = seen.get(head)
    if earlier is None:
        seen[head] = [app.eqn.params]
        return False
    key = _params_key(app.eqn.params)
    if key is None:
        return False
    for k, params in enumerate(earlier):
        if isinstance(params, Mapping):  # an earlier equation's params, keyed lazily
            params = earlier[k] = _params_key(params)
        if params == key:
            return True
    earlier.append(key)
    return False


def _params_key(params: Mapping) -> tuple | None:
    """Hashable params, or None when some value is not (never a duplicate then)."""
    key = tuple(sorted(params.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def analyzed_apps(g: Graph, prop: Propagator) -> list[int]:
    """The applications that may need a reshard: not dead code, not a duplicate of an
    earlier equation (unless it reduces: `_reduces`), not already working in its values'
    layouts (`Propagator.settled`).

    Example:
        >>> analyzed_apps(plan.graph, prop)  # doctest: +SKIP
        [3, 7, 12]
    """
    seen: dict = {}
    dead = dead_apps(g)
    return [
        a
        for a, app in enumerate(g.apps)
        if a not in dead
        and not (duplicate_app(app, seen) and not _reduces(app))
        and not prop.settled(a)
    ]


def _reduces(app) -> bool:
    """Whether an application has a reduction factor. XLA merges a duplicate equation
    but not the all-reduce of its partial result (collectives are never merged as
    common subexpressions): a softmax computed twice all-reduces its maximum twice, as
    one tuple all-reduce of the same operand."""
    return app.eqn is not None and any(f.kind is FactorKind.REDUCTION for f in app.rule.factors)


def moved_array(
    g: Graph, dims, a: int, vid: int, src: Sequence[DimSharding], dst: Sequence[DimSharding]
) -> tuple[tuple[int, ...], tuple[DimSharding, ...], tuple[DimSharding, ...], int]:
    """The array a move of value ``vid`` at application ``a`` from ``src`` to ``dst``
    moves, as ``(shape, src, dst, times)``, ``times`` per run of ``a``: the value itself,
    once; but the slice of a stack a loop's body reads in another layout than the
    stack's (`slices_stack`): where the stack is an argument of the step, one slice per
    iteration inside the loop, unless the moved stack is wanted whole (the body stacks
    the slice out again: a residual a scan's backward pass reads; or another loop slices
    the same stack in the same layout); XLA then moves the whole stack once, before the
    loop, as it does a stack the step makes itself (a weight stored with its layer axis
    second, transposed for the scan). Measured: a forward-only scan over an argument,
    one all-to-all of the slice per iteration; its train step, and each transposed
    attention weight stack of a scanned llama2, one all-to-all of the stack.

    Example:
        >>> moved_array(plan.graph, plan.dims, link, slice_vid, src, dst)  # doctest: +SKIP
        ((2, 64, 4, 16), ((), ('tensor',), (), ()), ((), (), ('tensor',), ()), 1)
    """
    if not slices_stack(g, a) or vid not in g.apps[a].results:
        return g.shapes[vid], tuple(src), tuple(dst), 1
    stack = g.apps[a].operands[0]
    if not _wanted_whole(g, dims, a, stack, vid, tuple(dst)):
        return g.shapes[vid], tuple(src), tuple(dst), g.shapes[stack][0]
    lead = tuple(dims[stack][:1])
    return g.shapes[stack], lead + tuple(src), lead + tuple(dst), 1


def made_runs(g: Graph) -> dict[int, float]:
    """How many times per call each value is made (as `jaxshard.cost.executions` counts
    the equations of ``g``), for the values made inside a loop or passed into one: a
    loop body's slice of a stacked input and its carry, once per iteration; a loop's
    result, once per run of the code around the loop; a value passed into a call, as
    often as the call runs; a value an equation makes from loop-invariant operands only
    (a weight the body transposes), as often as the most frequently made of them, since
    XLA hoists it out of the loop. A carry's body input can have its initial value's
    id: it counts as made once per iteration (a move outside the loop runs once all the
    same). A value made from constants only (an iota, a literal broadcast) counts as
    made wherever it is read (``math.inf``): XLA folds it into a constant and sinks that
    into the loop. A step's argument, and a value a loop body reads from outside (it
    has the outer value's id), are absent: made once per call, or where their maker
    runs.

    XLA moves such a loop-invariant value once, before the loop (its loop-invariant code
    motion hoists the collective out of the body): a value the body slices by the
    iteration counter (a microbatch ``xs[i]`` of a gradient accumulation loop), or a
    weight read transposed, is gathered or exchanged once, however often the body runs.

    Example:
        >>> made_runs(plan.graph)  # doctest: +SKIP
        {17: 4, 18: 4, 30: 1, 31: inf}
    """
    cached = g.memo.get("made_runs")
    if cached is not None and cached[0] == len(g.apps):
        return cached[1]
    runs = executions(g)
    made: dict[int, float] = {}
    for a, app in enumerate(g.apps):  # the links first: a body lists them after itself
        if app.kind is not AppKind.LINK:
            continue
        if a in g.out_links:  # the outer result: made where the loop runs
            made.setdefault(app.operands[0], runs[a])
        elif slices_stack(g, a):  # one slice per iteration of the body
            made[app.results[0]] = runs[g.link_body.get(a, a)]
        elif a in g.carry_links:  # the body's input (it may share the initial value's
            made[app.operands[0]] = made[app.results[0]] = runs[a]  # id) and output
        else:  # a value passed into a call
            made[app.results[0]] = runs[a]
    for v in g.literals:
        made[v] = math.inf
    for a, app in enumerate(g.apps):
        if app.kind is AppKind.EQN:
            found = [made.get(v, 1) for v in app.operands]
            found = [n for n in found if n != math.inf]
            # made from constants only (an iota, a literal's broadcast): XLA folds it into
            # a constant, which it sinks into a loop rather than hoisting its move
            once = min(runs[a], max(found)) if found else math.inf
            for v in app.results:  # a carry's initial value is its body input too
                made[v] = max(made.get(v, 1), once)
    g.memo["made_runs"] = (len(g.apps), made)
    return made


def _wanted_whole(g: Graph, dims, a: int, stack: int, piece: int, layout: tuple) -> bool:
    """Whether the stack link ``a`` slices into ``piece`` (read in ``layout``) is wanted
    whole in that layout: another loop slices it so, or the body stacks ``piece`` (or
    what hands it on as it is) out of the loop (`moved_array`)."""
    found = g.memo.get("stack_slicers")
    if found is None or found[0] != len(g.apps):
        uses = g.uses()
        slicers: dict[int, list[int]] = {}
        for b in range(len(g.apps)):
            if slices_stack(g, b):
                slicers.setdefault(g.apps[b].operands[0], []).append(b)
        found = g.memo["stack_slicers"] = (len(g.apps), slicers, uses, set(g.in_vids))
    _, slicers, uses, args = found
    if stack not in args:
        return True  # made in the step: made in the layout the body reads, whole
    if any(b != a and tuple(dims[g.apps[b].results[0]]) == layout for b in slicers[stack]):
        return True
    todo, seen = [piece], {piece}
    while todo:
        v = todo.pop()
        for b in uses[v]:
            app = g.apps[b]
            if b in g.out_links and v in app.results:
                return True  # an out-link's result is the body's value it stacks
            if v not in app.operands:
                continue
            if _copies_operand(app):  # handed on as it is
                todo.extend(r for r in app.results if r not in seen and not seen.add(r))
    return False


class Move(NamedTuple):
    """One value an equation moves: from the layout ``src`` to ``dst``, summing its
    pending partial over ``partial`` (a result of a contraction over sharded axes)."""

    vid: int
    src: tuple[DimSharding, ...]
    dst: tuple[DimSharding, ...]
    partial: frozenset[str]


def app_moves(
    prop: Propagator, axis_sizes: Mapping[str, int], a: int
) -> tuple[list[Move], frozenset[str]]:
    """What application ``a`` of a finished propagation moves: ``(value, from, to,
    pending partial axes)`` for each operand brought to the layout the equation works in
    and each result taken from it (a partial sum when the equation reduces over sharded
    axes) to its own layout; and those partial axes. Moves may cost nothing (a slice).
    A loop carry's link (`Graph.carry_links`) moves what the body returns to the layout
    the body reads, once per iteration: XLA keeps one layout for a loop's carry.

    Example:
        >>> app_moves(prop, {"data": 2}, 5)  # doctest: +SKIP
        ([Move(vid=17, src=(('data',), ()), dst=((), ()), partial=frozenset())], frozenset())
    """
    dims = prop.state.dims
    graph = prop.graph
    results = graph.apps[a].results
    if a in graph.out_links and _slices(dims[graph.apps[a].operands[0]], dims[results[0]]):
        return [], frozenset()  # each device cuts its part of the nested result: no move
    if a in graph.carry_links:  # each iteration's output becomes the next one's input
        (carry_in,), (carry_out,) = graph.apps[a].operands, results
        handed, read = dims[carry_out], dims[carry_in]
        moves = [] if handed == read else [Move(carry_in, handed, read, frozenset())]
        return moves, frozenset()
    wants: dict[int, list[DimSharding]] = {}
    working, axes = prop.working(a)
    axes = axes.kept(lambda x: axis_sizes[x] > 1)  # one device: summed already
    layouts = prop.state.layouts
    for vid, d, want in working:
        if want is not None and layouts[vid][d].axes != want:
            wants.setdefault(vid, list(dims[vid]))[d] = want
    if axes and contracts(graph.apps[a]):
        gathered = _gathered_instead(graph, dims, wants, axes, axis_sizes, a)
        if gathered is not None:
            return gathered, frozenset()
    moves = [
        Move(vid, dims[vid], tuple(work), frozenset())
        for vid, work in wants.items()
        if vid not in results
    ]
    for r in results:
        if axes or r in wants:
            moves.append(Move(r, tuple(wants.get(r, dims[r])), dims[r], axes))
    return moves, axes


def _gathered_instead(graph, dims, wants, axes, axis_sizes, a) -> list[Move] | None:
    """The moves XLA makes instead of a contraction's partial sum when one operand alone
    holds the contracted dim split (the other is whole there and would be sliced) and,
    gathered, it is no larger than the result: it all-gathers that operand and
    contracts whole, moving at most half the bytes of the result's all-reduce (measured:
    ``x[b, k/4] @ w[k, n]`` gathers x when k <= n and all-reduces the product when k >
    n). None where the partial sum stands: the result is scattered over the summed
    axes (a reduce-scatter), or both operands hold them."""
    app = graph.apps[a]
    (r,) = app.results if len(app.results) == 1 else (None,)
    if r is None or any(x in axes for d in dims[r] for x in d):
        return None
    holders = [v for v in app.operands if any(x in axes for d in dims[v] for x in d)]
    if len(holders) != 1 or holders[0] in wants:
        return None
    (x,) = holders
    for v, work in wants.items():
        if v != r and any(
            tuple(y for y in w if y not in axes) != tuple(d) for d, w in zip(dims[v], work)
        ):  # not only a slice over the summed axes
            return None
    whole = tuple(tuple(y for y in d if y not in axes) for d in dims[x])
    out = tuple(wants.get(r, dims[r]))
    if per_device_bytes(graph.shapes[x], graph.dtypes[x], whole, axis_sizes) > per_device_bytes(
        graph.shapes[r], graph.dtypes[r], out, axis_sizes
    ):
        return None
    moves = [Move(x, dims[x], whole, frozenset())]
    if r in wants:
        moves.append(Move(r, out, dims[r], frozenset()))
    return moves


def _slices(outer: Sequence[DimSharding], inner: Sequence[DimSharding]) -> bool:
    """Whether a nested result in layout ``inner`` reaches the outer value's layout
    ``outer`` by a local slice (`slices_locally`), less a leading stacked dim.

    Example:
        >>> _slices([(), ("data",), ()], [(), ()]), _slices([("data",)], [("model",)])
        (True, False)
    """
    lead = len(outer) - len(inner)
    return lead in (0, 1) and slices_locally(outer[lead:], inner)
