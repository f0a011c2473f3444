"""The projection between tensor dims and a rule's factors: each factor's sharding
read from the dims of an application's operands and results (`factor_values`), and,
once propagation has finished, the layout each equation works in (`working`), whether
it already does (`settled`), and its halo exchanges.
"""

from __future__ import annotations

import math

from jaxshard.cost import (
    Collective,
    halo_collectives,
    pending_sums,
    unhaloed,
)
from jaxshard.lattice import Axes, DimSharding, join_axes
from jaxshard.propagate.vocabulary import (
    NEED,
    _axis_twice,
)
from jaxshard.rule import FactorKind


def miscompiled_window_sums(rule, values: dict[int, Axes], axis_sizes) -> list[int]:
    """The windowed sums of ``rule`` (a convolution's kernel gradient, summing the
    product over image rows read through a window wider than one) split at an
    application whose factors (``values``) leave some mesh axis of more than one device
    unused. XLA's partitioner sums such a product over the unused axes too, so the
    gradient comes out multiplied by their size (JAX 0.10 to 0.12, with `jax.jit` alone
    as with jaxshard's plans: rows split over "model" on a 2x4 mesh, batch unsplit, gave
    twice the gradient). Such a sum is worked whole: its operands are gathered along the
    window's dim for that equation.

    Example:
        >>> miscompiled_window_sums(kernel_gradient_rule, {0: ("model",)}, {"data": 2, "model": 4})  # doctest: +SKIP
        [0]
    """
    windowed = [
        f
        for f, factor in enumerate(rule.factors)
        if factor.kind is FactorKind.REDUCTION
        and factor.window is not None
        and factor.window.extent > 1
        and values.get(f)
    ]
    if not windowed:
        return []
    used = {x for axes in values.values() for x in axes or ()}
    if all(n == 1 or x in used for x, n in axis_sizes.items()):
        return []
    return windowed


class Projection:
    """`Propagator`'s reading of an application's dims as factors (a mixin: the state,
    graph and indexes are the propagator's)."""

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
        layouts = self.state.layouts
        values: dict[int, Axes] = {}
        sources: dict[int, tuple[int, int]] = {}
        conflict = False
        for t, d, f in single:
            vid = vids[t]
            s = layouts[vid][d].axes
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
            s = layouts[vid][d].axes
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
        layouts = self.state.layouts
        cands: dict[int, list[tuple[Axes, int, int]]] = {}
        for t, d, f in single:
            s = layouts[vids[t]][d].axes
            if s is not None:
                cands.setdefault(f, []).append((s, vids[t], d))
        for t, d, fl, sizes, need in compound:
            s = layouts[vids[t]][d].axes
            if s is None:
                continue
            parts, _ = self._split(s, sizes)
            for f, axes, skip in zip(fl, parts, need):
                if not skip:
                    cands.setdefault(f, []).append((axes, vids[t], d))
        return cands

    def settled(self, a: int) -> bool:
        """True when application ``a`` works in exactly the layouts its values already
        have, so `working` would ask for no reshard and no partial sum: every dim known and
        agreeing per factor, no compound dims or need-replication factors, no sharded
        reduction factor, and no mesh axis on two factors. A fast check for the final pass."""
        single, _, _, reductions = self._struct[a]
        if reductions is None:
            return False
        vids = self._vids[a]
        layouts = self.state.layouts
        values: dict[int, Axes] = {}
        for t, d, f in single:
            s = layouts[vids[t]][d].axes
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
        for f in miscompiled_window_sums(rule, values, self.axis_sizes):
            values[f] = ()
        return values

    def halos(self, a: int) -> list[tuple[int, Collective]]:
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
