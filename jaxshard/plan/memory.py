"""What a plan holds in memory per device: the estimate of `Plan.estimated_memory`
(arguments, results and the largest live set of intermediates, the copies XLA makes
of moved operands and of all-reduced partial sums counted as it makes them:
`moved_copies`), what it holds at its peak (`peak_buffers`), and the reduction times
of pending partial sums it needs."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Mapping

from jaxshard.cost import (
    LOWERED_IN_PLACE,
    Liveness,
    MemoryEstimate,
    bitcasts,
    combines_all_reduces,
    copies_result_transposes,
    copies_transposed_operands,
    dtype_name,
    fused_liveness,
    liveness,
    loop_ends,
    memory_estimate,
    peak_buffers,
    per_device_bytes,
    reads_of,
    recomputes_remat,
    reduces_in_place,
    schedule,
    transposed_operands,
    xla_scope,
)
from jaxshard.graph import AppKind, slices_stack, source_line, view_dims
from jaxshard.lattice import to_spec
from jaxshard.plan.apps import dead_apps


class PlanMemory:
    """`Plan`'s memory estimate (a mixin: the graph, layouts and reshards are the
    plan's)."""

    @functools.cached_property
    def estimated_memory(self) -> MemoryEstimate:
        """Estimated memory per device in bytes (the unit of ``memory_budget``): arguments,
        results and the peak of live intermediates, counted as XLA's fusion and buffer
        sharing leave them (`jaxshard.cost.memory_estimate`); ``.total`` is the figure a
        compiled program's memory analysis (arguments + results + temporaries) gives.

        Example:
            >>> plan.estimated_memory.total  # doctest: +SKIP
            35789824
        """
        live, copies = self._held
        return memory_estimate(self.graph, self.dims, self.axis_sizes, self.out_dims, live, copies)

    def peak_buffers(self) -> list[tuple[int, str]]:
        """What `estimated_memory` holds at its peak, largest first: ``(bytes per device,
        what)`` for each intermediate (named by the equation that makes it, with shape,
        dtype and layout) and each copy XLA makes (a moved operand, a transposed matmul
        operand, a partial sum's working buffer); `explain` shows the largest.

        Example:
            >>> plan.peak_buffers()[0]  # doctest: +SKIP
            (2101346304, '%812 = dot_general at model.py:324 (64, 4096, 128256) float32 P(...)')
        """
        found = self.peak_values()
        return [(b, what if isinstance(what, str) else self._named(what)) for b, what in found]

    def peak_values(self) -> list[tuple[int, int | str]]:
        """`peak_buffers` with each intermediate as its value's id in ``graph`` (a copy
        XLA makes is still described in words): for code that reads the values' layouts.

        Example:
            >>> plan.peak_values()[0]  # doctest: +SKIP
            (2101346304, 812)
        """
        live, copies = self._held
        return peak_buffers(self.graph, self.dims, self.axis_sizes, self.out_dims, live, copies)

    @functools.cached_property
    def _held(self) -> tuple[Liveness, list[tuple[int, int, int, str]]]:
        """The buffers' lives and the copies no value holds, as `estimated_memory` counts
        them."""
        g = self.graph
        # readers of a reduced value wait for its combined reduction
        reduced = self._reduction_times(schedule(g))
        ready = {self.reshards[i].vid: t for i, t in reduced.items()}
        views = bitcasts(g, self.dims, self.axis_sizes, {r.app for r in self.reshards})
        cpu = copies_transposed_operands(self.mesh)
        live = liveness(g, dead_apps(g), ready, views, recomputes_remat(self.mesh))
        live = fused_liveness(g, live, matmul_epilogues=cpu)
        copies = self.moved_copies(live, reduced)
        if cpu:
            ends: dict[int, int] = {}
            reread: dict[int, int] = {}
            copies += transposed_operands(g, self.dims, self.axis_sizes, live, ends, reread)
            if ends or reread:
                end = live.end.copy()
                for o, e in ends.items():  # the matmul reads the copy: the operand is
                    end[o] = e  # free after its other readers
                for o, e in reread.items():  # the copy's fusion reads these again
                    end[o] = max(end[o], e)
                squeezable = {o: t for o, t in live.squeezable.items() if o not in reread}
                live = dataclasses.replace(live, end=end, squeezable=squeezable)
        return live, copies

    def _named(self, v: int) -> str:
        """A value as `explain` names it, with its shape, dtype and layout."""
        g = self.graph
        name = g.names.get(v)
        if name is None:
            name = f"%{v}"
            a = g.producers().get(v)
            if a is not None:
                name += f" = {g.apps[a].describe()}"
            else:  # a loop's result (its stacked residuals): named by the loop
                link = next(
                    (g.apps[b] for b in self._uses[v] if g.apps[b].kind is AppKind.LINK), None
                )
                if link is not None:
                    name += f" = {link.eqn.primitive.name} at {source_line(link.eqn, link.where)}"
        return f"{name} {tuple(g.shapes[v])} {dtype_name(g.dtypes[v])} {to_spec(self.dims[v])}"

    def moved_copies(
        self, live: Liveness | None = None, reduced: Mapping[int, int] | None = None
    ) -> list[tuple[int, int, int, str]]:
        """The buffers no value holds: operands moved for their use (a parameter
        gathered from its storage layout), alive from the use that moves it to the last
        later contraction in the same XLA computation that reads the same copy (XLA
        merges those collectives, `_move_operand`; a stack stored split along its layers
        is gathered whole for each loop that slices it, as early as it exists, and held
        to the loop's last iteration), and the working buffers of results
        computed in a larger layout (a gradient summed whole, then reduce-scattered) or
        gathered to one (an optimizer update gathered to its parameter's layout,
        `_gathered_together`), and, where XLA all-reduces apart from the operand
        (`jaxshard.cost.reduces_in_place`), a partial sum's second buffer while it is
        all-reduced (`_reduced_apart`); as ``(first, last, bytes per device)`` in the times of
        ``live``'s schedule (XLA gathers a parameter before the loops when nothing else
        holds the gather back); ``reduced``: `_reduction_times` in those times, when
        known.

        Example:
            >>> plan.moved_copies()  # doctest: +SKIP
            [(212, 480, 2101346304)]
        """
        g = self.graph
        sched = (live or liveness(g)).schedule
        at = sched.at
        last: dict[tuple, int] = {}
        for a, vid, dst in self.repeats:
            key = (vid, dst, xla_scope(g.apps[a].where))
            last[key] = max(last.get(key, at[a]), at[a])
        copies = []
        ends = None  # each loop's last time, made when a stack is gathered for its loop
        uses = producers = None  # made when a gathered result needs its readers
        reduced = self._reduction_times(sched) if reduced is None else reduced
        apart = not reduces_in_place(self.mesh)
        stored = set() if live is None else set(live.intermediates.tolist())
        # the buffers of the step's results (`_sits_in_a_result`)
        held = set() if live is None else {live.owner[v] for v in self._result_bytes}
        outs = set(g.out_vids)
        buffers = stored | outs
        applied: dict[str, list] = {}  # scope -> gathered updates fused into their applies
        for i, r in enumerate(self.reshards):
            t = int(at[r.app])
            if r.vid in g.apps[r.app].results:
                # computed in its working layout (a partial sum), then moved: the working
                # buffer is alive until its (possibly combined) collective runs
                size = per_device_bytes(g.shapes[r.vid], g.dtypes[r.vid], r.src, self.axis_sizes)
                own = per_device_bytes(g.shapes[r.vid], g.dtypes[r.vid], r.dst, self.axis_sizes)
                if size > own:
                    what = f"{self._named(r.vid)} summed in {to_spec(r.src)} before its move"
                    copies.append((t, reduced.get(i, t), size, what))
                elif apart and self._sits_in_a_result(r.vid, live, held):
                    # the result is the partial sum transposed, which XLA has the matmul
                    # write into the result's buffer: the all-reduce's output is a buffer
                    # of its own, transposed into the result at the end of the step
                    # (read in the buffer assignment of gradients returned by the step)
                    when = reduced.get(i, t)
                    last = int(at.max()) if sched.top[r.app] else when
                    # issued once the matmul's operands are free
                    freed = [int(live.end[live.owner[o]]) for o in g.apps[r.app].operands]
                    when = min(last, max([when, *(e + 1 for e in freed if e >= 0)]))
                    copies.append((when, last, size, f"{self._named(r.vid)}, all-reduced apart"))
                    if len(g.out_vids) > 1 and copies_result_transposes(self.mesh):
                        # transposed into a buffer of its own first, while the
                        # all-reduce's output is alive
                        what = f"{self._named(r.vid)}, all-reduced and transposed apart"
                        copies.append((when, when, size, what))
                elif apart and self._reduced_apart(r.vid, own):
                    # the all-reduce writes its result beside the partial sum, which the
                    # value stands for: both are alive while it runs
                    when = reduced.get(i, t)
                    copies.append((when, when, size, f"{self._named(r.vid)}, all-reduced apart"))
                o = None if live is None else live.owner[r.vid]
                if o is not None and o not in stored and live.end[o] >= 0:
                    # an elementwise result fusion would recompute in its readers: the
                    # collective's output is a buffer of its own (an optimizer update
                    # gathered to its parameter's layout)
                    if uses is None:
                        uses, producers = self._uses, g.producers()
                    readers = self._fusion_readers(r.vid, buffers, uses, at)
                    end = int(max(t, live.end[o], *readers.values()))
                    written = {v: w for v, w in readers.items() if v in outs}
                    first = min(readers.values(), default=t)
                    if written:  # an update applied to a parameter
                        scope = xla_scope(g.apps[r.app].where)
                        ready = self._fused_from(r.vid, buffers, producers, at)
                        applied.setdefault(scope, []).append((ready, first, end, own, written))
                    else:
                        what = f"{self._named(r.vid)} gathered to {to_spec(r.dst)}"
                        copies.append((first, end, own, what))
                continue
            size = per_device_bytes(g.shapes[r.vid], g.dtypes[r.vid], r.dst, self.axis_sizes)
            key = (r.vid, r.dst, xla_scope(g.apps[r.app].where))
            what = f"{self._named(r.vid)} moved to {to_spec(r.dst)} for {g.apps[r.app].describe()}"
            first, end = sched.hoisted(r.app, r.vid), int(max(t, last.get(key, t)))
            body = self._sliced_in.get(r.vid)
            if body is not None and not sched.top[r.app]:
                # a loop's slice of a stack (a layer's weight) moved for its use in the
                # body: XLA's schedule moves it at the body's start, and the copy is
                # alive from there (read in the buffer assignment of scanned FSDP
                # steps: every gathered weight of the layer at the attention's peak)
                first = min(first, int(at[body]))
            k = self._loop_of(r.app, sched) if slices_stack(g, r.app) else None
            if k is not None:
                # a stack gathered whole for its loop (stored split along its layers):
                # the loop reads it, one slice per iteration, until its last iteration,
                # and XLA gathers it as early as the stack exists, before the loops
                # before this one
                ends = ends if ends is not None else loop_ends(sched)
                end = max(end, int(ends[k]))
                if sched.seg[r.vid] < k:
                    first = min(first, max(0, sched.loop_starts[sched.seg[r.vid]] - 1))
            copies.append((first, end, size, what))
        for group in applied.values():
            copies += self._gathered_together(group)
        return copies

    def _loop_of(self, link: int, sched) -> int | None:
        """The top-level loop whose body ``link`` hands a stack's slices to (its index in
        `Schedule.loop_starts`), or None."""
        inside = [b for b in self._uses[self.graph.apps[link].results[0]] if not sched.top[b]]
        k = bisect.bisect_right(sched.loop_starts, min(inside, default=-1)) - 1
        return k if k >= 0 else None

    @functools.cached_property
    def _sliced_in(self) -> dict[int, int]:
        """Per slice of a stacked input a link hands a loop's body (`slices_stack`), the
        body's first application."""
        g = self.graph
        return {
            g.apps[a].results[0]: g.link_body.get(a, a)
            for a in range(len(g.apps))
            if slices_stack(g, a)
        }

    @functools.cached_property
    def _uses(self) -> list[list[int]]:
        """Per value, the applications it takes part in (`jaxshard.graph.Graph.uses`)."""
        return self.graph.uses()

    def _reduced_apart(self, v: int, size: int) -> bool:
        """Whether all-reducing partial sum ``v`` (``size`` bytes per device once reduced)
        takes a buffer the estimate does not hold. A result's buffer takes the all-reduce's
        output; its partial is one more, unless the result's maker writes over an operand
        of its type (a gradient scattered into zeros: the estimate holds those). Any other
        value stands for the partial; its all-reduced copy is one more, unless it flows,
        through moves and elementwise equations, into a result of at least its size (an
        update XLA writes over it). A layer's gradient the backward loop stacks is not
        such a result: XLA all-reduces it into a buffer of its own beside the partial
        (read in the buffer assignment of scanned steps)."""
        g = self.graph
        if v in self._result_bytes:
            maker = g.producers().get(v)
            if maker is None:
                return True
            app, args = g.apps[maker], set(g.in_vids)
            made = app.rule.results[app.results.index(v)]
            return not any(  # an operand with the result's factors, dim for dim, is written over
                dims == made and g.dtypes[o] == g.dtypes[v] and o not in args
                for o, dims in zip(app.operands, app.rule.operands)
            )
        return self._flows_into(v) < size

    def _needed(self, at):
        """A function: the earliest time (in ``at``) a value is read by work that cannot wait
        for the end of the step, infinite when every reader only moves it into step results
        (a transpose, a cast, an update: XLA may run those last)."""
        g, uses = self.graph, self._uses
        outs = set(g.out_vids)
        waits: dict[int, bool] = {}  # every reader of the value can run at the end

        def passes_on(b: int) -> bool:  # reader ``b`` only moves into step results
            app = g.apps[b]
            return (
                app.kind is AppKind.EQN
                and (view_dims(app) is not None or app.rule.plain)
                and all(r in outs or waits.get(r, False) for r in app.results)
            )

        # readers come after their operands' makers: values in reverse program order
        for a in range(len(g.apps) - 1, -1, -1):
            for v in g.apps[a].results:
                waits[v] = all(passes_on(b) for b in uses[v] if v in g.apps[b].operands)

        def needed(v: int) -> float:
            readers = [b for b in uses[v] if v in g.apps[b].operands and not passes_on(b)]
            return min((int(at[b]) for b in readers), default=math.inf)

        return needed

    def _earliest(self, sched) -> list[int]:
        """Per application, the earliest time XLA's scheduler can run it in ``sched``'s
        times: once the latest equation it reads from has run. A loop, what runs inside
        one and what reads a loop's result keep their times."""
        g = self.graph
        at, top = sched.at.tolist(), sched.top.tolist()
        producer, apps = g.producers(), g.apps
        earliest = list(at)
        for a, app in enumerate(apps):
            if not top[a] or app.kind is not AppKind.EQN:
                continue
            made = [p for p in map(producer.get, app.operands) if p is not None]
            if all(top[p] and apps[p].kind is AppKind.EQN for p in made):
                earliest[a] = max((earliest[p] for p in made), default=0)
        return earliest

    def _sits_in_a_result(self, v: int, live: Liveness | None, held: set[int]) -> bool:
        """Whether value ``v``, not itself a result, is transposed into a result whose
        buffer it shares in ``live`` (``held``: the results' buffers there; a matmul's
        partial sum whose only reader is that transpose: `liveness` has the matmul write
        in the transposed order)."""
        if live is None or v in self._result_bytes or live.owner[v] not in held:
            return False
        g, owner = self.graph, live.owner
        for b in self._uses[v]:
            app = g.apps[b]
            moved = view_dims(app) if v in app.operands else None
            if moved is not None and _reorders(moved, g.shapes[v]):
                return owner[app.results[0]] == owner[v]
        return False

    def _flows_into(self, v: int) -> float:
        """The most bytes per device of a result ``v`` flows into through moves and
        elementwise equations keeping its shape. Memoized per value: the partial sums
        of successive layers share the residual stream they flow along."""
        outs, memo = self._result_bytes, self._flows
        entered: dict[int, list[int]] = {}  # values whose successors are being walked
        todo = [v]
        while todo:
            u = todo[-1]
            if u in memo:
                todo.pop()
                continue
            nexts = entered.get(u)
            if nexts is None:
                nexts = entered[u] = self._flows_next(u)
                waiting = [r for r in nexts if r not in memo and r not in entered]
                if waiting:
                    todo.extend(waiting)
                    continue
            todo.pop()
            memo[u] = max((max(outs.get(r, -1), memo.get(r, -1)) for r in nexts), default=-1)
        return memo[v]

    def _flows_next(self, u: int) -> list[int]:
        """The values `_flows_into` follows from ``u``."""
        g = self.graph
        found = []
        for a in self._uses[u]:
            app = g.apps[a]
            if u not in app.operands or app.kind in (AppKind.TIE, AppKind.LINK):
                continue  # a loop's stack or carry is no buffer XLA writes the sum into
            moves = view_dims(app) is not None
            if not moves and not app.rule.plain:
                continue
            found += [r for r in app.results if moves or g.shapes[r] == g.shapes[u]]
        return found

    @functools.cached_property
    def _result_bytes(self) -> dict[int, int]:
        """Per result value, its bytes per device."""
        g = self.graph
        return {
            r: per_device_bytes(g.shapes[r], g.dtypes[r], self.out_dims[k], self.axis_sizes)
            for k, r in enumerate(g.out_vids)
        }

    @functools.cached_property
    def _flows(self) -> dict[int, float]:
        """`_flows_into`'s memo."""
        return {}

    def _gathered_together(self, group: list) -> list[tuple[int, int, int, str]]:
        """The gathered results of one computation that fusion folds into readers that
        write step results (optimizer updates gathered to their parameters' layouts;
        ``(computed, first reader, last reader, bytes, {result written: when})`` each),
        as XLA lays them out: it issues the gathers one after another before the first
        of their readers that runs once they are computed, so each is alive from there
        (optax computes every leaf's update, then applies them all: XLA gathers every
        update, then applies them), and a gather can sit in the buffer of a step result
        written after its last reader (a later parameter's new value): largest first,
        one gather to a result."""
        g = self.graph
        firsts = sorted(first for _, first, *_ in group)
        sizes = {
            v: per_device_bytes(g.shapes[v], g.dtypes[v], d, self.axis_sizes)
            for v, d in zip(g.out_vids, self.out_dims)
        }  # fmt: skip
        free = {v: t for *_, written in group for v, t in written.items()}
        copies = []
        for ready, first, last, size, _ in sorted(group, key=lambda c: -c[3]):
            fits = [v for v, t in free.items() if t > last and sizes[v] >= size]
            if fits:
                del free[min(fits, key=sizes.get)]
            else:
                earliest = firsts[min(bisect.bisect_left(firsts, ready), len(firsts) - 1)]
                what = "an optimizer update gathered to its parameter's layout"
                copies.append((min(first, earliest), last, size, what))
        return copies

    def _fused_from(self, v: int, buffers: set[int], producers, at) -> int:
        """When the last buffer that the chain fusion folds into ``v`` reads is written
        (XLA can compute ``v`` from then on)."""
        g = self.graph
        ready, todo, seen = 0, [v], {v}
        while todo:
            a = producers.get(todo.pop())
            if a is None:
                continue
            for x in g.apps[a].operands:
                if x in buffers:
                    ready = max(ready, int(at[producers[x]]) if x in producers else 0)
                elif x not in seen:
                    seen.add(x)
                    todo.append(x)
        return ready

    def _fusion_readers(self, v: int, buffers: set[int], uses, at) -> dict[int, int]:
        """The buffers (values in ``buffers``: stored, or results) written by equations
        that read ``v`` through the chain fusion folds into them, with when each is
        written."""
        g = self.graph
        written, todo, seen = {}, [v], {v}
        while todo:
            x = todo.pop()
            for a in uses[x]:
                if x not in g.apps[a].operands:
                    continue
                for res in g.apps[a].results:
                    if res in buffers:
                        written[res] = int(at[a])
                    elif res not in seen:
                        seen.add(res)
                        todo.append(res)
        return written

    def _reduction_times(self, sched) -> dict[int, int]:
        """When each partial sum's all-reduce runs, by index into ``reshards`` (in the
        times of ``sched``), where XLA combines them (`combines_all_reduces`): the
        reductions over the same axes in one computation are taken in order and combined
        until one reads the result of another in its group (or 256 are), and a group
        runs when its last member's partial is ready, so earlier partials wait (a head's
        gradient, summed before the backward loop, until the embedding's after it). But
        where a member's sum is needed (`_needed`) before the next partial is made in
        program order, and that partial's inputs are ready before then (`_earliest`),
        XLA computes it early and reduces both before the need: the group ends there
        (the experts' inputs, summed over the tokens, and a router's load-balancing sum
        that program order puts after the experts)."""
        g = self.graph
        at = sched.at
        if not combines_all_reduces(self.mesh):
            return {}
        sums = [
            (int(at[r.app]), i, r) for i, r in enumerate(self.reshards)
            if r.partial and r.vid in g.apps[r.app].results
        ]  # fmt: skip
        if len(sums) < 2:
            return {}
        own = {}
        for k, (_, _, r) in enumerate(sums):
            own[r.vid] = own.get(r.vid, 0) | 1 << k
        reads = reads_of(g, own)  # the reductions each value reads the result of
        groups: dict[tuple, list[tuple[int, int, int]]] = {}
        times: dict[int, int] = {}

        def close(members) -> None:
            end = max(t for t, _, _ in members)
            times.update((i, end) for _, i, _ in members)

        needed, earliest = self._needed(at), self._earliest(sched)
        soonest: dict[tuple, float] = {}  # per group, when its members' sums are first needed

        for k, (t, i, r) in sorted(enumerate(sums), key=lambda x: x[1][0]):
            key = (xla_scope(g.apps[r.app].where, LOWERED_IN_PLACE), r.partial)
            members = groups.setdefault(key, [])
            if members and (
                len(members) == 256
                or reads[r.vid] & sum(1 << m for _, _, m in members)
                or earliest[r.app] < soonest[key] < t
            ):
                close(members)
                members.clear()
            soonest[key] = min(soonest.get(key, math.inf) if members else math.inf, needed(r.vid))
            members.append((t, i, k))
        for members in groups.values():
            close(members)
        return times


def _reorders(moved: tuple[int, ...], shape) -> bool:
    """Whether a move (`view_dims`: per result dim, the operand dim it holds) changes the
    order of the operand's dims of more than one element (a transpose, not a cast).

    Example:
        >>> _reorders((1, 0), (4, 8)), _reorders((1, 0), (1, 8))
        (True, False)
    """
    kept = [d for d in moved if shape[d] > 1]
    return kept != sorted(kept)
