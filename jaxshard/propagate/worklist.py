"""The worklist: pins, rounds of visits that write every factor's merged sharding into
the dims still open, and undoable trials (`Propagator.trying`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache

from jaxshard.annotate import Pin
from jaxshard.cost import (
    CostModel,
)
from jaxshard.errors import JaxshardBug
from jaxshard.graph import AppKind, Graph, contracts
from jaxshard.lattice import DimSharding, join_axes, split_axes
from jaxshard.propagate.conflicts import ConflictPolicy
from jaxshard.propagate.projection import Projection
from jaxshard.propagate.vocabulary import (
    DEFAULT_RANK,
    HINT_RANK,
    OPEN_DIM,
    DimState,
    OriginKind,
    Proposal,
    State,
    _compile,
)


def _held(row, axes) -> bool:
    """Whether a dim of ``row`` already holds one of ``axes``."""
    for s in row:
        held = s.axes
        if held:
            for ax in axes:
                if ax in held:
                    return True
    return False


class _Stopped(Exception):
    """A trial's propagation wrote into a value that voids it (`Propagator.trying`)."""


class Propagator(Projection, ConflictPolicy):
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
        (('data',), ('model',))
    """

    def __init__(
        self,
        graph: Graph,
        axis_sizes: Mapping[str, int],
        cost_model: CostModel | None = None,
        free_factors: bool = True,
        reduce_scatter: bool = True,
    ):
        self.graph = graph
        # whether conflicts price a reduce-scatter as such, or as the all-reduce of its
        # input that a CPU runs (`has_reduce_scatter`; `jaxshard.plan.make` passes the
        # mesh's for the plan that sums gradients into their shards)
        self.reduce_scatter = reduce_scatter
        # whether a contraction may give an unhinted weight's free factor the axes of a
        # contracted one (`_free_factor_instead`), and the weights that took one: value
        # -> (its dims as the contraction would have them, the application, the argument
        # the value passes on)
        self.free_factors = free_factors
        self.swapped: dict[int, tuple[tuple[DimSharding, ...], int, int]] = {}
        self.axis_sizes = dict(axis_sizes)
        self.cost_model = cost_model
        size_one = DimState((), OriginKind.DEFAULT, "size-1 dim")
        self.state = State(
            [[size_one if s == 1 else OPEN_DIM for s in shape] for shape in graph.shapes]
        )
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
        # see `_feed`: a function of the hinted values alone, never written once made (a
        # fork shares them)
        self._fed = bytearray(len(graph.shapes))
        self._waits = [0] * len(graph.shapes)  # a waiting value: 1 + the argument it passes on
        self._waiting: set[int] = set()  # applications that proposed into them (`run`)
        self._fed_for: frozenset[int] | None = None  # the hinted values they were made for
        self._journal: list | None = None  # while `trying`: (value, dim, old state)
        self._stop: Collection[int] = ()  # while `trying`: values whose write ends it
        # `_feed` per set of hinted values: the current one and the one before (the
        # trials of one decision pin the same value, then `trying` restores the hints)
        self._feeds: dict[frozenset[int], tuple[bytearray, list[int]]] = {}
        self._queue: deque[int] = deque()
        self._queued = bytearray(len(graph.apps))
        axis_sizes = self.axis_sizes  # not self: a cycle would keep the whole state alive
        self._split = lru_cache(maxsize=None)(  # until the next full garbage collection
            lambda axes, sizes: split_axes(axes, sizes, axis_sizes)
        )
        # what a move costs (`_price`), per (shape, dtype, from, to, partial): repeated
        # layers and the trials of `split_for_memory` price the same moves again; a fork
        # shares it (prices depend on neither layouts nor conflicts)
        self._prices: dict[tuple, float] = {}

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
            [list(row) for row in state.layouts], dict(state.conflicts), state.visits
        )
        other.hinted = set(self.hinted)
        other._queue = deque(self._queue)
        other._queued = bytearray(self._queued)
        other._deferred = {k: list(v) for k, v in self._deferred.items()}
        other._waiting = set(self._waiting)
        other.swapped = dict(self.swapped)
        # a fork made inside `trying` writes into its own state only
        other._journal, other._stop = None, ()
        return other

    def adopt(self, fork: Propagator) -> None:
        """Take the layouts, conflicts and pending work of ``fork`` (a `fork` of this
        propagator, gone further) as this one's own: the fork is not used again.

        Example:
            >>> trial = prop.fork(); trial.pin(vid, pin); trial.run()  # doctest: +SKIP
            >>> prop.adopt(trial)  # doctest: +SKIP
        """
        if fork.graph is not self.graph or fork._journal is not None or self._journal is not None:
            raise JaxshardBug("Propagator.adopt: only a fork of this propagator, outside `trying`")
        self.__dict__.update(fork.__dict__)

    @contextmanager
    def trying(self, stop: Collection[int] = ()) -> Iterator[list[tuple[int, int, DimState]]]:
        """Pin and propagate a decision tentatively: every write inside the block is
        journaled (``(value, dim, old state)``, yielded) and undone on exit, with the
        conflicts it recorded. Propagation that writes into a value in ``stop`` ends the
        block there (the rest of it is skipped, the write is the journal's last entry):
        for a trial that is void once it reaches one of them, whose propagation would
        otherwise go on through the whole step.

        Example:
            >>> reached = None
            >>> with prop.trying(stop=pinned) as written:  # doctest: +SKIP
            ...     prop.pin(vid, pin); prop.run()
            ...     reached = {v for v, *_ in written}
            >>> reached is None  # it wrote into a value in ``pinned``  # doctest: +SKIP
        """
        journal: list = []
        self._journal, self._stop = journal, stop
        conflicts, hinted, visits = dict(self.state.conflicts), set(self.hinted), self.state.visits
        fed = self._fed_for, self._fed, self._waits
        try:
            yield journal
        except _Stopped:
            pass
        finally:
            self._journal, self._stop = None, ()
            layouts = self.state.layouts
            for vid, d, old in reversed(journal):
                layouts[vid][d] = old
            self.state.conflicts, self.hinted, self.state.visits = conflicts, hinted, visits
            self._fed_for, self._fed, self._waits = fed
            self._queue.clear()
            self._deferred = {}
            self._waiting = set()
            self._queued = bytearray(len(self._queued))

    def pin(self, vid: int, pin: Pin, rank: int = HINT_RANK) -> None:
        """Set the dims a user pinned (a hint) and queue their applications. ``rank``
        (`HINT_RANK` or `STORAGE_RANK`) is the priority of what propagates from them when
        it meets another hint's layout in a conflict."""
        row = self.state.layouts[vid]
        self.hinted.add(vid)
        pinned = {ax for value in pin.dims if value for ax in value}
        if self._journal is not None:
            self._journal.extend((vid, d, old) for d, old in enumerate(row))
        for d, value in enumerate(pin.dims):
            held = row[d].axes
            if value is not None:
                row[d] = DimState(value, OriginKind.HINT, pin.source, rank=rank)
            elif held and pinned.intersection(held):
                # propagation reached this dim before the pin (a storage pin comes after
                # the computation's layout): the pinned dims keep their axes
                row[d] = DimState(
                    tuple(ax for ax in held if ax not in pinned),
                    OriginKind.HINT,
                    f"{pin.source} (its axes removed here)",
                    rank=rank,
                )
        self._enqueue(self.uses[vid])

    def default(self, vids: Iterable[int], text: str) -> None:
        """Fill every still-open dim of ``vids`` as replicated, then propagate from them."""
        replicated = DimState((), OriginKind.DEFAULT, text)
        for vid in vids:
            row = self.state.layouts[vid]
            touched = False
            for d, s in enumerate(row):
                if s.axes is None:
                    row[d] = replicated
                    touched = True
            if touched:
                self._enqueue(self.uses[vid])
        self.run()

    def _enqueue(self, apps: Iterable[int]) -> None:
        for a in apps:
            if not self._queued[a]:
                self._queued[a] = 1
                self._queue.append(a)

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

        An argument no hint pins (and what passes it unchanged into the computation: a
        transpose, a loop's slice of it) waits too, for its uses to settle: once nothing
        else moves, the applications that proposed into it are visited again and it
        takes the layout they settled on. Taken as first proposed, an unhinted weight
        would follow the activation that reached its contraction first (its features
        split), one round before the result's own layout reached the other side and won
        the axis; the weight would then be rearranged in every step.
        """
        bound = self._bound
        visits = 0
        queued, visit = self._queued, self._visit
        self._feed()
        while self._queue or self._deferred or self._waiting:
            if not self._queue and self._deferred:
                deferred, self._deferred = self._deferred, {}
                self._apply(deferred)
                continue
            if not self._queue:  # the unhinted arguments' uses have settled
                waiting, self._waiting = sorted(self._waiting), set()
                proposals = {}
                for a in waiting:
                    visit(a, proposals, True)
                visits += len(waiting)
                self._apply(proposals)
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
        from inside the loop waits (`run`) until the argument's layout has come in. And
        mark the unhinted arguments and the values that pass them on unchanged (the same
        equations, a loop's slice), each with the argument it passes on: what reaches
        them waits for their uses to settle."""
        key = frozenset(self.hinted)
        if self._fed_for == key:  # a fork, or the end of a trial, has the same hints
            return
        self._fed_for = key
        known = self._feeds.get(key)
        if known is not None:
            self._fed, self._waits = known
            return
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
                if len(src.operands) != 1 or not src.rule.plain:
                    break
                v = src.operands[0]
            if v in self.hinted:
                for r in app.results:
                    fed[r] = 1
        waits = self._waits = [0] * len(self.graph.shapes)
        todo = [(v, v) for v in self.graph.in_vids if v not in self.hinted]
        while todo:
            v, arg = todo.pop()
            if waits[v]:
                continue
            waits[v] = 1 + arg
            for b in self.uses[v]:
                app = apps[b]
                passes = self._is_link[b] or (len(app.operands) == 1 and app.rule.plain)
                if passes and app.operands[0] == v:
                    todo.extend((r, arg) for r in app.results if r not in self.hinted)
        if len(self._feeds) >= 2:
            del self._feeds[next(iter(self._feeds))]
        self._feeds[key] = fed, waits

    def _apply(self, proposals: dict[tuple[int, int], list[Proposal]]) -> None:
        """Write a round's proposals. A value that changed queues its applications again,
        except a proposer that wrote exactly this sharding after a conflict-free visit
        without compound dims: visiting it again would find nothing new."""
        layouts, uses = self.state.layouts, self.uses
        queued, queue, journal = self._queued, self._queue, self._journal
        for (vid, d), props in proposals.items():
            row = layouts[vid]
            if row[d].axes is not None:
                continue
            first = props[0]
            axes, first_app, _, _, first_quiet = first
            if len(props) > 1 and any(p[0] != axes for p in props):
                new = self._resolve_value(vid, d, props)
                axes = new.axes
            else:
                new = None
            if axes and _held(row, axes):
                continue  # an axis may shard one dim only; the final pass records a reshard
            if new is None:
                new = self._propagated(first)
                if len(props) > 1 and new.rank < HINT_RANK:  # agreeing proposals: the
                    found = [self._propagated(p) for p in props[1:]]  # highest-ranked origin
                    new = max([new, *found], key=lambda s: s.rank)
            if journal is not None:
                journal.append((vid, d, row[d]))
                if vid in self._stop:
                    raise _Stopped  # `trying`: the trial is void, its journal undone
            row[d] = new
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

    def _propagated(self, proposal: Proposal) -> DimState:
        """The state a proposal writes: its axes, propagated through its application
        from its source dim, with the source's rank."""
        axes, app, src, src_dim, _ = proposal
        rank = self.state.layouts[src][src_dim].rank if src >= 0 else DEFAULT_RANK
        # positional: one is made per propagated dim, and keywords add matching to each
        return DimState(axes, OriginKind.PROPAGATED, "", app, src, src_dim, rank)

    def _visit(
        self, a: int, proposals: dict[tuple[int, int], list[Proposal]], settled: bool = False
    ) -> None:
        """Propose each factor's merged sharding to the open dims of application ``a``;
        into a waiting argument (`_feed`) only once its uses have ``settled`` (`run`). Then
        a contraction with such an unhinted weight may give the weight's free factor the
        axes of a contracted one (`_free_factor_instead`)."""
        values, sources, conflict = self._gather(a)
        if conflict:
            values, sources = self._factor_values_with_conflicts(a)
        if not values:
            return
        if settled and self.free_factors and contracts(self.graph.apps[a]):
            self._free_factor_instead(a, values, sources)
        _, compound, writable, _ = self._struct[a]
        quiet = not conflict and not compound  # see `_apply`
        vids = self._vids[a]
        layouts = self.state.layouts
        deferred, fed, is_link, waits = self._deferred, self._fed, self._is_link, self._waits
        for t, d, fl, sizes in writable:
            vid = vids[t]
            if layouts[vid][d].axes is not None:
                continue
            if len(fl) == 1:
                new = values.get(fl[0])
            else:
                new, _ = join_axes([values.get(f) for f in fl], sizes, self.axis_sizes)
            if new is None:
                continue
            src, src_dim = sources.get(fl[0], (-1, -1))
            if waits[vid] and not settled:
                self._waiting.add(a)  # visited again once the queue is empty
                continue
            key = (vid, d)
            into = deferred if new and fed[vid] and not is_link[a] else proposals
            found = into.get(key)
            if found is None:
                into[key] = [(new, a, src, src_dim, quiet)]
            else:
                found.append((new, a, src, src_dim, quiet))
