"""The search's memory model: per-device bytes of arguments, results and the live
activations at an equation, per joint choice of the decisions they depend on. A mixin of
`jaxshard.search.problem.Problem`, whose classes, terms and layouts it reads."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from jaxshard.cost import (  # noqa: F401 (fused_liveness re-exported)
    Liveness,
    MemoryEstimate,
    buffer_bytes,
    fused_liveness,
    memory_estimate,
    nbytes,
    per_device_bytes,
    xla_scope,
)
from jaxshard.graph import stack_results
from jaxshard.search.refs import UNSPLIT, decision_of

# the most joint choices one value's moved copies are priced over; past it each move is
# priced apart (XLA's shared copy of one layout may then be counted more than once)
MOVED_COMBOS = 256


class Moved(NamedTuple):
    """The copies of value ``vid`` an XLA computation moves for the equations that read
    it with a dim cut from their factor (`DimClasses._classes`), alive from the first such
    reader to the last (XLA moves a value once per layout and computation: the copy
    gathered for a projection's forward serves its backward): per cut dim, the factor's
    class; for a result, the buffer it is computed in before its move (at ``first``)."""

    vid: int
    first: int
    last: int
    cuts: tuple[tuple[int, object], ...]  # (dim, the factor's class reference)


class MemoryModel:
    """Memory rows and estimates for the integer program (see the module docstring).

    Example:
        >>> problem.memory(problem.baseline()).total  # doctest: +SKIP
        1048576.0
    """

    def activation_row(self, t: int) -> tuple[float, dict[tuple, np.ndarray]]:
        """Live intermediates at application ``t``: constant bytes, and per term the
        bytes under each joint choice. Each buffer is priced as
        `jaxshard.cost.memory_estimate` prices it (`buffer_bytes`): a loop's stack in its
        per-iteration layout, a stack in the buffer of a result it updates, written after
        it (the estimate also finds a stack room in other results' buffers: there the
        rows are above it, and the plan found is priced by the estimate itself). Rows do
        not depend on the budget: each is computed once per problem."""
        found = self._activation_rows.get(t)
        if found is None:
            found = self._activation_rows[t] = self._activation_row(t)
        return found

    def _activation_row(self, t: int) -> tuple[float, dict[tuple, np.ndarray]]:
        g, live = self.graph, self.live
        mask = (live.start[live.intermediates] <= t) & (live.end[live.intermediates] >= t)
        const = 0.0
        rows: dict[tuple, np.ndarray] = {}
        by_sig: dict[tuple, list] = {}
        for v in live.intermediates[mask]:
            v = int(v)
            inner, fills = self._buffer_parts(v)
            key = (self.refs(v), g.shapes[v], g.dtypes[v], inner, self._written_after(v, fills))
            hit = by_sig.get(key)
            if hit is None:
                by_sig[key] = [v, 1]
            else:
                hit[1] += 1
        for (refs, _, _, inner, fills), (v, count) in by_sig.items():
            free = {r for r in refs if type(r) is int}
            if inner is not None:
                free.update(r for r in self.refs(inner) if type(r) is int)
            for o in fills:
                free.update(self._result_decisions(o))
            if not free:
                const += count * self._buffer(v, inner, fills, {})
                continue
            term = self._term(free)
            row = rows.setdefault(term.decisions, np.zeros(len(term.time)))
            for n, choice in self._combos(term):
                row[n] += count * self._buffer(v, inner, fills, choice)
        for item in self.moved:
            if not item.first <= t <= item.last:
                continue
            free = self._moved_decisions(item)
            if not free:
                const += self.moved_bytes(item, {})
                continue
            term = self._term(free)
            row = rows.setdefault(term.decisions, np.zeros(len(term.time)))
            for n, choice in self._combos(term):
                row[n] += self.moved_bytes(item, choice)
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

    def _moved_terms(self) -> None:
        """The copies equations move their operands to, or compute their results in,
        where a dim was cut for a class the program pins (`Moved`; the step's constraints
        against the layouts of state), grouped per value and XLA computation, each with a
        joint term over the decisions its layouts depend on, made before the integer
        program is (memory rows added while solving use them). The other cuts (the keys'
        positions of attention, heads repeated for grouped queries) move small or
        short-lived copies that XLA fuses into their readers: the model leaves them out,
        as the compiled programs of the scale benchmark measure."""
        g = self.graph
        found: dict[tuple, list] = {}
        for a, moved in self.pin_cuts.items():
            if a in self.dead:
                continue
            cut = self.cuts[a]
            app = g.apps[a]
            rule = app.rule
            vids = (*app.operands, *app.results)
            majors = {(t, d): f for t, d, f in self._majors(rule)}
            holder = {}  # factor -> the class of the first dim not cut from it
            for (t, d), f in majors.items():
                if (t, d) not in cut and f not in holder:
                    holder[f] = self.refs(vids[t])[d]
            scope = xla_scope(app.where)
            for t, d in sorted(moved):
                if (t, d) not in majors:
                    continue
                entry = (d, holder.get(majors[t, d], UNSPLIT))
                if t >= len(rule.operands):  # a result: its work buffer, at this equation
                    found.setdefault((vids[t], a), [a, a, set()])[2].add(entry)
                    continue
                span = found.setdefault((vids[t], scope), [a, a, set()])
                span[0], span[1] = min(span[0], a), max(span[1], a)
                span[2].add(entry)
        self.moved: list[Moved] = []
        for (v, _), (first, last, entries) in found.items():
            item = Moved(v, first, last, tuple(sorted(entries, key=repr)))
            parts = [item]
            free = self._moved_decisions(item)
            if math.prod(len(self.decisions[x].candidates) for x in free) > MOVED_COMBOS:
                parts = [item._replace(cuts=(e,)) for e in item.cuts]
            for part in parts:
                self.moved.append(part)
                free = self._moved_decisions(part)
                if len(free) > 1:
                    self._term(free)

    def _moved_decisions(self, item: Moved) -> set[int]:
        refs = (*self.refs(item.vid), *(r for _, r in item.cuts))
        return {x for x in map(decision_of, refs) if x is not None}

    def moved_bytes(self, item: Moved, choice) -> int:
        """Per-device bytes of ``item``'s copies under a choice: one per distinct layout
        its cut dims move it to, none where a cut dim's factor has the value's own axes."""
        g, v = self.graph, item.vid
        lay = [tuple(self.axes(r, choice)) for r in self.refs(v)]
        layouts = set()
        for d, ref in item.cuts:
            axes = tuple(self.axes(ref, choice))
            if axes == lay[d]:
                continue
            layouts.add(tuple(
                axes if e == d else tuple(x for x in have if x not in axes)
                for e, have in enumerate(lay)
            ))  # fmt: skip
        return sum(per_device_bytes(g.shapes[v], g.dtypes[v], m, self.sizes) for m in layouts)

    def _stack_terms(self) -> None:
        """A joint term for each loop stack's decisions (its own, its per-iteration
        value's, and the results it may fill), made before the integer program is: the
        memory rows added while solving use them."""
        for v in self.live.intermediates:
            inner, fills = self._buffer_parts(int(v))
            if inner is None:
                continue
            free = {r for r in (*self.refs(int(v)), *self.refs(inner)) if type(r) is int}
            for o in fills:
                free.update(self._result_decisions(o))
            if len(free) > 1:
                self._term(free)

    def _buffer_parts(self, v: int) -> tuple[int | None, tuple[int, ...]]:
        """For intermediate ``v``: the per-iteration value of a loop's stack (None if
        not one), and the results (output positions) whose buffer the stack may fill
        (`jaxshard.graph.stack_results`)."""
        inner = self.live.stacked.get(v)
        return inner, () if inner is None else stack_results(self.graph, v)

    def _result_decisions(self, o: int) -> set[int]:
        """The decisions result ``o``'s layout depends on (a tied one: its argument's)."""
        g = self.graph
        i = self._tied_arg().get(o)
        if i is None:
            return {r for r in self.refs(g.out_vids[o]) if type(r) is int}
        free = {r for r in self.refs(g.in_vids[i]) if type(r) is int}
        k = self.leaf_group.get(i)
        if k is not None and self.groups[k].extra is not None:
            free.add(self.groups[k].extra)
        return free

    def _tied_arg(self) -> dict[int, int]:
        table = self.__dict__.get("_tied_cache")
        if table is None:
            table = self.__dict__["_tied_cache"] = {o: i for i, o in self.graph.ties}
        return table

    def _result_bytes(self, o: int, choice) -> int:
        """Per-device bytes of result ``o`` under a choice (a tied result is laid out
        as its argument is stored)."""
        g = self.graph
        r = g.out_vids[o]
        i = self._tied_arg().get(o)
        lay = self.leaf_layout(i, choice) if i is not None else None
        if lay is None:
            lay = [self.axes(x, choice) for x in self.refs(r)]
        return per_device_bytes(g.shapes[r], g.dtypes[r], lay, self.sizes)

    def _buffer(self, v: int, inner: int | None, fills: tuple[int, ...], choice) -> int:
        """Per-device bytes of intermediate ``v``'s buffer under a choice
        (`jaxshard.cost.buffer_bytes`, and 0 when a result's buffer holds it: one of
        ``fills`` of its size, written after ``v``'s last reader)."""
        later = self._written_after(v, fills)
        if any(self._stored_on_extra(o, choice) for o in later):
            # the update of a leaf stored apart runs in its storage layout, the stacked
            # gradient too (`jaxshard.plan.store_updates`): it fills the result's buffer
            return 0
        dims = {u: tuple(self.axes(r, choice) for r in self.refs(u)) for u in (v, inner)
                if u is not None}  # fmt: skip
        size = buffer_bytes(self.graph, v, dims, self.sizes, self.live)
        return 0 if any(self._result_bytes(o, choice) == size for o in later) else size

    def _written_after(self, v: int, fills: tuple[int, ...]) -> tuple[int, ...]:
        """Those of results ``fills`` first written after ``v``'s last reader (an update
        that reads the stack as it writes its result, plain SGD's, keeps it apart)."""
        out, live = self.graph.out_vids, self.live
        return tuple(o for o in fills if live.written_after(out[o], live.end[v]))

    def _stored_on_extra(self, o: int, choice) -> bool:
        """Whether result ``o`` is the new value of a leaf the choice stores on an extra
        axis (FSDP, or its optimizer state alone)."""
        i = self._tied_arg().get(o)
        k = None if i is None else self.leaf_group.get(i)
        extra = None if k is None else self.groups[k].extra
        return extra is not None and self.decisions[extra].candidates[choice[extra]] is not None

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
        for v in self.live.intermediates:
            inner, fills = self._buffer_parts(int(v))
            o = next((o for o in fills if self._stored_on_extra(o, choice)), None)
            if o is not None:  # a stacked gradient in its leaf's storage layout (`_buffer`)
                dims[int(v)] = out_dims[o]
                dims[inner] = tuple(out_dims[o][1:])
        return self.estimate(dims, out_dims, choice)

    def estimate(self, dims, out_dims, choice) -> MemoryEstimate:
        """`jaxshard.cost.memory_estimate` of a layout of every value, plus the gathered
        copies of the parameters the choice stores apart (FSDP), alive from their first
        use to their last."""
        spans = [
            (first, last, self.gathered_bytes(i, choice))
            for i, (first, last) in self.gathered_span.items()
        ]
        spans += [(m.first, m.last, self.moved_bytes(m, choice)) for m in self.moved]
        return memory_estimate(self.graph, dims, self.sizes, out_dims, self.live, spans)
