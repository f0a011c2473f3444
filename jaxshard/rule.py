"""The rule vocabulary and the registry that maps primitives to rules.

A rule factorizes one jaxpr equation (Shardy's OpShardingRule, Paddle's einsum
notation): named factors with sizes, each operand dim and result dim a list of factors
(major to minor), and each factor a kind — pass-through, reduction (contracted away:
sharding it leaves the result a pending partial sum) or need-replication (sharding it
would need a full gather). A factor may also be read through a window (a spatial dim of
a convolution, pooling, pad, slice or reverse: Shardy's permutation factors): its
`Window` says which neighbours' rows each shard needs, a halo exchange. Higher-order
primitives do not get rules but *regions*: inner jaxprs whose values are linked to the
outer equation's by small link rules. The catalogue in ``jaxshard.rules`` fills both
registries; the engine never names a primitive.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from jax.extend.core import Jaxpr, JaxprEqn, Primitive

from jaxshard.errors import JaxshardBug


class FactorKind(enum.Enum):
    """How a factor behaves when sharded."""

    PASS = "pass"
    REDUCTION = "reduction"
    NEED_REPLICATION = "need_replication"


@dataclass(frozen=True)
class Factor:
    """One named factor of a rule: its size, kind, and for a reduction how the partial
    results on different devices combine (``sum``, ``max``, ``min``, ``prod``, ``and``,
    ``or``). An ``indexed`` reduction is a dim looked up by global indices (a gather's
    table rows): each device finds only the rows it holds, which XLA's partitioner does
    by shifting and masking the indices, so the operation run on a device's shard alone
    is not its partial result.

    A ``window`` factor is a spatial dim read through a window (a convolution's rows, a
    pooling window, a pad or a reverse): it can be sharded, and each shard then fetches
    the window's overlap from its neighbours (a halo exchange, see `Window`). Its dims
    may differ in size (a strided convolution halves the rows); the factor's size is
    their greatest common divisor, so any axes dividing it divide every dim.

    Example:
        >>> Factor("k", 64, FactorKind.REDUCTION)
        Factor(name='k', size=64, kind=<FactorKind.REDUCTION: 'reduction'>, combine='sum', indexed=False, window=None)
    """

    name: str
    size: int
    kind: FactorKind = FactorKind.PASS
    combine: str = "sum"
    indexed: bool = False
    window: Window | None = None

    @property
    def plain(self) -> bool:
        """A pass-through factor whose shards need nothing from each other."""
        return self.kind is FactorKind.PASS and self.window is None


@dataclass(frozen=True)
class Window:
    """How one dim of operand ``operand`` (``size`` long) is read to make a dim ``out``
    long, for a factor sharded evenly over both (Shardy's permutation factors). Output
    position ``o`` reads the operand, dilated by ``base_dilation``, at ``o * stride -
    low + j * dilation`` for ``j < extent`` (positions outside it are padding). A pad is
    a window of extent 1 (``low`` its low padding, negative to crop), a strided
    convolution's rows a window of the kernel's height. With ``reverse`` the dim is
    read back to front (`lax.rev`): each shard's rows live on the mirror device. With
    ``written`` ``(start, rows)`` the dim is an update's destination (a dynamic update
    slice at a constant start): each shard writes the update's rows that fall in it,
    when they all fall in one shard; rows across a shard boundary make XLA's partitioner
    gather the dim.

    Example:
        >>> Window(size=64, out=64, extent=3, low=1).halo(8)  # a 3x3 'SAME' convolution
        (1, 1)
        >>> Window(size=64, out=32, extent=2, stride=2).halo(8)  # 2x2 pooling, aligned
        (0, 0)
        >>> Window(size=64, out=64, reverse=True).permutes(8)  # each shard to its mirror
        (8,)
        >>> Window(size=8, out=8, written=(3, 2)).halo(2), Window(8, 8, written=(4, 2)).halo(2)
        (None, (0, 0))
    """

    size: int
    out: int
    extent: int = 1
    stride: int = 1
    low: int = 0
    dilation: int = 1
    base_dilation: int = 1
    reverse: bool = False
    operand: int = 0
    written: tuple[int, int] | None = None

    def halo(self, n: int) -> tuple[int, int] | None:
        """Rows (of the operand) each of ``n`` equal shards needs from the shard before
        it and from the shard after it, at most: ``(0, 0)`` when the shards are
        independent, None when a shard needs rows beyond its neighbours or the dims do
        not split evenly (XLA's partitioner then gathers the dim)."""
        return _halo(self, n)

    def permutes(self, n: int) -> tuple[int, ...] | None:
        """The rows each collective-permute of a halo exchange over ``n`` shards sends,
        one per direction that needs any (empty: no communication); None where the dim
        cannot stay split (see `halo`)."""
        if n <= 1:
            return ()
        if self.reverse:
            mirrored = self.size % n == 0 and self.out == self.size and self.extent == 1
            return (self.size // n,) if mirrored else None
        halo = self.halo(n)
        return None if halo is None else tuple(h for h in halo if h > 0)


@functools.lru_cache(maxsize=4096)
def _halo(w: Window, n: int) -> tuple[int, int] | None:
    if n <= 1:
        return (0, 0)
    if w.size % n or w.out % n or w.reverse:
        return None
    shard, out_shard = w.size // n, w.out // n
    if w.written is not None:
        start, rows = w.written
        return (0, 0) if start // shard == (start + rows - 1) // shard else None
    dilated = (w.size - 1) * w.base_dilation + 1
    before = after = 0
    for s in range(n):
        first = max(s * out_shard * w.stride - w.low, 0)
        last = min(((s + 1) * out_shard - 1) * w.stride - w.low + (w.extent - 1) * w.dilation,
                   dilated - 1)  # fmt: skip
        first_row, last_row = -(-first // w.base_dilation), last // w.base_dilation
        if first_row > last_row:
            continue  # the shard reads padding only
        # the rows it reads of the shards before and after its own (all of them in one
        # neighbour's, when the window reads none of its own: ``x[:2]`` of two shards)
        if first_row < (s - 1) * shard or last_row >= (s + 2) * shard:
            return None  # rows beyond its neighbours
        before = max(before, min(last_row + 1, s * shard) - first_row)
        after = max(after, last_row + 1 - max(first_row, (s + 1) * shard))
    if before > shard or after > shard:
        return None
    return (before, after)


Dims = tuple[tuple[int, ...], ...]  # per dim: factor indices, major to minor


@dataclass(frozen=True)
class Rule:
    """A factorization of one equation; prints like Shardy's rules.

    Example:
        >>> m, k, n = Factor("m", 128), Factor("k", 64, FactorKind.REDUCTION), Factor("n", 256)
        >>> r = Rule((m, k, n), operands=(((0,), (1,)), ((1,), (2,))), results=(((0,), (2,)),))
        >>> print(r)
        ([m, k], [k, n])->([m, n]) reduction={k} {m=128, k=64, n=256}
    """

    factors: tuple[Factor, ...]
    operands: tuple[Dims, ...]
    results: tuple[Dims, ...]

    @functools.cached_property
    def plain(self) -> bool:
        """Every factor plain (`Factor.plain`): elementwise, or a pure rearrangement.
        Cached: planning asks it of every equation in several passes, and a rule is
        shared by the repeated layers that build it.

        Example:
            >>> Rule((Factor("m", 4),), operands=(((0,),),), results=(((0,),),)).plain
            True
        """
        return all(f.plain for f in self.factors)

    def __str__(self) -> str:
        def dims(ds: Dims) -> str:
            return (
                "[" + ", ".join("".join(self.factors[f].name for f in d) or "1" for d in ds) + "]"
            )

        text = "(" + ", ".join(dims(o) for o in self.operands) + ")->("
        text += ", ".join(dims(r) for r in self.results) + ")"
        for kind in (FactorKind.REDUCTION, FactorKind.NEED_REPLICATION):
            names = [
                f.name
                + (f":{f.combine}" if kind is FactorKind.REDUCTION and f.combine != "sum" else "")
                for f in self.factors
                if f.kind is kind
            ]
            if names:
                text += f" {kind.value}={{{', '.join(names)}}}"
        windowed = [f.name for f in self.factors if f.window is not None]
        if windowed:
            text += f" window={{{', '.join(windowed)}}}"
        return text + " {" + ", ".join(f"{f.name}={f.size}" for f in self.factors) + "}"

    def check(
        self, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]], what: str
    ) -> None:
        """Raise JaxshardBug unless the rule matches the equation's shapes.

        Example:
            >>> r = identity_rule((2, 3))
            >>> r.check([(2, 3)], [(2, 3)], "sin")
        """
        for label, dims_list, shapes in (
            ("operand", self.operands, in_shapes),
            ("result", self.results, out_shapes),
        ):
            if len(dims_list) != len(shapes):
                raise JaxshardBug(
                    f"{what}: rule {self} has {len(dims_list)} {label}s, equation has {len(shapes)}"
                )
            for i, (dims, shape) in enumerate(zip(dims_list, shapes)):
                sizes = tuple(_dim_size(self.factors, d, n) for d, n in zip(dims, shape))
                if sizes != tuple(shape):
                    raise JaxshardBug(
                        f"{what}: rule {self} gives {label} {i} shape {sizes}, "
                        f"equation has {tuple(shape)}"
                    )


def _dim_size(factors: Sequence[Factor], dim: tuple[int, ...], actual: int) -> int:
    """A dim's size by its factors; a dim of one windowed factor may be either of the
    window's sizes."""
    if len(dim) == 1 and factors[dim[0]].window is not None:
        w = factors[dim[0]].window
        return actual if actual in (w.size, w.out) else -1
    return math.prod(factors[f].size for f in dim)


class RuleBuilder:
    """Builds a rule factor by factor.

    Example:
        >>> b = RuleBuilder(n_operands=1, n_results=1, ranks=([2], [1]))
        >>> a = b.add_factor(operand_dims={0: 0}, result_dims={0: 0}, size=4)
        >>> k = b.add_factor(operand_dims={0: 1}, size=3, kind=FactorKind.REDUCTION)
        >>> print(b.build())
        ([a, b])->([a]) reduction={b} {a=4, b=3}
    """

    def __init__(self, n_operands: int, n_results: int, ranks: tuple[Sequence[int], Sequence[int]]):
        self._factors: list[Factor] = []
        self._operands = [[[] for _ in range(ranks[0][i])] for i in range(n_operands)]
        self._results = [[[] for _ in range(ranks[1][i])] for i in range(n_results)]

    def add_factor(
        self,
        operand_dims: Mapping[int, int] = {},  # noqa: B006 - read only
        result_dims: Mapping[int, int] = {},  # noqa: B006 - read only
        size: int = 1,
        kind: FactorKind = FactorKind.PASS,
        name: str | None = None,
        combine: str = "sum",
        indexed: bool = False,
        window: Window | None = None,
    ) -> int:
        """Add a factor living in the given dims (appended as their minor-most factor).
        A windowed factor's size is the greatest common divisor of the window's sizes."""
        index = len(self._factors)
        if window is not None:
            size = math.gcd(window.size, window.out)
        self._factors.append(
            Factor(name or _factor_name(index), size, kind, combine, indexed, window)
        )
        for operand, dim in operand_dims.items():
            self._operands[operand][dim].append(index)
        for result, dim in result_dims.items():
            self._results[result][dim].append(index)
        return index

    def build(self) -> Rule:
        """The finished, immutable rule."""
        freeze = lambda tensors: tuple(tuple(tuple(d) for d in t) for t in tensors)  # noqa: E731
        return Rule(tuple(self._factors), freeze(self._operands), freeze(self._results))


def _factor_name(index: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[index] if index < 26 else f"f{index}"


def identity_rule(shape: Sequence[int], n: int = 2) -> Rule:
    """Every dim passes through unchanged between ``n`` tensors of one shape.

    Example:
        >>> print(identity_rule((4, 8)))
        ([a, b])->([a, b]) {a=4, b=8}
    """
    dims = tuple((i,) for i in range(len(shape)))
    factors = tuple(Factor(_factor_name(i), s) for i, s in enumerate(shape))
    return Rule(factors, (dims,) * (n - 1), (dims,))


# --- regions: how higher-order primitives link inner jaxprs -------------------------


class Side(StrEnum):
    """Which values of an equation or jaxpr a `Port` indexes."""

    IN = "in"  # operands (a jaxpr's inputs)
    OUT = "out"  # results (a jaxpr's outputs)


class Port(NamedTuple):
    """One value of an equation or a jaxpr: its side and index.

    Example:
        >>> str(Port(Side.IN, 2))
        'in[2]'
    """

    side: Side
    index: int

    def __str__(self) -> str:
        return f"{self.side.value}[{self.index}]"


@dataclass(frozen=True)
class Link:
    """Ties an outer value (a `Port` of the equation) to an inner one (a `Port` of the
    region's jaxpr).

    ``rule`` has the outer value as its operand and the inner value as its result;
    ``None`` means identity.
    """

    outer: Port
    inner: Port
    rule: Rule | None = None


@dataclass(frozen=True)
class Region:
    r"""An inner jaxpr of a higher-order equation, with how its values meet the outer ones.

    ``ties`` lists groups of inner values (`Port`\ s) that must share one
    sharding, e.g. a loop carry's body input and body output. ``param`` names the
    equation parameter holding this region's jaxpr (``index`` its position when the
    parameter is a tuple, like ``cond``'s branches): lowering rewrites it with
    constraints inside.
    """

    jaxpr: Jaxpr
    consts: tuple[Any, ...]
    links: tuple[Link, ...]
    ties: tuple[tuple[tuple[str, int], ...], ...] = field(default=())
    param: str = "jaxpr"
    index: int | None = None


RuleFn = Callable[[JaxprEqn], "Rule | None"]  # None: nothing to read, a boundary
RegionFn = Callable[[JaxprEqn], list[Region]]
# a boundary's fixed layouts: per operand and per result, a full PartitionSpec
BoundaryFn = Callable[[JaxprEqn], tuple[list[Any], list[Any]]]

_RULES: dict[Primitive, RuleFn] = {}
_REGIONS: dict[Primitive, RegionFn] = {}
_BOUNDARIES: dict[Primitive, BoundaryFn] = {}
_ANNOTATIONS: dict[Primitive, BoundaryFn] = {}


_TABLES: dict[str, dict[Primitive, Callable]] = {
    "rule": _RULES,
    "region": _REGIONS,
    "boundary": _BOUNDARIES,
    "annotation": _ANNOTATIONS,
}


def _register(kind: str, primitives: Sequence[Primitive]) -> Callable[[Callable], Callable]:
    """A decorator registering its function as the ``kind`` of each primitive; a
    primitive has one entry in all the tables (a second would silently decide which
    one the engine reads). Registering the same function again (a module reloaded) is
    allowed."""

    def deco(fn: Callable) -> Callable:
        for prim in primitives:
            for held, table in _TABLES.items():
                old = table.get(prim)
                if old is not None and _name(old) != _name(fn):
                    raise JaxshardBug(
                        f"primitive {prim.name!r} already has the {held} {_name(old)}; "
                        f"{_name(fn)} cannot be registered as its {kind} too. Extend "
                        "the one registered, or register the new function for other "
                        "primitives"
                    )
            _TABLES[kind][prim] = fn
        return fn

    return deco


def _name(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def register_rule(*primitives: Primitive) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn(eqn) -> Rule`` for primitives (each primitive once: a second
    registration of any kind raises).

    Example:
        >>> from jax.extend.core import primitives as p
        >>> @register_rule(p.neg_p)  # doctest: +SKIP
        ... def _neg(eqn): ...
    """
    return _register("rule", primitives)


def register_region(*primitives: Primitive) -> Callable[[RegionFn], RegionFn]:
    """Register ``fn(eqn) -> [Region]`` for higher-order primitives (see `Region`)."""
    return _register("region", primitives)


def register_boundary(*primitives: Primitive) -> Callable[[BoundaryFn], BoundaryFn]:
    """Register ``fn(eqn) -> (operand specs, result specs)`` for primitives whose
    operands and results have fixed layouts and whose inside is not planned (e.g.
    `shard_map`: the body is manual). Nothing propagates across them."""
    return _register("boundary", primitives)


def register_annotation(*primitives: Primitive) -> Callable[[BoundaryFn], BoundaryFn]:
    """Register ``fn(eqn) -> (operand specs, result specs)`` for identity primitives that
    pin layouts (``None`` entries pin nothing): the equation passes shardings through
    like an elementwise op, and the given specs become pins (e.g. a user's
    `with_sharding_constraint`)."""
    return _register("annotation", primitives)


def annotation_fn_for(primitive: Primitive) -> BoundaryFn | None:
    """The registered annotation function of a primitive, or None."""
    return _ANNOTATIONS.get(primitive)


def boundary_fn_for(primitive: Primitive) -> BoundaryFn | None:
    """The registered boundary function of a primitive, or None."""
    return _BOUNDARIES.get(primitive)


def rule_fn_for(primitive: Primitive) -> RuleFn | None:
    """The registered rule function of a primitive, or None."""
    return _RULES.get(primitive)


def region_fn_for(primitive: Primitive) -> RegionFn | None:
    """The registered region function of a higher-order primitive, or None."""
    return _REGIONS.get(primitive)


def covered_primitives() -> list[str]:
    """Names of every primitive the catalogue covers, sorted.

    Example:
        >>> import jaxshard.rules  # registers the catalogue
        >>> "dot_general" in covered_primitives()
        True
    """
    return sorted({p.name for p in (*_RULES, *_REGIONS, *_BOUNDARIES, *_ANNOTATIONS)})


def primitive(name: str) -> Primitive:
    """A JAX primitive object by name, for the few that `jax.extend` does not export.

    Example:
        >>> primitive("split").name
        'split'
    """
    from jaxshard.jax_compat import optional_primitive

    found = optional_primitive(name)
    if found is None:
        raise JaxshardBug(f"primitive {name!r} not found in this JAX version")
    return found


def shapes_of(vars_: Iterable[Any]) -> list[tuple[int, ...]]:
    """Shapes of jaxpr vars or literals (an abstract token counts as rank 0)."""
    return [tuple(getattr(v.aval, "shape", ())) for v in vars_]
