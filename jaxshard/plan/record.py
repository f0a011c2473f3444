"""The `Plan` record: every value's layout, the reshards and pending sums a final pass
over the equations finds, their predicted collectives, bytes and memory, the in/out
specs as pytrees, and what a saved plan records of its program. The stages above it
(explaining, verifying) register their entry points here (`register_stage`), so the
record imports nothing above itself."""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxshard.cost import (
    Liveness,
    MemoryEstimate,
    PlannedCollective,
    WrittenCollective,
    bitcasts,
    combines_all_reduces,
    executions,
    fused_liveness,
    has_reduce_scatter,
    in_while_loop,
    liveness,
    memory_estimate,
    nbytes,
    per_device_bytes,
    reads_of,
    reshard_collectives,
    schedule,
    step_bytes,
    written_collectives,
    xla_scope,
)
from jaxshard.errors import JaxshardBug
from jaxshard.graph import Graph, contracts
from jaxshard.lattice import DimSharding, to_spec
from jaxshard.plan.apps import analyzed_apps, app_moves, dead_apps
from jaxshard.propagate import (
    Conflict,
    Origin,
    OriginKind,
    Propagator,
)
from jaxshard.saved import (
    PLAN_FORMAT,
    PLAN_VERSION,
    SavedPlan,
    dims_to_json,
    program_fingerprint,
    read_saved,
)
from jaxshard.trace import Traced


@dataclass(frozen=True)
class Reshard:
    """A predicted reshard: at application ``app``, value ``vid`` moves ``src``->``dst``
    (after summing pending ``partial`` reductions) by the collectives ``steps`` (a halo
    exchange keeps the layout: ``src == dst``, one collective-permute), sending
    ``ring_bytes`` per device (ring volume) each time
    the equation runs: ``runs`` times per call (the lengths of the scans around it). In a
    while loop (``in_while``) the trip count is not known when planning, and ``runs``
    counts the loop once."""

    app: int
    vid: int
    src: tuple[DimSharding, ...]
    dst: tuple[DimSharding, ...]
    partial: frozenset[str]
    ring_bytes: float
    steps: tuple[PlannedCollective, ...]
    where: str
    runs: int = 1
    in_while: bool = False

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collectives as text: ``('all-gather over data',)``."""
        return tuple(str(s) for s in self.steps)

    @property
    def call_bytes(self) -> float:
        """Bytes per device per call: ``ring_bytes * runs``."""
        return self.ring_bytes * self.runs


def mesh_axis_sizes(mesh: Mesh) -> dict[str, int]:
    """``{axis name: size}`` of a mesh.

    Example:
        >>> import jax
        >>> mesh_axis_sizes(jax.make_mesh((1,), ("data",)))
        {'data': 1}
    """
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


# The stages above the plan (explaining, verifying) register their entry points here, so
# `Plan.explain` and `Plan.verify` reach them while this package imports nothing above itself.
_STAGES: dict[str, Callable[..., Any]] = {}


def register_stage(name: str, fn: Callable[..., Any]) -> None:
    """Make ``fn`` the implementation of ``Plan.<name>`` (called as ``fn(plan, ...)``).

    Example:
        >>> register_stage("explain", explain_plan)  # doctest: +SKIP
    """
    _STAGES[name] = fn


def _stage(name: str) -> Callable[..., Any]:
    return _STAGES[name]  # registered when the jaxshard package is imported, before any plan


class Plan:
    """A complete sharding plan for one function and one set of argument shapes.

    Attributes: ``in_specs``/``out_specs`` (pytrees of PartitionSpec shaped like the
    arguments ``(args, kwargs)``... see `in_specs`), ``reshards``, ``slices`` (the
    ``(application, value)`` pairs where a value is cut to a finer layout for its use, no
    collective needed), ``repeats`` (``(application, value, layout)`` where an operand
    is wanted in a layout an earlier use in the same XLA computation moved it to: XLA
    merges the two moves, and the first copy stays alive until then; for a contraction),
    ``moved_again`` (the same for other uses: moved again, priced again), ``conflicts``, and
    ``search_result``: the `jaxshard.search.SearchResult` of the search that chose this
    plan's layouts (None for a plan made from hints alone).
    """

    def __init__(
        self,
        traced: Traced,
        graph: Graph,
        prop: Propagator,
        mesh: Mesh,
        out_dims: Sequence[tuple[DimSharding, ...]] | None = None,
    ):
        # the layouts are copied into tuples: the propagator may go on, the plan may not
        self.traced, self.graph, self.mesh = traced, graph, mesh
        self.axis_sizes = mesh_axis_sizes(mesh)
        self.dims: tuple[tuple[DimSharding, ...], ...] = tuple(map(tuple, prop.state.dims))
        self.origins: tuple[tuple[Origin | None, ...], ...] = tuple(map(tuple, prop.state.origins))
        self.conflicts: list[Conflict] = list(prop.state.conflicts.values())
        self.visits = prop.state.visits
        self.search_result: Any = None  # set by search_hints before it returns the plan
        self.pipelined: tuple = ()  # the PipelinedLoops of auto_shard(pipeline=...)
        self.partial: dict[int, frozenset[str]] = {}
        self.reshards: list[Reshard] = []
        # (application, value) where a value is cut to a finer layout with no collective
        self.slices: list[tuple[int, int]] = []
        # (application, value, layout): an operand wanted where an earlier use moved it
        self.repeats: list[tuple[int, int, tuple[DimSharding, ...]]] = []
        # the same for a later use that does not contract the operand: moved again
        self.moved_again: list[tuple[int, int, tuple[DimSharding, ...]]] = []
        # (value, layout) -> the XLA computations (`xla_scope`) it was moved to it in
        self._moved: dict[tuple[int, tuple[DimSharding, ...]], set[tuple[int, ...]]] = {}
        self._runs, self._in_while = executions(graph), in_while_loop(graph)
        self._reduce_scatter = has_reduce_scatter(mesh)
        self._analyze(prop)
        # the collectives the program writes itself (shard_map bodies), priced like reshards
        self.written: list[WrittenCollective] = written_collectives(
            graph, self.dims, self.axis_sizes
        )
        if out_dims is None:
            out_dims = [self.dims[v] for v in graph.out_vids]
            for i, o in graph.ties:  # the new value of an argument keeps its layout...
                if graph.out_vids[o] not in prop.hinted:  # ...unless the user pinned the result
                    out_dims[o] = self.dims[graph.in_vids[i]]
        self.out_dims: tuple[tuple[DimSharding, ...], ...] = tuple(map(tuple, out_dims))
        self._returned(graph)
        # a plan is a value: the step's cache shares it, so nothing in it changes again
        for name in ("conflicts", "reshards", "slices", "repeats", "moved_again", "written"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self.partial = MappingProxyType(self.partial)
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(
                f"Plan is immutable: cannot set {name!r} (plan again, or load a saved plan)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Plan is immutable: cannot delete {name!r}")

    def _attach(self, **found: Any) -> None:
        """Set what the planning that made this plan found after constructing it (the
        search's result, the pipelined loops), once, before the plan is handed out."""
        for name, value in found.items():
            if name not in ("search_result", "pipelined") or getattr(self, name):
                raise JaxshardBug(f"Plan._attach({name}=...): set once, before handing out")
            object.__setattr__(self, name, value)

    def _analyze(self, prop: Propagator) -> None:
        g = self.graph
        for a in analyzed_apps(g, prop):
            moves, axes = app_moves(prop, self.axis_sizes, a)
            for vid, src, dst, partial in moves:
                if vid not in g.apps[a].results:
                    self._move_operand(a, vid, dst)
                else:  # computed in the working layout (partial), then moved
                    if axes:
                        self.partial[vid] = axes
                    self._add_reshard(a, vid, src, dst, partial)
            for vid, step in prop.halos(a):
                layout = tuple(self.dims[vid])
                self.reshards.append(
                    Reshard(a, vid, layout, layout, frozenset(), step.ring_bytes, (step,),
                            g.apps[a].describe(), self._runs[a], self._in_while[a])
                )  # fmt: skip

    def _returned(self, graph: Graph) -> None:
        """A result computed in another layout than the one it is returned in (the new
        value of an argument keeps the argument's layout, while the update computing it
        worked in its optimizer state's split layout) moves at the end of the step: XLA
        all-gathers it into the output buffer, a reshard at the equation that made it."""
        producers = None
        for o, (vid, out) in enumerate(zip(graph.out_vids, self.out_dims)):
            if tuple(self.dims[vid]) == out:
                continue
            producers = producers if producers is not None else graph.producers()
            a = producers.get(vid)
            if a is None:
                continue
            self._add_reshard(a, vid, tuple(self.dims[vid]), out, frozenset(), returned_as=o)

    def _move_operand(self, a: int, vid: int, dst: tuple[DimSharding, ...]) -> None:
        """Operand ``vid`` of application ``a`` moves to ``dst``. The lowered program
        constrains a copy of it at its first use in each XLA computation (`xla_scope`).
        A later contraction there (a weight the backward pass multiplies by again) is
        constrained alike: XLA's common-subexpression pass merges its collective into
        the first one's, whose result stays alive until then. ``repeats`` records those
        uses, at no bytes. Any other later use (an elementwise optimizer update) is left
        unconstrained and priced as moved again (``moved_again``): constrained, the
        update too would work on the gathered copy, which then lives to the step's end."""
        scope = xla_scope(self.graph.apps[a].where)
        scopes = self._moved.setdefault((vid, dst), set())
        if scope in scopes:
            if contracts(self.graph.apps[a]):
                self.repeats.append((a, vid, dst))
                return
            self.moved_again.append((a, vid, dst))
        scopes.add(scope)
        self._add_reshard(a, vid, self.dims[vid], dst, frozenset())

    def _add_reshard(self, a, vid, src, dst, partial, returned_as: int | None = None) -> None:
        """Value ``vid`` of application ``a`` moves from ``src`` to ``dst`` (``returned_as``:
        into result leaf ``returned_as``'s buffer, after the step); a move with no
        collective is a local slice, recorded for an operand only."""
        g = self.graph
        steps = reshard_collectives(
            g.shapes[vid], g.dtypes[vid], src, dst, self.axis_sizes, partial, self._reduce_scatter
        )
        if not steps:
            if returned_as is None:
                self.slices.append((a, vid))
        else:
            cost = sum(s.ring_bytes for s in steps) + 0.0
            where = g.apps[a].describe()
            where += "" if returned_as is None else f", returned as out/{returned_as}"
            self.reshards.append(
                Reshard(a, vid, src, dst, partial, cost, tuple(steps), where,
                        self._runs[a], self._in_while[a])
            )  # fmt: skip

    # --- the public views ------------------------------------------------------------

    def spec(self, vid: int) -> PartitionSpec:
        """The PartitionSpec of a value."""
        return to_spec(self.dims[vid])

    def _tree(self, leaves, tree):
        return jax.tree_util.tree_unflatten(tree, leaves)

    @property
    def in_specs(self) -> Any:
        """PartitionSpecs shaped like the arguments: a tuple of positional args' specs,
        plus a dict of keyword args' specs when there are any.

        Example:
            >>> plan.in_specs  # doctest: +SKIP
            ({'w1': P(None, 'model')}, {'tok': P('data',)})
        """
        args, kwargs = self._tree([self.spec(v) for v in self.graph.in_vids], self.traced.in_tree)
        return (args, kwargs) if kwargs else args

    @property
    def out_specs(self) -> Any:
        """PartitionSpecs shaped like the function's result."""
        return self._tree([to_spec(d) for d in self.out_dims], self.traced.out_tree)

    @property
    def in_shardings(self) -> Any:
        """NamedShardings (on the plan's mesh) shaped like `in_specs`; use them to create
        arguments directly in their planned layout."""
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), self.in_specs)

    @property
    def out_shardings(self) -> Any:
        """NamedShardings shaped like `out_specs`."""
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), self.out_specs)

    def flat_in_dims(self) -> list[tuple[DimSharding, ...]]:
        """Per argument leaf, the planned per-dim axes."""
        return [self.dims[v] for v in self.graph.in_vids]

    def per_device_bytes(self, names_prefix: str = "") -> tuple[int, int]:
        """(per-device, replicated) bytes of the argument leaves under a path prefix.

        Example:
            >>> plan.per_device_bytes("params/")  # doctest: +SKIP
            (106496, 425984)
        """
        g, sizes = self.graph, self.axis_sizes
        device = total = 0
        for vid, name in zip(g.in_vids, self.traced.in_names):
            if name.startswith(names_prefix):
                device += per_device_bytes(g.shapes[vid], g.dtypes[vid], self.dims[vid], sizes)
                total += nbytes(g.shapes[vid], g.dtypes[vid])
        return device, total

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
        g = self.graph
        # readers of a reduced value wait for its combined reduction
        reduced = self._reduction_times(schedule(g).at)
        ready = {self.reshards[i].vid: t for i, t in reduced.items()}
        views = bitcasts(g, self.dims, self.axis_sizes, {r.app for r in self.reshards})
        live = fused_liveness(g, liveness(g, dead_apps(g), ready, views))
        copies = self.moved_copies(live, reduced)
        return memory_estimate(g, self.dims, self.axis_sizes, self.out_dims, live, copies)

    def moved_copies(
        self, live: Liveness | None = None, reduced: Mapping[int, int] | None = None
    ) -> list[tuple[int, int, int]]:
        """The buffers no value holds: operands moved for their use (a parameter
        gathered from its storage layout), alive from the use that moves it to the last
        later contraction in the same XLA computation that reads the same copy (XLA
        merges those collectives, `_move_operand`), and the working buffers of results
        computed in a larger layout (a gradient summed whole, then reduce-scattered) or
        gathered to one (an optimizer update gathered to its parameter's layout,
        `_gathered_together`); as ``(first, last, bytes per device)`` in the times of
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
        uses = producers = None  # made when a gathered result needs its readers
        reduced = self._reduction_times(at) if reduced is None else reduced
        stored = set() if live is None else set(live.intermediates.tolist())
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
                    copies.append((t, reduced.get(i, t), size))
                o = None if live is None else live.owner[r.vid]
                if o is not None and o not in stored and live.end[o] >= 0:
                    # an elementwise result fusion would recompute in its readers: the
                    # collective's output is a buffer of its own (an optimizer update
                    # gathered to its parameter's layout)
                    if uses is None:
                        uses, producers = g.uses(), g.producers()
                    readers = self._fusion_readers(r.vid, buffers, uses, at)
                    end = int(max(t, live.end[o], *readers.values()))
                    written = {v: w for v, w in readers.items() if v in outs}
                    first = min(readers.values(), default=t)
                    if written:  # an update applied to a parameter
                        scope = xla_scope(g.apps[r.app].where)
                        ready = self._fused_from(r.vid, buffers, producers, at)
                        applied.setdefault(scope, []).append((ready, first, end, own, written))
                    else:
                        copies.append((first, end, own))
                continue
            size = per_device_bytes(g.shapes[r.vid], g.dtypes[r.vid], r.dst, self.axis_sizes)
            key = (r.vid, r.dst, xla_scope(g.apps[r.app].where))
            copies.append((sched.hoisted(r.app, r.vid), int(max(t, last.get(key, t))), size))
        for group in applied.values():
            copies += self._gathered_together(group)
        return copies

    def _gathered_together(self, group: list) -> list[tuple[int, int, int]]:
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
                copies.append((min(first, earliest), last, size))
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

    def _reduction_times(self, at) -> dict[int, int]:
        """When each partial sum's all-reduce runs, by index into ``reshards``, where XLA
        combines them (`combines_all_reduces`): the reductions over the same axes in one
        computation are taken in order and combined until one reads the result of
        another in its group (or 256 are), and a group runs when its last member's
        partial is ready, so earlier partials wait (a head's gradient, summed before the
        backward loop, until the embedding's after it)."""
        g = self.graph
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

        for k, (t, i, r) in sorted(enumerate(sums), key=lambda x: x[1][0]):
            key = (xla_scope(g.apps[r.app].where), r.partial)
            members = groups.setdefault(key, [])
            if members and (
                len(members) == 256 or reads[r.vid] & sum(1 << m for _, _, m in members)
            ):
                close(members)
                members.clear()
            members.append((t, i, k))
        for members in groups.values():
            close(members)
        return times

    @property
    def predicted_bytes(self) -> float:
        """Predicted collective bytes per device for one call (`jaxshard.cost.step_bytes`):
        a reshard in a scan body counts once per iteration; one in a while loop counts
        once (its trip count is not known), so with `while_reshards` the total is a lower
        bound.

        Example:
            >>> plan.predicted_bytes  # doctest: +SKIP
            1036288.0
        """
        return step_bytes(self)

    @property
    def while_reshards(self) -> list[Reshard]:
        """The reshards inside while loops, counted once in `predicted_bytes`.

        Example:
            >>> plan.while_reshards  # doctest: +SKIP
            []
        """
        return [r for r in self.reshards if r.in_while]

    def origin_text(self, vid: int) -> str:
        """Why a value has its layout: for each sharded or hinted dim, the hint that pinned
        it or the chain it was propagated along (back to the nearest named value).

        Example:
            >>> plan.origin_text(plan.graph.in_vids[0])  # doctest: +SKIP
            "dim 1: propagated from params/l0/wq (hint 'params/.*/wq': P(None, 'model')) via ..."
        """
        texts = []
        for d, origin in enumerate(self.origins[vid]):
            if origin is not None and (self.dims[vid][d] or origin.kind is OriginKind.HINT):
                texts.append(f"dim {d}: {self._describe_origin(vid, d)}")
        return "; ".join(texts) or "replicated: nothing sharded it"

    def _describe_origin(self, vid: int, d: int) -> str:
        origin = self.origins[vid][d]
        if origin.kind is not OriginKind.PROPAGATED:
            return origin.text
        via = self.graph.apps[origin.app].describe()
        seen = set()
        args = set(self.graph.in_vids)
        while origin is not None and origin.kind is OriginKind.PROPAGATED and (vid, d) not in seen:
            seen.add((vid, d))
            vid, d = origin.source, origin.source_dim
            origin = self.origins[vid][d]
            name = self.graph.names.get(vid)
            if name is not None and (
                vid in args or origin is None or origin.kind is not OriginKind.PROPAGATED
            ):
                hint = (
                    f" ({origin.text})"
                    if origin is not None and origin.kind is OriginKind.HINT
                    else ""
                )
                return f"propagated from {name} dim {d}{hint} via {via}"
        if origin is not None and origin.kind is OriginKind.HINT:
            return f"propagated from {origin.text} via {via}"
        return f"propagated via {via}"

    def to_json(self) -> str:
        """The plan as deterministic, versioned JSON: every value's layout plus the mesh,
        argument and result shapes it was made for.

        Example:
            >>> text = plan.to_json()  # doctest: +SKIP
            >>> step = jaxshard.auto_shard(mesh, plan=jaxshard.Plan.from_json(text))(fn)  # doctest: +SKIP
        """
        record = record_of(self.traced, self.graph, self.mesh)
        record["dims"] = [dims_to_json(d) for d in self.dims]
        record["out_dims"] = [dims_to_json(d) for d in self.out_dims]
        if self.pipelined:
            record["pipeline"] = [loop.to_json() for loop in self.pipelined]
        return json.dumps(record, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> SavedPlan:
        """Read a plan written by `to_json`, checked against the format
        (`jaxshard.saved`): a file that does not follow it is a `ShardingError` naming
        the field, what it holds and what was expected.

        Example:
            >>> saved = Plan.from_json(plan.to_json())  # doctest: +SKIP
        """
        return read_saved(text)

    def verify(self, lowered: Any = None) -> Any:
        """Compile the plan's program and compare its collectives with the predictions;
        see `jaxshard.verify.verify`.

        Example:
            >>> plan.verify().surprises  # doctest: +SKIP
            []
        """
        return _stage("verify")(self, lowered)

    def explain(self, intermediates: bool = False) -> str:
        """A readable table of every argument and result (and, with ``intermediates``,
        every equation's results), the reshards, the conflicts and why they were decided
        as they were, and totals.

        Example:
            >>> print(plan.explain())  # doctest: +SKIP
        """
        return _stage("explain")(self, intermediates=intermediates)


def record_of(traced: Traced, graph: Graph, mesh: Mesh) -> dict:
    """What a saved plan records of the program it was made for: format, mesh, program
    fingerprint, argument and result leaves (`jaxshard.saved` documents the fields)."""
    leaf = lambda name, vid: {  # noqa: E731
        "name": name,
        "value": vid,
        "shape": list(graph.shapes[vid]),
        "dtype": str(graph.dtypes[vid]),
    }
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "mesh": {"axes": list(mesh.axis_names), "sizes": list(mesh.axis_sizes)},
        "inputs": [leaf(n, v) for n, v in zip(traced.in_names, graph.in_vids)],
        "outputs": [leaf(n, v) for n, v in zip(traced.out_names, graph.out_vids)],
        "values": len(graph.shapes),
        "program": program_fingerprint(graph),
    }
