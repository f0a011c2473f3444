"""The search's joint terms: for each value, equation and group, the decisions whose
joint choice sets a cost (collective bytes and time), tabulated per combination for the
integer program (`Term`, `term_index`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from jaxshard.cost import (
    CollectiveKind,
    executions,
    halo_collectives,
    pending_sums,
    reshard_collectives,
    ring_bytes,
    unhaloed,
    xla_scope,
)
from jaxshard.lattice import Axes
from jaxshard.plan import (
    duplicate_app,
)
from jaxshard.rule import FactorKind
from jaxshard.search.decisions import _EXTRA_TIEBREAK, US, Scope
from jaxshard.search.refs import Fixed, decision_of


@dataclass
class Term:
    """A function of the joint choice of ``decisions``: per combination (product order)
    communication time (µs), bytes, memory bytes, whether it is allowed, and a tie-break
    added to the objective only."""

    decisions: tuple[int, ...]
    sizes: tuple[int, ...]
    time: np.ndarray
    bytes: np.ndarray
    memory: np.ndarray
    allowed: np.ndarray
    bias: np.ndarray

    @staticmethod
    def empty(decisions: tuple[int, ...], sizes: tuple[int, ...]) -> Term:
        n = math.prod(sizes)
        z = np.zeros(n)
        return Term(decisions, sizes, z, z.copy(), z.copy(), np.ones(n, dtype=bool), z.copy())


def term_index(term: Term, choice) -> int:
    n = 0
    for d, s in zip(term.decisions, term.sizes):
        n = n * s + choice[d]
    return n


class Terms:
    """`Problem`'s joint terms (a mixin: the graph, mesh and tables are the
    problem's)."""

    def _term(self, decisions) -> Term:
        decisions = tuple(sorted(set(decisions)))
        term = self.terms.get(decisions)
        if term is None:
            sizes = tuple(len(self.decisions[d].candidates) for d in decisions)
            term = self.terms[decisions] = Term.empty(decisions, sizes)
        return term

    def _combos(self, term: Term):
        for n, combo in enumerate(itertools.product(*(range(s) for s in term.sizes))):
            yield n, dict(zip(term.decisions, combo))

    def _layout(self, refs, choice) -> tuple[Axes, ...] | None:
        """A tensor's layout under a choice, or None if one axis lands on two dims."""
        dims = tuple(self.axes(r, choice) for r in refs)
        used = [a for d in dims for a in d]
        return dims if len(used) == len(set(used)) else None

    def _value_terms(self) -> None:
        """No tensor carries one axis on two dims (beyond what hints already force)."""
        g = self.graph
        seen = set()
        for v in range(len(g.shapes)):
            refs = self.refs(v)
            free = {decision_of(r) for r in refs} - {None}
            if not free or refs in seen:
                continue
            seen.add(refs)
            fixed_axes = [a for r in refs if type(r) is Fixed for a in r.axes]
            if sum(decision_of(r) is not None for r in refs) < 2 and not fixed_axes:
                continue  # one decided dim and nothing else sharded: no clash possible
            term = self._term(free)
            for n, choice in self._combos(term):
                dims = [self.axes(r, choice) for r in refs]
                used = [a for d, r in zip(dims, refs) for a in d if decision_of(r) is not None]
                if len(used) != len(set(used)) or set(used) & set(fixed_axes):
                    term.allowed[n] = False

    def _app_terms(self) -> None:
        """Collectives each equation needs under each joint choice of its decisions:
        all-reduces of partial results, gathers for need-replication factors."""
        g = self.graph
        sigs: dict[tuple, list] = {}
        seen: dict = {}
        runs = executions(g)
        special: dict[int, tuple] = {}
        for a, app in enumerate(g.apps):
            if a in self.dead or duplicate_app(app, seen):
                continue
            rule = app.rule
            kinds = special.get(id(rule))
            if kinds is None:
                kinds = special[id(rule)] = tuple(
                    f for f, factor in enumerate(rule.factors)
                    if not factor.plain and factor.size > 1
                )  # fmt: skip
            cut = self.cuts.get(a, frozenset())
            if not kinds and not cut:
                continue
            vids = (*app.operands, *app.results)
            key = (id(rule), tuple(self.refs(v) for v in vids), cut)
            entry = sigs.get(key)
            if entry is None:
                sigs[key] = [app, runs[a]]
            else:
                entry[1] += runs[a]
        for (_, refs, cut), (app, count) in sigs.items():
            free = {decision_of(r) for rs in refs for r in rs} - {None}
            if not free:
                t, b = self._app_cost(app, refs, {}, cut)
                self.constant_time += count * t
                self.constant_bytes += count * b
                continue
            term = self._term(free)
            # a clash the hints make with nothing chosen is no choice's fault
            forced = self._app_cost(app, refs, dict.fromkeys(term.decisions, 0), cut) is None
            for n, choice in self._combos(term):
                cost = self._app_cost(app, refs, choice, cut, forced)
                if cost is None:
                    term.allowed[n] = False
                    continue
                term.time[n] += count * cost[0]
                term.bytes[n] += count * cost[1]

    def _app_cost(
        self, app, refs, choice, cut=frozenset(), forced: bool = False
    ) -> tuple[float, float] | None:
        """(µs, bytes) of the collectives an application needs under a choice; None when
        the choice shards a need-replication factor on an axis another factor of the
        equation uses (a sharded table row
        gathered by indices sharded the same way: XLA exchanges the whole result for it,
        which the rules do not predict), unless ``forced`` (the hints make that clash
        under every choice: it is priced as the rules see it). A dim ``cut`` from its
        factor (`_classes`) is moved: an operand to the factor's layout before, a result
        from it after."""
        g, rule = self.graph, app.rule
        vids = (*app.operands, *app.results)
        layouts = []
        for rs in refs:
            lay = self._layout(rs, choice)
            if lay is None:
                return 0.0, 0.0  # not allowed anyway (a value term says so)
            layouts.append(lay)
        tensors = (*rule.operands, *rule.results)
        factor_axes: dict[int, Axes] = {}
        majors: dict[tuple[int, int], int] = {}
        moved = set(cut)
        for t, dims in enumerate(tensors):
            for d, fl in enumerate(dims):
                # a windowed factor of size 1 (no axis splits both its dims) still
                # makes a split operand dim whole here
                big = [f for f in fl if rule.factors[f].size > 1 or rule.factors[f].window]
                if not big:
                    continue
                f = majors[t, d] = big[0]
                axes = layouts[t][d]
                if not axes or (t, d) in cut or factor_axes.get(f) == axes:
                    continue
                taken = {a for h, other in factor_axes.items() if h != f for a in other}
                if cut and (f in factor_axes or taken.intersection(axes)):
                    # two factors in one class (classes merged after this equation
                    # was cut): the later dims move to the earlier factors' layout
                    moved.add((t, d))
                else:
                    factor_axes.setdefault(f, axes)
        for f, axes in factor_axes.items():
            if rule.factors[f].kind is FactorKind.NEED_REPLICATION and any(
                a in other for h, other in factor_axes.items() if h != f for a in axes
            ):
                decided = any(decision_of(r) is not None for rs in refs for r in rs)
                if decided and not forced:
                    return None
        partial = pending_sums(rule, factor_axes)
        need = {f for f, axes in factor_axes.items()
                if rule.factors[f].kind is FactorKind.NEED_REPLICATION}  # fmt: skip
        # a windowed factor split: a halo exchange, or worked whole where the shards
        # would need more than their neighbours' rows
        steps = []
        need |= unhaloed(rule, factor_axes, self.sizes)
        if any(rule.factors[f].window is not None for f in factor_axes):
            windowed = {f: axes for f, axes in factor_axes.items() if f not in need}
            layout_of = dict(zip(vids, layouts))
            steps += [
                s for _, s in halo_collectives(rule, windowed, g, vids, layout_of, self.sizes)
            ]
        n_ops = len(rule.operands)
        for t, dims in enumerate(tensors):
            v = vids[t]
            work = list(layouts[t])  # the layout the equation works in
            for d in range(len(dims)):
                if (t, d) in moved:
                    work[d] = factor_axes.get(majors[t, d], ())
                if t < n_ops and need and any(f in need for f in dims[d]):
                    work[d] = ()
            if t >= n_ops and (partial or work != list(layouts[t])):
                steps += reshard_collectives(
                    g.shapes[v], g.dtypes[v], work, layouts[t], self.sizes, partial
                )
            elif t < n_ops and work != list(layouts[t]):
                steps += reshard_collectives(g.shapes[v], g.dtypes[v], layouts[t], work, self.sizes)
        seconds = sum(self.cost_model.collective_time(s.axes, s.ring_bytes) for s in steps)
        if self.cost_model.flops:
            flops = 2 * math.prod(f.size for f in rule.factors)
            split = math.prod(self.sizes[a] for axes in factor_axes.values() for a in axes)
            seconds += flops / split / self.cost_model.flops
        return seconds * US, sum(s.ring_bytes for s in steps)

    def _uses(self, v: int) -> list[int]:
        """Equations that read argument ``v`` in its compute layout (not the optimizer's
        elementwise update, which works in the stored layout), in program order."""
        g = self.graph
        shape = g.shapes[v]
        uses = []
        for a in self._readers.get(v, ()):
            app = g.apps[a]
            others = [g.shapes[u] for u in (*app.operands, *app.results)]
            if not all(s == shape or s == () for s in others):
                uses.append(a)
        return uses

    def _group_terms(self) -> None:
        """Per group: the memory of its arguments (and tied results) under each joint
        choice, and the gathers an extra storage axis costs at each use."""
        g = self.graph
        # per parameter that may be stored apart: its first and last use, between which
        # XLA keeps the gathered copy (the forward's uses to the backward's)
        self.gathered_span: dict[int, tuple[int, int]] = {}
        for grp in self.groups:
            leaves = (*grp.owners, *grp.followers)
            refs = {i: self.refs(g.in_vids[i]) for i in leaves}
            free = {decision_of(r) for rs in refs.values() for r in rs} - {None}
            if grp.extra is not None:
                free.add(grp.extra)
            # a parameter stored apart is gathered once per XLA computation that uses it:
            # the copy gathered for the first use serves the later ones there (the
            # backward's uses and a remat body's recomputation read the same copy, as
            # `jaxshard.plan.Plan.moved_copies` counts it)
            uses = {
                i: len({xla_scope(g.apps[a].where) for a in self._compute_uses(g.in_vids[i])})
                for i in grp.owners
            }
            for i in grp.owners if grp.extra is not None else ():
                spots = self._compute_uses(g.in_vids[i])
                if spots:
                    self.gathered_span[i] = (min(spots), max(spots))
            if not free:
                continue
            term = self._term(free)
            for n, choice in self._combos(term):
                for i in leaves:
                    lay = self.leaf_layout(i, choice)
                    if lay is None:
                        term.allowed[n] = False
                        break
                    shards = math.prod(self.sizes[a] for x in lay for a in x)
                    term.memory[n] += self._leaf_bytes(i) / shards
                    extra = grp.extra is not None and self.decisions[grp.extra].candidates[
                        choice[grp.extra]
                    ]  # fmt: skip
                    if not extra or i not in uses:
                        continue
                    term.bias[n] += _EXTRA_TIEBREAK  # on ties, prefer layouts without
                    # the parameter is all-gathered over the extra axis: at each use when
                    # it is stored sharded, once after the update when only its state is
                    gathers = uses[i] if extra.scope is Scope.ALL else 1
                    n_axis = math.prod(self.sizes[a] for a in extra.axes)
                    local = self._leaf_bytes(i) / (2 if i in self.tied else 1) / shards
                    if extra.scope is Scope.ALL:
                        local *= n_axis
                    b = ring_bytes(CollectiveKind.ALL_GATHER, n_axis, local)
                    term.bytes[n] += gathers * b
                    term.time[n] += gathers * US * self.cost_model.collective_time(extra.axes, b)
