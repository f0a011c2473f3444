"""The search's memory model: per-device bytes of arguments, results and the live
activations at an equation, per joint choice of the decisions they depend on. A mixin of
`jaxshard.search.problem.Problem`, whose classes, terms and layouts it reads."""

from __future__ import annotations

import math

import numpy as np

from jaxshard.cost import (  # noqa: F401 (fused_liveness re-exported)
    Liveness,
    MemoryEstimate,
    fused_liveness,
    memory_estimate,
    nbytes,
    per_device_bytes,
)


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
            free = tuple(sorted({r for r in refs if type(r) is int}))
            if not free:
                const += size / math.prod(self.sizes[a] for r in refs for a in self.axes(r, {}))
                continue
            term = self._term(free)
            row = rows.setdefault(term.decisions, np.zeros(len(term.time)))
            for n, choice in self._combos(term):
                shards = math.prod(self.sizes[a] for r in refs for a in self.axes(r, choice))
                row[n] += size / shards
        # a parameter stored apart (FSDP) is gathered for its uses, and XLA keeps the
        # gathered copy from the forward's use to the backward's
        for i, (first, last) in self.gathered_span.items():
            if first <= t <= last:
                k = self.leaf_group[i]
                leaves = (*self.groups[k].owners, *self.groups[k].followers)
                free = {r for j in leaves for r in self.refs(g.in_vids[j]) if type(r) is int}
                term = self._term({*free, self.groups[k].extra})
                row = rows.setdefault(term.decisions, np.zeros(len(term.time)))
                for n, choice in self._combos(term):
                    row[n] += self.gathered_bytes(i, choice)
        return const, rows

    def _static_memory(self) -> float:
        """Bytes of arguments and results that no decision touches."""
        g = self.graph
        total = 0.0
        for i, v in enumerate(g.in_vids):
            if i not in self.leaf_group:
                lay = [self.axes(r, {}) if type(r) is not int else () for r in self.refs(v)]
                shards = math.prod(self.sizes[a] for x in lay for a in x)
                total += self._leaf_bytes(i) / shards
        tied_out = {o for _, o in g.ties}
        for o, v in enumerate(g.out_vids):
            if o not in tied_out:
                lay = [self.axes(r, {}) if type(r) is not int else () for r in self.refs(v)]
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
        return self.estimate(dims, out_dims, choice)

    def estimate(self, dims, out_dims, choice) -> MemoryEstimate:
        """`jaxshard.cost.memory_estimate` of a layout of every value, plus the gathered
        copies of the parameters the choice stores apart (FSDP), alive from their first
        use to their last."""
        base = memory_estimate(self.graph, dims, self.sizes, out_dims, self.live)
        spans = [(span, self.gathered_bytes(i, choice)) for i, span in self.gathered_span.items()]
        spans = [(span, b) for span, b in spans if b]
        if not spans:
            return base
        live, n_apps = self.live, len(self.graph.apps)
        sizes = np.array(
            [per_device_bytes(self.graph.shapes[v], self.graph.dtypes[v], dims[v], self.sizes)
             for v in live.intermediates],
            dtype=np.float64,
        )  # fmt: skip
        delta = np.zeros(n_apps + 1)
        np.add.at(delta, live.start[live.intermediates], sizes)
        np.add.at(delta, live.end[live.intermediates] + 1, -sizes)
        for (first, last), b in spans:
            delta[first] += b
            delta[last + 1] -= b
        curve = np.cumsum(delta)[:n_apps]
        peak = int(np.argmax(curve))
        return MemoryEstimate(base.arguments, base.results, int(curve[peak]), peak)
