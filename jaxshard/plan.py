"""Planning: trace, annotate, propagate, decide, and the resulting `Plan`.

`make_plan` runs the stages in order. After the fixed point, dims no hint reached are
decided: arguments' open dims become replicated and propagate, then any dim still open
is replicated. A final pass over every application records the reshards (a tensor whose
layout differs from the one the equation works in) and the pending partial sums, with
the collectives and bytes the cost model predicts. The Plan holds a complete spec for
every value, the in/out specs as pytrees, and explains itself.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxshard.annotate import Pin, PinKind, match_hints, merge_pins
from jaxshard.cost import (
    CostModel,
    Liveness,
    MemoryCurve,
    MemoryEstimate,
    PlannedCollective,
    WrittenCollective,
    bitcasts,
    combines_all_reduces,
    executions,
    fused_liveness,
    has_reduce_scatter,
    human_bytes,
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
from jaxshard.errors import JaxshardBug, ShardingError
from jaxshard.graph import AppKind, Graph, build_graph, contracts, find_root
from jaxshard.lattice import DimSharding, slices_locally, spec_entry, to_spec
from jaxshard.propagate import (
    DEFAULT_RANK,
    STORAGE_RANK,
    Conflict,
    Origin,
    OriginKind,
    Propagator,
)
from jaxshard.rule import FactorKind
from jaxshard.saved import (  # noqa: F401 (SavedPlan re-exported)
    PLAN_FORMAT,
    PLAN_VERSION,
    SavedPlan,
    dims_from_json,
    dims_to_json,
    program_fingerprint,
    read_saved,
)
from jaxshard.trace import Traced, auto_view, trace_on_mesh  # noqa: F401 (auto_view re-exported)


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
# `Plan.explain` and `Plan.verify` reach them while plan.py imports nothing above itself.
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


def dead_apps(g: Graph) -> set[int]:
    """Equations whose results nothing uses (JAX's tracing keeps them; XLA removes them).

    Example:
        >>> dead_apps(plan.graph)  # doctest: +SKIP
        {12, 13}
    """
    cached = g.memo.get("dead_apps")
    if cached is not None and cached[0] == len(g.apps):  # planning asks more than once
        return cached[1]
    readers = [0] * len(g.shapes)
    for app in g.apps:
        for v in app.operands:
            readers[v] += 1
        if app.kind is not AppKind.EQN:  # links and ties read their results too
            for v in app.results:
                readers[v] += 1
    for v in g.out_vids:
        readers[v] += 1
    producer = g.producers()
    dead: set[int] = set()
    work = [
        a
        for a, app in enumerate(g.apps)
        if app.kind is AppKind.EQN and not any(readers[v] for v in app.results)
    ]
    while work:
        a = work.pop()
        if a in dead:
            continue
        dead.add(a)
        for v in g.apps[a].operands:
            readers[v] -= 1
            p = producer.get(v)
            if readers[v] == 0 and p is not None and not any(readers[r] for r in g.apps[p].results):
                work.append(p)
    g.memo["dead_apps"] = (len(g.apps), frozenset(dead))
    return g.memo["dead_apps"][1]


def duplicate_app(app, seen: dict) -> bool:
    """True for an equation identical to an earlier one (same primitive, operands and
    params), which XLA's common-subexpression elimination merges; ``seen`` collects the
    equations met so far.

    Example:
        >>> seen = {}
        >>> [duplicate_app(app, seen) for app in plan.graph.apps]  # doctest: +SKIP
        [False, False, True]
    """
    if app.eqn is None:
        return False
    head = (app.eqn.primitive, app.operands)
    # the params are compared only between equations of one primitive on the same
    # operands (sorting every equation's params was a tenth of `decide`)
    earlier = seen.get(head)
    if earlier is None:
        seen[head] = [app.eqn.params]
        return False
    key = _params_key(app.eqn.params)
    if key is None:
        return False
    for k, params in enumerate(earlier):
        if isinstance(params, Mapping):  # an earlier equation's params, keyed lazily
            params = earlier[k] = _params_key(params)
        if params == key:
            return True
    earlier.append(key)
    return False


def _params_key(params: Mapping) -> tuple | None:
    """Hashable params, or None when some value is not (never a duplicate then)."""
    key = tuple(sorted(params.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def analyzed_apps(g: Graph, prop: Propagator) -> list[int]:
    """The applications that may need a reshard: not dead code, not a duplicate of an
    earlier equation (unless it reduces: `_reduces`), not already working in its values'
    layouts (`Propagator.settled`).

    Example:
        >>> analyzed_apps(plan.graph, prop)  # doctest: +SKIP
        [3, 7, 12]
    """
    seen: dict = {}
    dead = dead_apps(g)
    return [
        a
        for a, app in enumerate(g.apps)
        if a not in dead
        and not (duplicate_app(app, seen) and not _reduces(app))
        and not prop.settled(a)
    ]


def _reduces(app) -> bool:
    """Whether an application has a reduction factor. XLA merges a duplicate equation
    but not the all-reduce of its partial result (collectives are never merged as
    common subexpressions): a softmax computed twice all-reduces its maximum twice, as
    one tuple all-reduce of the same operand."""
    return app.eqn is not None and any(f.kind is FactorKind.REDUCTION for f in app.rule.factors)


Move = tuple[int, tuple[DimSharding, ...], tuple[DimSharding, ...], frozenset[str]]


def app_moves(
    prop: Propagator, axis_sizes: Mapping[str, int], a: int
) -> tuple[list[Move], frozenset[str]]:
    """What application ``a`` of a finished propagation moves: ``(value, from, to,
    pending partial axes)`` for each operand brought to the layout the equation works in
    and each result taken from it (a partial sum when the equation reduces over sharded
    axes) to its own layout; and those partial axes. Moves may cost nothing (a slice).

    Example:
        >>> app_moves(prop, {"data": 2}, 5)  # doctest: +SKIP
        ([(17, (('data',), ()), ((), ()), frozenset())], frozenset())
    """
    dims = prop.state.dims
    graph = prop.graph
    results = graph.apps[a].results
    if a in graph.out_links and _slices(dims[graph.apps[a].operands[0]], dims[results[0]]):
        return [], frozenset()  # each device cuts its part of the nested result: no move
    wants: dict[int, list[DimSharding]] = {}
    working, axes = prop.working(a)
    axes = axes.kept(lambda x: axis_sizes[x] > 1)  # one device: summed already
    for vid, d, want in working:
        if want is not None and dims[vid][d] != want:
            wants.setdefault(vid, list(dims[vid]))[d] = want
    if axes and contracts(graph.apps[a]):
        gathered = _gathered_instead(graph, dims, wants, axes, axis_sizes, a)
        if gathered is not None:
            return gathered, frozenset()
    moves: list[Move] = [
        (vid, tuple(dims[vid]), tuple(work), frozenset())
        for vid, work in wants.items()
        if vid not in results
    ]
    for r in results:
        if axes or r in wants:
            moves.append((r, tuple(wants.get(r, dims[r])), tuple(dims[r]), axes))
    return moves, axes


def _gathered_instead(graph, dims, wants, axes, axis_sizes, a) -> list[Move] | None:
    """The moves XLA makes instead of a contraction's partial sum when one operand alone
    holds the contracted dim split (the other is whole there and would be sliced) and,
    gathered, it is no larger than the result: it all-gathers that operand and
    contracts whole, moving at most half the bytes of the result's all-reduce (measured:
    ``x[b, k/4] @ w[k, n]`` gathers x when k <= n and all-reduces the product when k >
    n). None where the partial sum stands: the result is scattered over the summed
    axes (a reduce-scatter), or both operands hold them."""
    app = graph.apps[a]
    (r,) = app.results if len(app.results) == 1 else (None,)
    if r is None or any(x in axes for d in dims[r] for x in d):
        return None
    holders = [v for v in app.operands if any(x in axes for d in dims[v] for x in d)]
    if len(holders) != 1 or holders[0] in wants:
        return None
    (x,) = holders
    for v, work in wants.items():
        if v != r and any(
            tuple(y for y in w if y not in axes) != tuple(d) for d, w in zip(dims[v], work)
        ):  # not only a slice over the summed axes
            return None
    whole = tuple(tuple(y for y in d if y not in axes) for d in dims[x])
    out = tuple(wants.get(r, dims[r]))
    if per_device_bytes(graph.shapes[x], graph.dtypes[x], whole, axis_sizes) > per_device_bytes(
        graph.shapes[r], graph.dtypes[r], out, axis_sizes
    ):
        return None
    moves: list[Move] = [(x, tuple(dims[x]), whole, frozenset())]
    if r in wants:
        moves.append((r, out, tuple(dims[r]), frozenset()))
    return moves


def _slices(outer: Sequence[DimSharding], inner: Sequence[DimSharding]) -> bool:
    """Whether a nested result in layout ``inner`` reaches the outer value's layout
    ``outer`` by a local slice (`slices_locally`), less a leading stacked dim.

    Example:
        >>> _slices([(), ("data",), ()], [(), ()]), _slices([("data",)], [("model",)])
        (True, False)
    """
    lead = len(outer) - len(inner)
    return lead in (0, 1) and slices_locally(outer[lead:], inner)


def make_plan(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    mesh: Mesh,
    hints: Mapping[str, PartitionSpec] | None = None,
    saved: SavedPlan | None = None,
    cost_model: CostModel | None = None,
) -> Plan:
    """Run every planning stage for ``fn(*args, **kwargs)`` on ``mesh``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> plan = make_plan(lambda x, w: x @ w, (jnp.ones((8, 4)), jnp.ones((4, 16))), {}, mesh,
        ...                  {"x": P("data"), "w": P(None, "model")})
        >>> plan.out_specs
        P('data', 'model')

    With ``saved`` (from `Plan.from_json`), nothing is propagated: every value takes
    its saved layout, after checking the mesh, shapes and dtypes match. ``cost_model``
    (`jaxshard.cost.CostModel`) prices conflicts in time over the mesh axes instead of
    bytes moved.
    """
    traced, graph = trace_graph(fn, args, kwargs, mesh)
    with gc_paused():
        if saved is not None:
            return _replan(traced, graph, mesh, saved)
        return plan_from_graph(traced, graph, mesh, hints, cost_model)


def trace_graph(fn: Callable, args: tuple, kwargs: dict, mesh: Mesh) -> tuple[Traced, Graph]:
    """Trace ``fn(*args, **kwargs)`` on ``mesh`` (`trace_on_mesh`: its Auto view, as the
    lowered program will replay it, or the Explicit mesh for code in explicit-sharding
    style) and build its graph: the first stages of every plan and search.

    Example:
        >>> traced, graph = trace_graph(lambda x: x * 2, (jnp.ones(4),), {}, mesh)  # doctest: +SKIP
    """
    traced = trace_on_mesh(fn, args, kwargs, mesh)
    with gc_paused():
        return traced, build_graph(traced, mesh_axis_sizes(mesh))


def hint_pins(
    traced: Traced, graph: Graph, hints: Mapping[str, PartitionSpec], axis_sizes: Mapping[str, int]
) -> dict[int, Pin]:
    """Per value id, what is pinned: the graph's own pins (`jaxshard.hint` and sharding
    constraints inside the function) merged with the ``hints`` matched on argument and
    result paths; two pins of one dim that disagree are an error naming both.

    Example:
        >>> pins = hint_pins(traced, graph, {"x": P("data")}, {"data": 2})  # doctest: +SKIP
    """
    names = list(traced.in_names) + list(traced.out_names)
    vids = list(graph.in_vids) + list(graph.out_vids)
    pins: dict[int, Pin] = dict(graph.pins)
    for i, pin in match_hints(hints, names, [graph.shapes[v] for v in vids], axis_sizes).items():
        vid = vids[i]
        pins[vid] = merge_pins(pins[vid], pin, names[i]) if vid in pins else pin
    _stack_on_stages(graph, pins)
    return pins


def _stack_on_stages(graph: Graph, pins: dict[int, Pin]) -> None:
    """A pipeline splits a stacked argument's layer dim over its stage axis: where a hint
    pins that argument's layer dim unsharded (``P(None, None, 'model')`` written for the
    unpipelined step), the stage axis goes there; a hint that puts another axis there
    is an error naming both. An argument no hint pins gets the stage axis on its layer
    dim and the rest open."""
    producer = {r: a for a, app in enumerate(graph.apps) for r in app.results}
    arguments = set(graph.in_vids)
    for vid, pin in list(pins.items()):
        if pin.kind is not PinKind.PIPELINE or not pin.dims or not pin.dims[0]:
            continue
        stacked = vid
        for _ in range(8):  # back through the reshape (and a flip or cast) to the argument
            a = producer.get(stacked)
            if stacked in arguments or a is None or len(graph.apps[a].operands) != 1:
                break
            stacked = graph.apps[a].operands[0]
        hinted = pins.get(stacked)
        if stacked in arguments and hinted is None:
            # pinned here too, so that no layout choice (the search's) puts another
            # axis on the layer dim the pipeline splits
            rest = (None,) * (len(graph.shapes[stacked]) - 1)
            pins[stacked] = Pin((pin.dims[0], *rest), pin.source, PinKind.PIPELINE)
            continue
        if stacked not in arguments or hinted is None or hinted.kind is not PinKind.HINTS:
            continue
        layer = hinted.dims[0]
        if layer == ():
            dims = (pin.dims[0], *hinted.dims[1:])
            source = f"{hinted.source}, its layer dim on {pin.source}"
            pins[stacked] = Pin(dims, source, hinted.kind)
        elif layer is not None and layer != pin.dims[0]:
            raise ShardingError(
                f"{graph.value_name(stacked)}: {hinted.source} puts {spec_entry(layer)!r} on "
                f"the layer dim, which the pipeline splits over {spec_entry(pin.dims[0])!r} "
                f"({pin.source}); leave that dim to the pipeline (None or P.UNCONSTRAINED) "
                "or drop pipeline="
            )


def plan_from_graph(
    traced: Traced,
    graph: Graph,
    mesh: Mesh,
    hints: Mapping[str, PartitionSpec] | None = None,
    cost_model: CostModel | None = None,
    storage: Mapping[int, bool] | None = None,
) -> Plan:
    """Propagate hints over an already built graph and decide what is left (no tracing):
    the planning half of `make_plan`, for callers that plan one graph several times.

    A hint that `split_storage` reads as a storage layout is also planned with its axes
    on the computation (expert parallelism puts the experts dim on the batch's axis on
    purpose); the plan that moves fewer bytes is kept. ``storage`` maps value ids whose
    choice the caller has priced itself to it (per dim, the mesh axes that are storage
    alone, the rest of the hint being the computation's layout; True: a storage layout
    as `split_storage` reads it; False: all on the computation); they are not tried
    (the search's hints name one leaf each: trying them would re-plan once per leaf).

    Example:
        >>> plan = plan_from_graph(traced, graph, mesh, {"x": P("data")})  # doctest: +SKIP
    """
    sizes = mesh_axis_sizes(mesh)
    pins = hint_pins(traced, graph, hints or {}, sizes)
    decided = storage or {}
    compute, storage = split_storage(pins, graph)
    for vid, apart in decided.items():
        pin = pins.get(vid)
        if pin is None:
            continue
        if apart is False:
            if vid in storage:
                compute[vid] = pin
                del storage[vid]
            continue
        if apart is True:  # stored apart, on the axes `split_storage` finds
            continue
        # the caller's own split: which axes the computation spends is not guessed from
        # the batch's (an axis the batch leaves free would otherwise split the compute)
        axes = ", ".join(repr(a) for d in apart for a in d)
        note = f" (storage: {axes} apart from the computation, gathered at its uses)"
        storage[vid] = Pin(pin.dims, pin.source + note, pin.kind, pin.parts, pin.hint)
        kept = tuple(_compute_part(d, set(a)) for d, a in zip(pin.dims, apart))
        compute.pop(vid, None)
        if any(d is not None for d in kept):
            compute[vid] = Pin(kept, pin.source, pin.kind, pin.parts, pin.hint)
    plan = decide(traced, graph, propagate_pins(graph, sizes, compute, storage, cost_model), mesh)
    groups: dict[str, list[int]] = {}  # storage pins by the hint that made them
    for vid in storage:
        if vid not in decided:
            groups.setdefault(pins[vid].hint or pins[vid].source, []).append(vid)
    for vids in groups.values():  # this hint's axes on the computation instead?
        trial_compute = {**compute, **{v: pins[v] for v in vids}}
        trial_storage = {v: p for v, p in storage.items() if v not in vids}
        prop = propagate_pins(graph, sizes, trial_compute, trial_storage, cost_model)
        trial = decide(traced, graph, prop, mesh)
        if trial.predicted_bytes < plan.predicted_bytes:
            plan, compute, storage = trial, trial_compute, trial_storage
    return plan


def propagate_hints(
    traced: Traced,
    graph: Graph,
    mesh: Mesh,
    hints: Mapping[str, PartitionSpec] | None = None,
    cost_model: CostModel | None = None,
) -> Propagator:
    """Pin the hints (`hint_pins`) and propagate them to a fixed point: the computation's
    layout first, then the storage layouts (`split_storage`).

    Example:
        >>> prop = propagate_hints(traced, graph, mesh, {"x": P("data")})  # doctest: +SKIP
    """
    sizes = mesh_axis_sizes(mesh)
    compute, storage = split_storage(hint_pins(traced, graph, hints or {}, sizes), graph)
    return propagate_pins(graph, sizes, compute, storage, cost_model)


def propagate_pins(
    graph: Graph,
    axis_sizes: Mapping[str, int],
    compute: Mapping[int, Pin],
    storage: Mapping[int, Pin],
    cost_model: CostModel | None = None,
) -> Propagator:
    """Propagation from the computation's pins to a fixed point, then from the storage
    pins at `STORAGE_RANK` into what is still open.

    Example:
        >>> prop = propagate_pins(graph, {"data": 2}, {0: pin}, {})  # doctest: +SKIP
    """
    prop = Propagator(graph, axis_sizes, cost_model)
    for vid, pin in compute.items():
        prop.pin(vid, pin)
    prop.run()  # the computation's layout first: it outranks every storage layout
    for vid, pin in storage.items():
        prop.pin(vid, pin, STORAGE_RANK)
    prop.run()
    if storage:
        store_updates(graph, prop, storage)
    return prop


def store_updates(graph: Graph, prop: Propagator, storage: Mapping[int, Pin]) -> None:
    """Lay out the update of stored state in its storage layout (ZeRO/FSDP: the
    optimizer update on shards, reading the gradient sliced), where propagation left it
    in a coarser compute layout.

    From the new value of each stored leaf, back through the elementwise equations that
    make it (the optimizer's update) to the gradient: every value that only the step's
    new state depends on (not the loss or any other result) and whose layout the storage
    layout refines (adds axes to replicated dims) takes the storage layout. So do the
    unpinned state leaves the update reads (the optimizer's moments: argument and new
    value) and a loop's stacked gradient (each iteration's slice is cut where it is
    stored). The first propagation run can leave such a chain replicated on the storage
    axis (a dim the activations' hints replicate reaches the gradient and the update):
    the plan then kept the moments whole on every device and gathered them for the
    results. A value a non-scalar result of the step depends on keeps its layout; a
    scalar result (a norm of the gradients or of the new parameters, as a training
    step's metrics) does not hold it.

    Example:
        >>> store_updates(graph, prop, storage)  # doctest: +SKIP
    """
    dims, origins = prop.state.dims, prop.state.origins
    producer: dict[int, int] = {}
    for a, app in enumerate(graph.apps):
        for v in app.results if app.kind is not AppKind.TIE else ():
            producer.setdefault(v, a)
    state_out = {graph.out_vids[o] for _, o in graph.ties}
    # values some other result depends on: the computation's, never touched. A scalar
    # result (the loss, a gradient's or the new parameters' norm) reads what it reduces
    # in any layout, for a scalar's all-reduce: it does not hold the update in its own.
    needed = {v for v in graph.out_vids if v not in state_out and graph.shapes[v]}
    for app in reversed(graph.apps):
        if any(r in needed for r in app.results):
            needed.update(app.operands)
    args = set(graph.in_vids)
    # a loop's stacked results (a scanned gradient): each iteration's slice is cut from
    # the body's value where it is stored, so the stack can take the storage layout
    stacked_results = {
        graph.apps[a].operands[0]
        for a in graph.out_links
        if len(graph.shapes[graph.apps[a].operands[0]])
        == len(graph.shapes[graph.apps[a].results[0]]) + 1
    }
    # the unpinned state leaves (optimizer moments): they follow the parameter whose
    # update reads them, argument and new value alike
    followers = {
        graph.out_vids[o]: graph.in_vids[i]
        for i, o in graph.ties
        if graph.in_vids[i] not in prop.hinted and graph.out_vids[o] not in prop.hinted
    }
    for i, o in graph.ties:
        pin = storage.get(graph.in_vids[i])
        new = graph.out_vids[o]
        if pin is None or new in args:
            continue
        work, seen = [(new, tuple(pin.dims))], set()
        while work:
            v, layout = work.pop()
            if v in seen or v in needed or v in args:
                continue
            if v in state_out and v != new and v not in followers:
                continue  # another pinned state leaf's new value keeps its own layout
            if not _refines(layout, dims[v]) or not _divides(
                layout, graph.shapes[v], prop.axis_sizes
            ):
                continue
            seen.add(v)
            arg = followers.get(v)
            if arg is not None and v != new:
                if arg in seen or arg in prop.hinted or not _refines(layout, dims[arg]):
                    continue
                seen.add(arg)
                _store(dims[arg], origins[arg], layout, f"{pin.source}, its optimizer state")
                prop.hinted.add(arg)
                prop.hinted.add(v)
            if v in stacked_results:
                _store(dims[v], origins[v], layout, f"{pin.source}, its update")
                continue
            a = producer.get(v)
            if a is None or xla_scope(graph.apps[a].where):
                continue  # made inside a loop or a branch: left as propagated
            app = graph.apps[a]
            if not all(f.plain for f in app.rule.factors):
                continue  # the gradient: sliced where the update reads it
            _store(dims[v], origins[v], layout, f"{pin.source}, its update")
            work.extend(zip(app.operands, _operand_layouts(app, v, layout)))


def _store(dims: list, origins: list, layout: Sequence[DimSharding], text: str) -> None:
    """Write a storage layout's set dims into one value's state."""
    for d, axes in enumerate(layout):
        if axes is not None and dims[d] != axes:
            dims[d] = axes
            origins[d] = Origin(OriginKind.HINT, text, rank=STORAGE_RANK)


def _operand_layouts(app, v: int, layout) -> list[tuple[DimSharding, ...]]:
    """The layout of each operand of an elementwise-like equation (every factor passes
    through: elementwise, transpose, broadcast) that puts result ``v`` in ``layout``:
    each operand dim takes the axes of the result dim its factor maps to, open where it
    maps to none or to several factors."""
    rule = app.rule
    by_factor = {}
    for d, fl in enumerate(rule.results[app.results.index(v)]):
        if len(fl) == 1:
            by_factor[fl[0]] = layout[d]
    return [
        tuple(by_factor.get(fl[0]) if len(fl) == 1 else None for fl in dims)
        for dims in rule.operands
    ]


def _divides(layout: Sequence[DimSharding], shape: Sequence[int], sizes: Mapping[str, int]) -> bool:
    """Whether each dim of ``shape`` splits evenly over its axes in ``layout``."""
    return all(
        axes is None or n % math.prod(sizes[a] for a in axes) == 0
        for axes, n in zip(layout, shape, strict=True)
    )


def _refines(layout: Sequence[DimSharding], dims: Sequence[DimSharding]) -> bool:
    """Whether ``layout`` only adds minor axes to each dim of ``dims`` (its shards are
    slices of theirs) and no axis another dim keeps; a dim ``layout`` leaves open keeps
    what it has.

    Example:
        >>> _refines([("data", "model"), None], [("data",), ()])
        True
        >>> _refines([("data",), None], [(), ("data",)])  # "data" on both dims
        False
    """
    merged = [have if want is None else want for want, have in zip(layout, dims, strict=True)]
    used = [a for axes in merged for a in axes or ()]
    return len(used) == len(set(used)) and all(
        want is None or tuple(want[: len(have or ())]) == tuple(have or ())
        for want, have in zip(layout, dims, strict=True)
    )


UNREACHED = "replicated: no hint or propagation reached it"


def decide(traced: Traced, graph: Graph, prop: Propagator, mesh: Mesh) -> Plan:
    """Settle what propagation left open and make the `Plan`: large state that no hint
    reached is split where that saves memory for few collective bytes
    (`split_for_memory`), the rest is replicated (arguments first, then everything else).

    Example:
        >>> plan = decide(traced, graph, propagate_hints(traced, graph, mesh), mesh)  # doctest: +SKIP
    """
    split_for_memory(graph, prop, has_reduce_scatter(mesh))
    settle_open(prop)
    return Plan(traced, graph, prop, mesh)


def settle_open(prop: Propagator) -> None:
    """Replicate what propagation left open (the arguments first, then everything else)
    and keep stacked slices in their stack's layout (`sink_stacked_gathers`).

    Example:
        >>> settle_open(prop)  # doctest: +SKIP
    """
    g = prop.graph
    prop.default(g.in_vids, UNREACHED)
    prop.default(range(len(g.shapes)), UNREACHED)
    sink_stacked_gathers(g, prop)


def sink_stacked_gathers(graph: Graph, prop: Propagator) -> None:
    """Gather a scanned stack one slice per iteration, not whole before the loop.

    Where a loop body needs a stacked input (layer weights under `lax.scan`) in a
    coarser layout than the stack's (FSDP: stored split, used whole), the slice the body
    reads keeps the stack's layout and is gathered at its uses inside the body, once per
    iteration. That moves the same bytes as gathering the whole stack at the loop, holds
    one gathered layer instead of all of them, and is what XLA does with the stack left
    in its stored layout (a dynamic slice, then the all-gather).

    Example:
        >>> sink_stacked_gathers(plan.graph, prop)  # doctest: +SKIP
    """
    dims, origins = prop.state.dims, prop.state.origins
    for a, app in enumerate(graph.apps):
        if app.kind is not AppKind.LINK or a in graph.out_links or len(app.results) != 1:
            continue  # only a loop's stacked inputs: an out-link carries a body's result
        stack, piece = app.operands[0], app.results[0]
        factors = app.rule.factors
        if (
            not factors
            or factors[0].kind is not FactorKind.NEED_REPLICATION
            or len(graph.shapes[stack]) != len(graph.shapes[piece]) + 1
        ):
            continue
        stored, used = dims[stack][1:], dims[piece]
        if tuple(stored) == tuple(used) or not slices_locally(stored, used):
            continue  # not a gather: the body's layout is not coarser than the stack's
        for d, axes in enumerate(stored):
            if axes != used[d]:
                dims[piece][d] = axes
                origins[piece][d] = Origin(
                    OriginKind.PROPAGATED, app=a, source=stack, source_dim=d + 1,
                    rank=origins[stack][d + 1].rank if origins[stack][d + 1] else DEFAULT_RANK,
                )  # fmt: skip


# A state leaf is worth pricing a split for when it holds at least this share of the
# arguments' per-device bytes; together, the splits kept may add at most this share to
# the plan's collective cost (bytes per device, or seconds under a cost model).
MEMORY_SHARE, COST_ALLOWANCE = 0.01, 0.02


class _Pricing:
    """The plan `decide` would make from a propagation (its open dims replicated by
    propagating defaults) and what it costs: per application the collective cost, and
    the memory estimate. `price` costs the same plan with some values laid out
    otherwise: only the applications around them are priced again, and ``moved`` says
    whether those applications gather more than before (the new layout is then a
    storage layout, gathered again for its use or its results). `keep` makes such a change
    part of the plan."""

    def __init__(
        self, prop: Propagator, live, runs: list[int], apps: list[int], reduce_scatter: bool
    ):
        g = prop.graph
        self.reduce_scatter = reduce_scatter
        final = prop.fork()
        settle_open(final)
        self.final, self.runs, self.apps = final, runs, set(apps)
        # per application (cost, gathered bytes), priced when first needed
        self.costs: dict[int, tuple[float, float]] = {}
        self._cost: float | None = None
        tied = dict((g.out_vids[o], g.in_vids[i]) for i, o in g.ties)
        sources = [tied.get(v, v) for v in g.out_vids]
        self.memory = MemoryCurve(g, final.state.dims, prop.axis_sizes, sources, live)
        # a new value returned in its argument's layout (`Plan._returned`), priced as a
        # move at the end of the step: result -> argument
        self.returned = {r: i for r, i in tied.items() if r not in prop.hinted and r != i}

    @property
    def cost(self) -> float:
        """The plan's collective cost (every application priced once, on first use)."""
        if self._cost is None:
            self._cost = sum(self._app(a)[0] for a in self.apps)
            self._cost += sum(self._app(("returned", r))[0] for r in self.returned)
        return self._cost

    def _app(self, a) -> tuple[float, float]:
        """The cost of application ``a``, or of returning value ``v`` for ``a = ("returned",
        v)``."""
        found = self.costs.get(a)
        if found is None:
            found = self.costs[a] = self._price_of(a)
        return found

    def _price_of(self, a) -> tuple[float, float]:
        if isinstance(a, tuple):
            return _return_cost(self.final, a[1], self.returned[a[1]], self.reduce_scatter)
        return _app_cost(self.final, a, self.runs[a], self.reduce_scatter)

    def price(self, changed: dict[int, list[DimSharding]]) -> tuple[float, int, bool, dict]:
        """``(extra collective cost, memory, moved, per-application costs)`` with the
        values in ``changed`` laid out as given there."""
        dims = self.final.state.dims
        touched: set = {a for v in changed for a in self.final.uses[v] if a in self.apps}
        touched |= {
            ("returned", r) for r, i in self.returned.items() if r in changed or i in changed
        }
        before = {a: self._app(a) for a in touched}
        old = {v: dims[v] for v in changed}
        costs = {}
        try:
            for v, new in changed.items():
                dims[v] = new
            for a in touched:
                costs[a] = self._price_of(a)
        finally:
            for v, d in old.items():
                dims[v] = d
        extra = sum(c[0] - before[a][0] for a, c in costs.items())
        moved = sum(c[1] - before[a][1] for a, c in costs.items()) > 0
        return extra, self.memory.total_with(changed), moved, costs

    def settled_changes(self, prop: Propagator) -> dict[int, list[DimSharding]]:
        """The values whose layout differs from this plan's once ``prop`` (this plan's
        propagation with a decision added) is settled as `decide` settles it."""
        final = prop.fork()
        settle_open(final)
        now, old = final.state.dims, self.final.state.dims
        return {v: now[v] for v in range(len(now)) if now[v] != old[v]}

    def keep(
        self, changed: dict[int, list[DimSharding]], costs: dict[int, tuple[float, float]]
    ) -> None:
        """Make a priced change part of the plan."""
        dims = self.final.state.dims
        for v, new in changed.items():
            dims[v] = new
        self.cost  # noqa: B018 - the total before the change, then moved by the delta
        self._cost += sum(c[0] - self._app(a)[0] for a, c in costs.items())
        self.costs.update(costs)
        self.memory.update(changed)


def _return_cost(prop: Propagator, r: int, arg: int, reduce_scatter: bool) -> tuple[float, float]:
    """What returning value ``r`` in argument ``arg``'s layout costs, once per call (as
    `_app_cost`)."""
    g, dims = prop.graph, prop.state.dims
    src = [() if d is None else d for d in dims[r]]
    dst = [() if d is None else d for d in dims[arg]]
    steps = reshard_collectives(g.shapes[r], g.dtypes[r], src, dst, prop.axis_sizes,
                                frozenset(), reduce_scatter)  # fmt: skip
    return _steps_cost(prop, steps, 1)


def _steps_cost(prop: Propagator, steps, runs: int) -> tuple[float, float]:
    """Collectives run ``runs`` times: their cost (bytes per device, or seconds under the
    propagator's cost model) and the bytes of it that gather or rearrange a layout."""
    total = gathered = 0.0
    for step in steps:
        if prop.cost_model is None:
            total += step.ring_bytes * runs
        else:
            total += prop.cost_model.collective_time(step.axes, step.ring_bytes) * runs
        if step.kind in ("all-gather", "all-to-all"):
            gathered += step.ring_bytes * runs
    return total, gathered


def _app_cost(prop: Propagator, a: int, runs: int, reduce_scatter: bool) -> tuple[float, float]:
    """The collective cost of application ``a`` run ``runs`` times per call (bytes per
    device, or seconds under the propagator's cost model), and the bytes of it that
    gather or rearrange a layout (all-gathers, all-to-alls) rather than sum partials."""
    if prop.settled(a):
        return 0.0, 0.0
    g, sizes = prop.graph, prop.axis_sizes
    steps = [step for _, step in prop.halos(a)]
    for vid, src, dst, partial in app_moves(prop, sizes, a)[0]:
        steps += reshard_collectives(
            g.shapes[vid], g.dtypes[vid], src, dst, sizes, partial, reduce_scatter
        )
    return _steps_cost(prop, steps, runs)


def split_for_memory(
    graph: Graph, prop: Propagator, reduce_scatter: bool = True
) -> list[tuple[int, Pin]]:
    """Split large state no hint pinned where that saves memory for few more bytes.

    After propagation a parameter (or optimizer state) that no hint pinned may have open
    dims, and `decide` would replicate them: every device then holds the whole of it, its
    optimizer state and its new value (an embedding table and the output head, the
    largest weights of a language model, under tensor-parallel hints on the blocks).
    For each such leaf holding at least `MEMORY_SHARE` of the arguments' memory,
    largest first, each way of splitting one open dim over one mesh axis it does not
    use yet is propagated and priced like the rest of the plan: the collectives it
    changes (`app_moves`, times their executions) and the memory estimate
    (`jaxshard.cost.memory_estimate`). The split that saves the most memory is kept
    when it saves some, all kept splits together add at most `COST_ALLOWANCE` of the
    plan's collective cost, the leaf is used in its split layout (a split its uses
    gather again is a storage layout, FSDP, whose gathered copies the memory estimate
    does not see: those come from hints or the search), and no leaf a hint pinned
    changes. A vocabulary-parallel head and embedding pass: splitting the head's
    vocabulary dim shards the logits and their softmax for a few all-reduces of
    per-token scalars, and a lookup in a split table is summed once per token instead
    of the table's gradient once per step. ``reduce_scatter``: whether the backend has
    one (`jaxshard.cost.has_reduce_scatter`). Returns the ``(value, pin)`` kept;
    their origin names the memory saved and the cost.

    Example:
        >>> split_for_memory(graph, prop)  # doctest: +SKIP
        [(3, Pin(dims=(('model',), None), source='split to save memory: ...'))]
    """
    sizes = prop.axis_sizes
    state = dict.fromkeys(graph.in_vids[i] for i, _ in graph.ties)
    dims = prop.state.dims
    open_state = [
        v
        for v in state
        if v not in prop.hinted and None in dims[v] and _split_options(graph, dims, v, sizes)
    ]
    if not open_state:
        return []

    # the arguments alone (open dims replicated) bound the plan's memory from below
    floor = MEMORY_SHARE * sum(
        per_device_bytes(graph.shapes[v], graph.dtypes[v], dims[v], sizes)
        for v in set(graph.in_vids)
    )
    big = sorted(
        (v for v in open_state if nbytes(graph.shapes[v], graph.dtypes[v]) >= floor),
        key=lambda v: -nbytes(graph.shapes[v], graph.dtypes[v]),
    )
    if not big:
        return []
    dead = dead_apps(graph)
    live, runs = liveness(graph, dead), executions(graph)
    seen: dict = {}
    apps = [a for a, app in enumerate(graph.apps) if a not in dead and not duplicate_app(app, seen)]
    base = _Pricing(prop, live, runs, apps, reduce_scatter)
    spent, memory = 0.0, base.memory.total
    hinted = set(prop.hinted)  # the user's leaves keep their layout, open dims included
    kept = []
    for vid in big:
        if None not in dims[vid]:
            continue  # a split kept before reached it
        options = []
        for d, axis in _split_options(graph, dims, vid, sizes):
            pin = Pin(tuple((axis,) if i == d else None for i in range(len(dims[vid]))), "")
            with prop.trying() as written:  # first priced as propagation leaves it
                prop.pin(vid, pin, DEFAULT_RANK)
                prop.run()
                changed = {
                    v: [() if x is None else x for x in dims[v]]
                    for v in dict.fromkeys(v for v, *_ in written)
                }
            if not hinted.isdisjoint(changed):
                continue  # it would change a leaf the user pinned
            extra, total, moved, _ = base.price(changed)
            if not moved and total < memory and spent + extra <= COST_ALLOWANCE * base.cost:
                options.append((total, d, axis, pin))
        best = None
        for _, _, _, pin in sorted(options):  # then as `decide` would settle it
            with prop.trying():
                prop.pin(vid, pin, DEFAULT_RANK)
                prop.run()
                changed = base.settled_changes(prop)
            if not hinted.isdisjoint(changed):
                continue
            extra, total, moved, costs = base.price(changed)
            if not moved and total < memory and spent + extra <= COST_ALLOWANCE * base.cost:
                best = (extra, total, pin, changed, costs)
                break
        if best is None:
            continue
        extra, total, pin, changed, costs = best
        shown = f"{extra:.0f} B" if prop.cost_model is None else f"{extra * 1e6:.2f} µs"
        pin = Pin(pin.dims, f"split to save memory: {human_bytes(memory - total)} less per "
                            f"device for {shown} more collectives per step")  # fmt: skip
        prop.pin(vid, pin, DEFAULT_RANK)
        prop.run()
        kept.append((vid, pin))
        spent += extra
        base.keep(changed, costs)
        memory = total
    return kept


def _split_options(graph: Graph, dims, vid: int, sizes: Mapping[str, int]) -> list[tuple[int, str]]:
    """``(dim, mesh axis)`` for each open dim of ``vid`` and each mesh axis of size > 1 it
    does not use yet that divides the dim."""
    used = {x for d in dims[vid] if d for x in d}
    shape = graph.shapes[vid]
    return [
        (d, x)
        for d, have in enumerate(dims[vid])
        if have is None
        for x, n in sizes.items()
        if n > 1 and x not in used and shape[d] % n == 0
    ]


def split_storage(
    pins: Mapping[int, Pin], graph: Graph, classes: bool = True
) -> tuple[dict[int, Pin], dict[int, Pin]]:
    """Split the pins into the computation's layout and storage layouts (FSDP/ZeRO).

    The state of a step (the arguments whose new value it returns: parameters,
    optimizer state) is where a layout can be a *storage* layout: a mesh axis that the
    pins on the other arguments (the batch) spend on the computation is, on a state
    leaf, only where that leaf lives between steps (with no such pin, the in-function
    hints count instead: the step lays its batch out inside), unless the computation
    spends it on that very dim: an axis that a pin on anything else puts on a dim one
    factor ties to the leaf's dim (`_dim_classes`) stays on the computation (MaxText's
    layout puts the MLP's hidden dim on "tensor" both in the activations and in the
    weight; only the weight's "fsdp" is storage). ``classes=False`` skips that test
    (for graphs whose apps are not rules, as in the example). Propagation runs the
    returned compute pins to a fixed point first; the storage pins follow at
    `STORAGE_RANK` into what is still open (the optimizer update, the gradient), and
    where they meet the computation's layout they lose: the parameter is gathered at its
    use and its gradient reduce-scattered back. Returns ``(compute, storage)``: a state
    leaf's compute pin keeps its dims' other axes, its storage pin is the whole pin.
    Whether a hint's axes are better spent on the computation after all (expert
    parallelism puts the experts dim on the batch's axis on purpose) is priced by
    `plan_from_graph`: it plans each storage hint both ways and keeps the plan that
    moves fewer bytes.

    Example (FSDP: ``w`` on the batch's axis; ``x`` is data, ``w`` is state):
        >>> from types import SimpleNamespace
        >>> g = SimpleNamespace(in_vids=[0, 1], out_vids=[2], ties=[(1, 0)])
        >>> pins = {0: Pin((("data",), None), "batch"), 1: Pin((("data",), ("model",)), "w")}
        >>> compute, storage = split_storage(pins, g, classes=False)
        >>> compute[1].dims, storage[1].dims
        ((None, ('model',)), (('data',), ('model',)))
    """
    state = {graph.in_vids[i] for i, _ in graph.ties} | {graph.out_vids[o] for _, o in graph.ties}
    # the pipeline's stage pins spend their axis on the layer stack the state leaves hold
    pipeline = (PinKind.PIPELINE, PinKind.MICROBATCHES)
    spent = {vid: pin for vid, pin in pins.items() if pin.kind not in pipeline}
    # the axes the batch spends: the pins on the other arguments, else (no such pin: the
    # step lays its data out inside) every other pin
    args = set(graph.in_vids)
    data = [pin for vid, pin in spent.items() if vid not in state and vid in args]
    if not data:
        data = [pin for vid, pin in spent.items() if vid not in state]
    used = {ax for pin in data for d in pin.dims for ax in d or ()}
    stored = [
        vid
        for vid, pin in pins.items()
        if vid in state and any(ax in used for d in pin.dims for ax in d or ())
    ]
    # per (value, dim) class of dims one factor ties together: the axes the pins on
    # everything else put there
    spent_on: dict[int, set[str]] | None = None
    root = None
    if stored and classes:
        parent, offset = _dim_classes(graph)

        def root(vid: int, d: int) -> int:
            return find_root(parent, offset[vid] + d)

        spent_on = {}
        for vid, pin in spent.items():
            if vid not in state:
                for d, axes in enumerate(pin.dims):
                    if axes:
                        spent_on.setdefault(root(vid, d), set()).update(axes)
    compute, storage = {}, {}
    for vid, pin in pins.items():
        if vid not in stored:
            compute[vid] = pin
            continue
        apart = [
            {
                ax
                for ax in d or ()
                if ax in used and (root is None or ax not in spent_on.get(root(vid, i), ()))
            }
            for i, d in enumerate(pin.dims)
        ]
        axes = sorted(set().union(*apart))
        if not axes:  # the computation spends these axes on these very dims
            compute[vid] = pin
            continue
        note = f" (storage: the computation spends {', '.join(map(repr, axes))} elsewhere)"
        storage[vid] = Pin(pin.dims, pin.source + note, pin.kind, pin.parts, pin.hint)
        kept = tuple(_compute_part(d, a) for d, a in zip(pin.dims, apart))
        if any(d is not None for d in kept):
            compute[vid] = Pin(kept, pin.source, pin.kind, pin.parts, pin.hint)
    return compute, storage


def _dim_classes(graph: Graph) -> tuple[list[int], list[int]]:
    """Union-find over every (value, dim): the dims each factor of each application ties
    together (a need-replication factor ties nothing: its dims are never split), as
    ``(parent, offset)``; dim ``d`` of value ``v`` is element ``offset[v] + d``.

    Example:
        >>> parent, offset = _dim_classes(graph)  # doctest: +SKIP
        >>> find_root(parent, offset[x] + 1) == find_root(parent, offset[w] + 0)  # doctest: +SKIP
        True
    """
    offset = [0]
    for shape in graph.shapes:
        offset.append(offset[-1] + len(shape))
    parent = list(range(offset[-1]))
    for app in graph.apps:
        rule = app.rule
        vids = (*app.operands, *app.results)
        first: dict[int, int] = {}
        for t, dims in enumerate((*rule.operands, *rule.results)):
            for d, fl in enumerate(dims):
                big = [f for f in fl if rule.factors[f].size > 1]  # the major factor
                if not big or rule.factors[big[0]].kind is FactorKind.NEED_REPLICATION:
                    continue
                k = find_root(parent, offset[vids[t]] + d)
                other = find_root(parent, first.setdefault(big[0], k))
                if other != k:
                    parent[k] = other
    return parent, offset


def _compute_part(dim: DimSharding, used: set[str]) -> DimSharding:
    """A pinned dim less the storage axes: open when only those pinned it.

    Example:
        >>> _compute_part(("data", "model"), {"data"}), _compute_part(("data",), {"data"})
        (('model',), None)
    """
    if dim is None or not used.intersection(dim):
        return dim
    rest = tuple(ax for ax in dim if ax not in used)
    return rest or None


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


def _replan(traced: Traced, graph: Graph, mesh: Mesh, saved: SavedPlan) -> Plan:
    diffs = saved.differences(record_of(traced, graph, mesh))
    if diffs:
        raise ShardingError(
            "the saved plan does not match this function, arguments or mesh:\n  "
            + "\n  ".join(diffs)
            + "\nPlan again (drop plan=...) or load the plan made for this program."
        )
    saved.check(graph)
    prop = Propagator(graph, mesh_axis_sizes(mesh))
    for vid, dims in enumerate(saved.record["dims"]):
        prop.pin(vid, Pin(dims_from_json(dims), "saved plan"))
    out_dims = [dims_from_json(d) for d in saved.record["out_dims"]]
    return Plan(traced, graph, prop, mesh, out_dims)


@contextlib.contextmanager
def gc_paused():
    """Planning allocates many small, long-lived objects; Python's cyclic collector would
    rescan them over and over (a third of planning time on a 12-layer GPT).

    Example:
        >>> import gc
        >>> with gc_paused():
        ...     gc.isenabled()
        False
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
