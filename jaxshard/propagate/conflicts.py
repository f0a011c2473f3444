"""The conflict policy: where two shardings meet on one factor or one (value, dim), or
one mesh axis reaches two factors, which one wins (a hint's over a default's, a
computation's over a storage layout's, then the fewest bytes or least time moved) and
why, recorded for `explain()`.
"""

from __future__ import annotations

from jaxshard.cost import (
    Collective,
    halo_collectives,
    pending_sums,
    reshard_collectives,
    unhaloed,
    xla_scope,
)
from jaxshard.graph import contracts
from jaxshard.lattice import Axes, DimSharding, format_dim, join_axes
from jaxshard.propagate.vocabulary import (
    _RANK_REASON,
    DEFAULT_RANK,
    Conflict,
    ConflictKey,
    DimState,
    Proposal,
    _axis_twice,
    _copies_operand,
)
from jaxshard.rule import FactorKind


class ConflictPolicy:
    """`Propagator`'s decisions between shardings that meet (a mixin: the state, graph
    and cost model are the propagator's)."""

    def _resolve_value(self, vid: int, d: int, proposals: list[Proposal]) -> DimState:
        """The state written where proposals that differ reach one open dim in a round."""
        props = [self._propagated(p) for p in proposals]
        options: dict[Axes, list[tuple[int, int]]] = {}
        for s in props:
            holders = options.setdefault(s.axes, [])
            if (s.source, s.source_dim) not in holders:
                holders.append((s.source, s.source_dim))
        top = max(s.rank for s in props)
        pool = sorted({s.axes for s in props if s.rank == top})
        chosen, reason = self._decide(pool, options, ranked=top > DEFAULT_RANK)
        name = self.graph.names.get(vid, f"%{vid}")
        won = max((s for s in props if s.axes == chosen), key=lambda s: s.rank)
        self.state.conflicts[ConflictKey(None, value=vid, dim=d)] = Conflict(
            won.app,
            f"dim {d} of {name}",
            options,
            chosen,
            "reached in the same round; " + reason,
        )
        return won

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

    def _resolve(self, a: int, f: int, cands: list[tuple[Axes, int, int]]) -> Axes:
        options: dict[Axes, list[tuple[int, int]]] = {}
        for axes, vid, d in cands:
            options.setdefault(axes, []).append((vid, d))
        layouts = self.state.layouts
        rank = {c: layouts[c[1]][c[2]].rank for c in cands}
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
        layouts = self.state.layouts
        holders = {
            f: [(vid, d) for held, vid, d in cands.get(f, ()) if set(axes) & set(held)] for f in fs
        }
        rank = {f: max((layouts[v][d].rank for v, d in holders[f]), default=0) for f in fs}
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

    def _free_factor_instead(
        self, a: int, values: dict[int, Axes], sources: dict[int, tuple[int, int]]
    ) -> None:
        """At a contraction that reaches an unhinted argument (`run`'s waiting values: a
        weight no hint pins), give the axes of a contracted factor to the argument's own
        free factor instead, where that costs less here.

        An activation split over its features meets a weight no hint pinned. Following
        it splits the weight's contracted dim and leaves the product a partial sum over
        those axes, summed at every step (row parallel). Gathering the activation and
        splitting the weight's output features over the same axes leaves the product
        split instead (column parallel). Which one moves fewer bytes depends on the sizes:
        summing a product wider than its input (a mixture of experts' per-expert hidden
        layer, an up projection) costs more than gathering the input; summing a narrower
        one (a down projection) costs less. What the split product costs further on is
        not seen here: `jaxshard.plan.plan_from_graph` also plans with these weights
        pinned to the layouts recorded in ``swapped``, and with no such choice, and
        keeps the plan that moves the fewest bytes. The free factor taken is a dim of
        the weight alone and the result, still open everywhere, that the axes divide:
        the largest (ties: the last). Changes ``values`` and ``sources`` in place."""
        app = self.graph.apps[a]
        rule, vids, layouts, waits = app.rule, self._vids[a], self.state.layouts, self._waits
        n_operands = len(app.operands)
        row_cost = None
        for f, axes in list(values.items()):
            factor = rule.factors[f]
            if not axes or factor.kind is not FactorKind.REDUCTION or factor.indexed:
                continue
            src = sources.get(f)
            for t in range(n_operands):
                vid = vids[t]
                tdims = rule.operands[t]
                if not waits[vid] or src is None or src[0] == vid:
                    continue
                if not any(fl == (f,) and layouts[vid][d].open for d, fl in enumerate(tdims)):
                    continue
                free = self._free_factors(a, t, values, axes)
                if not free:
                    continue
                g = free[-1]
                if row_cost is None:
                    row_cost = self._app_cost(a, values)
                if self._app_cost(a, {**values, f: (), g: axes}) < row_cost:
                    values[f], values[g] = (), axes
                    sources[g] = src
                    if self._journal is None:  # not a trial's (`trying`)
                        dims = self._column_dims(tdims, f, g, axes)
                        self.swapped[vid] = (dims, a, waits[vid] - 1)
                    return

    @staticmethod
    def _column_dims(tdims, f: int, g: int, axes: Axes) -> tuple[DimSharding, ...]:
        """A weight's dims (its factors ``tdims``) with ``g`` split over ``axes`` and ``f``
        whole; the others left open."""
        return tuple(axes if fl == (g,) else () if fl == (f,) else None for fl in tdims)

    def _free_factors(self, a: int, t: int, values: dict[int, Axes], axes: Axes) -> list[int]:
        """Factors of operand ``t`` of application ``a`` in no other operand, kept by a
        result, open in every value here, and divisible by ``axes``: smallest first."""
        app = self.graph.apps[a]
        rule, vids, layouts = app.rule, self._vids[a], self.state.layouts
        n = 1
        for x in axes:
            n *= self.axis_sizes[x]
        elsewhere = {
            f for u, tdims in enumerate(rule.operands) if u != t for fl in tdims for f in fl
        }
        kept = {f for tdims in rule.results for fl in tdims for f in fl}
        found = []
        for d, fl in enumerate(rule.operands[t]):
            if len(fl) != 1:
                continue
            g = fl[0]
            factor = rule.factors[g]
            if (
                g in values or g in elsewhere or g not in kept
                or factor.kind is not FactorKind.PASS or factor.size % n
                or not layouts[vids[t]][d].open
            ):  # fmt: skip
                continue
            found.append((factor.size, d, g))
        return [g for _, _, g in sorted(found)]

    def _app_cost(self, a: int, values: dict[int, Axes]) -> float:
        """The cost (`_price`) to work at application ``a`` with factor shardings
        ``values``: operands move from their layout to the working one, results from
        the working one (a partial sum over the reduction factors' axes) to theirs. Open
        dims cost nothing. A windowed factor split adds its halo exchange, or, where its
        shards would need more than a halo, is worked whole."""
        g, dims = self.graph, self.state.dims  # each read a tuple of the value's axes
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
        layouts = self.state.layouts
        for t, d, fl, sizes in self._struct[a][2]:
            have = layouts[vids[t]][d].axes
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
        rule, vids, layouts = app.rule, self._vids[b], self.state.layouts
        for d in moved:
            fl = rule.operands[t][d]
            if len(fl) != 1:
                return False
            known = [
                layouts[vids[t2]][d2].axes
                for t2, d2, fl2, _ in self._struct[b][2]
                if t2 != t and fl2 == fl and not layouts[vids[t2]][d2].open
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
        shape, dtype = self.graph.shapes[vid], self.graph.dtypes[vid]
        key = (shape, dtype, tuple(src), tuple(dst), partial)
        found = self._prices.get(key)
        if found is None:
            steps = reshard_collectives(
                shape, dtype, src, dst, self.axis_sizes, partial, self.reduce_scatter
            )
            found = self._prices[key] = sum(self._step_price(s) for s in steps) + 0.0
        return found

    def _step_price(self, step: Collective) -> float:
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
