"""The cost model: bytes each device moves to turn one layout of a tensor into another,
what that costs in time, and how much memory a plan needs per device.

Ring volumes per device, with S the per-device size of the tensor after the collective:
local slice 0; all-gather (n-1)/n·S; all-to-all (n-1)/n·S; reduce-scatter (n-1)/n·S of
the input; all-reduce of a partial 2(n-1)/n·S. A `CostModel` turns bytes into seconds
per mesh axis (bandwidth and latency, e.g. a slow cross-host "data" axis). Memory of a
layout is the per-device share of the tensor's bytes; `memory_estimate` adds up a whole
plan: arguments, results, and the largest set of intermediates alive at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from jax.extend.core import Literal
from jax.sharding import AbstractMesh

from jaxshard.graph import AppKind, contracts, elementwise_reach, find_root
from jaxshard.lattice import DimSharding, slices_locally
from jaxshard.rule import FactorKind


def human_bytes(n: float, digits: int = 1) -> str:
    """Bytes with a binary unit (whole bytes below 1 KiB, ``digits`` decimals above).

    Example:
        >>> human_bytes(1536), human_bytes(12), human_bytes(3 * 2**30), human_bytes(2**16, 2)
        ('1.5 KiB', '12 B', '3.0 GiB', '64.00 KiB')
    """
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} GiB"


def itemsize(dtype) -> int:
    """Bytes per element; a typed PRNG key counts its key data (2 uint32 for threefry).

    Example:
        >>> import jax
        >>> itemsize(np.float32), itemsize(jax.random.key(0).dtype)
        (4, 8)
    """
    if dtype is None:
        return 0
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # an extended dtype (jax.random.key's): not a NumPy type
        return dtype.itemsize


def dtype_name(dtype) -> str:
    """``float32``, ``key<fry>``; "-" for a value with no dtype (a token)."""
    if dtype is None:
        return "-"
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def nbytes(shape: Sequence[int], dtype) -> int:
    """Global bytes of an array.

    Example:
        >>> nbytes((4, 8), np.float32)
        128
    """
    return math.prod(shape) * itemsize(dtype)


def shards(dims: Sequence[DimSharding], axis_sizes: Mapping[str, int]) -> int:
    """How many pieces a layout cuts a tensor into (open dims count as replicated).

    Example:
        >>> shards([("data",), ("model",)], {"data": 2, "model": 4})
        8
    """
    return math.prod(axis_sizes[a] for d in dims if d for a in d)


def per_device_bytes(shape, dtype, dims, axis_sizes) -> int:
    """Bytes one device holds of a tensor in this layout.

    Example:
        >>> per_device_bytes((8, 16), np.float32, [("data",), ()], {"data": 2})
        256
    """
    return nbytes(shape, dtype) // shards(dims, axis_sizes)


def per_device_shape(shape, dims, axis_sizes) -> tuple[int, ...]:
    """The shape of one device's piece of a tensor in this layout.

    Example:
        >>> per_device_shape((8, 16), [("data",), ()], {"data": 8})
        (1, 16)
    """
    return tuple(n // math.prod(axis_sizes[a] for a in d or ()) for n, d in zip(shape, dims))


def ring_bytes(kind: str, n: int, local: float) -> float:
    """Bytes one device sends for one collective over a group of ``n`` devices with ring
    algorithms: ``2(n-1)/n`` of the buffer for an all-reduce, ``(n-1)/n`` for the others.
    ``local`` is the per-device buffer: the all-reduced one, the all-gathered result, the
    reduce-scattered input, the all-to-all buffer; a collective-permute sends it whole.

    Example:
        >>> ring_bytes("all-reduce", 4, 1024), ring_bytes("all-gather", 4, 1024)
        (1536.0, 768.0)
    """
    if kind == "collective-permute":
        return float(local)
    share = (n - 1) / n * local
    return 2 * share if kind == "all-reduce" else share


class PartialSum(frozenset):
    """The mesh axes over which a value holds pending partial sums, grouped by the
    reduction factor that left them: XLA sums each group in an all-reduce of its own (a
    weight gradient contracting a batch split over "data" and positions split over
    "model" is two all-reduces, one per axis, not one over both). A frozenset of the
    axes everywhere else.

    Example:
        >>> s = PartialSum([("data",), ("model",)])
        >>> sorted(s), s.groups, "data" in s
        (['data', 'model'], (('data',), ('model',)), True)
        >>> s.kept(lambda axis: axis != "data").groups
        (('model',),)
    """

    groups: tuple[tuple[str, ...], ...]

    def __new__(cls, groups=()):
        groups = tuple(tuple(g) for g in groups if g)
        self = super().__new__(cls, (a for g in groups for a in g))
        self.groups = groups
        return self

    def __reduce__(self):
        return PartialSum, (self.groups,)

    def kept(self, keep) -> PartialSum:
        """The axes ``keep(axis)`` accepts, in their groups."""
        return PartialSum(tuple(a for a in g if keep(a)) for g in self.groups)


def pending_sums(rule, values) -> PartialSum:
    """The partial sums an equation leaves when its factors are split as ``values``
    (factor -> mesh axes): one group per reduction factor, except that the windowed
    reduction factors (a kernel gradient summed over the rows and the columns of an
    image split both ways) are summed together, in one all-reduce over all their axes,
    as XLA emits it.

    Example:
        >>> from jaxshard.rule import Factor, FactorKind, Rule, Window
        >>> r, w = FactorKind.REDUCTION, Window(8, 8)
        >>> rule = Rule((Factor("a", 8, r), Factor("b", 8, r, window=w),
        ...              Factor("c", 8, r, window=w)), (), ())
        >>> pending_sums(rule, {0: ("d",), 1: ("x",), 2: ("y",)}).groups
        (('d',), ('x', 'y'))
    """
    factors = rule.factors
    groups, windowed = [], []
    for f, axes in sorted(values.items()):
        if factors[f].kind is FactorKind.REDUCTION:
            (windowed if factors[f].window is not None else groups).append(axes)
    return PartialSum([*groups, tuple(a for axes in windowed for a in axes)])


def partial_groups(partial: frozenset[str]) -> tuple[tuple[str, ...], ...]:
    """The all-reduce groups of pending ``partial`` sums: a `PartialSum`'s own, else one
    group of every axis.

    Example:
        >>> partial_groups(frozenset({"data", "model"}))
        (('data', 'model'),)
    """
    groups = getattr(partial, "groups", None)
    if groups is not None:
        return groups
    return (tuple(sorted(partial)),) if partial else ()


class PlannedCollective(NamedTuple):
    """One collective a reshard calls for: its kind, the mesh axes it runs over, and the
    bytes one device sends (ring volumes). Prints as the plan's explanation shows it.

    Example:
        >>> print(PlannedCollective("all-gather", ("data", "model"), 768.0))
        all-gather over data,model
    """

    kind: str
    axes: tuple[str, ...]
    ring_bytes: float  # what one device sends (ring volume), not a buffer's size

    def __str__(self) -> str:
        return f"{self.kind} over {','.join(self.axes)}"


def unhaloed(rule, values, axis_sizes) -> set[int]:
    """The windowed factors of ``rule`` split in ``values`` (factor -> mesh axes) whose
    shards would need more than their neighbours' rows (`jaxshard.rule.Window.permutes`
    is None): the equation works them whole.

    Example:
        >>> from jaxshard.rule import Factor, Rule, Window
        >>> rule = Rule((Factor("r", 62, window=Window(64, 62, 3)),), (), ())
        >>> unhaloed(rule, {0: ("x",)}, {"x": 2}), unhaloed(rule, {0: ("x",)}, {"x": 8})
        (set(), {0})
    """
    return {
        f
        for f, axes in values.items()
        if axes
        and rule.factors[f].window is not None
        and rule.factors[f].window.permutes(math.prod(axis_sizes[a] for a in axes)) is None
    }


def halo_collectives(
    rule, values, graph, vids, layouts, axis_sizes
) -> list[tuple[int, PlannedCollective]]:
    """The collective-permutes of an equation's halo exchanges (Shardy's permutation
    factors, GSPMD's windowed ops): for each windowed factor of ``rule`` split over mesh
    axes in ``values`` (factor -> axes), one per direction whose neighbour rows the
    shards need (`jaxshard.rule.Window.permutes`), each sending those rows of the read
    operand's cross-section in its working layout (``layouts``: value -> dims). Returns
    ``(value, collective)`` pairs; ``vids`` are the equation's operands then results.

    Example:
        >>> # a 3x3 'SAME' convolution of x[1, 64, 64, 4] with its rows split 8 ways: one
        >>> # row of 64 x 4 floats from each neighbour, 1 KiB each way
        >>> halo_collectives(rule, {1: ("x",)}, graph, vids, layouts, {"x": 8})  # doctest: +SKIP
        [(0, PlannedCollective(kind='collective-permute', axes=('x',), ring_bytes=1024.0)), ...]
    """
    out = []
    grown: dict[int, list[int]] = {}  # per operand: its shard with the halos fetched so far
    split = []
    for f, factor in enumerate(rule.factors):
        axes = tuple(a for a in values.get(f) or () if axis_sizes[a] > 1)
        if factor.window is not None and axes:
            t = factor.window.operand
            dim = next(d for d, fl in enumerate(rule.operands[t]) if f in fl)
            split.append((t, dim, factor.window, axes))
    # XLA exchanges one dim's halos after another's, in dim order, each with the halo
    # rows the earlier ones fetched: the corners travel with the later exchange
    for t, dim, window, axes in sorted(split, key=lambda s: s[:2]):
        rows = window.permutes(math.prod(axis_sizes[a] for a in axes))
        if not rows:
            continue
        vid = vids[t]
        local = grown.setdefault(
            vid, list(per_device_shape(graph.shapes[vid], layouts[vid], axis_sizes))
        )
        section = math.prod(n for d, n in enumerate(local) if d != dim)
        section *= itemsize(graph.dtypes[vid])
        out += [(vid, PlannedCollective("collective-permute", axes, float(r * section)))
                for r in rows]  # fmt: skip
        if not window.reverse:
            local[dim] += sum(rows)
    return out


def reshard_cost(
    shape: Sequence[int],
    dtype,
    src: Sequence[DimSharding],
    dst: Sequence[DimSharding],
    axis_sizes: Mapping[str, int],
    partial: frozenset[str] = frozenset(),
) -> tuple[float, list[str]]:
    """Per-device bytes and the collectives that turn layout ``src`` into ``dst``.

    Example:
        >>> sizes = {"data": 2, "model": 4}
        >>> reshard_cost((8, 16), np.float32, [("data",), ()], [(), ()], sizes)
        (256.0, ['all-gather over data'])
        >>> reshard_cost((8, 16), np.float32, [(), ()], [("data",), ()], sizes)
        (0.0, [])
        >>> reshard_cost((8, 16), np.float32, [(), ()], [(), ()], sizes, frozenset({"model"}))
        (768.0, ['all-reduce over model'])
        >>> reshard_cost((8, 16), np.float32, [(), ("model",)], [(), ("model",)], sizes,
        ...              frozenset({"model"}))  # each device sends 3 of its 4 quarters
        (384.0, ['reduce-scatter over model'])
    """
    steps = reshard_collectives(shape, dtype, src, dst, axis_sizes, partial)
    return sum(s.ring_bytes for s in steps) + 0.0, [str(s) for s in steps]


def reshard_collectives(
    shape: Sequence[int],
    dtype,
    src: Sequence[DimSharding],
    dst: Sequence[DimSharding],
    axis_sizes: Mapping[str, int],
    partial: frozenset[str] = frozenset(),
    reduce_scatter: bool = True,
) -> list[PlannedCollective]:
    """The collectives of `reshard_cost` one by one: ``(kind, mesh axes, bytes per device)``,
    so a `CostModel` can price each on its own axes. Without ``reduce_scatter`` (a backend
    that has none, see `has_reduce_scatter`) a reduce-scatter moves what an all-reduce of
    its input moves: the backend sums the whole input and each device keeps its slice.

    Example:
        >>> sizes = {"data": 2, "model": 4}
        >>> reshard_collectives((8, 16), np.float32, [("data",), ()], [(), ()], sizes,
        ...                     frozenset({"model"}))
        [PlannedCollective(kind='all-reduce', axes=('model',), ring_bytes=384.0),
         PlannedCollective(kind='all-gather', axes=('data',), ring_bytes=256.0)]
    """
    # an axis of size 1 moves nothing: XLA emits no collective over it
    src = [tuple(a for a in d or () if axis_sizes[a] > 1) for d in src]
    dst = [tuple(a for a in d or () if axis_sizes[a] > 1) for d in dst]
    steps = [tuple(dst)] if partial else reshard_steps(src, dst)
    if len(steps) > 1:  # the lowering passes through each (`reshard_steps`)
        return [
            c for a, b in zip([tuple(src), *steps], steps)
            for c in _step_collectives(shape, dtype, a, b, axis_sizes, partial, reduce_scatter)
        ]  # fmt: skip
    return _step_collectives(shape, dtype, src, dst, axis_sizes, partial, reduce_scatter)


def _step_collectives(shape, dtype, src, dst, axis_sizes, partial, reduce_scatter):
    """`reshard_collectives` of one step (axes of size 1 already dropped)."""
    groups = partial_groups(partial)
    partial = frozenset(a for a in partial if axis_sizes[a] > 1)
    total = nbytes(shape, dtype)
    where_src = {a: i for i, d in enumerate(src) for a in d}
    where_dst = {a: i for i, d in enumerate(dst) for a in d}
    local_dst = total / shards(dst, axis_sizes)
    local_src = total / shards(src, axis_sizes)
    out: list[PlannedCollective] = []
    scattered = sorted(a for a in partial if a in where_dst)
    reduced = sorted(a for a in partial if a not in where_dst)
    for group in groups:  # one all-reduce per reduction factor's axes, as XLA emits them
        axes = tuple(sorted(a for a in group if a in reduced))
        if axes:
            n = math.prod(axis_sizes[a] for a in axes)
            out.append(
                PlannedCollective("all-reduce", axes, ring_bytes("all-reduce", n, local_src))
            )
    if scattered:  # the input is whole along the scattered axes, whatever ``src`` says
        n = math.prod(axis_sizes[a] for a in scattered)
        whole = [tuple(a for a in d if a not in scattered) for d in src]
        kind = "reduce-scatter" if reduce_scatter else "all-reduce"
        volume = ring_bytes(kind, n, total / shards(whole, axis_sizes))
        out.append(PlannedCollective("reduce-scatter", tuple(scattered), volume))
    moved = sorted(
        a
        for a, i in where_src.items()
        if a in where_dst and (where_dst[a] != i or _order_changed(src[i], dst[where_dst[a]], a))
    )
    if moved:
        n = math.prod(axis_sizes[a] for a in moved)
        out.append(
            PlannedCollective("all-to-all", tuple(moved), ring_bytes("all-to-all", n, local_dst))
        )
    removed = sorted(a for a in where_src if a not in where_dst)
    if removed:
        n = math.prod(axis_sizes[a] for a in removed)
        out.append(
            PlannedCollective("all-gather", tuple(removed), ring_bytes("all-gather", n, local_dst))
        )
    return out


def reshard_steps(src: Sequence[DimSharding], dst: Sequence[DimSharding]) -> list[tuple]:
    """The layouts a reshard from ``src`` to ``dst`` passes through, ending with ``dst``.

    One step, unless XLA's partitioner has no collective for the whole move and would
    replicate the array on every device first ("involuntary full rematerialization",
    measured on JAX 0.10 and 0.12): a dim that gives one axis to another dim and loses
    another axis altogether or to a third dim, or a dim that takes axes from two
    others. Such a reshard goes through steps XLA does with one collective each: the
    gathered axes first, then the moved axes one at a time, then the added ones.

    Example:
        >>> reshard_steps([(), ("data", "model")], [("data",), ()])
        [((), ('data',)), (('data',), ())]
        >>> reshard_steps([(), ("data",)], [("data",), ()])
        [(('data',), ())]
    """
    src = [tuple(d or ()) for d in src]
    dst = [tuple(d or ()) for d in dst]
    where_dst = {a: j for j, d in enumerate(dst) for a in d}
    removed = {a for d in src for a in d if a not in where_dst}
    out_of: dict[int, set[int]] = {}  # per source dim: the dims its moved axes go to
    into: dict[int, set[int]] = {}  # per destination dim: the dims its moved axes leave
    for i, d in enumerate(src):
        for a in d:
            j = where_dst.get(a, i)
            if j != i:
                out_of.setdefault(i, set()).add(j)
                into.setdefault(j, set()).add(i)
    awkward = any(
        len(js) > 1 or any(a in removed for a in src[i]) for i, js in out_of.items()
    ) or any(len(i) > 1 for i in into.values())
    if not awkward:
        return [tuple(dst)]
    cur = [tuple(a for a in d if a not in removed) for d in src]
    steps = [tuple(cur)]
    for j, d in enumerate(dst):
        for a in d:
            i = next((k for k, held in enumerate(cur) if a in held), None)
            if i is None or i == j:
                continue
            cur = [tuple(x for x in held if x != a) for held in cur]
            cur[j] = tuple(x for x in dst[j] if x == a or x in cur[j]) + tuple(
                x for x in cur[j] if x not in dst[j]
            )
            steps.append(tuple(cur))
    steps.append(tuple(dst))
    return [b for a, b in zip([tuple(src), *steps], steps) if a != b]


def has_reduce_scatter(mesh) -> bool:
    """Whether the devices of ``mesh`` run reduce-scatters as such. XLA's CPU backend does
    not: its partitioner leaves an all-reduce of the whole input (measured on every
    compiled program of the benchmarks), so a reduce-scatter there costs an all-reduce.
    A mesh without devices (abstract) is taken to be an accelerator's.

    Example:
        >>> import jax
        >>> has_reduce_scatter(jax.make_mesh((1,), ("data",)))  # on a CPU
        False
    """
    return _platform(mesh) != "cpu"


def combines_all_reduces(mesh) -> bool:
    """Whether XLA combines every independent all-reduce over the same devices in a
    computation into one, whatever their size, on the devices of ``mesh``: its CPU
    backend does (no byte threshold, at most 256 operands), so a partial sum waits for
    the last reduction of its group; accelerators combine only small ones.

    Example:
        >>> import jax
        >>> combines_all_reduces(jax.make_mesh((1,), ("data",)))  # on a CPU
        True
    """
    return _platform(mesh) == "cpu"


def _platform(mesh) -> str | None:
    """The platform of ``mesh``'s devices; None for an abstract mesh (planned for an
    accelerator)."""
    if isinstance(mesh, AbstractMesh):
        return None
    devices = getattr(mesh, "devices", None)
    return getattr(getattr(devices, "flat", [None])[0], "platform", None)


def _order_changed(src_axes: tuple[str, ...], dst_axes: tuple[str, ...], axis: str) -> bool:
    before_src = src_axes[: src_axes.index(axis)]
    before_dst = dst_axes[: dst_axes.index(axis)]
    return before_src != before_dst


# --- time ----------------------------------------------------------------------------


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
        """Bytes per second one device moves over ``axis``."""
        return self.bandwidth.get(axis, self.default_bandwidth)

    def axis_latency(self, axis: str) -> float:
        """Fixed seconds per collective over ``axis``."""
        return self.latency.get(axis, self.default_latency)

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
            >>> t = CostModel().reshard_time((1024, 256), np.float32, [(), ()], [(), ()],
            ...                              {"model": 4}, frozenset({"model"}))
            >>> round(t * 1e6, 2)  # µs: an all-reduce of 1 MiB over 4 devices
            20.73
        """
        steps = reshard_collectives(shape, dtype, src, dst, axis_sizes, partial)
        return sum(self.collective_time(s.axes, s.ring_bytes) for s in steps)


# --- executions ----------------------------------------------------------------------


def executions(graph) -> list[int]:
    """How many times each application of ``graph`` runs per call: the product of the
    lengths of the scans around it (a while loop counts once: its trip count is not
    known when planning; `in_while_loop` says which). A scan's links to the outside run
    once.

    Example:
        >>> import jax, jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
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
        >>> from jaxshard.graph import build_graph
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
    "ppermute": ("collective-permute", "axis_name"),
    "psum": ("all-reduce", "axes"),
    "psum_invariant": ("all-reduce", "axes"),
    "pmax": ("all-reduce", "axes"),
    "pmin": ("all-reduce", "axes"),
    "all_gather": ("all-gather", "axis_name"),
    "all_gather_invariant": ("all-gather", "axis_name"),
    "reduce_scatter": ("reduce-scatter", "axis_name"),
    "all_to_all": ("all-to-all", "axis_name"),
}


@dataclass(frozen=True)
class WrittenCollective:
    """A collective the program writes itself (in a `shard_map` body): its kind, mesh
    axes, per-device bytes of its operand (of its result for a gather or scatter), group
    size, runs per call (as `executions` counts) and source line.

    Example:
        >>> c = WrittenCollective("collective-permute", ("stage",), 4096, 2, 7, False, "m.py:3")
        >>> c.ring_bytes, str(c)
        (4096.0, 'collective-permute over stage (written at m.py:3)')
    """

    kind: str
    axes: tuple[str, ...]
    local: int
    group: int
    runs: int
    in_while: bool
    line: str

    @property
    def ring_bytes(self) -> float:
        """Bytes one device sends each time it runs (ring volumes, as `ring_bytes`)."""
        return ring_bytes(self.kind, self.group, self.local)

    def __str__(self) -> str:
        return f"{self.kind} over {','.join(self.axes)} (written at {self.line})"


def written_collectives(graph, dims, axis_sizes: Mapping[str, int]) -> list[WrittenCollective]:
    """The collectives in the `shard_map` bodies of ``graph`` (top-level equations of each
    body), priced with the layouts ``dims`` gives the shard_map's operands: a body sees
    its operands whole along the axes it leaves automatic, so one device holds the body
    value's bytes over the shards of those axes.

    Example:
        >>> [str(c) for c in written_collectives(plan.graph, plan.dims, plan.axis_sizes)]  # doctest: +SKIP
        ['collective-permute over stage (written at pipeline.py:90)']
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
            var = (eqn.outvars if kind in ("all-gather", "reduce-scatter") else eqn.invars)[0]
            split = auto_shards[source[var]] if var in source else 1
            local = nbytes(var.aval.shape, var.aval.dtype) // split
            group = math.prod(axis_sizes.get(a, 1) for a in axes)
            out.append(WrittenCollective(kind, axes, local, group, runs, in_while, b.line))
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


# --- memory --------------------------------------------------------------------------


class Schedule(NamedTuple):
    """When XLA runs each application: ``at[a]`` is a time in application units.

    XLA's scheduler keeps the program's loops in order but moves the work between them
    as early as its operands allow: anything outside the loops that does not read a
    loop's result runs before that loop (a parameter's gather for the logits, the zeros
    of the embedding gradient's scatter-add, the one-hot of the labels), so its buffer
    is alive across the loop. ``seg[v]`` is how many of the top-level loops value ``v``
    waits for; ``loop_starts[k]`` the first application of the ``k``-th top-level loop;
    ``top[a]`` whether application ``a`` is outside every loop.
    """

    at: np.ndarray
    seg: np.ndarray
    loop_starts: tuple[int, ...]
    top: np.ndarray

    def hoisted(self, a: int, v: int) -> int:
        """The time XLA computes what application ``a`` needs from value ``v`` alone (a
        parameter's gathered copy): before the first loop ``v`` does not wait for, when
        ``a`` runs after it outside the loops.

        Example:
            >>> s = Schedule(np.arange(9), np.zeros(3, int), (4,), np.ones(9, bool))
            >>> s.hoisted(7, 0), s.hoisted(2, 0)
            (3, 2)
        """
        k = int(self.seg[v])
        if self.top[a] and k < len(self.loop_starts) and self.loop_starts[k] <= a:
            return min(int(self.at[a]), max(0, self.loop_starts[k] - 1))
        return int(self.at[a])


def schedule(graph, ready: Mapping[int, int] | None = None) -> Schedule:
    """Each application's time in XLA's schedule of ``graph``: program order, except
    that work outside the loops that reads no result of a loop before it moves to just
    before the first such loop (`Schedule`). Measured on XLA's CPU schedules of scanned
    models: every top-level instruction not reading a loop's result is scheduled before
    that loop. ``ready`` maps values to the earliest time their readers may run (a
    gradient whose all-reduce XLA combines with a later one's).

    Example:
        >>> import jax, jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> def f(w, xs):
        ...     c, _ = jax.lax.scan(lambda c, x: (c * x, None), jnp.sin(w), xs)
        ...     return c + jnp.cos(w)   # cos(w) reads no loop result: before the scan
        >>> g = build_graph(trace(f, (jnp.ones(4), jnp.ones((3, 4))), {}), {})
        >>> s = schedule(g)
        >>> [(a.describe().split()[0], int(t)) for a, t in zip(g.apps, s.at) if a.kind is AppKind.EQN]
        [('sin', 0), ('mul', 1), ('cos', 0), ('add', 5)]
    """
    from jax.extend.core import primitives

    loop_prims = (primitives.scan_p, primitives.while_p)
    memo: dict[int, int | None] = {}

    def outer_loop(where) -> int | None:
        if where is None:
            return None
        found = memo.get(id(where), -1)
        if found == -1:
            eqn, outer = where
            found = outer_loop(outer)
            if found is None and eqn.primitive in loop_prims:
                found = id(eqn)
            memo[id(where)] = found
        return found

    n_apps = len(graph.apps)
    loop_of: list[int | None] = []
    for app in graph.apps:
        key = outer_loop(app.where)
        if key is None and app.kind is AppKind.LINK and app.eqn is not None:
            key = id(app.eqn) if app.eqn.primitive in loop_prims else None
        loop_of.append(key)
    first: dict[int, int] = {}
    for a, key in enumerate(loop_of):
        if key is not None:
            first.setdefault(key, a)
    order = {key: k for k, key in enumerate(first)}  # loops in program order
    loop_starts = tuple(first.values())
    top = np.array([key is None for key in loop_of], dtype=bool)
    edges = flow(graph)
    seg = np.zeros(len(graph.shapes), dtype=np.int64)
    for v, t in (ready or {}).items():  # as late as the loops that end before it
        seg[v] = np.searchsorted(np.array(loop_starts), t, side="right")
    changed = True
    while changed:  # a call's links come after its body: repeat until nothing moves
        changed = False
        for a, sources, sinks in edges:
            key = loop_of[a]
            if key is not None:  # inside a loop: its values, and its results, wait for it
                k = order[key] + 1
            else:
                k = max((int(seg[v]) for v in sources), default=0)
            for v in sinks:
                if seg[v] < k:
                    seg[v] = k
                    changed = True
    at = np.arange(n_apps, dtype=np.int64)
    if loop_starts:
        before = np.searchsorted(np.array(loop_starts), np.arange(n_apps), side="right")
        for a, sources, _ in edges:
            if top[a]:
                k = max((int(seg[v]) for v in sources), default=0)
                if k < before[a]:
                    at[a] = max(0, loop_starts[k] - 1)
    for a, sources, _ in edges if ready else ():
        if top[a]:
            at[a] = max([int(at[a]), *(ready[v] for v in sources if v in ready)])
    return Schedule(at, seg, loop_starts, top)


def flow(graph) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Each application as ``(index, sources, sinks)`` in the direction values flow: an
    equation from its operands to its results, a link into a call from the outer value to
    the inner one, a call's result link from the inner value out; ties left out.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> flow(build_graph(trace(jnp.sin, (jnp.ones(4),), {}), {}))
        [(0, (0,), (1,))]
    """
    out_links = graph.out_links
    return [
        (a, app.results, app.operands) if a in out_links else (a, app.operands, app.results)
        for a, app in enumerate(graph.apps) if app.kind is not AppKind.TIE
    ]  # fmt: skip


def reads_of(graph, own: Mapping[int, int]) -> list[int]:
    """Per value, the union of the bit sets ``own`` gives the values it is computed from
    (transitively, through calls and loops; not its own bits).

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.cos(jnp.sin(x)), (jnp.ones(4),), {}), {})
        >>> reads_of(g, {0: 1, 1: 2})
        [0, 1, 3]
    """
    reads = [0] * len(graph.shapes)
    edges = flow(graph)
    changed = True
    while changed:  # a call's links come after its body: repeat until nothing moves
        changed = False
        for _, sources, sinks in edges:
            bits = 0
            for v in sources:
                bits |= reads[v] | own.get(v, 0)
            if bits:
                for v in sinks:
                    if reads[v] | bits != reads[v]:
                        reads[v] |= bits
                        changed = True
    return reads


@dataclass(frozen=True)
class Liveness:
    """When each buffer of a graph is alive, in application (equation) order.

    ``owner[v]`` is the buffer value ``v`` lives in (identity links of nested jaxprs
    alias their outer value); ``start``/``end`` are the first and last times (`Schedule`)
    of each owner (``-1``: not an intermediate — an argument, a result or a
    constant). ``intermediates`` lists the owners counted as activations.
    """

    owner: list[int]
    start: np.ndarray
    end: np.ndarray
    intermediates: np.ndarray
    # a loop's stacked input or result (owner) -> the per-iteration value its link slices
    # it into: while the loop runs, XLA holds the stack in that value's layout
    stacked: Mapping[int, int] = field(default_factory=dict)
    schedule: Schedule | None = None
    # a contraction's result written over in place by its reader (its buffer ends before
    # that time) -> the time it ends if the contraction's layout has a unit dim
    squeezable: Mapping[int, int] = field(default_factory=dict)


def liveness(
    graph,
    skip: Iterable[int] = (),
    ready: Mapping[int, int] | None = None,
    bitcasts: Iterable[int] = (),
) -> Liveness:
    """Lifetimes of a graph's buffers: produced by their first equation, freed after their
    last use, in the times of XLA's `schedule` (``ready`` as there); arguments and
    results live for the whole call and are not intermediates. Applications in ``skip``
    (dead code) neither produce nor use anything; those in ``bitcasts`` (`bitcasts`: a
    layout's reshapes that keep each device's data as it is) make no buffer of their own.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sin(jnp.cos(x)) * 2, (jnp.ones(4),), {}), {})
        >>> live = liveness(g)
        >>> [(int(live.start[v]), int(live.end[v])) for v in live.intermediates]
        [(0, 1), (1, 2)]
    """
    n = len(graph.shapes)
    parent = list(range(n))
    skip = set(skip)
    for app in graph.apps:
        if app.kind is AppKind.LINK and len(app.operands) == 1 and len(app.results) == 1:
            o, r = app.operands[0], app.results[0]
            if graph.shapes[o] == graph.shapes[r] and _is_identity(app.rule):
                ro, rr = find_root(parent, o), find_root(parent, r)
                if ro != rr:
                    parent[rr] = ro
    # a transpose is the only reader of what an equation made: XLA's layout assignment
    # has the maker write in the transposed order, and the transpose is a bitcast
    readers = np.zeros(n, dtype=np.int64)
    for app in graph.apps:
        for v in app.operands:
            readers[v] += 1
    made = graph.producers()
    for a, app in enumerate(graph.apps):
        if (
            app.eqn is not None
            and app.kind is AppKind.EQN
            and app.eqn.primitive.name == "transpose"
        ):
            (o,), (r,) = app.operands, app.results
            if readers[o] == 1 and o in made and a not in skip:
                ro, rr = find_root(parent, o), find_root(parent, r)
                if ro != rr:  # the maker's layout sizes the buffer (a partial sum's)
                    parent[rr] = ro
    # a bitcast reads its operand's buffer in the new shape (a layer stack reshaped into
    # pipeline stages): one buffer
    for a in bitcasts:
        (o, *_), (r,) = graph.apps[a].operands, graph.apps[a].results
        ro, rr = find_root(parent, o), find_root(parent, r)
        if ro != rr and a not in skip:
            parent[rr] = ro
    owner = _common_subexpressions(graph, [find_root(parent, v) for v in range(n)], skip)
    big = len(graph.apps) + 1
    start = np.full(n, big, dtype=np.int64)
    end = np.full(n, -1, dtype=np.int64)
    stacked: dict[int, int] = {}
    link_body = getattr(graph, "link_body", {})
    sched = schedule(graph, ready)
    at = sched.at
    for a, app in enumerate(graph.apps):
        if a in skip or app.kind is AppKind.TIE:
            continue
        t = int(at[a])
        if app.kind is AppKind.LINK:
            for v, r in zip(app.operands, app.results):
                if len(graph.shapes[v]) == len(graph.shapes[r]) + 1:
                    stacked[owner[v]] = r
            # a link's operand is the outer value of a loop or call, linked after the body:
            # a stacked result (the residuals a scan saves for the backward pass, a
            # scanned gradient) is allocated when the loop starts and filled as it runs,
            # and a stacked input the loop reads is alive until it ends
            first = int(at[link_body.get(a, a)])
            for v in app.operands:
                o = owner[v]
                if start[o] == big:
                    start[o] = min(first, t)
                if t > end[o]:
                    end[o] = t
            continue
        for v in app.results:
            o = owner[v]
            if t < start[o]:
                start[o] = t
        for v in app.operands:
            o = owner[v]
            if t > end[o]:
                end[o] = t
    boundary = {owner[v] for v in (*graph.in_vids, *graph.out_vids)}
    produced = start < big
    for o in boundary:
        produced[o] = False
    roots = np.array([owner[v] == v for v in range(n)], dtype=bool)
    keep = produced & roots
    end = np.maximum(end, start)  # a result nothing reads lives at its own equation
    start = np.where(keep, start, -1)
    end = np.where(keep, end, -1)
    return Liveness(owner, start, end, np.flatnonzero(keep), stacked, sched)


def bitcasts(graph, dims: Sequence[Sequence[DimSharding]], axis_sizes, moved: set[int]) -> set[int]:
    """The equations XLA runs as bitcasts under a layout: read from the rule, one array
    regrouped into other dims with its elements in the same order (a reshape, a squeeze:
    one operand and one result of other shapes holding the same factors in the same
    order, nothing summed, one dtype), that hold the same bytes on each device and move
    nothing (``moved``: applications that reshard an operand or result). Each device's
    shard is then the regrouped shard of its operand (a stack of 32 layers split 8 ways
    is 8 stacks of 4 layers, each device's 4 layers where they were).

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: x.reshape(2, 4) * 2, (jnp.ones(8),), {}), {})
        >>> rows = [[("data",)] + [()] * (len(s) - 1) for s in g.shapes]
        >>> bitcasts(g, rows, {"data": 2}, set())
        {0}
    """
    out = set()
    for a, app in enumerate(graph.apps):
        rule = app.rule
        if (
            app.kind is not AppKind.EQN
            or a in moved
            or len(rule.operands) != 1
            or len(rule.results) != 1
            or any(f.kind is FactorKind.REDUCTION or f.window is not None for f in rule.factors)
        ):
            continue
        (o,), (r,) = app.operands, app.results
        if (
            graph.shapes[o] != graph.shapes[r]
            and graph.dtypes[o] == graph.dtypes[r]
            and [f for d in rule.operands[0] for f in d] == [f for d in rule.results[0] for f in d]
            and per_device_bytes(graph.shapes[o], graph.dtypes[o], dims[o], axis_sizes)
            == per_device_bytes(graph.shapes[r], graph.dtypes[r], dims[r], axis_sizes)
        ):
            out.add(a)
    return out


# calls XLA inlines before its common-subexpression pass; every other enclosing equation
# (a loop, a branch, a rematerialized region behind its optimization barrier, a manual
# shard_map body) keeps the values inside apart from equal ones outside
_INLINED_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                            "custom_vjp_call", "custom_vjp_call_jaxpr"})  # fmt: skip


def _common_subexpressions(graph, owner: list[int], skip: set[int]) -> list[int]:
    """``owner`` with the results of an equation that repeats an earlier one (the same
    primitive and parameters on the same buffers and literals, in the same loop body)
    owned by the earlier one's: XLA's common-subexpression elimination computes them
    once, into one buffer; a conversion to its operand's own type is its operand.
    ``jnp.var`` recomputes the mean and the centred input that a layer norm computes
    beside it: counted twice, they made a GPT's estimate 5% high."""
    seen: dict[tuple, tuple[int, ...]] = {}
    for a, app in enumerate(graph.apps):
        eqn = app.eqn
        if app.kind is not AppKind.EQN or eqn is None or a in skip or eqn.effects:
            continue
        inputs = tuple(
            _literal_key(var) if isinstance(var, Literal) else owner[v]
            for var, v in zip(eqn.invars, app.operands)
        )  # fmt: skip
        try:
            key = (eqn.primitive, tuple(sorted(eqn.params.items())), inputs, xla_scope(app.where))
            first = seen.setdefault(key, app.results)
        except (TypeError, ValueError):  # parameters that cannot be compared (arrays)
            continue
        if first is not app.results:
            for r, f in zip(app.results, first, strict=True):
                owner[r] = owner[f]
        elif eqn.primitive.name == "convert_element_type" and _same_type(eqn):
            owner[app.results[0]] = inputs[0]  # XLA's simplifier removes it
    return owner


def _literal_key(var) -> tuple:
    """A literal operand by its value and type (a NaN equals nothing: never merged)."""
    val = var.val
    if not isinstance(val, (bool, int, float, complex, np.generic)):
        val = (np.asarray(val).tobytes(), np.shape(val))
    return ("literal", val, var.aval.dtype, var.aval.weak_type)


def _same_type(eqn) -> bool:
    """A conversion to the type its operand has (``jnp.var`` casts to the computation
    dtype its input already has)."""
    (var,) = eqn.invars
    return not isinstance(var, Literal) and var.aval.dtype == eqn.outvars[0].aval.dtype


def xla_scope(where) -> tuple[int, ...]:
    """The enclosing equations of an application (its `App.where`) that XLA does not
    inline, by identity: applications with equal scopes end up in one XLA computation,
    where its common-subexpression pass merges equal instructions.

    Example:
        >>> xla_scope(None)
        ()
    """
    scope = []
    while where is not None:
        eqn, where = where
        if eqn.primitive.name not in _INLINED_CALLS:
            scope.append(id(eqn))
    return tuple(scope)


def _is_identity(rule) -> bool:
    return all(r == o for r, o in zip(rule.results[0], rule.operands[0])) and all(
        len(d) == 1 for d in rule.operands[0]
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of a plan: arguments, results, and the largest live set of
    intermediates (at application ``peak_app``).

    Example:
        >>> MemoryEstimate(100, 100, 50, 3).total
        250
    """

    arguments: int
    results: int
    activations: int
    peak_app: int

    @property
    def total(self) -> int:
        """Arguments + results + peak activations (no buffer donated)."""
        return self.arguments + self.results + self.activations


# elementwise primitives XLA counts as expensive (`HloInstruction::IsExpensive`): its
# fusion does not duplicate them into several readers
EXPENSIVE = frozenset(
    {"exp", "exp2", "log", "log1p", "expm1", "div", "pow", "sqrt", "rsqrt", "cbrt", "tanh",
     "logistic", "erf", "erf_inv", "erfc", "atan2", "sin", "cos", "tan", "asin", "acos",
     "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "digamma", "rem"}
)  # fmt: skip


def fused_liveness(graph, live: Liveness, extend: bool = True) -> Liveness:
    """``live`` less the buffers XLA's fusion never makes: a value an elementwise
    equation computes and only elementwise equations read is recomputed inside its
    readers' fusions, not stored (the backward pass reads such residuals of the
    forward's elementwise chains, say a layer norm's centred input, from their
    operands), unless an `EXPENSIVE` equation makes it for several readers (silu's
    sigmoid, read by the forward's product and the backward's derivative). With
    ``extend`` those operands stay alive until the fused value's last reader, as the
    recomputation needs them.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.cost import liveness
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sum(jnp.sin(jnp.cos(x)) * 2), (jnp.ones(4),), {}), {})
        >>> len(liveness(g).intermediates), len(fused_liveness(g, liveness(g)).intermediates)
        (3, 1)
    """
    owner = live.owner
    producer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for a, app in enumerate(graph.apps):
        if app.kind is not AppKind.EQN:
            continue
        for v in app.results:
            producer.setdefault(owner[v], a)
        for v in app.operands:
            readers.setdefault(owner[v], []).append(a)
    elementwise: dict[int, bool] = {}

    def is_elementwise(a: int) -> bool:
        hit = elementwise.get(a)
        if hit is None:
            app = graph.apps[a]
            shape = graph.shapes[app.results[0]] if app.results else None
            hit = elementwise[a] = (
                app.kind is AppKind.EQN
                and all(f.plain for f in app.rule.factors)
                and all(graph.shapes[u] in (shape, ()) for u in app.operands)
            )
        return hit

    scopes: dict[int, tuple] = {}

    def scope(a: int) -> tuple:
        hit = scopes.get(a)
        if hit is None:
            hit = scopes[a] = xla_scope(graph.apps[a].where)
        return hit

    # a value read inside a loop it is not made in is the loop's operand: XLA fuses only
    # within one computation, so it is stored (a mask broadcast JAX hoisted out of a scan)
    def fusible(a: int) -> bool:  # XLA fuses a broadcast into its readers too
        return is_elementwise(a) or graph.apps[a].eqn.primitive.name == "broadcast_in_dim"

    # XLA's fusion duplicates a producer into each of several readers only when it is
    # cheap: an expensive one (an exponential, a division) read twice is stored
    def duplicable(v: int) -> bool:
        eqn = graph.apps[producer[v]].eqn
        return len(set(readers.get(v, ()))) < 2 or eqn.primitive.name not in EXPENSIVE

    fused = [
        int(v) for v in live.intermediates
        if int(v) in producer and fusible(producer[int(v)])
        and all(is_elementwise(r) and scope(r) == scope(producer[int(v)])
                for r in readers.get(int(v), ()))
        and duplicable(int(v))
    ]  # fmt: skip
    end = live.end.copy()
    if extend:  # later fused values first: their operands may be fused values too
        for v in sorted(fused, key=lambda v: -producer[v]):
            for u in graph.apps[producer[v]].operands:
                o = owner[u]
                if end[o] >= 0 and end[v] > end[o]:
                    end[o] = end[v]
    kept = np.setdiff1d(live.intermediates, np.array(fused, dtype=np.int64))
    # an elementwise result written over an operand of its shape that dies there (XLA
    # computes a fusion in place when its operand's buffer is free): the operand's buffer
    # ends as the result's begins. XLA drops a contraction's unit dims from its output,
    # and reads it through a bitcast that it does not overwrite: those wait for a layout
    # (`memory_estimate`)
    at = live.schedule.at if live.schedule is not None else np.arange(len(graph.apps))
    stored = set(kept.tolist())
    fused_set = set(fused)
    squeezable: dict[int, int] = {}

    def inputs(a: int) -> Iterator[int]:  # the stored buffers a fusion rooted at ``a`` reads
        todo, seen = [a], {a}
        while todo:
            for u in graph.apps[todo.pop()].operands:
                o = owner[u]
                if o not in fused_set:
                    yield o
                elif producer[o] not in seen:
                    seen.add(producer[o])
                    todo.append(producer[o])

    for v in stored:
        a = producer.get(v)
        if a is None or not is_elementwise(a):
            continue
        for o in inputs(a):
            if (
                o in stored and o != v and end[o] == at[a] and live.start[o] < at[a]
                and graph.shapes[o] == graph.shapes[v] and graph.dtypes[o] == graph.dtypes[v]
                and o in producer and scope(producer[o]) == scope(a)  # not a loop's operand
            ):  # fmt: skip
                end[o] = at[a] - 1
                if o in producer and contracts(graph.apps[producer[o]]):
                    squeezable[o] = int(at[a])
                break
    return Liveness(owner, live.start, end, kept, live.stacked, live.schedule, squeezable)


def memory_estimate(
    graph,
    dims: Sequence[Sequence[DimSharding]],
    axis_sizes: Mapping[str, int],
    out_dims: Sequence[Sequence[DimSharding]] | None = None,
    live: Liveness | None = None,
    extra: Iterable[tuple[int, int, float]] = (),
) -> MemoryEstimate:
    """Per-device memory of a layout of every value of ``graph``; ``extra`` adds buffers
    no value holds, as ``(first, last, bytes)``: alive from application ``first`` to
    ``last`` (the gathered copy of a parameter stored apart).

    The approximation: a linear scan over the equations in program order, each
    intermediate alive from the equation that makes it to its last reader, every one a
    buffer of its own. XLA fuses elementwise chains (fewer, shorter-lived buffers) and
    may reorder, so this over-counts activations of unfused code; arguments and results
    (kept apart, as without donation) are exact.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sin(x) * 2, (jnp.ones((8, 4)),), {}), {})
        >>> memory_estimate(g, [[("data",), ()]] * len(g.shapes), {"data": 2})
        MemoryEstimate(arguments=64, results=64, activations=64, peak_app=0)
    """
    live = live or liveness(graph)
    out_dims = out_dims if out_dims is not None else [dims[v] for v in graph.out_vids]
    args = sum(
        per_device_bytes(graph.shapes[v], graph.dtypes[v], dims[v], axis_sizes)
        for v in set(graph.in_vids)
    )
    seen: set[int] = set()
    results = 0
    for v, d in zip(graph.out_vids, out_dims):
        if v not in seen:
            seen.add(v)
            results += per_device_bytes(graph.shapes[v], graph.dtypes[v], d, axis_sizes)
    n_apps = len(graph.apps)
    extra = [(first, last, b) for first, last, b in extra if b]
    if not (len(live.intermediates) or extra) or not n_apps:
        return MemoryEstimate(args, results, 0, -1)
    sizes = np.array(
        [buffer_bytes(graph, v, dims, axis_sizes, live) for v in live.intermediates],
        dtype=np.int64,
    )
    # a loop's stacked result that an elementwise update turns into a step result of the
    # same per-device size (a scanned gradient and its parameter's new value) is filled
    # in that result's buffer: XLA shares an output's buffer with what computes it
    for i, v in enumerate(live.intermediates):
        if (
            int(v) in live.stacked
            and sizes[i]
            and _fills_a_result(graph, int(v), int(sizes[i]), dims, out_dims, axis_sizes)
        ):
            sizes[i] = 0
    end = live.end
    for v, t in live.squeezable.items():
        if 1 in per_device_shape(graph.shapes[v], dims[v], axis_sizes):
            end = end.copy() if end is live.end else end
            end[v] = t
    delta = np.zeros(n_apps + 1, dtype=np.int64)
    np.add.at(delta, live.start[live.intermediates], sizes)
    np.add.at(delta, end[live.intermediates] + 1, -sizes)
    for first, last, b in extra:
        delta[first] += int(b)
        delta[last + 1] -= int(b)
    curve = np.cumsum(delta)[:n_apps]
    peak = int(np.argmax(curve))
    return MemoryEstimate(args, results, int(curve[peak]), peak)


def _fills_a_result(graph, v: int, size: int, dims, out_dims, axis_sizes) -> bool:
    """Whether a result of per-device ``size`` bytes is computed from value ``v`` by
    equations that keep its shape and treat each element alone."""
    shape = graph.shapes[v]
    results = {
        r: per_device_bytes(graph.shapes[r], graph.dtypes[r], d, axis_sizes)
        for r, d in zip(graph.out_vids, out_dims)
        if graph.shapes[r] == shape
    }
    if size not in results.values():
        return False
    return any(results.get(u) == size for u in elementwise_reach(graph, v, links=False))


def buffer_bytes(graph, v: int, dims, axis_sizes: Mapping[str, int], live: Liveness) -> int:
    """Per-device bytes of intermediate ``v``'s buffer: its layout's share, or for a loop's
    stacked input or result whose per-iteration value is laid out otherwise, the larger of
    that and the stack in the per-iteration layout (XLA fills a scan's stacked gradient in
    the layout each iteration computes it in, and moves it to its own after the loop).

    Example:
        >>> buffer_bytes(graph, v, plan.dims, plan.axis_sizes, live)  # doctest: +SKIP
        4294967296
    """
    own = per_device_bytes(graph.shapes[v], graph.dtypes[v], dims[v], axis_sizes)
    inner = live.stacked.get(v)
    if inner is None or dims[inner] is None:
        return own
    if slices_locally(dims[v][1:], dims[inner]):
        return own  # the stack's layout slices the iteration's: each slice is cut locally
    layers = graph.shapes[v][0]
    each = per_device_bytes(graph.shapes[inner], graph.dtypes[inner], dims[inner], axis_sizes)
    return max(own, layers * each)


class MemoryCurve:
    """`memory_estimate` of one layout, kept so that the estimate of a few values laid
    out otherwise costs only those values: for pricing one decision after another.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sin(x) * 2, (jnp.ones((8, 4)),), {}), {})
        >>> curve = MemoryCurve(g, [[(), ()]] * len(g.shapes), {"data": 2})
        >>> curve.total, curve.total_with({v: [("data",), ()] for v in range(len(g.shapes))})
        (384, 192)
    """

    def __init__(
        self,
        graph,
        dims: Sequence[Sequence[DimSharding]],
        axis_sizes: Mapping[str, int],
        sources: Sequence[int] | None = None,
        live: Liveness | None = None,
    ):
        self.graph, self.axis_sizes = graph, axis_sizes
        self.live = live or liveness(graph)
        # each distinct result, by the value whose layout it takes (an argument for a tie)
        sources = list(sources if sources is not None else graph.out_vids)
        seen: set[int] = set()
        self.results: list[int] = []
        self.results_sources = sources
        for v, src in zip(graph.out_vids, sources):
            if v not in seen:
                seen.add(v)
                self.results.append(src)
        self.args = sorted(set(graph.in_vids))
        self.position = {int(v): i for i, v in enumerate(self.live.intermediates)}
        self.sizes = np.array(
            [self._bytes(v, dims[v]) for v in self.live.intermediates], dtype=np.int64
        )
        self.dims = dims
        self.total = self.total_with({})

    def _bytes(self, v: int, dims) -> int:
        return per_device_bytes(self.graph.shapes[v], self.graph.dtypes[v], dims, self.axis_sizes)

    def update(self, changed: Mapping[int, Sequence[DimSharding]]) -> None:
        """Take the layouts in ``changed`` for good (``dims``, given at construction, must
        already hold them)."""
        for v in changed:
            i = self.position.get(v)
            if i is not None:
                self.sizes[i] = self._bytes(v, self.dims[v])
        self.total = self.total_with({})

    def total_with(self, changed: Mapping[int, Sequence[DimSharding]]) -> int:
        """Arguments + results + peak activations with the values in ``changed`` laid out
        as given there and every other value as at construction."""
        layout = lambda v: changed.get(v, self.dims[v])  # noqa: E731
        args = sum(self._bytes(v, layout(v)) for v in self.args)
        results = sum(self._bytes(v, layout(v)) for v in self.results)
        live = self.live
        if not len(live.intermediates) or not self.graph.apps:
            return args + results
        sizes = self.sizes
        moved = [(self.position[v], v) for v in changed if v in self.position]
        if moved:
            sizes = sizes.copy()
            for i, v in moved:
                sizes[i] = self._bytes(v, changed[v])
        n_apps = len(self.graph.apps)
        delta = np.zeros(n_apps + 1, dtype=np.int64)
        np.add.at(delta, live.start[live.intermediates], sizes)
        np.add.at(delta, live.end[live.intermediates] + 1, -sizes)
        return args + results + int(np.cumsum(delta)[:n_apps].max())
