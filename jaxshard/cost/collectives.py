"""Collectives of a reshard: the steps XLA's partitioner takes from one layout to
another (`reshard_steps`), each step's collectives and ring bytes per device
(`reshard_collectives`), pending partial sums, halo exchanges, and what the backend
runs as such (`has_reduce_scatter`, `combines_all_reduces`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from jaxshard import jax_compat
from jaxshard.cost.sizes import (
    CollectiveKind,
    itemsize,
    nbytes,
    per_device_shape,
    ring_bytes,
    shards,
)
from jaxshard.lattice import DimSharding
from jaxshard.rule import FactorKind


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


@dataclass(frozen=True)
class Collective:
    """One collective: as a plan calls for it (`reshard_collectives`, `halo_collectives`),
    as `jaxshard.hlo.compiled_collectives` reads a compiled program, as a plan writes it
    inside `shard_map` (`written_collectives`), and as `jaxshard.verify` matches them.

    ``bytes`` is one device's buffer of it: its operand's, its result's where the kind is
    `CollectiveKind.sized_by_result` (an all-gather's whole result, a reduce-scatter's
    slice), the rows a collective-permute sends; `ring_bytes` is what one device sends
    per run (ring volume), the unit every cost is in. Matching compares kind, axes and
    bytes; the rest rides along: ``group`` (devices per replica group), ``runs`` per call
    (None: inside a compiled loop whose trip count is unknown), ``in_while`` (planned
    inside a while loop, whose body ``runs`` counts once), ``line`` (the source line
    that writes it), ``order`` (the mesh axes in the order a plan runs it over; sorted
    when not given) and ``priced_as`` (the kind a backend runs it as: a reduce-scatter
    all-reduced where there is none, `has_reduce_scatter`).

    Example:
        >>> c = Collective("all-gather", frozenset({"model"}), 1024, group=4, runs=2)
        >>> str(c), c.ring_bytes, c.over
        ('all-gather over model of 1024 B, 2 runs', 768.0, 'all-gather over model')
    """

    kind: CollectiveKind
    axes: frozenset[str]
    bytes: float
    group: int = field(default=0, compare=False)
    runs: int | None = field(default=1, compare=False)
    in_while: bool = field(default=False, compare=False)
    line: str = field(default="", compare=False)
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)
    priced_as: CollectiveKind | None = field(default=None, compare=False, repr=False)
    # what one device sends per run with ring algorithms (the cost model's volumes):
    # all-reduce 2(n-1)/n·S, all-gather and all-to-all (n-1)/n·S, reduce-scatter (n-1)·S
    # (S its scattered result), collective-permute S; 0 for a group of one
    ring_bytes: float = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:  # typed here: a kind may come by its HLO name
        kind = self.kind
        if type(kind) is not CollectiveKind:
            kind = CollectiveKind(kind)
            object.__setattr__(self, "kind", kind)
        if not self.order:
            object.__setattr__(self, "order", tuple(sorted(self.axes)))
        n, s = self.group, self.bytes
        if n <= 1 and kind != CollectiveKind.PERMUTE:
            ring = 0.0
        else:
            size = n * s if kind == CollectiveKind.REDUCE_SCATTER else s
            ring = ring_bytes(self.priced_as or kind, n, size)
        object.__setattr__(self, "ring_bytes", ring)

    @property
    def over(self) -> str:
        """The kind and its mesh axes, as a plan's explanation shows it."""
        return f"{self.kind} over {','.join(self.order)}"

    def __str__(self) -> str:
        runs = (
            ", in a loop of unknown trip count"
            if self.runs is None
            else (f", {self.runs} runs" if self.runs != 1 else "")
        )
        written = f" (written at {self.line})" if self.line else ""
        size = int(self.bytes) if float(self.bytes).is_integer() else self.bytes
        return f"{self.kind} over {','.join(sorted(self.axes)) or '?'} of {size} B{runs}{written}"


def planned(
    kind: CollectiveKind,
    axes: Sequence[str],
    local: float,
    axis_sizes: Mapping[str, int],
    priced_as: CollectiveKind | None = None,
) -> Collective:
    """The `Collective` a plan calls for over mesh ``axes`` (in that order), with
    ``local`` the buffer `jaxshard.cost.sizes.ring_bytes` prices: the all-reduced one, the
    all-gathered result, the reduce-scattered input, the all-to-all buffer, the rows a
    permute sends.

    Example:
        >>> planned(CollectiveKind.REDUCE_SCATTER, ("model",), 1024.0, {"model": 4}).bytes
        256.0
    """
    n = math.prod(axis_sizes[a] for a in axes)
    size = local / n if kind == CollectiveKind.REDUCE_SCATTER else local
    return Collective(kind, frozenset(axes), size, n, order=tuple(axes), priced_as=priced_as)


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
) -> list[tuple[int, Collective]]:
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
        [(0, Collective(kind='collective-permute', axes=frozenset({'x'}), bytes=1024.0, group=8, ...)), ...]
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
        out += [(vid, planned(CollectiveKind.PERMUTE, axes, float(r * section), axis_sizes))
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
        >>> import numpy as np
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
    return sum(s.ring_bytes for s in steps) + 0.0, [s.over for s in steps]


def reshard_collectives(
    shape: Sequence[int],
    dtype,
    src: Sequence[DimSharding],
    dst: Sequence[DimSharding],
    axis_sizes: Mapping[str, int],
    partial: frozenset[str] = frozenset(),
    reduce_scatter: bool = True,
) -> list[Collective]:
    """The collectives of `reshard_cost` one by one: ``(kind, mesh axes, bytes per device)``,
    so a `CostModel` can price each on its own axes. Without ``reduce_scatter`` (a backend
    that has none, see `has_reduce_scatter`) a reduce-scatter moves what an all-reduce of
    its input moves: the backend sums the whole input and each device keeps its slice.

    Example:
        >>> import numpy as np
        >>> sizes = {"data": 2, "model": 4}
        >>> steps = reshard_collectives((8, 16), np.float32, [("data",), ()], [(), ()], sizes,
        ...                             frozenset({"model"}))
        >>> [(s.over, s.ring_bytes) for s in steps]
        [('all-reduce over model', 384.0), ('all-gather over data', 256.0)]
    """
    # an axis of size 1 moves nothing: XLA emits no collective over it
    src, dst = without_unit_axes(src, axis_sizes), without_unit_axes(dst, axis_sizes)
    steps = [tuple(dst)] if partial else reshard_steps(src, dst, axis_sizes)
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
    out: list[Collective] = []

    def add(kind: CollectiveKind, axes, local: float, priced_as: CollectiveKind | None = None):
        out.append(planned(kind, axes, local, axis_sizes, priced_as))

    scattered = sorted(a for a in partial if a in where_dst)
    reduced = sorted(a for a in partial if a not in where_dst)
    for group in groups:  # one all-reduce per reduction factor's axes, as XLA emits them
        axes = sorted(a for a in group if a in reduced)
        if axes:
            add(CollectiveKind.ALL_REDUCE, axes, local_src)
    if scattered:  # the input is whole along the scattered axes, whatever ``src`` says
        whole = [tuple(a for a in d if a not in scattered) for d in src]
        # a backend without reduce-scatter all-reduces the input, each device keeping its
        # slice: one all-reduce per reduction's axes where they land on different dims
        # (measured on XLA's CPU backend: a weight gradient summed over the batch on
        # "data" and the sequence on "model", kept split over both, is two all-reduces
        # of the whole gradient; kept split over both on one dim, it is one)
        kind = CollectiveKind.REDUCE_SCATTER if reduce_scatter else CollectiveKind.ALL_REDUCE
        local = total / shards(whole, axis_sizes)
        parts = [sorted(a for a in g if a in scattered) for g in groups]
        parts = [p for p in parts if p]
        apart = len(parts) > 1 and len({where_dst[p[0]] for p in parts}) > 1
        for part in parts if apart and not reduce_scatter else [scattered]:
            add(CollectiveKind.REDUCE_SCATTER, part, local, kind)
    if not scattered or not reduce_scatter:
        # summed first (a backend without reduce-scatter all-reduces the whole input,
        # measured on MaxText's MoE gate), the array then moves as from ``src``
        permuted = _permuted(src, dst, axis_sizes, local_src, local_dst, summed=bool(partial))
        if permuted is not None:
            return out + permuted
    moved = sorted(
        a
        for a, i in where_src.items()
        if a in where_dst and (where_dst[a] != i or _order_changed(src[i], dst[where_dst[a]], a))
    )
    if moved:
        add(CollectiveKind.ALL_TO_ALL, moved, local_dst)
    removed = sorted(a for a in where_src if a not in where_dst)
    dims = sorted({where_src[a] for a in removed}, reverse=True)
    held = set(where_src)
    if not moved and len(dims) > 1 and all(a in held for a in where_dst):
        # gathered from several dims and nothing else: XLA gathers one dim at a time, the
        # last dim first (measured on 2x4, 4x2 and 2x4x2 meshes), as many bytes in all
        layout = [list(d) for d in src]
        for i in dims:
            layout[i] = [a for a in layout[i] if a in where_dst]
            gathered = sorted(a for a in src[i] if a not in where_dst)
            add(CollectiveKind.ALL_GATHER, gathered, total / shards(layout, axis_sizes))
        return out
    if removed:
        add(CollectiveKind.ALL_GATHER, removed, local_dst)
    return out


def _permuted(
    src, dst, axis_sizes, local_src: float, local_dst: float, summed: bool = False
) -> list[Collective] | None:
    """The collectives of a move where XLA's partitioner permutes shards between devices
    instead of gathering or exchanging them, or None for any other move. Measured on
    XLA's CPU partitioner (JAX 0.10 and 0.12; 2x4, 4x2, 2x8, 4x4, 2x4x2 and 2x2x2
    meshes; ``tests/test_permutes.py`` compiles such moves against this model):

    - every dim split into as many shards as before, in another order or over other
      axes (``[tensor, fsdp] -> [fsdp, tensor]`` on 4x4): one collective-permute;
    - dims that change axes in place, each split into a multiple of its shards
      (``[fsdp] -> [tensor]`` on fsdp=2 x tensor=4, ``[a] -> [(b, c)]``): each device
      slices its shard, then one collective-permute sends every device its new shard;
      where each new split only adds minor axes (``[fsdp] -> [(fsdp, tensor)]``) the
      slice alone does, and the usual path says so;
    - one dim from one axis to a coarser other one, on a mesh of just those two axes
      (``[tensor] -> [fsdp]`` on fsdp=2 x tensor=4): a collective-permute of the shard,
      then an all-gather over the source axis's major part (Shardy's sub-axis
      ``tensor:(1)2``). With a third mesh axis XLA gathers over a group this model does
      not name, and the usual path prices the move;
    - one dim's axes moving to an unsplit dim while the first takes new axes of no more
      shards (`_exchange`: ``[tensor, -] -> [fsdp, tensor]``, MaxText's AdamW moments):
      an all-to-all over the moved axes' minor part, then a collective-permute;
    - one dim cut into k times fewer shards and another into k times more, nothing
      gathered (`_transfer`: ``[f, -, t] -> [(t, f), -, -]``): an all-to-all over the
      first dim's minor k shards, then a collective-permute where axes are not yet in
      place (none where they are: ``[f, -] -> [-, f]`` is the all-to-all alone).

    The permute's axes are those along which a shard's device changes: moved to another
    dim or another place among its dim's axes, added or removed.

    Example:
        >>> [str(c) for c in _permuted([("x",)], [("y",)], {"x": 2, "y": 4}, 512, 256)]
        ['collective-permute over x,y of 256 B']
        >>> [str(c) for c in _permuted([("y",)], [("x",)], {"x": 2, "y": 4}, 256, 512)]
        ['collective-permute over x,y of 256 B', 'all-gather over y:(1)2 of 512 B']
    """
    changed = [i for i, (s, d) in enumerate(zip(src, dst)) if s != d]
    if not changed:
        return None

    def count(axes) -> int:  # the shards one dim's axes cut it into
        return shards((axes,), axis_sizes)

    place = [
        {a: (i, count(d[:k])) for i, d in enumerate(layout) for k, a in enumerate(d)}
        for layout in (src, dst)
    ]
    axes = sorted(a for a in {*place[0], *place[1]} if place[0].get(a) != place[1].get(a))
    if all(count(s) == count(d) for s, d in zip(src, dst)):  # the same shards, elsewhere
        return [planned(CollectiveKind.PERMUTE, axes, local_dst, axis_sizes)]
    # measured on plain moves only; after a partial sum (``summed``: MaxText's
    # Mixtral-8x7B sums a gradient over "fsdp" and moves it over "tensor") the usual path
    # prices the move: as an exchange and permute, the plan chose layouts for which XLA
    # gathered 7 GiB more per device
    exchange = None
    if not summed:
        exchange = _exchange(src, dst, axis_sizes) or _transfer(src, dst, axis_sizes)
    if exchange is not None:
        minor, group, permuted = exchange
        out = [planned(CollectiveKind.PERMUTE, permuted, local_dst, axis_sizes)] if permuted else []
        if group == 1:
            return out
        a2a = Collective(CollectiveKind.ALL_TO_ALL, frozenset(minor), local_dst, group, order=minor)
        return [a2a, *out]
    if any(place[1].get(a, (i,))[0] != i for a, (i, _) in place[0].items()):
        return None  # an axis goes to another dim: an all-to-all
    if all(count(dst[i]) % count(src[i]) == 0 for i in changed):
        if all(dst[i][: len(src[i])] == src[i] for i in changed):
            return None  # a local slice
        return [planned(CollectiveKind.PERMUTE, axes, local_dst, axis_sizes)]
    mesh = {x for x, n in axis_sizes.items() if n > 1}
    if len(changed) != 1 or mesh != set(axes) or len(axes) != 2:
        return None
    (i,) = changed
    if len(src[i]) != 1 or len(dst[i]) != 1 or count(src[i]) % count(dst[i]):
        return None
    n = count(src[i]) // count(dst[i])
    major = f"{src[i][0]}:(1){n}"  # the source axis's major part, as Shardy names it
    return [
        planned(CollectiveKind.PERMUTE, axes, local_src, axis_sizes),
        Collective(CollectiveKind.ALL_GATHER, frozenset({major}), local_dst, n, order=(major,)),
    ]


def _exchange(src, dst, axis_sizes) -> tuple[tuple[str, ...], int, list[str]] | None:
    """How XLA's partitioner makes a move where one dim's axes go whole to a dim no axis
    splits yet and the first dim takes new axes instead, of no more shards than it gave
    (``[t, -] -> [f, t]``), on a mesh whose other axes are all of size 1: each device
    slices its shard along the receiving dim by the moved axes' major part, exchanges the
    minor part by an all-to-all, and one collective-permute puts the halves where the new
    axes want them. Returns the all-to-all's axes (Shardy's sub-axis where the minor part
    cuts an axis: ``t:(2)4`` is the minor four of an axis of eight), its group (1: no
    all-to-all, the new axes have as many shards as the moved ones) and the permute's
    axes; None for any other move. Measured on XLA's CPU partitioner (JAX 0.10 and 0.12):
    2x4, 4x2, 2x8 and 4x4 two-axis meshes and 2x4x2 and 2x2x2 meshes moving two axes,
    arrays of 2 to 4 dims, every pair of dims. Two exceptions take `reshard_steps`'
    all-to-all of the whole moved axes and then a slice: axes moving from the last dim
    into the one before it (XLA exchanges them whole), and a mesh axis of size more than
    1 the move does not touch (XLA would give up and replicate the array).

    Example:
        >>> _exchange([("t",), ()], [("f",), ("t",)], {"f": 2, "t": 8})
        (('t:(2)4',), 4, ['f', 't'])
        >>> _exchange([("t",), ()], [("f",), ("t",)], {"f": 4, "t": 4})
        ((), 1, ['f', 't'])
    """
    changed = [i for i, (s, d) in enumerate(zip(src, dst)) if s != d]
    if len(changed) != 2 or not _whole_mesh(src, dst, axis_sizes):
        return None
    i, j = changed if src[changed[0]] else changed[::-1]
    moved, new = tuple(src[i]), tuple(dst[i])
    if not moved or not new or src[j] or tuple(dst[j]) != moved:
        return None
    if i == len(src) - 1 and j == i - 1:
        return None  # from the last dim into the one before: the whole all-to-all, a slice
    if any(a in d for d in src for a in new):
        return None
    n, m = math.prod(axis_sizes[a] for a in moved), math.prod(axis_sizes[a] for a in new)
    minor = None if n % m else _cut(moved, n // m, axis_sizes, minor=True)
    if minor is None:
        return None
    whole = {a for a, _, size in minor if size == axis_sizes[a]}
    permuted = sorted({*new, *(a for a in moved if a not in whole)})
    return _named(minor, axis_sizes), n // m, permuted


def _transfer(src, dst, axis_sizes) -> tuple[tuple[str, ...], int, list[str]] | None:
    """How XLA's partitioner makes a move where one dim ``i`` is cut into k times fewer
    shards and another ``j`` into k times more, and no axis is gathered: an all-to-all
    over ``i``'s minor k shards (whole axes or Shardy's sub-axis, ``b:(2)2``) sends them
    to ``j``, where they split it after its own axes; then, where an axis is not yet
    where the destination wants it (another dim, another place in its dim, or a new
    axis), one collective-permute over those axes. Same return as `_exchange` (no
    permute: an empty list). ``[f, -, t] -> [(t, f), -, -]`` is an all-to-all over ``t``
    and a permute over both axes (the order of dim 0's axes changes), not the all-to-all
    over both the usual path names. Measured on XLA's CPU partitioner for random moves
    of 2- and 3-dim arrays on 2x4, 4x2, 2x8, 4x4, 2x4x2 and 2x2x2 meshes (JAX 0.10; the
    cases ``tests/test_permutes.py`` compiles also on 0.12); not for a mesh axis of size
    more than 1 the move does not touch (as `_exchange`).

    Example:
        >>> _transfer([("f",), (), ("t",)], [("t", "f"), (), ()], {"f": 4, "t": 4})
        (('t',), 4, ['f', 't'])
        >>> _transfer([("a", "c"), (), ("b",)], [("c", "b"), ("a",), ()], {"a": 2, "b": 2, "c": 2})
        (('b',), 2, ['a', 'b', 'c'])
        >>> _transfer([("f",), ()], [(), ("f",)], {"f": 2, "t": 1})
        (('f',), 2, [])
    """
    if not _whole_mesh(src, dst, axis_sizes):
        return None
    if {a for d in src for a in d} - {a for d in dst for a in d}:
        return None  # a gather: the usual path
    s, t = ([shards((d,), axis_sizes) for d in layout] for layout in (src, dst))
    shrink = [d for d in range(len(src)) if t[d] < s[d]]
    grow = [d for d in range(len(src)) if t[d] > s[d]]
    if len(shrink) != 1 or len(grow) != 1:
        return None
    (i,), (j,) = shrink, grow
    if s[i] % t[i] or t[j] % s[j] or s[i] // t[i] != t[j] // s[j]:
        return None
    k = s[i] // t[i]
    minor, major = _cut(src[i], k, axis_sizes, minor=True), _cut(src[i], t[i], axis_sizes)
    if minor is None or major is None:
        return None
    after = [[(a, 1, axis_sizes[a]) for a in d] for d in src]
    after[i], after[j] = major, after[j] + minor
    whole = [[(a, 1, axis_sizes[a]) for a in d] for d in dst]
    there, wanted = _places(after), _places(whole)
    permuted = sorted(a for a in {*there, *wanted} if there.get(a) != wanted.get(a))
    return _named(minor, axis_sizes), k, permuted


def _whole_mesh(src, dst, axis_sizes) -> bool:
    """Whether every mesh axis of size more than 1 splits ``src`` or ``dst``."""
    held = {a for layout in (src, dst) for d in layout for a in d}
    return all(a in held for a, n in axis_sizes.items() if n > 1)


def _cut(axes, k: int, axis_sizes, minor: bool = False) -> list[tuple[str, int, int]] | None:
    """The major (or ``minor``) ``k`` shards of a dim split over ``axes``, as pieces
    ``(axis, pre-size within the axis, size)`` in major-to-minor order, or None where
    ``k`` cuts no axis evenly."""
    pieces: list[tuple[str, int, int]] = []
    for a in reversed(axes) if minor else axes:
        if k == 1:
            break
        size = axis_sizes[a]
        if k % size == 0:
            piece, k = (a, 1, size), k // size
        elif size % k == 0:
            piece, k = ((a, size // k, k) if minor else (a, 1, k)), 1
        else:
            return None
        pieces.append(piece)
    if k != 1:
        return None
    return pieces[::-1] if minor else pieces


def _named(pieces, axis_sizes) -> tuple[str, ...]:
    """Pieces of axes (`_cut`) as compiled programs name them: ``t`` or ``t:(2)4``."""
    return tuple(a if size == axis_sizes[a] else f"{a}:({pre}){size}" for a, pre, size in pieces)


def _places(layout) -> dict[str, set[tuple[int, int, int, int]]]:
    """Per mesh axis, where its pieces split a layout of pieces (`_cut`): ``(dim, shards
    of the dim's axes before it, pre-size within the axis, size)``, adjacent pieces of
    one axis merged (an axis's two halves in order are the axis)."""
    out: dict[str, set[tuple[int, int, int, int]]] = {}
    for d, pieces in enumerate(layout):
        merged: list[list] = []
        for a, pre, size in pieces:
            if merged and merged[-1][0] == a and merged[-1][1] * merged[-1][2] == pre:
                merged[-1][2] *= size
            else:
                merged.append([a, pre, size])
        before = 1
        for a, pre, size in merged:
            out.setdefault(a, set()).add((d, before, pre, size))
            before *= size
    return out


def without_unit_axes(
    dims: Sequence[DimSharding], axis_sizes: Mapping[str, int]
) -> tuple[tuple[str, ...], ...]:
    """A layout without its mesh axes of size 1: they split nothing and move nothing, so
    a reshard and its steps (`reshard_steps`) are read without them.

    Example:
        >>> without_unit_axes([("data", "stage"), None], {"data": 2, "stage": 1})
        (('data',), ())
    """
    return tuple(tuple(a for a in d or () if axis_sizes[a] > 1) for d in dims)


def reshard_steps(
    src: Sequence[DimSharding],
    dst: Sequence[DimSharding],
    axis_sizes: Mapping[str, int] | None = None,
) -> list[tuple]:
    """The layouts a reshard from ``src`` to ``dst`` passes through, ending with ``dst``.

    One step, unless XLA's partitioner has no collective for the whole move and would
    replicate the array on every device first ("involuntary full rematerialization",
    measured on JAX 0.10 and 0.12): a dim that gives one axis to another dim and loses
    another axis altogether or to a third dim, or a dim that takes axes from two
    others. Nor when an axis moves between dims while another axis is added (XLA then
    runs the all-to-all over a part of the moved axis and permutes the rest, as many
    bytes as the all-to-all of the whole axis followed by a slice), unless
    ``axis_sizes`` show the move as one whose collectives the plan names (`_exchange`,
    `_transfer`: every mesh axis of size more than 1 takes part; measured for
    ``[tensor, -, -] -> [fsdp, -, tensor]`` on a 2x4 fsdp x tensor mesh and in MaxText's
    optimizer update). Nor when an axis moves while another is gathered: XLA gathers
    first and moves the gathered array (measured for ``[fsdp, tensor, -] -> [tensor,
    -, -]`` and its variants, the gathered axis on the moved axis's source, destination
    or a third dim), the same bytes, and a step
    another use of the value may share (`Plan`'s operand moves). Such a reshard goes
    through steps XLA does with one collective each: the gathered axes first, then the
    moved axes one at a time, then the added ones.

    Example:
        >>> reshard_steps([(), ("data", "model")], [("data",), ()])
        [((), ('data',)), (('data',), ())]
        >>> reshard_steps([(), ("data",)], [("data",), ()])
        [(('data',), ())]
        >>> reshard_steps([("model",), ()], [("data",), ("model",)])
        [((), ('model',)), (('data',), ('model',))]
        >>> reshard_steps([("data",), ("model",)], [("model",), ()])
        [((), ('model',)), (('model',), ())]
    """
    src = [tuple(d or ()) for d in src]
    dst = [tuple(d or ()) for d in dst]
    if axis_sizes is not None and (
        _exchange(src, dst, axis_sizes) is not None or _transfer(src, dst, axis_sizes) is not None
    ):
        return [tuple(dst)]
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
    held = {a for d in src for a in d}
    added = any(a not in held for d in dst for a in d)
    # gathering first moves the same bytes as moving first; a conflict's trial layout
    # that gives one axis to two dims is priced as one step, as it always was
    wanted = [a for d in dst for a in d]
    gathered_first = bool(removed) and len(wanted) == len(set(wanted))
    awkward = (
        any(len(js) > 1 or any(a in removed for a in src[i]) for i, js in out_of.items())
        or any(len(i) > 1 for i in into.values())
        or (bool(out_of) and (added or gathered_first))
    )
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


def moved_dtype(dtype, mesh) -> Any:
    """The element type a collective moves values of ``dtype`` in on ``mesh``'s devices.
    XLA's CPU backend computes only in the floating types it supports: it widens
    bfloat16 to float32 and the 8-bit floats to float16 before a collective (all-gather,
    all-reduce, all-to-all and collective-permute alike, measured on the compiled
    programs of JAX 0.10 to 0.12), so they move twice their bytes there. Accelerators
    move them as they are, as does a mesh without devices (abstract).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> moved_dtype(jnp.bfloat16, jax.make_mesh((1,), ("data",)))  # on a CPU
        dtype('float32')
        >>> moved_dtype(jnp.int8, jax.make_mesh((1,), ("data",)))
        dtype('int8')
        >>> moved_dtype(jax.random.key(0).dtype, jax.make_mesh((1,), ("data",)))
        key<fry>
    """
    if dtype is None or _platform(mesh) != "cpu":
        return dtype
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # an extended dtype (a typed PRNG key): its key data are integers
        return dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return dtype
    if dtype == jnp.bfloat16:
        return np.dtype(np.float32)
    return np.dtype(np.float16) if dtype.itemsize == 1 else dtype


def recomputes_remat(mesh) -> bool:
    """Whether the devices of ``mesh`` recompute a layer rematerialized with
    ``jax.checkpoint`` outside a loop (`jaxshard.cost.liveness`): accelerators do; XLA's
    CPU backend does from JAX 0.11 (`jax_compat.CPU_RECOMPUTES_REMAT`), while JAX 0.10's
    merges the recomputation with the forward.

    Example:
        >>> import jax
        >>> from jaxshard import jax_compat
        >>> recomputes_remat(jax.make_mesh((1,), ("data",))) == jax_compat.CPU_RECOMPUTES_REMAT
        True
    """
    return _platform(mesh) != "cpu" or jax_compat.CPU_RECOMPUTES_REMAT


def copies_result_transposes(mesh) -> bool:
    """Whether the devices of ``mesh`` write a transpose into a step's result through a
    buffer of its own where the step has several results (`jax_compat.
    CPU_COPIES_RESULT_TRANSPOSES`: XLA's CPU backend from JAX 0.11); accelerators are
    taken to write the transpose straight into the result.

    Example:
        >>> import jax
        >>> from jaxshard import jax_compat
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> copies_result_transposes(mesh) == jax_compat.CPU_COPIES_RESULT_TRANSPOSES
        True
    """
    return _platform(mesh) == "cpu" and jax_compat.CPU_COPIES_RESULT_TRANSPOSES


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


def reduces_in_place(mesh) -> bool:
    """Whether XLA writes an all-reduce's result over its operand on the devices of
    ``mesh``. Its CPU backend does not: in the buffer assignment of its programs a
    matmul's partial sum and its all-reduced result are two buffers, both alive while
    it runs (a forward matmul whose contracted dim is split, read by its activation:
    the estimate is 0.88x of the compiled program when they are taken as one).
    Accelerators are taken to reduce in place.

    Example:
        >>> import jax
        >>> reduces_in_place(jax.make_mesh((1,), ("data",)))  # on a CPU
        False
    """
    return _platform(mesh) != "cpu"


def copies_transposed_operands(mesh) -> bool:
    """Whether the devices of ``mesh`` copy a matmul operand whose dims are not in their
    kernels' order (`jaxshard.cost.transposed_operands`): XLA's CPU backend does;
    accelerators' matmuls read either order.

    Example:
        >>> import jax
        >>> copies_transposed_operands(jax.make_mesh((1,), ("data",)))  # on a CPU
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
