"""The rule vocabulary and the registry that maps primitives to rules.

A rule factorizes one jaxpr equation (Shardy's OpShardingRule, Paddle's einsum
notation): named factors with sizes, each operand dim and result dim a list of factors
(major to minor), and each factor a kind — pass-through, reduction (contracted away:
sharding it leaves the result a pending partial sum) or need-replication (sharding it
would need a full gather). Higher-order primitives do not get rules but *regions*: inner
jaxprs whose values are linked to the outer equation's by small link rules. The
catalogue in ``jaxshard.rules`` fills both registries; the engine never names a
primitive.
"""

from __future__ import annotations

import enum
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

    Example:
        >>> Factor("k", 64, FactorKind.REDUCTION)
        Factor(name='k', size=64, kind=<FactorKind.REDUCTION: 'reduction'>, combine='sum', indexed=False)
    """

    name: str
    size: int
    kind: FactorKind = FactorKind.PASS
    combine: str = "sum"
    indexed: bool = False


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
                sizes = tuple(math.prod(self.factors[f].size for f in d) for d in dims)
                if sizes != tuple(shape):
                    raise JaxshardBug(
                        f"{what}: rule {self} gives {label} {i} shape {sizes}, "
                        f"equation has {tuple(shape)}"
                    )


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
    ) -> int:
        """Add a factor living in the given dims (appended as their minor-most factor)."""
        index = len(self._factors)
        self._factors.append(Factor(name or _factor_name(index), size, kind, combine, indexed))
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
