"""The order XLA runs a program in and what is alive when: a schedule of the
equations (`schedule`), the data flow, each value's live range (`liveness`), and what
XLA never allocates (bitcasts, common subexpressions it merges, calls it inlines).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from jax.extend.core import Literal

from jaxshard.cost.sizes import per_device_bytes
from jaxshard.graph import AppKind, find_root
from jaxshard.lattice import DimSharding
from jaxshard.rule import FactorKind

# calls XLA inlines before its common-subexpression pass; every other enclosing equation
# (a loop, a branch, a rematerialized region behind its optimization barrier, a manual
# shard_map body) keeps the values inside apart from equal ones outside
_INLINED_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                            "custom_vjp_call", "custom_vjp_call_jaxpr"})  # fmt: skip
# on XLA's CPU backend, rematerialized regions too (`liveness`)
_CPU_INLINED = _INLINED_CALLS | {"remat2"}
# the calls whose equations land in the XLA computation that encloses them, as its
# collective passes see it (`xla_scope`'s ``inlined``): a rematerialized region is
# lowered in place too, only behind an optimization barrier (XLA combines the all-reduces
# of its weight gradients with every other layer's)
LOWERED_IN_PLACE = _CPU_INLINED


class Schedule(NamedTuple):
    """When XLA runs each application: ``at[a]`` is a time in application units.

    XLA's scheduler keeps the program's loops in order but moves the work between them
    as early as its operands allow: anything outside the loops that does not read a
    loop's result runs before that loop (a parameter's gather for the logits, the zeros
    of the embedding gradient's scatter-add, the one-hot of the labels), so its buffer
    is alive across the loop. ``seg[v]`` is how many of the top-level loops value ``v``
    waits for; ``loop_starts[k]`` the first application of the ``k``-th top-level loop;
    ``top[a]`` whether application ``a`` is outside every loop.
    """

    at: np.ndarray
    seg: np.ndarray
    loop_starts: tuple[int, ...]
    top: np.ndarray

    def hoisted(self, a: int, v: int) -> int:
        """The time XLA computes what application ``a`` needs from value ``v`` alone (a
        parameter's gathered copy): before the first loop ``v`` does not wait for, when
        ``a`` runs after it outside the loops.

        Example:
            >>> s = Schedule(np.arange(9), np.zeros(3, int), (4,), np.ones(9, bool))
            >>> s.hoisted(7, 0), s.hoisted(2, 0)
            (3, 2)
        """
        k = int(self.seg[v])
        if self.top[a] and k < len(self.loop_starts) and self.loop_starts[k] <= a:
            return min(int(self.at[a]), max(0, self.loop_starts[k] - 1))
        return int(self.at[a])


def schedule(graph, ready: Mapping[int, int] | None = None) -> Schedule:
    """Each application's time in XLA's schedule of ``graph``: program order, except
    that work outside the loops that reads no result of a loop before it moves to just
    before the first such loop (`Schedule`). Measured on XLA's CPU schedules of scanned
    models: every top-level instruction not reading a loop's result is scheduled before
    that loop. ``ready`` maps values to the earliest time their readers may run (a
    gradient whose all-reduce XLA combines with a later one's).

    Example:
        >>> import jax, jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> def f(w, xs):
        ...     c, _ = jax.lax.scan(lambda c, x: (c * x, None), jnp.sin(w), xs)
        ...     return c + jnp.cos(w)   # cos(w) reads no loop result: before the scan
        >>> g = build_graph(trace(f, (jnp.ones(4), jnp.ones((3, 4))), {}), {})
        >>> s = schedule(g)
        >>> [(a.describe().split()[0], int(t)) for a, t in zip(g.apps, s.at) if a.kind is AppKind.EQN]
        [('sin', 0), ('mul', 1), ('cos', 0), ('add', 5)]
    """
    from jax.extend.core import primitives

    loop_prims = (primitives.scan_p, primitives.while_p)
    memo: dict[int, int | None] = {}

    def outer_loop(where) -> int | None:
        if where is None:
            return None
        found = memo.get(id(where), -1)
        if found == -1:
            eqn, outer = where
            found = outer_loop(outer)
            if found is None and eqn.primitive in loop_prims:
                found = id(eqn)
            memo[id(where)] = found
        return found

    n_apps = len(graph.apps)
    loop_of: list[int | None] = []
    for app in graph.apps:
        key = outer_loop(app.where)
        if key is None and app.kind is AppKind.LINK and app.eqn is not None:
            key = id(app.eqn) if app.eqn.primitive in loop_prims else None
        loop_of.append(key)
    first: dict[int, int] = {}
    for a, key in enumerate(loop_of):
        if key is not None:
            first.setdefault(key, a)
    order = {key: k for k, key in enumerate(first)}  # loops in program order
    loop_starts = tuple(first.values())
    top = np.array([key is None for key in loop_of], dtype=bool)
    edges = flow(graph)
    # lists while filled (see `liveness`), arrays once made
    seg = [0] * len(graph.shapes)
    for v, t in (ready or {}).items():  # as late as the loops that end before it
        seg[v] = int(np.searchsorted(np.array(loop_starts), t, side="right"))
    changed = True
    while changed:  # a call's links come after its body: repeat until nothing moves
        changed = False
        for a, sources, sinks in edges:
            key = loop_of[a]
            if key is not None:  # inside a loop: its values, and its results, wait for it
                k = order[key] + 1
            else:
                k = max((seg[v] for v in sources), default=0)
            for v in sinks:
                if seg[v] < k:
                    seg[v] = k
                    changed = True
    at = list(range(n_apps))
    is_top = top.tolist()
    if loop_starts:
        before = np.searchsorted(np.array(loop_starts), np.arange(n_apps), side="right").tolist()
        for a, sources, _ in edges:
            if is_top[a]:
                k = max((seg[v] for v in sources), default=0)
                if k < before[a]:
                    at[a] = max(0, loop_starts[k] - 1)
    for a, sources, _ in edges if ready else ():
        if is_top[a]:
            at[a] = max([at[a], *(ready[v] for v in sources if v in ready)])
    return Schedule(np.array(at, dtype=np.int64), np.array(seg, dtype=np.int64), loop_starts, top)


def flow(graph) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Each application as ``(index, sources, sinks)`` in the direction values flow: an
    equation from its operands to its results, a link into a call from the outer value to
    the inner one, a call's result link from the inner value out; ties left out.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> flow(build_graph(trace(jnp.sin, (jnp.ones(4),), {}), {}))
        [(0, (0,), (1,))]
    """
    out_links = graph.out_links
    return [
        (a, app.results, app.operands) if a in out_links else (a, app.operands, app.results)
        for a, app in enumerate(graph.apps) if app.kind is not AppKind.TIE
    ]  # fmt: skip


def reads_of(graph, own: Mapping[int, int]) -> list[int]:
    """Per value, the union of the bit sets ``own`` gives the values it is computed from
    (transitively, through calls and loops; not its own bits).

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.cos(jnp.sin(x)), (jnp.ones(4),), {}), {})
        >>> reads_of(g, {0: 1, 1: 2})
        [0, 1, 3]
    """
    reads = [0] * len(graph.shapes)
    edges = flow(graph)
    changed = True
    while changed:  # a call's links come after its body: repeat until nothing moves
        changed = False
        for _, sources, sinks in edges:
            bits = 0
            for v in sources:
                bits |= reads[v] | own.get(v, 0)
            if bits:
                for v in sinks:
                    if reads[v] | bits != reads[v]:
                        reads[v] |= bits
                        changed = True
    return reads


@dataclass(frozen=True)
class Liveness:
    """When each buffer of a graph is alive, in application (equation) order.

    ``owner[v]`` is the buffer value ``v`` lives in (identity links of nested jaxprs
    alias their outer value); ``start``/``end`` are the first and last times (`Schedule`)
    of each owner (``-1``: not an intermediate — an argument, a result or a
    constant). ``intermediates`` lists the owners counted as activations.
    """

    owner: list[int]
    start: np.ndarray
    end: np.ndarray
    intermediates: np.ndarray
    # a loop's stacked input or result (owner) -> the per-iteration value its link slices
    # it into: while the loop runs, XLA holds the stack in that value's layout
    stacked: Mapping[int, int] = field(default_factory=dict)
    schedule: Schedule | None = None
    # a contraction's result written over in place by its reader (its buffer ends before
    # that time) -> the time it ends if the contraction's layout has a unit dim
    squeezable: Mapping[int, int] = field(default_factory=dict)
    # per owner, the first application that makes it and the last that reads it, in
    # program order: the order within a run of applications the schedule moves to one
    # time (`transient_peaks`)
    span: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    # per owner of a result the step computes (not an argument returned as it is), the
    # first time anything is written into its buffer
    results_from: Mapping[int, int] = field(default_factory=dict)
    # the calls XLA inlines before merging common subexpressions (`xla_scope`): with
    # rematerialized regions on XLA's CPU backend (`liveness`)
    inlined: frozenset[str] = _INLINED_CALLS

    def written_after(self, r: int, t: int) -> bool:
        """Whether result value ``r``'s buffer is first written after time ``t`` (a result
        the step does not compute, an argument returned as it is, is copied in at the end).

        Example:
            >>> live.written_after(graph.out_vids[0], 12)  # doctest: +SKIP
            True
        """
        return self.results_from.get(self.owner[r], math.inf) > t


def liveness(
    graph,
    skip: Iterable[int] = (),
    ready: Mapping[int, int] | None = None,
    bitcasts: Iterable[int] = (),
    remat_barriers: bool = True,
) -> Liveness:
    """Lifetimes of a graph's buffers: produced by their first equation, freed after their
    last use, in the times of XLA's `schedule` (``ready`` as there), a loop's consts until
    the loop's last application (`_hold_loop_consts`); arguments and results live for
    the whole call and are not intermediates. Applications in ``skip``
    (dead code) neither produce nor use anything; those in ``bitcasts`` (`bitcasts`: a
    layout's reshapes that keep each device's data as it is) make no buffer of their own.
    Without ``remat_barriers`` (XLA's CPU backend: its compiler removes the optimization
    barrier JAX puts before a rematerialized region before it merges common
    subexpressions), a rematerialized equation in the computation of its forward twin is
    that twin: the forward's value stays alive until the backward pass reads it.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sin(jnp.cos(x)) * 2, (jnp.ones(4),), {}), {})
        >>> live = liveness(g)
        >>> [(int(live.start[v]), int(live.end[v])) for v in live.intermediates]
        [(0, 1), (1, 2)]
    """
    n = len(graph.shapes)
    parent = list(range(n))
    skip = set(skip)
    for app in graph.apps:
        if app.kind is AppKind.LINK and len(app.operands) == 1 and len(app.results) == 1:
            o, r = app.operands[0], app.results[0]
            if graph.shapes[o] == graph.shapes[r] and _is_identity(app.rule):
                ro, rr = find_root(parent, o), find_root(parent, r)
                if ro != rr:
                    parent[rr] = ro
    # a transpose is the only reader of what an equation made: XLA's layout assignment
    # has the maker write in the transposed order, and the transpose is a bitcast
    readers = np.zeros(n, dtype=np.int64)
    for app in graph.apps:
        for v in app.operands:
            readers[v] += 1
    made = graph.producers()
    for a, app in enumerate(graph.apps):
        if (
            app.eqn is not None
            and app.kind is AppKind.EQN
            and app.eqn.primitive.name == "transpose"
        ):
            (o,), (r,) = app.operands, app.results
            if readers[o] == 1 and o in made and a not in skip:
                ro, rr = find_root(parent, o), find_root(parent, r)
                if ro != rr:  # the maker's layout sizes the buffer (a partial sum's)
                    parent[rr] = ro
    # a bitcast reads its operand's buffer in the new shape (a layer stack reshaped into
    # pipeline stages): one buffer
    for a in bitcasts:
        (o, *_), (r,) = graph.apps[a].operands, graph.apps[a].results
        ro, rr = find_root(parent, o), find_root(parent, r)
        if ro != rr and a not in skip:
            parent[rr] = ro
    inlined = _INLINED_CALLS if remat_barriers else _CPU_INLINED
    merged: set[int] = set()
    owner = [find_root(parent, v) for v in range(n)]
    owner = _common_subexpressions(graph, owner, skip, inlined, merged)
    big = len(graph.apps) + 1
    # lists while filled: the loop indexes them once per operand and result, and a NumPy
    # array indexed by a Python int makes a NumPy scalar each time (3x slower)
    start, end = [big] * n, [-1] * n
    stacked: dict[int, int] = {}
    link_body = getattr(graph, "link_body", {})
    sched = schedule(graph, ready)
    at = sched.at.tolist()
    early = max(0, sched.loop_starts[0] - 1) if sched.loop_starts else big  # see the links
    span: dict[int, list[int]] = {}
    for a, app in enumerate(graph.apps):
        if a in skip or app.kind is AppKind.TIE:
            continue
        for v in (*app.operands, *app.results):
            hit = span.get(owner[v])
            if hit is None:
                span[owner[v]] = [a, a]
            else:
                hit[1] = a
        t = at[a]
        if app.kind is AppKind.LINK:
            for v, r in zip(app.operands, app.results):
                if len(graph.shapes[v]) == len(graph.shapes[r]) + 1:
                    stacked[owner[v]] = r
            # a link's operand is the outer value of a loop or call, linked after the body:
            # a stacked result (the residuals a scan saves for the backward pass, a
            # scanned gradient) is allocated before the loop starts and filled as it
            # runs, and a stacked input the loop reads is alive until it ends. XLA makes
            # the stack's zero-filled buffer, which reads nothing, before the first loop
            # (read in the buffer assignment of scanned steps: the backward loop's
            # gradient stacks are made before the forward loop)
            first = at[link_body.get(a, a)]
            for v in app.operands:
                o = owner[v]
                if start[o] == big:
                    start[o] = min(first, t, early if o in stacked else big)
                if t > end[o]:
                    end[o] = t
            continue
        for v in app.results:
            o = owner[v]
            if t < start[o]:
                start[o] = t
        if a in merged:
            continue  # XLA computes it once, where it first appears: it reads nothing
        for v in app.operands:
            o = owner[v]
            if t > end[o]:
                end[o] = t
    start, end = np.array(start, dtype=np.int64), np.array(end, dtype=np.int64)
    _hold_loop_consts(graph, sched, owner, made, skip, end)
    boundary = {owner[v] for v in (*graph.in_vids, *graph.out_vids)}
    produced = start < big
    inputs = {owner[v] for v in graph.in_vids}
    results_from = {
        owner[v]: int(start[owner[v]])
        for v in graph.out_vids
        if produced[owner[v]] and owner[v] not in inputs
    }
    for o in boundary:
        produced[o] = False
    roots = np.array([owner[v] == v for v in range(n)], dtype=bool)
    keep = produced & roots
    end = np.maximum(end, start)  # a result nothing reads lives at its own equation
    start = np.where(keep, start, -1)
    end = np.where(keep, end, -1)
    kept = np.flatnonzero(keep)
    same = (start == end).tolist()
    spans = {o: (span[o][0], span[o][1]) for o in kept.tolist() if same[o]}
    return Liveness(
        owner, start, end, kept, stacked, sched, span=spans, results_from=results_from,
        inlined=inlined,
    )  # fmt: skip


def loop_bodies(sched: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The applications inside the top-level loops, the loop each belongs to (its index
    in `Schedule.loop_starts`), and each loop's last application (-1 for none).

    Example:
        >>> s = Schedule(np.arange(6), np.zeros(1, int), (1, 4), np.array([1, 0, 0, 1, 0, 1], bool))
        >>> [x.tolist() for x in loop_bodies(s)]
        [[1, 2, 4], [0, 0, 1], [2, 4]]
    """
    inside = np.flatnonzero(~sched.top)
    loop = np.searchsorted(np.array(sched.loop_starts), inside, side="right") - 1
    last = np.full(len(sched.loop_starts), -1, dtype=np.int64)
    np.maximum.at(last, loop, inside)
    return inside, loop, last


def loop_ends(sched: Schedule, last: np.ndarray | None = None) -> np.ndarray:
    """Each top-level loop's last time (``last``: `loop_bodies`' last applications,
    when already known).

    Example:
        >>> s = Schedule(np.arange(6), np.zeros(1, int), (1, 4), np.array([1, 0, 0, 1, 0, 1], bool))
        >>> loop_ends(s).tolist()
        [2, 4]
    """
    last = loop_bodies(sched)[2] if last is None else last
    return sched.at[np.maximum(last, 0)]


def _hold_loop_consts(graph, sched: Schedule, owner, made, skip, end: np.ndarray) -> None:
    """A value a loop's body reads but does not make (a scan's consts: a mask, a rotary
    table JAX's partial evaluation computed before the loop) is read again by every
    iteration: alive until the body's last application, not its last reader in one
    iteration. Measured on the 70B step at 256 devices: the attention mask's -inf
    broadcast (4 GiB a device) is held across the whole forward loop, where the
    score matmul's result and the mask's select are alive beside it."""
    top, starts = sched.top, sched.loop_starts
    if not starts:
        return
    inside, loop, last = loop_bodies(sched)
    first = np.array(starts, dtype=np.int64)
    held_to = loop_ends(sched, last)
    for a, k in zip(inside.tolist(), loop.tolist()):
        app = graph.apps[a]
        if a in skip or app.kind is not AppKind.EQN:
            continue
        for v in app.operands:
            p = made.get(v)
            if p is None or graph.apps[p].kind is not AppKind.EQN:
                continue  # an argument (alive throughout), or a slice the loop reads
            if first[k] <= p <= last[k] and not top[p]:
                continue  # made inside this loop
            o = owner[v]
            if end[o] < held_to[k]:
                end[o] = held_to[k]


def bitcasts(graph, dims: Sequence[Sequence[DimSharding]], axis_sizes, moved: set[int]) -> set[int]:
    """The equations XLA runs as bitcasts under a layout: read from the rule, one array
    regrouped into other dims with its elements in the same order (a reshape, a squeeze:
    one operand and one result of other shapes holding the same factors in the same
    order, nothing summed, one dtype), that hold the same bytes on each device and move
    nothing (``moved``: applications that reshard an operand or result). Each device's
    shard is then the regrouped shard of its operand (a stack of 32 layers split 8 ways
    is 8 stacks of 4 layers, each device's 4 layers where they were).

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: x.reshape(2, 4) * 2, (jnp.ones(8),), {}), {})
        >>> rows = [[("data",)] + [()] * (len(s) - 1) for s in g.shapes]
        >>> bitcasts(g, rows, {"data": 2}, set())
        {0}
    """
    out = set()
    for a, app in enumerate(graph.apps):
        rule = app.rule
        if (
            app.kind is not AppKind.EQN
            or a in moved
            or len(rule.operands) != 1
            or len(rule.results) != 1
            or any(f.kind is FactorKind.REDUCTION or f.window is not None for f in rule.factors)
        ):
            continue
        (o,), (r,) = app.operands, app.results
        if (
            graph.shapes[o] != graph.shapes[r]
            and graph.dtypes[o] == graph.dtypes[r]
            and [f for d in rule.operands[0] for f in d] == [f for d in rule.results[0] for f in d]
            and per_device_bytes(graph.shapes[o], graph.dtypes[o], dims[o], axis_sizes)
            == per_device_bytes(graph.shapes[r], graph.dtypes[r], dims[r], axis_sizes)
        ):
            out.add(a)
    return out


def _common_subexpressions(
    graph,
    owner: list[int],
    skip: set[int],
    inlined: frozenset[str] = _INLINED_CALLS,
    merged: set[int] | None = None,
) -> list[int]:
    """``owner`` with the results of an equation that repeats an earlier one (the same
    primitive and parameters on the same buffers and literals, in the same loop body)
    owned by the earlier one's: XLA's common-subexpression elimination computes them
    once, into one buffer; a conversion to its operand's own type is its operand. The
    repeats are added to ``merged``: XLA removes them, so they read nothing.
    ``jnp.var`` recomputes the mean and the centred input that a layer norm computes
    beside it: counted twice, they made a GPT's estimate 5% high."""
    seen: dict[tuple, tuple[int, ...]] = {}
    literals = getattr(graph, "literals", {})
    for a, app in enumerate(graph.apps):
        eqn = app.eqn
        if app.kind is not AppKind.EQN or eqn is None or a in skip or eqn.effects:
            continue
        inputs = tuple(
            _literal_key(literals[v]) if v in literals else owner[v] for v in app.operands
        )
        try:
            scope = xla_scope(app.where, inlined)
            key = (eqn.primitive, tuple(sorted(eqn.params.items())), inputs, scope)
            first = seen.setdefault(key, app.results)
        except (TypeError, ValueError):  # parameters that cannot be compared (arrays)
            continue
        if first is not app.results:
            for r, f in zip(app.results, first, strict=True):
                owner[r] = owner[f]
            if merged is not None:
                merged.add(a)
        elif eqn.primitive.name == "convert_element_type" and _same_type(eqn):
            if not isinstance(inputs[0], tuple):  # a literal's conversion: a constant
                owner[app.results[0]] = inputs[0]  # XLA's simplifier removes it
    return owner


def _literal_key(var) -> tuple:
    """A literal operand by its value and type (a NaN equals nothing: never merged)."""
    val = var.val
    if not isinstance(val, (bool, int, float, complex, np.generic)):
        val = (np.asarray(val).tobytes(), np.shape(val))
    return ("literal", val, var.aval.dtype, var.aval.weak_type)


def _same_type(eqn) -> bool:
    """A conversion to the type its operand has (``jnp.var`` casts to the computation
    dtype its input already has)."""
    (var,) = eqn.invars
    return not isinstance(var, Literal) and var.aval.dtype == eqn.outvars[0].aval.dtype


def xla_scope(where, inlined: frozenset[str] = _INLINED_CALLS) -> tuple[int, ...]:
    """The enclosing equations of an application (its `App.where`) that XLA does not
    inline, by identity: applications with equal scopes end up in one XLA computation,
    where its common-subexpression pass merges equal instructions.

    Example:
        >>> xla_scope(None)
        ()
    """
    scope = []
    while where is not None:
        eqn, where = where
        if eqn.primitive.name not in inlined:
            scope.append(id(eqn))
    return tuple(scope)


def _is_identity(rule) -> bool:
    return all(r == o for r, o in zip(rule.results[0], rule.operands[0])) and all(
        len(d) == 1 for d in rule.operands[0]
    )
