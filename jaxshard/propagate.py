"""Propagation: a worklist fixed point that moves shardings through every rule, both ways.

Visiting an application reads every factor's sharding from all its operands and
results, merges per factor, and writes the result back into dims that are still open
(forward, backward and sideways at once). A dim only ever goes from open to known, so
the worklist terminates. Two different known shardings meeting on one factor are a
conflict: recorded with both origins, decided by policy (a sharding that comes from a
user hint beats a default; otherwise the option whose reshards cost least wins: fewest
bytes per device, or with a `jaxshard.cost.CostModel` the least time over the mesh axes
they use), and never written over a known dim — the tensors that lose are resharded at
that equation.

Within one application a mesh axis shards at most one factor: when operands give one
axis to two factors (``x + y`` with ``x: P('x')``, ``y: P(None, 'x')``; a contracting
and a free dim of a matmul both on ``'x'``), that is a conflict decided by the same
policy, and the factors that lose keep their other axes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import NamedTuple

from jaxshard.annotate import Pin
from jaxshard.cost import (
    CostModel,
    PlannedCollective,
    halo_collectives,
    pending_sums,
    reshard_collectives,
    unhaloed,
    xla_scope,
)
from jaxshard.errors import JaxshardBug
from jaxshard.graph import AppKind, Graph, contracts
from jaxshard.lattice import Axes, DimSharding, format_dim, join_axes, split_axes
from jaxshard.rule import FactorKind

NEED = FactorKind.NEED_REPLICATION


# A round's proposed write to one (value, dim): (axes proposed, the application proposing
# them, the value and dim they came from (-1, -1: none), quiet: the proposer need not be
# visited again after this write, see `_apply`). A plain tuple, unpacked by these names
# where read: the hot loop makes one per written dim, and a NamedTuple costs 5x to build.
Proposal = tuple[Axes, int, int, int, bool]


# Conflict priorities of a dim's origin, highest first. A storage layout is a hint on a
# parameter or optimizer state that uses a mesh axis the computation spends on something
# else (FSDP: a weight dim on the batch's axis): where it meets a layout derived from the
# other hints, the other hints win and the stored value is resharded at its use.
HINT_RANK, STORAGE_RANK, DEFAULT_RANK = 2, 1, 0


class ConflictKey(NamedTuple):
    """Where a conflict was decided, so one decision is recorded once: a factor of an
    application (``axis`` set when the conflict is over one mesh axis given to several
    factors), or a dim of a value reached differently in one round (``app`` is None)."""

    app: int | None
    factor: int = -1  # the rule's factor index (for an application)
    axis: str = ""
    value: int = -1  # for a value: its id...
    dim: int = -1  # ...and the dim


class OriginKind(StrEnum):
    """Where a dim's sharding came from."""

    HINT = "hint"  # a pin: a hint, an annotation, a storage layout
    PROPAGATED = "propagated"  # through an application, from another value's dim
    DEFAULT = "default"  # nothing reached it: replicated (or a size-1 dim)


class Origin(NamedTuple):
    """Why a dim has its sharding: a hint, propagation through an app, or a default.
    (A named tuple: one is made per propagated dim, so it must be cheap to create.)"""

    kind: OriginKind
    text: str = ""
    app: int = -1  # for "propagated": the application it came through
    source: int = -1  # for "propagated": the value it came from
    source_dim: int = -1  # ... and that value's dim
    rank: int = 0  # its pin's priority in conflicts: DEFAULT_RANK, STORAGE_RANK or HINT_RANK


@dataclass
class Conflict:
    """Two or more known shardings of one factor at one application, and the decision."""

    app: int
    factor: str
    options: dict[Axes, list[tuple[int, int]]]  # sharding -> [(value, dim)] holding it
    chosen: Axes
    reason: str


@dataclass
class State:
    """Per value, per dim: the sharding (None = open) and its origin."""

    dims: list[list[DimSharding]]
    origins: list[list[Origin | None]]
    conflicts: dict[ConflictKey, Conflict] = field(default_factory=dict)
    visits: int = 0


def _compile(rule) -> tuple:
    """Index a rule for the hot path: (single-factor dims, compound dims, all dims, and
    for `Propagator.settled` the reduction factors, or None when the rule has compound
    dims, need-replication or windowed factors), each entry naming the tensor by its position
    among operands then results."""
    sizes = [f.size for f in rule.factors]
    need = [f.kind is NEED for f in rule.factors]
    single, compound, writable = [], [], []
    for t, tdims in enumerate((*rule.operands, *rule.results)):
        for d, fl in enumerate(tdims):
            if not fl:
                continue
            fsizes = tuple(sizes[f] for f in fl)
            writable.append((t, d, fl, fsizes))
            if len(fl) == 1 and rule.factors[fl[0]].window is None:
                if not need[fl[0]]:
                    single.append((t, d, fl[0]))
            else:  # a windowed dim too: its size may be a multiple of the factor's
                compound.append((t, d, fl, fsizes, tuple(need[f] for f in fl)))
    reductions = None
    windowed = any(f.window is not None for f in rule.factors)
    if not compound and not any(need) and not windowed:
        reductions = tuple(i for i, f in enumerate(rule.factors) if f.kind is FactorKind.REDUCTION)
    return tuple(single), tuple(compound), tuple(writable), reductions


class Propagator:
    """Runs propagation over a Graph; see the module doc.

    Example:
        >>> import jax.numpy as jnp
        >>> import jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> from jaxshard.annotate import Pin
        >>> t = trace(lambda x, w: x @ w, (jnp.ones((8, 4)), jnp.ones((4, 16))), {})
        >>> g = build_graph(t, {"data": 2, "model": 4})
        >>> prop = Propagator(g, {"data": 2, "model": 4})
        >>> prop.pin(g.in_vids[0], Pin((("data",), None), "hint"))
        >>> prop.pin(g.in_vids[1], Pin((None, ("model",)), "hint"))
        >>> prop.run()
        >>> prop.state.dims[g.out_vids[0]]
        [('data',), ('model',)]
    """

    def __init__(
        self, graph: Graph, axis_sizes: Mapping[str, int], cost_model: CostModel | None = None
    ):
        self.graph = graph
        self.axis_sizes = dict(axis_sizes)
        self.cost_model = cost_model
        dims = [[() if s == 1 else None for s in shape] for shape in graph.shapes]
        origins: list[list[Origin | None]] = [
            [Origin(OriginKind.DEFAULT, "size-1 dim") if s == 1 else None for s in shape]
            for shape in graph.shapes
        ]
        self.state = State(dims, origins)
        self.uses = graph.uses()
        compiled: dict[int, tuple] = {}  # per Rule object: repeated layers share one
        self._struct = [
            compiled.get(id(app.rule)) or compiled.setdefault(id(app.rule), _compile(app.rule))
            for app in graph.apps
        ]
        self._vids = [(*app.operands, *app.results) for app in graph.apps]
        # proposals into a value a loop passes in from a hinted argument, made inside the
        # loop: applied once nothing else moves (`run`)
        self._deferred: dict[tuple[int, int], list[Proposal]] = {}
        total_dims = sum(len(s) for s in graph.shapes)  # visits a fixed point can need
        self._bound = len(graph.apps) + sum(len(u) for u in self.uses) * 2 + total_dims + 16
        self.hinted: set[int] = set()
        self._scopes: dict[int, tuple[int, ...]] = {}  # per application, on first use
        self._producer = graph.producers()
        self._is_link = bytearray(app.kind is AppKind.LINK for app in graph.apps)
        self._links = [a for a, app in enumerate(graph.apps) if app.kind is AppKind.LINK]
        self._fed = bytearray(len(graph.shapes))  # see `_feed`
        self._fed_for: tuple[int, int] | None = None
        self._journal: list | None = None  # while `trying`: (value, dim, old axes, old origin)
        self._queue: deque[int] = deque()
        self._queued = bytearray(len(graph.apps))
        axis_sizes = self.axis_sizes  # not self: a cycle would keep the whole state alive
        self._split = lru_cache(maxsize=None)(  # until the next full garbage collection
            lambda axes, sizes: split_axes(axes, sizes, axis_sizes)
        )

    def fork(self) -> Propagator:
        """A copy whose layouts can change without touching this one (the graph and the
        rules' indexes are shared): for trying a decision and keeping it or not.

        Example:
            >>> trial = prop.fork()  # doctest: +SKIP
            >>> trial.pin(vid, pin); trial.run()  # doctest: +SKIP
        """
        other = object.__new__(Propagator)
        other.__dict__.update(self.__dict__)
        state = self.state
        other.state = State(
            [list(d) for d in state.dims],
            [list(o) for o in state.origins],
            dict(state.conflicts),
            state.visits,
        )
        other.hinted = set(self.hinted)
        other._queue = deque(self._queue)
        other._queued = bytearray(self._queued)
        other._deferred = {k: list(v) for k, v in self._deferred.items()}
        other._fed = bytearray(self._fed)
        other._journal = None  # a fork made inside `trying` writes into its own state only
        return other

    @contextmanager
    def trying(self) -> Iterator[list[tuple[int, int, DimSharding, Origin | None]]]:
        """Pin and propagate a decision tentatively: every write inside the block is
        journaled (``(value, dim, old axes, old origin)``, yielded) and undone on exit,
        with the conflicts it recorded.

        Example:
            >>> with prop.trying() as written:  # doctest: +SKIP
            ...     prop.pin(vid, pin); prop.run()
            ...     reached = {v for v, *_ in written}
        """
        journal: list = []
        self._journal = journal
        conflicts, hinted, visits = dict(self.state.conflicts), set(self.hinted), self.state.visits
        try:
            yield journal
        finally:
            self._journal = None
            dims, origins = self.state.dims, self.state.origins
            for vid, d, axes, origin in reversed(journal):
                dims[vid][d] = axes
                origins[vid][d] = origin
            self.state.conflicts, self.hinted, self.state.visits = conflicts, hinted, visits
            self._queue.clear()
            self._deferred = {}
            self._queued = bytearray(len(self._queued))

    # --- seeding -------------------------------------------------------------------

    def pin(self, vid: int, pin: Pin, rank: int = HINT_RANK) -> None:
        """Set the dims a user pinned (a hint) and queue their applications. ``rank``
        (`HINT_RANK` or `STORAGE_RANK`) is the priority of what propagates from them when
        it meets another hint's layout in a conflict."""
        dims, origins = self.state.dims[vid], self.state.origins[vid]
        self.hinted.add(vid)
        pinned = {ax for value in pin.dims if value for ax in value}
        if self._journal is not None:
            self._journal.extend((vid, d, dims[d], origins[d]) for d in range(len(dims)))
        for d, value in enumerate(pin.dims):
            if value is not None:
                dims[d] = value
                origins[d] = Origin(OriginKind.HINT, pin.source, rank=rank)
            elif dims[d] and pinned.intersection(dims[d]):
                # propagation reached this dim before the pin (a storage pin comes after
                # the computation's layout): the pinned dims keep their axes
                dims[d] = tuple(ax for ax in dims[d] if ax not in pinned)
                origins[d] = Origin(
                    OriginKind.HINT, f"{pin.source} (its axes removed here)", rank=rank
                )
        self._enqueue(self.uses[vid])

    def default(self, vids: Iterable[int], text: str) -> None:
        """Fill every still-open dim of ``vids`` as replicated, then propagate from them."""
        for vid in vids:
            dims = self.state.dims[vid]
            touched = False
            for d, value in enumerate(dims):
                if value is None:
                    dims[d] = ()
                    self.state.origins[vid][d] = Origin(OriginKind.DEFAULT, text)
                    touched = True
            if touched:
                self._enqueue(self.uses[vid])
        self.run()

    def _enqueue(self, apps: Iterable[int]) -> None:
        for a in apps:
            if not self._queued[a]:
                self._queued[a] = 1
                self._queue.append(a)

    # --- the fixed point -----------------------------------------------------------

    def run(self) -> None:
        """Visit queued applications in rounds until nothing changes.

        A round reads the state as it was when the round began and applies all writes
        together, so two shardings that reach one open dim in the same round are a
        conflict decided by cost, not by which application was visited first.

        What the inside of a loop (or call) would write into a value the loop passes in
        from a hinted argument (`_feed`: a stacked weight, through a transpose) waits
        until nothing else moves: the weight's own layout, arriving along its longer path
        from the hint, comes first. The other way round, an activation's layout reaching
        the weight through a contraction would take the axis the weight's hint gives
        another of its dims, and the weight would be rearranged at every iteration.
        """
        bound = self._bound
        visits = 0
        queued, visit = self._queued, self._visit
        self._feed()
        while self._queue or self._deferred:
            if not self._queue:
                deferred, self._deferred = self._deferred, {}
                self._apply(deferred)
                continue
            batch = list(self._queue)
            self._queue.clear()
            proposals: dict[tuple[int, int], list[Proposal]] = {}
            for a in batch:
                queued[a] = 0
                visit(a, proposals)
            visits += len(batch)
            if visits > bound:
                raise JaxshardBug(
                    f"propagation exceeded {bound} visits without reaching a fixed point"
                )
            self._apply(proposals)
        self.state.visits += visits

    def _feed(self) -> None:
        """Mark the values a loop or call passes in from a hinted argument (through
        layout-preserving equations: a transpose, a type conversion): what reaches them
        from inside the loop waits (`run`) until the argument's layout has come in."""
        key = (id(self.hinted), len(self.hinted))
        if self._fed_for == key:  # hints are added, never removed, but by `trying`'s undo
            return
        self._fed_for = key
        apps, producer = self.graph.apps, self._producer
        fed = self._fed = bytearray(len(self.graph.shapes))
        for a in self._links:
            app = apps[a]
            if not app.operands:
                continue
            v, seen = app.operands[0], set()
            while v not in self.hinted and v in producer and v not in seen:
                seen.add(v)
                src = apps[producer[v]]
                if len(src.operands) != 1 or not all(f.plain for f in src.rule.factors):
                    break
                v = src.operands[0]
            if v in self.hinted:
                for r in app.results:
                    fed[r] = 1

    def _apply(self, proposals: dict[tuple[int, int], list[Proposal]]) -> None:
        """Write a round's proposals. A value that changed queues its applications again,
        except a proposer that wrote exactly this sharding after a conflict-free visit
        without compound dims: visiting it again would find nothing new."""
        dims, origins, uses = self.state.dims, self.state.origins, self.uses
        queued, queue, journal = self._queued, self._queue, self._journal
        for (vid, d), props in proposals.items():
            state = dims[vid]
            if state[d] is not None:
                continue
            first = props[0]
            axes, first_app, _, _, first_quiet = first
            if len(props) > 1 and any(p[0] != axes for p in props):
                axes, origin = self._resolve_value(vid, d, props)
            else:
                origin = None
            if axes and any(ax in other for other in state if other for ax in axes):
                continue  # an axis may shard one dim only; the final pass records a reshard
            if origin is None:
                origin = self._origin(first)
                if len(props) > 1 and origin.rank < HINT_RANK:  # agreeing proposals: the
                    found = [self._origin(p) for p in props[1:]]  # highest-ranked origin
                    origin = max([origin, *found], key=lambda o: o.rank)
            if journal is not None:
                journal.append((vid, d, None, origins[vid][d]))
            state[d] = axes
            origins[vid][d] = origin
            if len(props) == 1:
                skip = first_app if first_quiet else -1
                for u in uses[vid]:
                    if not queued[u] and u != skip:
                        queued[u] = 1
                        queue.append(u)
            else:
                quiet = {app for p_axes, app, _, _, q in props if q and p_axes == axes}
                for u in uses[vid]:
                    if not queued[u] and u not in quiet:
                        queued[u] = 1
                        queue.append(u)

    def _origin(self, proposal: Proposal) -> Origin:
        _, app, src, src_dim, _ = proposal
        root = self.state.origins[src][src_dim] if src >= 0 else None
        return Origin(
            OriginKind.PROPAGATED,
            app=app,
            source=src,
            source_dim=src_dim,
            rank=DEFAULT_RANK if root is None else root.rank,
        )

    def _resolve_value(self, vid: int, d: int, proposals: list[Proposal]) -> tuple[Axes, Origin]:
        props = [(p[0], self._origin(p)) for p in proposals]
        options: dict[Axes, list[tuple[int, int]]] = {}
        for axes, origin in props:
            holders = options.setdefault(axes, [])
            if (origin.source, origin.source_dim) not in holders:
                holders.append((origin.source, origin.source_dim))
        top = max(o.rank for _, o in props)
        pool = sorted({axes for axes, o in props if o.rank == top})
        chosen, reason = self._decide(pool, options, ranked=top > DEFAULT_RANK)
        name = self.graph.names.get(vid, f"%{vid}")
        origin = max((o for axes, o in props if axes == chosen), key=lambda o: o.rank)
        self.state.conflicts[ConflictKey(None, value=vid, dim=d)] = Conflict(
            origin.app,
            f"dim {d} of {name}",
            options,
            chosen,
            "reached in the same round; " + reason,
        )
        return chosen, origin

    def _decide(
        self,
        pool: list[Axes],
        options: dict[Axes, list[tuple[int, int]]],
        results: set[int] = frozenset(),
        ranked: bool = True,
    ) -> tuple[Axes, str]:
        """The policy: options derived from hints beat defaults (and from other hints,
        storage layouts), then the cheapest reshards (bytes per device, or seconds under
        the cost model). ``pool`` holds the highest-ranked options (``ranked``: above a
        default). Operands move from their layout to the chosen one; ``results`` move from
        the chosen one to theirs."""
        if len(pool) == 1:
            return pool[0], _RANK_REASON if ranked else "the only option"
        costs = {option: self._cost_to(option, options, results) for option in pool}
        chosen = min(pool, key=lambda o: (costs[o], -len(o), o))
        shown = ", ".join(f"{format_dim(o)}: {self._shown(costs[o])}" for o in pool)
        return chosen, self._cost_reason(shown)

    def factor_values(self, a: int) -> tuple[dict[int, Axes], dict[int, tuple[int, int]]]:
        """The merged sharding of each factor at application ``a``, and a (value, dim)
        supplying it. Hot path: one pass, falling back to conflict resolution only when
        two known shardings of a factor differ."""
        values, sources, conflict = self._gather(a)
        if conflict:
            return self._factor_values_with_conflicts(a)
        return values, sources

    def _gather(self, a: int) -> tuple[dict[int, Axes], dict[int, tuple[int, int]], bool]:
        """One pass over application ``a``'s dims: each factor's first known sharding and
        where it came from, and whether two known shardings of one factor differ (or one
        mesh axis shards two factors)."""
        single, compound, _, _ = self._struct[a]
        vids = self._vids[a]
        dims = self.state.dims
        values: dict[int, Axes] = {}
        sources: dict[int, tuple[int, int]] = {}
        conflict = False
        for t, d, f in single:
            vid = vids[t]
            s = dims[vid][d]
            if s is None:
                continue
            prev = values.get(f)
            if prev is None:
                values[f] = s
                sources[f] = (vid, d)
            elif prev != s:
                conflict = True
        for t, d, fl, sizes, need in compound:
            vid = vids[t]
            s = dims[vid][d]
            if s is None:
                continue
            parts, _ = self._split(s, sizes)
            for f, axes, skip in zip(fl, parts, need):
                if skip:
                    continue
                prev = values.get(f)
                if prev is None:
                    values[f] = axes
                    sources[f] = (vid, d)
                elif prev != axes:
                    conflict = True
        if not conflict and len(values) > 1 and _axis_twice(values.values()):
            conflict = True  # one mesh axis on two factors: decided like a conflict
        return values, sources, conflict

    def _candidates(self, a: int) -> dict[int, list[tuple[Axes, int, int]]]:
        """Per factor at application ``a``: every known (axes, value, dim) holding it."""
        single, compound, _, _ = self._struct[a]
        vids = self._vids[a]
        dims = self.state.dims
        cands: dict[int, list[tuple[Axes, int, int]]] = {}
        for t, d, f in single:
            s = dims[vids[t]][d]
            if s is not None:
                cands.setdefault(f, []).append((s, vids[t], d))
        for t, d, fl, sizes, need in compound:
            s = dims[vids[t]][d]
            if s is None:
                continue
            parts, _ = self._split(s, sizes)
            for f, axes, skip in zip(fl, parts, need):
                if not skip:
                    cands.setdefault(f, []).append((axes, vids[t], d))
        return cands

    def _factor_values_with_conflicts(self, a: int):
        cands = self._candidates(a)
        values: dict[int, Axes] = {}
        sources: dict[int, tuple[int, int]] = {}
        for f, cs in cands.items():
            first = cs[0][0]
            if any(c[0] != first for c in cs):
                first = self._resolve(a, f, cs)
            values[f] = first
            sources[f] = next((vid, d) for axes, vid, d in cs if axes == first)
        if _axis_twice(values.values()):
            self._give_each_axis_once(a, values, cands)
        return values, sources

    def _visit(self, a: int, proposals: dict[tuple[int, int], list[Proposal]]) -> None:
        values, sources, conflict = self._gather(a)
        if conflict:
            values, sources = self._factor_values_with_conflicts(a)
        if not values:
            return
        _, compound, writable, _ = self._struct[a]
        quiet = not conflict and not compound  # see `_apply`
        vids = self._vids[a]
        dims = self.state.dims
        deferred, fed, is_link = self._deferred, self._fed, self._is_link
        for t, d, fl, sizes in writable:
            vid = vids[t]
            if dims[vid][d] is not None:
                continue
            if len(fl) == 1:
                new = values.get(fl[0])
            else:
                new, _ = join_axes([values.get(f) for f in fl], sizes, self.axis_sizes)
            if new is None:
                continue
            src, src_dim = sources.get(fl[0], (-1, -1))
            key = (vid, d)
            into = deferred if new and fed[vid] and not is_link[a] else proposals
            found = into.get(key)
            if found is None:
                into[key] = [(new, a, src, src_dim, quiet)]
            else:
                found.append((new, a, src, src_dim, quiet))

    def _resolve(self, a: int, f: int, cands: list[tuple[Axes, int, int]]) -> Axes:
        options: dict[Axes, list[tuple[int, int]]] = {}
        for axes, vid, d in cands:
            options.setdefault(axes, []).append((vid, d))
        origins = self.state.origins
        rank = {c: origins[c[1]][c[2]].rank for c in cands}
        top = max(rank.values())
        pool = sorted({c[0] for c in cands if rank[c] == top})
        results = set(self.graph.apps[a].results)
        chosen, reason = self._decide(pool, options, results, ranked=top > DEFAULT_RANK)
        name = self.graph.apps[a].rule.factors[f].name
        self.state.conflicts[ConflictKey(a, f)] = Conflict(
            a, f"factor {name}", options, chosen, reason
        )
        return chosen

    def _give_each_axis_once(
        self, a: int, values: dict[int, Axes], cands: dict[int, list[tuple[Axes, int, int]]]
    ) -> None:
        """Decide, for each mesh axis that ``values`` gives to several factors, the one
        factor that keeps it; the others lose just that axis (their holders are
        resharded). Same policy as a factor's conflict: a factor holding the axis from
        a hint beats one holding it by default, then the fewest bytes moved at this
        application (see `_app_cost`), then a pass-through factor over a reduction (no
        pending partial sum), then the major factor. Factors given the same several
        axes (a sequence's query and key positions, both over ``('data', 'model')``)
        are decided as a whole first: one keeps them all, rather than each keeping one
        and the result taking a layout that neither side has."""
        by_axes: dict[Axes, list[int]] = {}
        for f in sorted(values):
            if len(values[f]) > 1:
                by_axes.setdefault(values[f], []).append(f)
        for axes, fs in by_axes.items():
            if len(fs) > 1:
                self._give_axes(a, values, cands, axes, fs)
        owners: dict[str, list[int]] = {}
        for f in sorted(values):
            for axis in values[f]:
                owners.setdefault(axis, []).append(f)
        for axis, fs in sorted(owners.items()):
            if len(fs) > 1:
                self._give_axes(a, values, cands, (axis,), fs)

    def _give_axes(self, a: int, values, cands, axes: Axes, fs: list[int]) -> None:
        """`_give_each_axis_once` for one group of ``axes`` held by the factors ``fs``."""
        factors = self.graph.apps[a].rule.factors
        origins = self.state.origins
        holders = {
            f: [(vid, d) for held, vid, d in cands.get(f, ()) if set(axes) & set(held)] for f in fs
        }
        rank = {f: max((origins[v][d].rank for v, d in holders[f]), default=0) for f in fs}
        top = max(rank.values())
        pool = [f for f in fs if rank[f] == top]
        costs = {}
        for f in pool:
            trial = dict(values)
            for loser in fs:
                if loser != f:
                    trial[loser] = tuple(x for x in trial[loser] if x not in axes)
            costs[f] = self._app_cost(a, trial)
        chosen = min(pool, key=lambda f: (costs[f], factors[f].kind is FactorKind.REDUCTION, f))
        if len(pool) == 1:
            reason = _RANK_REASON
        else:
            shown = ", ".join(f"to {factors[f].name}: {self._shown(costs[f])}" for f in pool)
            reason = self._cost_reason(shown)
        what = f"axes {format_dim(axes)}" if len(axes) > 1 else f"axis {axes[0]!r}"
        for loser in fs:
            if loser == chosen:
                continue
            kept = tuple(x for x in values[loser] if x not in axes)
            self.state.conflicts[ConflictKey(a, loser, axes[0])] = Conflict(
                a,
                f"factor {factors[loser].name} (mesh {what} also shards factor "
                f"{factors[chosen].name}; one axis goes to one factor)",
                {values[loser]: holders[loser]},
                kept,
                f"{what} went to factor {factors[chosen].name}: {reason}",
            )
            values[loser] = kept

    def _app_cost(self, a: int, values: dict[int, Axes]) -> float:
        """The cost (`_price`) to work at application ``a`` with factor shardings
        ``values``: operands move from their layout to the working one, results from
        the working one (a partial sum over the reduction factors' axes) to theirs. Open
        dims cost nothing. A windowed factor split adds its halo exchange, or, where its
        shards would need more than a halo, is worked whole."""
        g, dims = self.graph, self.state.dims
        rule = g.apps[a].rule
        vids = self._vids[a]
        n_operands = len(g.apps[a].operands)
        halo = 0.0
        if self._struct[a][3] is None and any(f.window is not None for f in rule.factors):
            values = {**values, **dict.fromkeys(unhaloed(rule, values, self.axis_sizes), ())}
            layouts = {v: dims[v] for v in vids}
            for _, step in halo_collectives(rule, values, g, vids, layouts, self.axis_sizes):
                halo += self._step_price(step)
        work: dict[int, list[DimSharding]] = {}
        for t, d, fl, sizes in self._struct[a][2]:
            have = dims[vids[t]][d]
            if have is None:
                continue
            if len(fl) == 1:
                want = values.get(fl[0])
            else:
                want, _ = join_axes([values.get(f) for f in fl], sizes, self.axis_sizes)
            if want is not None and want != have:
                work.setdefault(t, list(dims[vids[t]]))[d] = want
        partial = pending_sums(rule, values)
        total = halo
        for t, vid in enumerate(vids):
            have = dims[vid]
            want = work.get(t, have)
            if t < n_operands:
                if t in work:
                    total += self._price(vid, have, want) / self._sharers(a, vid, want)
            elif partial or t in work:
                total += self._price(vid, want, have, partial)
        return total

    def _sharers(self, a: int, vid: int, want) -> int:
        """How many contractions share one move of operand ``vid`` to ``want`` with
        application ``a``: ``a`` and the contractions in the same XLA computation reading
        ``vid`` (or a copy of it) whose other operands and results hold each moved dim's
        factor in ``want``'s layout already. XLA merges their equal collectives into one
        (`jaxshard.plan.Plan._move_operand`): one activation feeding the query, key and
        value projections is gathered once for all three, where reduce-scattering their
        results costs each its own."""
        apps = self.graph.apps
        if not contracts(apps[a]):
            return 1
        have = self.state.dims[vid]
        moved = [d for d, w in enumerate(want) if w != have[d]]
        scope = self._scope(a)
        sharers = {a}
        for v in self._copies(vid):
            for b in self.uses[v]:
                if b in sharers or not contracts(apps[b]) or self._scope(b) != scope:
                    continue
                if self._holds(b, v, moved, want):
                    sharers.add(b)
        return len(sharers)

    def _holds(self, b: int, v: int, moved: list[int], want) -> bool:
        """Whether application ``b``'s other values hold the factor of each of ``v``'s
        dims in ``moved`` as ``want`` lays that dim out (at least one known, none other)."""
        app = self.graph.apps[b]
        if v not in app.operands:
            return False
        t = app.operands.index(v)
        rule, vids, dims = app.rule, self._vids[b], self.state.dims
        for d in moved:
            fl = rule.operands[t][d]
            if len(fl) != 1:
                return False
            known = [
                dims[vids[t2]][d2]
                for t2, d2, fl2, _ in self._struct[b][2]
                if t2 != t and fl2 == fl and dims[vids[t2]][d2] is not None
            ]
            if not known or any(k != want[d] for k in known):
                return False
        return True

    def _copies(self, vid: int) -> set[int]:
        """``vid`` and the values that copy it unchanged (a sharding constraint, a
        checkpoint name) or that it copies, transitively: XLA merges their moves."""
        apps, producer = self.graph.apps, self._producer
        root = vid
        while root in producer and _copies_operand(apps[producer[root]]):
            root = apps[producer[root]].operands[0]
        found, todo = {root}, [root]
        while todo:
            v = todo.pop()
            for b in self.uses[v]:
                if _copies_operand(apps[b]) and apps[b].operands[0] == v:
                    for r in apps[b].results:
                        if r not in found:
                            found.add(r)
                            todo.append(r)
        return found

    def _scope(self, a: int) -> tuple[int, ...]:
        found = self._scopes.get(a)
        if found is None:
            found = self._scopes[a] = xla_scope(self.graph.apps[a].where)
        return found

    def _price(self, vid: int, src, dst, partial: frozenset[str] = frozenset()) -> float:
        """What moving value ``vid`` from ``src`` to ``dst`` costs: bytes per device, or
        seconds under the cost model."""
        shape, dtype, sizes = self.graph.shapes[vid], self.graph.dtypes[vid], self.axis_sizes
        steps = reshard_collectives(shape, dtype, src, dst, sizes, partial)
        return sum(self._step_price(s) for s in steps) + 0.0

    def _step_price(self, step: PlannedCollective) -> float:
        if self.cost_model is None:
            return step.ring_bytes
        return self.cost_model.collective_time(step.axes, step.ring_bytes)

    def _shown(self, cost: float) -> str:
        return f"{cost:.0f} B" if self.cost_model is None else f"{cost * 1e6:.2f} µs"

    def _cost_reason(self, shown: str) -> str:
        if self.cost_model is None:
            return f"cheapest reshard in bytes per device ({shown})"
        return f"cheapest reshard in time under the cost model ({shown})"

    def _cost_to(
        self, option: Axes, options: dict[Axes, list[tuple[int, int]]], results=frozenset()
    ) -> float:
        total = 0.0
        for axes, holders in options.items():
            if axes == option:
                continue
            for vid, d in holders:
                have = self.state.dims[vid]
                work = list(have)
                work[d] = option
                total += self._price(vid, *((work, have) if vid in results else (have, work)))
        return total

    def settled(self, a: int) -> bool:
        """True when application ``a`` works in exactly the layouts its values already
        have, so `working` would ask for no reshard and no partial sum: every dim known and
        agreeing per factor, no compound dims or need-replication factors, no sharded
        reduction factor, and no mesh axis on two factors. A fast check for the final pass."""
        single, _, _, reductions = self._struct[a]
        if reductions is None:
            return False
        vids = self._vids[a]
        dims = self.state.dims
        values: dict[int, Axes] = {}
        for t, d, f in single:
            s = dims[vids[t]][d]
            if s is None or values.setdefault(f, s) != s:
                return False
        for f in reductions:
            if values.get(f):
                return False
        used: set[str] = set()
        for axes in values.values():
            for ax in axes:  # a loop, not a list: this runs for every equation
                if ax in used:
                    return False
                used.add(ax)
        return True

    def working(self, a: int) -> tuple[list[tuple[int, int, DimSharding]], frozenset[str]]:
        """For a finished propagation: each (value, dim, layout application ``a`` works
        in), and the mesh axes over which its results are pending partial reductions.

        Need-replication factors are worked in replicated; a factor some dim cannot
        express (a sharded minor factor of a compound dim) is worked in replicated too.
        """
        values = self.working_factors(a)
        writable = self._struct[a][2]
        changed = bool(self._struct[a][1])
        while changed:  # a drop in one compound dim can make another one inexact
            changed = False
            for _, _, fl, sizes in writable:
                if len(fl) > 1:
                    _, exact = join_axes([values.get(f) for f in fl], sizes, self.axis_sizes)
                    if not exact:
                        changed |= self._drop_unexpressible(values, fl, sizes)
        vids = self._vids[a]
        out = []
        for t, d, fl, sizes in writable:
            if len(fl) == 1:
                want = values.get(fl[0])
            else:
                want, _ = join_axes([values.get(f) for f in fl], sizes, self.axis_sizes)
            out.append((vids[t], d, want))
        return out, pending_sums(self.graph.apps[a].rule, values)

    def working_factors(self, a: int) -> dict[int, Axes]:
        """Each factor's sharding where application ``a`` works: need-replication
        factors whole, and windowed factors whole where their shards would need more
        than a halo from their neighbours (`jaxshard.rule.Window.permutes`)."""
        values, _ = self.factor_values(a)
        rule = self.graph.apps[a].rule
        for f in unhaloed(rule, values, self.axis_sizes):
            values[f] = ()
        for f, factor in enumerate(rule.factors):
            if factor.kind is NEED:
                values[f] = ()
        return values

    def halos(self, a: int) -> list[tuple[int, PlannedCollective]]:
        """The halo exchanges of application ``a`` of a finished propagation: per
        windowed factor it works split, one collective-permute per direction of the
        operand read through the window (``(value, collective)``), sending that many
        rows of the operand's cross-section in its working layout."""
        rule = self.graph.apps[a].rule
        if not any(f.window is not None for f in rule.factors):
            return []
        values = self.working_factors(a)
        layouts = {vid: list(self.state.dims[vid]) for vid in self._vids[a]}
        for vid, d, want in self.working(a)[0]:
            if want is not None:
                layouts[vid][d] = want
        return halo_collectives(rule, values, self.graph, self._vids[a], layouts, self.axis_sizes)

    def _drop_unexpressible(self, values: dict[int, Axes], fl, sizes) -> bool:
        for i, f in enumerate(fl):
            axes = values.get(f)
            if axes is None or math.prod(self.axis_sizes[x] for x in axes) != sizes[i]:
                changed = False
                for later in fl[i + 1 :]:
                    if values.get(later):
                        values[later] = ()
                        changed = True
                return changed
        return False


_RANK_REASON = "a hinted sharding beats a default, and another hint beats a storage layout"


_COPIES = frozenset({"sharding_constraint", "copy", "copy_p", "name"})


def _copies_operand(app) -> bool:
    """Whether an application's result is its first operand unchanged (a sharding
    constraint, a copy, a checkpoint name)."""
    return app.eqn is not None and app.eqn.primitive.name in _COPIES


def _axis_twice(shardings: Iterable[Axes]) -> bool:
    """True when one mesh axis appears in two of the shardings (or twice in one).

    Example:
        >>> _axis_twice([("x",), (), ("y",)]), _axis_twice([("x",), ("y", "x")])
        (False, True)
    """
    seen: set[str] = set()
    for axes in shardings:
        for axis in axes:
            if axis in seen:
                return True
            seen.add(axis)
    return False
