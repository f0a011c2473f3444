"""The `Plan` record: every value's layout, the reshards and pending sums a final pass
over the equations finds, their predicted collectives, bytes and memory, the in/out
specs as pytrees, and what a saved plan records of its program. The stages above it
(explaining, verifying) register their entry points here (`register_stage`), so the
record imports nothing above itself."""

from __future__ import annotations

import functools
import json
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxshard.cost import (
    Collective,
    executions,
    has_reduce_scatter,
    in_while_loop,
    moved_dtype,
    nbytes,
    per_device_bytes,
    reshard_collectives,
    reshard_steps,
    step_bytes,
    without_unit_axes,
    written_collectives,
    xla_scope,
)
from jaxshard.errors import JaxshardBug
from jaxshard.graph import Graph, contracts
from jaxshard.lattice import DimSharding, to_spec
from jaxshard.plan.apps import analyzed_apps, app_moves, made_runs, moved_array
from jaxshard.plan.memory import PlanMemory
from jaxshard.propagate import (
    Conflict,
    DimState,
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
    exchange keeps the layout: ``src == dst``, one collective-permute), each time the
    equation runs: ``runs`` times per call (the lengths of the scans around it). In a
    while loop (``in_while``) the trip count is not known when planning, and ``runs``
    counts the loop once."""

    app: int
    vid: int
    src: tuple[DimSharding, ...]
    dst: tuple[DimSharding, ...]
    partial: frozenset[str]
    steps: tuple[Collective, ...]
    where: str
    runs: int = 1
    in_while: bool = False

    @property
    def ring_bytes(self) -> float:
        """Bytes one device sends per run (ring volumes of its steps)."""
        return sum(s.ring_bytes for s in self.steps) + 0.0

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collectives as text: ``('all-gather over data',)``."""
        return tuple(s.over for s in self.steps)

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


class Plan(PlanMemory):
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
        # each dim's state (axes, origin, rank), and their axes alone for the many readers
        self.layouts: tuple[tuple[DimState, ...], ...] = tuple(map(tuple, prop.state.layouts))
        axes = operator.attrgetter("axes")
        self.dims: tuple[tuple[DimSharding, ...], ...] = tuple(
            [tuple(map(axes, row)) for row in self.layouts]
        )
        self.conflicts: list[Conflict] = list(prop.state.conflicts.values())
        self.visits = prop.state.visits
        self.search_result: Any = None  # set by search_hints before it returns the plan
        self.pipelined: tuple = ()  # the PipelinedLoops of auto_shard(pipeline=...)
        self.partial: dict[int, frozenset[str]] = {}
        self.reshards: list[Reshard] = []
        # (application, value) where a value is cut to a finer layout with no collective
        self.slices: list[tuple[int, int]] = []
        # of those, the results: (application, result) -> the layout it is computed in
        self.sliced_results: dict[tuple[int, int], tuple[DimSharding, ...]] = {}
        # (application, value, layout): an operand wanted where an earlier use moved it
        self.repeats: list[tuple[int, int, tuple[DimSharding, ...]]] = []
        # the same for a later use that does not contract the operand: moved again
        self.moved_again: list[tuple[int, int, tuple[DimSharding, ...]]] = []
        # (value, layout) -> the XLA computations (`xla_scope`) it was moved to it in
        self._moved: dict[tuple[int, tuple[DimSharding, ...]], set[tuple[int, ...]]] = {}
        self._runs, self._in_while = executions(graph), in_while_loop(graph)
        self._reduce_scatter = has_reduce_scatter(mesh)
        # the backend's element type on the wire (XLA's CPU widens bfloat16 to float32)
        self._on_wire = functools.partial(moved_dtype, mesh=mesh)
        self._analyze(prop)
        # the collectives the program writes itself (shard_map bodies), priced like reshards
        self.written: list[Collective] = written_collectives(
            graph, self.dims, self.axis_sizes, self._on_wire
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
        self.sliced_results = MappingProxyType(self.sliced_results)
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
                    self._move_operand(a, vid, src, dst)
                else:  # computed in the working layout (partial), then moved
                    if axes:
                        self.partial[vid] = axes
                    self._add_reshard(a, vid, src, dst, partial)
            for vid, step in prop.halos(a):
                layout = tuple(self.dims[vid])
                self.reshards.append(
                    Reshard(a, vid, layout, layout, frozenset(), (step,), g.apps[a].describe(),
                            self._runs[a], self._in_while[a])
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

    def _move_operand(
        self, a: int, vid: int, src: tuple[DimSharding, ...], dst: tuple[DimSharding, ...]
    ) -> None:
        """Operand ``vid`` of application ``a`` moves from ``src`` (its layout; for a loop
        carry's body input, the layout its body output hands it) to ``dst``. The lowered
        program constrains a copy of it at its first use in each XLA computation
        (`xla_scope`). A later contraction there (a weight the backward pass multiplies by again) is
        constrained alike: XLA's common-subexpression pass merges its collective into
        the first one's, whose result stays alive until then. ``repeats`` records those
        uses, at no bytes. Any other later use (an elementwise optimizer update) is left
        unconstrained and priced as moved again (``moved_again``): constrained, the
        update too would work on the gathered copy, which then lives to the step's end.

        A move in steps (`reshard_steps`: an axis gathered, then another moved) shares
        its steps the same way: XLA merges a step's collective with an earlier move of
        the value to that layout in the same computation, and a later move to it with
        the step's, so only the rest of the move is priced."""
        scope = xla_scope(self.graph.apps[a].where)
        to = without_unit_axes(dst, self.axis_sizes)
        scopes = self._moved.setdefault((vid, to), set())
        if scope in scopes:
            app = self.graph.apps[a]
            if contracts(app) or self._cuts_unevenly(a, vid, src) or self._joins_along(a, src, to):
                self.repeats.append((a, vid, dst))
                return
            self.moved_again.append((a, vid, dst))
        scopes.add(scope)
        start = src
        steps = reshard_steps(without_unit_axes(src, self.axis_sizes), to, self.axis_sizes)
        for step in steps[:-1]:
            done = self._moved.setdefault((vid, step), set())
            if scope in done:
                start = step  # moved there before in this computation: XLA merges it
            done.add(scope)
        self._add_reshard(a, vid, start, dst, frozenset())

    def _joins_along(
        self, a: int, src: tuple[DimSharding, ...], to: tuple[DimSharding, ...]
    ) -> bool:
        """Whether application ``a`` concatenates along a dim the move from ``src`` to
        ``to`` changes: left unconstrained, XLA's partitioner joins the pieces its own way
        (all-to-alls of the pieces, then the joined result gathered: ``jnp.pad`` in "edge"
        mode, whose edges are slices of the moved operand), not by moving the operand
        again, so such a use reads the moved copy too."""
        eqn = self.graph.apps[a].eqn
        if eqn is None or eqn.primitive.name != "concatenate":
            return False
        d = eqn.params["dimension"]
        moved = without_unit_axes(src, self.axis_sizes)
        return d < len(to) and moved[d] != to[d]

    def _cuts_unevenly(self, a: int, vid: int, src: tuple[DimSharding, ...]) -> bool:
        """Whether application ``a`` cuts operand ``vid`` (laid out ``src``) into a
        result whose dim its split does not divide (``x[:7]`` of eight rows split in
        two): left unconstrained, XLA's partitioner makes a program its own verifier
        rejects, so such a use reads the moved copy too."""
        g = self.graph
        shape = g.shapes[vid]
        for r in g.apps[a].results:
            out = g.shapes[r]
            if len(out) != len(shape):
                continue
            for d, axes in enumerate(src):
                n = math.prod(self.axis_sizes[x] for x in axes)
                if n > 1 and out[d] != shape[d] and out[d] % n:
                    return True
        return False

    def _add_reshard(self, a, vid, src, dst, partial, returned_as: int | None = None) -> None:
        """Value ``vid`` of application ``a`` moves from ``src`` to ``dst`` (``returned_as``:
        into result leaf ``returned_as``'s buffer, after the step); a move with no
        collective is a local slice (not recorded for a returned value), and a result's
        slice also keeps the layout it is computed in (`sliced_results`). A loop's slice
        of a stack moves as `moved_array` says: per iteration, or the whole stack once."""
        g = self.graph
        shape, moved, times = g.shapes[vid], (src, dst), 1
        runs = self._runs[a]
        if returned_as is None and not partial:
            shape, *moved, times = moved_array(g, self.dims, a, vid, src, dst)
            # a loop-invariant value moves once, before the loop
            runs = int(min(runs, made_runs(g).get(vid, 1)))
        steps = reshard_collectives(
            shape, self._on_wire(g.dtypes[vid]), *moved, self.axis_sizes, partial,
            self._reduce_scatter,
        )  # fmt: skip
        if 0 in g.shapes[vid]:  # an empty array (an odd-length scan's last half): XLA
            steps = []  # moves nothing
        if not steps:
            if returned_as is None:
                self.slices.append((a, vid))
                if vid in g.apps[a].results:
                    self.sliced_results[(a, vid)] = tuple(src)
        else:
            where = g.apps[a].describe()
            where += "" if returned_as is None else f", returned as out/{returned_as}"
            where += ", the loop carry's next iteration" if a in g.carry_links else ""
            self.reshards.append(
                Reshard(a, vid, src, dst, partial, tuple(steps), where,
                        runs * times, self._in_while[a])
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
        for d, s in enumerate(self.layouts[vid]):
            if not s.open and (s.axes or s.kind is OriginKind.HINT):
                texts.append(f"dim {d}: {self._describe_origin(vid, d)}")
        return "; ".join(texts) or "replicated: nothing sharded it"

    def _describe_origin(self, vid: int, d: int) -> str:
        origin = self.layouts[vid][d]
        if origin.kind is not OriginKind.PROPAGATED:
            return origin.text
        via = self.graph.apps[origin.app].describe()
        seen = set()
        args = set(self.graph.in_vids)
        while origin.kind is OriginKind.PROPAGATED and (vid, d) not in seen:
            seen.add((vid, d))
            vid, d = origin.source, origin.source_dim
            origin = self.layouts[vid][d]
            name = self.graph.names.get(vid)
            if name is not None and (vid in args or origin.kind is not OriginKind.PROPAGATED):
                hint = f" ({origin.text})" if origin.kind is OriginKind.HINT else ""
                return f"propagated from {name} dim {d}{hint} via {via}"
        if origin.kind is OriginKind.HINT:
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
