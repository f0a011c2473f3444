"""The sharding lattice: what is known about how one tensor is laid out on the mesh.

Per tensor dim the state is either *open* (``None``: nothing known yet) or an ordered
tuple of mesh axes, major to minor (``()`` is "replicated", which is information too).
A tensor also carries the set of mesh axes over which it is a pending partial reduction
(OneFlow's P). Merging is monotone: open absorbs anything, equal values agree, two
different known values are a *conflict* that the caller must decide (never by visit
order). The module also maps between a dim's axes and the factors of a compound dim (a
reshape's ``72 = 6 * 12``), where only whole factors pass axes on to the next factor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from jax.sharding import PartitionSpec

from jaxshard.errors import ShardingError

Axes = tuple[str, ...]
DimSharding = Axes | None  # None: open
OPEN: DimSharding = None
REPLICATED: Axes = ()


@dataclass(frozen=True)
class TensorSharding:
    """The lattice value of one tensor: per-dim axes (or open) plus pending partial axes.

    Example:
        >>> TensorSharding((("data",), None), frozenset({"model"}))
        TensorSharding(data, ?, partial={model})
    """

    dims: tuple[DimSharding, ...]
    partial: frozenset[str] = field(default_factory=frozenset)

    def __repr__(self) -> str:
        parts = [format_dim(d) for d in self.dims]
        if self.partial:
            parts.append("partial={" + ",".join(sorted(self.partial)) + "}")
        return "TensorSharding(" + ", ".join(parts) + ")"

    @property
    def is_complete(self) -> bool:
        """True when no dim is open.

        Example:
            >>> TensorSharding(((), ("data",))).is_complete
            True
        """
        return all(d is not None for d in self.dims)


def format_dim(dim: DimSharding) -> str:
    """Short text for one dim: ``?`` open, ``-`` replicated, ``a*b`` for several axes.

    Example:
        >>> [format_dim(None), format_dim(()), format_dim(("data", "model"))]
        ['?', '-', 'data*model']
    """
    if dim is None:
        return "?"
    return "*".join(dim) if dim else "-"


def merge_dim(a: DimSharding, b: DimSharding) -> tuple[DimSharding, bool]:
    """Merge two states of one dim: returns ``(merged, conflict)``.

    Monotone: open yields to anything; equal values agree; two different known values
    conflict, and the first is returned unchanged so nothing is silently overwritten.

    Example:
        >>> merge_dim(None, ("data",))
        (('data',), False)
        >>> merge_dim((), ())
        ((), False)
        >>> merge_dim(("data",), ("model",))
        (('data',), True)
    """
    if a is None:
        return b, False
    if b is None or a == b:
        return a, False
    return a, True


def slices_locally(finer: Sequence[DimSharding], coarser: Sequence[DimSharding]) -> bool:
    """Whether a value laid out as ``coarser`` reaches ``finer`` by a local slice: each
    dim of ``finer`` starts with the axes of the same dim of ``coarser`` (it only adds
    minor axes); an open dim never does.

    Example:
        >>> slices_locally([("data", "model"), ()], [("data",), ()])
        True
        >>> slices_locally([("model", "data")], [("data",)])
        False
    """
    return all(
        f is not None and c is not None and tuple(f[: len(c)]) == tuple(c)
        for f, c in zip(finer, coarser, strict=True)
    )


def spec_entry(dim: DimSharding) -> object:
    """The PartitionSpec entry for one dim state.

    Example:
        >>> spec_entry(()), spec_entry(("data",)), spec_entry(("a", "b"))
        (None, 'data', ('a', 'b'))
    """
    if dim is None:
        return PartitionSpec.UNCONSTRAINED
    if not dim:
        return None
    return dim[0] if len(dim) == 1 else tuple(dim)


def to_spec(dims: Sequence[DimSharding]) -> PartitionSpec:
    """A PartitionSpec for per-dim states, trailing replicated dims trimmed (canonical).

    Example:
        >>> to_spec([("data",), (), ()])
        P('data',)
        >>> to_spec([None, ("model",)])
        P(UNCONSTRAINED, 'model')
    """
    entries = [spec_entry(d) for d in dims]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def from_spec(spec: PartitionSpec, rank: int) -> tuple[DimSharding, ...]:
    """Per-dim states pinned by a (partial) spec; dims past its end stay open.

    ``None`` pins a dim replicated, a name or tuple of names pins it to those axes,
    ``P.UNCONSTRAINED`` leaves it open. The caller checks the spec is not too long.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> from_spec(P("data", None), 3)
        (('data',), (), None)
        >>> from_spec(P(P.UNCONSTRAINED, ("a", "b")), 2)
        (None, ('a', 'b'))
    """
    dims: list[DimSharding] = []
    for entry in tuple(spec)[:rank]:
        if entry is PartitionSpec.UNCONSTRAINED:
            dims.append(None)
        elif entry is None:
            dims.append(())
        elif isinstance(entry, str):
            dims.append((entry,))
        else:
            dims.append(tuple(entry))
    dims.extend([None] * (rank - len(dims)))
    return tuple(dims)


def check_dims(
    dims: Sequence[DimSharding],
    shape: Sequence[int],
    axis_sizes: Mapping[str, int],
    where: str,
    fix: str = "",
) -> None:
    """Raise ShardingError unless ``dims`` is a valid layout of ``shape`` on the mesh.

    Valid: every axis exists, appears at most once, and the product of a dim's axis
    sizes divides the dim. ``where`` names the culprit in the message.

    Example:
        >>> check_dims([("data",)], [8], {"data": 2}, "params/w")
        >>> check_dims([("data",)], [3], {"data": 2}, "params/w")
        Traceback (most recent call last):
        ...
        jaxshard.errors.ShardingError: params/w: dim 0 has size 3, which mesh axes ('data',) ...
    """
    seen: set[str] = set()
    for i, dim in enumerate(dims):
        if not dim:
            continue
        for axis in dim:
            if axis not in axis_sizes:
                raise ShardingError(
                    f"{where}: mesh axis {axis!r} is not in the mesh, whose axes are "
                    f"{tuple(axis_sizes)}. {fix or 'Use one of the mesh axes.'}"
                )
            if axis in seen:
                raise ShardingError(
                    f"{where}: mesh axis {axis!r} is used twice in one spec; a mesh axis "
                    f"may shard at most one dim of a tensor. {fix}".rstrip()
                )
            seen.add(axis)
        size = math.prod(axis_sizes[a] for a in dim)
        if shape[i] % size:
            raise ShardingError(
                f"{where}: dim {i} has size {shape[i]}, which mesh axes {dim} (size {size}) "
                f"do not divide. Pick axes whose sizes divide {shape[i]}, or pad the array. "
                f"{fix}".rstrip()
            )


def split_axes(
    axes: Axes, factor_sizes: Sequence[int], axis_sizes: Mapping[str, int]
) -> tuple[tuple[Axes, ...], Axes]:
    """Distribute a compound dim's axes over its factors, major factor first.

    An axis goes to the current factor while its size divides what is left of it; a
    factor passes on to the next only when fully used. Returns the per-factor axes and
    the axes that could not be placed (a reshard, never a wrong spec).

    Example:
        >>> split_axes(("x",), [6, 12], {"x": 2})
        ((('x',), ()), ())
        >>> split_axes(("x", "y"), [2, 12], {"x": 2, "y": 4})
        ((('x',), ('y',)), ())
        >>> split_axes(("y",), [6, 12], {"y": 4})
        (((), ()), ('y',))
    """
    out: list[list[str]] = [[] for _ in factor_sizes]
    f = 0
    remaining = factor_sizes[0] if factor_sizes else 1
    for i, axis in enumerate(axes):
        n = axis_sizes[axis]
        while f < len(factor_sizes) and remaining == 1:
            f += 1
            remaining = factor_sizes[f] if f < len(factor_sizes) else 1
        if f >= len(factor_sizes) or remaining % n:
            return tuple(tuple(a) for a in out), tuple(axes[i:])
        out[f].append(axis)
        remaining //= n
    return tuple(tuple(a) for a in out), ()


def join_axes(
    factor_axes: Sequence[DimSharding], factor_sizes: Sequence[int], axis_sizes: Mapping[str, int]
) -> tuple[DimSharding, bool]:
    """The dim state made of its factors' states: ``(dim, exact)``.

    Axes of a later factor can only follow a fully sharded earlier one, so a factor that
    is not fully sharded ends the dim. The dim is open only while its major factor is
    open; a later factor still open is taken as unsharded (the dim keeps the known
    prefix, as Shardy does). ``exact`` is False when some factor's axes could not be
    represented (the caller records a reshard).

    Example:
        >>> join_axes([("x",), ()], [2, 12], {"x": 2})
        (('x',), True)
        >>> join_axes([("x",), ("y",)], [2, 12], {"x": 2, "y": 4})
        (('x', 'y'), True)
        >>> join_axes([(), ("y",)], [6, 12], {"y": 4})
        ((), False)
        >>> join_axes([None, ("x",)], [2, 12], {"x": 2})
        (None, True)
        >>> join_axes([("x",), None], [2, 12], {"x": 2})
        (('x',), True)
    """
    if factor_axes and factor_axes[0] is None:
        return None, True
    axes: list[str] = []
    for i, (fa, size) in enumerate(zip(factor_axes, factor_sizes)):
        if fa is None:
            return tuple(axes), True
        axes.extend(fa)
        if math.prod(axis_sizes[a] for a in fa) != size:
            return tuple(axes), not any(factor_axes[i + 1 :])
    return tuple(axes), True
