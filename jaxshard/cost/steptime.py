"""Time: a `CostModel` turns bytes into seconds per mesh axis; how often each
equation runs (`executions`: the trip counts of the scans around it); the collectives
a user wrote (`written_collectives`); matrix-multiply FLOPs; and a plan's modeled
step time (`step_time`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from jax.extend.core import Literal

from jaxshard.cost.collectives import Collective, reshard_collectives
from jaxshard.cost.sizes import CollectiveKind, nbytes, shards
from jaxshard.lattice import DimSharding


@dataclass(frozen=True)
class CostModel:
    """Seconds per collective from bytes per device: ``bytes / bandwidth + latency`` on
    each mesh axis, with defaults for axes not listed (100 GB/s and 5 µs: a fast
    intra-host link). A collective over several axes runs at the slowest one's bandwidth
    and pays every axis's latency (a hierarchical ring). With ``flops`` (per device per
    second) the search also counts compute: contractions and reductions, each the product
    of its factor sizes (twice that for a multiply-add) divided over the devices its
    sharded factors split it across; without it only communication counts, and
    replicating everything costs nothing.

    Example:
        >>> model = CostModel(bandwidth={"data": 10e9}, latency={"data": 20e-6})
        >>> round(model.collective_time(("model",), 1e6), 9)  # 1 MB over the fast axis
        1.5e-05
        >>> model.collective_time(("data",), 1e6)  # over the slow cross-host axis
        0.00012
        >>> round(model.time({"data": 1e6, "model": 1e6}), 7)  # one collective per axis
        0.000135
    """

    bandwidth: Mapping[str, float] = field(default_factory=dict)  # bytes/s per axis
    latency: Mapping[str, float] = field(default_factory=dict)  # seconds per collective
    default_bandwidth: float = 100e9
    default_latency: float = 5e-6
    flops: float | None = None  # FLOP/s per device; None: communication only

    def axis_bandwidth(self, axis: str) -> float:
        """Bytes per second one device moves over ``axis`` (a sub-axis, ``model:(1)2``,
        over its axis's links)."""
        return self.bandwidth.get(axis.split(":")[0], self.default_bandwidth)

    def axis_latency(self, axis: str) -> float:
        """Fixed seconds per collective over ``axis`` (a sub-axis: its axis's)."""
        return self.latency.get(axis.split(":")[0], self.default_latency)

    def collective_time(self, axes: Iterable[str], nbytes: float) -> float:
        """Seconds for one collective moving ``nbytes`` per device over ``axes``."""
        axes = tuple(axes)
        if not axes or nbytes <= 0:
            return 0.0
        bandwidth = min(self.axis_bandwidth(a) for a in axes)
        return nbytes / bandwidth + sum(self.axis_latency(a) for a in axes)

    def time(
        self, bytes_per_axis: Mapping[str, float], counts: Mapping[str, int] | None = None
    ) -> float:
        """Seconds for the collective bytes per device on each axis (``counts``: how many
        collectives carry them, one per axis with bytes by default).

        Example:
            >>> CostModel().time({"model": 2e6}, {"model": 4})
            4e-05
        """
        total = 0.0
        for axis, b in bytes_per_axis.items():
            n = (counts or {}).get(axis, 1 if b > 0 else 0)
            total += b / self.axis_bandwidth(axis) + n * self.axis_latency(axis)
        return total

    def reshard_time(
        self,
        shape: Sequence[int],
        dtype,
        src: Sequence[DimSharding],
        dst: Sequence[DimSharding],
        axis_sizes: Mapping[str, int],
        partial: frozenset[str] = frozenset(),
    ) -> float:
        """Seconds to turn layout ``src`` (pending ``partial`` sums) into ``dst``.

        Example:
            >>> import numpy as np
            >>> t = CostModel().reshard_time((1024, 256), np.float32, [(), ()], [(), ()],
            ...                              {"model": 4}, frozenset({"model"}))
            >>> round(t * 1e6, 2)  # µs: an all-reduce of 1 MiB over 4 devices
            20.73
        """
        steps = reshard_collectives(shape, dtype, src, dst, axis_sizes, partial)
        return sum(self.collective_time(s.axes, s.ring_bytes) for s in steps)


def executions(graph) -> list[int]:
    """How many times each application of ``graph`` runs per call: the product of the
    lengths of the scans around it (a while loop counts once: its trip count is not
    known when planning; `in_while_loop` says which). A scan's links to the outside run
    once.

    Example:
        >>> import jax, jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import AppKind, build_graph
        >>> f = lambda xs: jax.lax.scan(lambda c, x: (c + jnp.sin(x), None), jnp.zeros(()), xs)
        >>> g = build_graph(trace(f, (jnp.ones(12),), {}), {})
        >>> [(a.describe().split()[0], n) for a, n in zip(g.apps, executions(g)) if a.kind is AppKind.EQN]
        [('sin', 12), ('add', 12)]
    """
    return [runs for runs, _ in _loops(graph)]


def in_while_loop(graph) -> list[bool]:
    """For each application of ``graph``: whether a while loop encloses it, so that
    `executions` (which counts such a loop once) is a lower bound.

    Example:
        >>> import jax, jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import AppKind, build_graph
        >>> f = lambda x: jax.lax.while_loop(lambda c: c.sum() < 9, jnp.sin, x)
        >>> g = build_graph(trace(f, (jnp.ones(4),), {}), {})
        >>> sorted({(a.describe().split()[0], w) for a, w in zip(g.apps, in_while_loop(g))
        ...         if a.kind is AppKind.EQN})
        [('lt', True), ('reduce_sum', True), ('sin', True)]
    """
    return [unknown for _, unknown in _loops(graph)]


def _loops(graph) -> list[tuple[int, bool]]:
    """Per application: (product of the enclosing scans' lengths, inside a while loop)."""
    count = loop_counter()
    return [count(app.where) for app in graph.apps]


def loop_counter():
    """A function from an equation's enclosing equations (`App.where`) to (the product of
    the enclosing scans' lengths, whether a while loop encloses it), memoized per chain."""
    from jax.extend.core import primitives

    memo: dict[int, tuple[int, bool]] = {}

    def count(where) -> tuple[int, bool]:
        if where is None:
            return 1, False
        found = memo.get(id(where))
        if found is None:
            eqn, outer = where
            runs, unknown = count(outer)
            if eqn.primitive is primitives.scan_p:
                runs *= eqn.params["length"]
            found = memo[id(where)] = (runs, unknown or eqn.primitive is primitives.while_p)
        return found

    return count


# collectives a program writes itself (inside shard_map): primitive -> (kind, axes parameter)
_WRITTEN = {
    "ppermute": (CollectiveKind.PERMUTE, "axis_name"),
    "psum": (CollectiveKind.ALL_REDUCE, "axes"),
    "psum_invariant": (CollectiveKind.ALL_REDUCE, "axes"),
    "pmax": (CollectiveKind.ALL_REDUCE, "axes"),
    "pmin": (CollectiveKind.ALL_REDUCE, "axes"),
    "all_gather": (CollectiveKind.ALL_GATHER, "axis_name"),
    "all_gather_invariant": (CollectiveKind.ALL_GATHER, "axis_name"),
    "reduce_scatter": (CollectiveKind.REDUCE_SCATTER, "axis_name"),
    "all_to_all": (CollectiveKind.ALL_TO_ALL, "axis_name"),
}


def written_collectives(
    graph, dims, axis_sizes: Mapping[str, int], moved_as: Callable | None = None
) -> list[Collective]:
    """The collectives in the `shard_map` bodies of ``graph`` (top-level equations of each
    body), priced with the layouts ``dims`` gives the shard_map's operands: a body sees
    its operands whole along the axes it leaves automatic, so one device holds the body
    value's bytes over the shards of those axes. ``moved_as`` maps a value's element
    type to the one the backend moves it in (`jaxshard.cost.moved_dtype`).

    Example:
        >>> [str(c) for c in written_collectives(plan.graph, plan.dims, plan.axis_sizes)]  # doctest: +SKIP
        ['collective-permute over stage of 4096 B, 7 runs (written at pipeline.py:90)']
    """
    count = loop_counter()
    out = []
    for b in graph.boundaries:
        body = b.eqn.params.get("jaxpr")
        if body is None or not b.operands:
            continue
        body = getattr(body, "jaxpr", body)
        manual = set(b.eqn.params.get("newly_manual_axes") or axis_sizes)
        auto_shards = [
            shards([tuple(a for a in (d or ()) if a not in manual) for d in dims[v]], axis_sizes)
            for v in b.operands
        ]
        source = _body_sources(body)
        runs, in_while = count(b.where)
        for eqn in body.eqns:
            found = _WRITTEN.get(eqn.primitive.name)
            if found is None:
                continue
            kind, param = found
            axes = eqn.params.get(param, ())
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            var = (eqn.outvars if kind.sized_by_result else eqn.invars)[0]
            split = auto_shards[source[var]] if var in source else 1
            dtype = var.aval.dtype if moved_as is None else moved_as(var.aval.dtype)
            local = nbytes(var.aval.shape, dtype) // split
            group = math.prod(axis_sizes.get(a, 1) for a in axes)
            out.append(Collective(kind, frozenset(axes), local, group, runs, in_while, b.line))
    return out


def _body_sources(body) -> dict:
    """Per value of a `shard_map` body, the operand it is computed from (of several, the
    largest): its layout along the automatic axes is that operand's, a slice of the
    manual dim or an elementwise step away (operands a body closes over, index tables,
    come first and are small)."""
    source = {v: i for i, v in enumerate(body.invars)}
    for eqn in body.eqns:
        found = [v for v in eqn.invars if not isinstance(v, Literal) and v in source]
        if found:
            largest = max(found, key=lambda v: math.prod(v.aval.shape))
            for out in eqn.outvars:
                source[out] = source[largest]
    return source


def step_bytes(plan) -> float:
    """A plan's predicted collective bytes per device for one call: each reshard's bytes
    times the times its equation runs (``Reshard.runs``, from `executions`). This is
    ``plan.predicted_bytes``; reshards inside while loops count once per loop entry.

    Example:
        >>> step_bytes(plan)  # doctest: +SKIP
        5246976.0
    """
    reshards = sum(r.ring_bytes * r.runs for r in plan.reshards)
    return reshards + sum(c.ring_bytes * c.runs for c in plan.written)


_CONTRACTIONS = ("dot_general", "conv_general_dilated", "ragged_dot_general")


def compute_flops(plan) -> float:
    """Predicted FLOPs per device for one call of the planned program: each matrix
    multiply or convolution counts 2·(product of its factor sizes), split over the
    distinct mesh axes its operands and result hold, times the times it runs
    (`executions`). A pipeline's bubble is in it: its loop runs M+S−1 times.

    Example:
        >>> compute_flops(plan)  # doctest: +SKIP
        8.4e9
    """
    dims, sizes = plan.dims, plan.axis_sizes
    total = 0.0
    for app, work in _contractions(plan.graph):
        axes = {ax for v in (*app.operands, *app.results) for d in dims[v] for ax in d or ()}
        total += work / math.prod(sizes[ax] for ax in axes)
    return total


def program_flops(graph, in_scans: bool = False) -> float:
    """The FLOPs of one call of the whole unsharded program: its matrix multiplies and
    convolutions, each 2·(product of its factor sizes) times the times it runs; with
    ``in_scans`` only those inside a `jax.lax.scan`. Spread evenly over ``n`` devices,
    ``program_flops(g) / n`` is a floor under any plan's `compute_flops`.

    Example:
        >>> program_flops(plan.graph)  # doctest: +SKIP
        6.7e10
    """
    return sum(work for app, work in _contractions(graph) if not in_scans or _in_scan(app.where))


def _in_scan(where) -> bool:
    while where is not None:
        eqn, where = where
        if eqn.primitive.name == "scan":
            return True
    return False


def _contractions(graph) -> Iterator[tuple[Any, float]]:
    """Each contraction of ``graph`` with its FLOPs per call (all its runs)."""
    runs = executions(graph)
    for a, app in enumerate(graph.apps):
        if app.eqn is not None and app.eqn.primitive.name in _CONTRACTIONS:
            yield app, 2.0 * math.prod(f.size for f in app.rule.factors) * runs[a]


class StepTime(NamedTuple):
    """A plan's estimated seconds per call: compute, and communication per set of mesh
    axes its collectives run over."""

    compute: float
    communication: Mapping[tuple[str, ...], float]

    @property
    def total(self) -> float:
        """Compute plus communication, one after the other (no overlap assumed)."""
        return self.compute + sum(self.communication.values())

    @classmethod
    def of(cls, compute: float, moved: Iterable[tuple], model: CostModel) -> StepTime:
        """``compute`` seconds and the collectives ``moved`` as ``(axes, ring bytes,
        runs)``, each priced on its axes by ``model``, summed per set of axes.

        Example:
            >>> StepTime.of(0.5, [(("model",), 1e6, 2)], CostModel()).total
            0.50003
        """
        comm: dict[tuple[str, ...], float] = {}
        for axes, sent, runs in moved:
            key = tuple(sorted(axes))
            comm[key] = comm.get(key, 0.0) + model.collective_time(key, sent) * runs
        return cls(compute, comm)


def step_time(plan, model: CostModel) -> StepTime:
    """The estimated seconds of one call of ``plan`` under ``model``: its contractions'
    FLOPs per device (`compute_flops`) over ``model.flops`` (0 without them), and each
    predicted collective's time (bandwidth and latency of the axes it runs over) times
    the times it runs.

    Example:
        >>> step_time(plan, CostModel(flops=100e12)).total  # doctest: +SKIP
        0.0123
    """
    compute = compute_flops(plan) / model.flops if model.flops else 0.0
    moved = [(s.axes, s.ring_bytes, r.runs) for r in plan.reshards for s in r.steps]
    moved += [(c.axes, c.ring_bytes, c.runs) for c in plan.written]
    return StepTime.of(compute, moved, model)
