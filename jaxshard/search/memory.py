"""The search's memory model: per-device bytes of arguments, results and the live
activations at an equation, per joint choice of the decisions they depend on. A mixin of
`jaxshard.search.problem.Problem`, whose classes, terms and layouts it reads."""

from __future__ import annotations

import math

import numpy as np

from jaxshard.cost import MemoryEstimate, memory_estimate, nbytes


class MemoryModel:
    """Memory rows and estimates for the integer program (see the module docstring).

    Example:
        >>> problem.memory(problem.baseline()).total  # doctest: +SKIP
        1048576.0
    """

    def activation_row(self, t: int) -> tuple[float, dict[tuple, np.ndarray]]:
        """Live intermediates at application ``t``: constant bytes, and per term the
        bytes under each joint choice."""
        g, live = self.graph, self.live
        mask = (live.start[live.intermediates] <= t) & (live.end[live.intermediates] >= t)
        const = 0.0
        rows: dict[tuple, np.ndarray] = {}
        by_sig: dict[tuple, float] = {}
        for v in live.intermediates[mask]:
            v = int(v)
            key = (self.refs(v), g.shapes[v], g.dtypes[v])
            by_sig[key] = by_sig.get(key, 0) + 1
        for (refs, shape, dtype), count in by_sig.items():
            size = nbytes(shape, dtype) * count
            free = tuple(sorted({r for r in refs if r >= 0}))
            if not free:
                const += size / math.prod(self.sizes[a] for r in refs for a in self.axes(r, {}))
                continue
            term = self._term(free)
            row = rows.setdefault(term.decisions, np.zeros(len(term.time)))
            for n, choice in self._combos(term):
                shards = math.prod(self.sizes[a] for r in refs for a in self.axes(r, choice))
                row[n] += size / shards
        return const, rows

    def _static_memory(self) -> float:
        """Bytes of arguments and results that no decision touches."""
        g = self.graph
        total = 0.0
        for i, v in enumerate(g.in_vids):
            if i not in self.leaf_group:
                lay = [self.axes(r, {}) if r < 0 else () for r in self.refs(v)]
                shards = math.prod(self.sizes[a] for x in lay for a in x)
                total += self._leaf_bytes(i) / shards
        tied_out = {o for _, o in g.ties}
        for o, v in enumerate(g.out_vids):
            if o not in tied_out:
                lay = [self.axes(r, {}) if r < 0 else () for r in self.refs(v)]
                total += nbytes(g.shapes[v], g.dtypes[v]) / math.prod(
                    self.sizes[a] for x in lay for a in x
                )
        return total

    def peak(self, choice) -> int:
        return self.memory(choice).peak_app

    def memory(self, choice) -> MemoryEstimate:
        """The class model's memory estimate of a choice (every value at its class's axes,
        each group's arguments with their extra axis)."""
        g = self.graph
        dims = [tuple(self.axes(r, choice) for r in self.refs(v)) for v in range(len(g.shapes))]
        for i in self.leaf_group:
            lay = self.leaf_layout(i, choice)
            if lay is not None:
                dims[g.in_vids[i]] = tuple(lay)
        out_dims = [dims[v] for v in g.out_vids]
        for i, o in g.ties:
            out_dims[o] = dims[g.in_vids[i]]
        return memory_estimate(g, dims, self.sizes, out_dims, self.live)
