"""Sizes: bytes of a dtype and an array, a layout's per-device share and shape, the
ring volume of a collective over a group, and bytes as text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum

import numpy as np

from jaxshard.lattice import DimSharding


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


class CollectiveKind(StrEnum):
    """The collectives a plan calls for and XLA emits, named as in HLO text. A string:
    each compares equal to (and hashes as) its HLO name, and prints as it.

    Example:
        >>> CollectiveKind("all-gather") is CollectiveKind.ALL_GATHER, CollectiveKind.ALL_GATHER
        (True, 'all-gather')
        >>> CollectiveKind.REDUCE_SCATTER.sized_by_result, CollectiveKind.ALL_REDUCE.sized_by_result
        (True, False)
    """

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    PERMUTE = "collective-permute"

    def __repr__(self) -> str:  # as its HLO name, so records print as they always have
        return str.__repr__(self)

    @property
    def sized_by_result(self) -> bool:
        """Whether a device's buffer of it is counted by its result (a gather's whole
        result, a scatter's slice) rather than by its operand, as compiled programs are
        read (`jaxshard.hlo.compiled_collectives`)."""
        return self in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER)


def ring_bytes(kind: CollectiveKind, n: int, local: float) -> float:
    """Bytes one device sends for one collective over a group of ``n`` devices with ring
    algorithms: ``2(n-1)/n`` of the buffer for an all-reduce, ``(n-1)/n`` for the others.
    ``local`` is the per-device buffer: the all-reduced one, the all-gathered result, the
    reduce-scattered input, the all-to-all buffer; a collective-permute sends it whole.

    Example:
        >>> ring_bytes(CollectiveKind.ALL_REDUCE, 4, 1024), ring_bytes(CollectiveKind.ALL_GATHER, 4, 1024)
        (1536.0, 768.0)
    """
    if kind == CollectiveKind.PERMUTE:
        return float(local)
    share = (n - 1) / n * local
    return 2 * share if kind == CollectiveKind.ALL_REDUCE else share
