"""The cost model: bytes each device moves to turn one layout of a tensor into another.

Ring volumes per device, with S the per-device size of the tensor after the collective:
local slice 0; all-gather (n-1)/n·S; all-to-all (n-1)/n·S; reduce-scatter (n-1)/n·S of
the input; all-reduce of a partial 2(n-1)/n·S. Memory of a layout is the per-device
share of the tensor's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxshard.lattice import DimSharding


def nbytes(shape: Sequence[int], dtype) -> int:
    """Global bytes of an array.

    Example:
        >>> nbytes((4, 8), np.float32)
        128
    """
    return math.prod(shape) * (np.dtype(dtype).itemsize if dtype is not None else 0)


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
    """
    src = [d or () for d in src]
    dst = [d or () for d in dst]
    total = nbytes(shape, dtype)
    where_src = {a: i for i, d in enumerate(src) for a in d}
    where_dst = {a: i for i, d in enumerate(dst) for a in d}
    local_dst = total / shards(dst, axis_sizes)
    local_src = total / shards(src, axis_sizes)
    cost, ops = 0.0, []
    scattered = sorted(a for a in partial if a in where_dst)
    reduced = sorted(a for a in partial if a not in where_dst)
    if reduced:
        n = math.prod(axis_sizes[a] for a in reduced)
        cost += 2 * (n - 1) / n * local_src
        ops.append("all-reduce over " + ",".join(reduced))
    if scattered:
        n = math.prod(axis_sizes[a] for a in scattered)
        cost += (n - 1) / n * local_src
        ops.append("reduce-scatter over " + ",".join(scattered))
    moved = sorted(
        a
        for a, i in where_src.items()
        if a in where_dst and (where_dst[a] != i or _order_changed(src[i], dst[where_dst[a]], a))
    )
    if moved:
        n = math.prod(axis_sizes[a] for a in moved)
        cost += (n - 1) / n * local_dst
        ops.append("all-to-all over " + ",".join(moved))
    removed = sorted(a for a in where_src if a not in where_dst)
    if removed:
        n = math.prod(axis_sizes[a] for a in removed)
        cost += (n - 1) / n * local_dst
        ops.append("all-gather over " + ",".join(removed))
    return cost, ops


def _order_changed(src_axes: tuple[str, ...], dst_axes: tuple[str, ...], axis: str) -> bool:
    before_src = src_axes[: src_axes.index(axis)]
    before_dst = dst_axes[: dst_axes.index(axis)]
    return before_src != before_dst
