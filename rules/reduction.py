"""Reductions over some dims: `reduce_sum/max/min/prod/and/or/xor`, `argmax/argmin`, and
`psum/pmax/pmin` over positional axes (what `vmap` makes of a collective over its named
axis: each operand reduced over those dims).

Kept dims pass through. A reduced dim is a reduction factor when partial results
combine by the same reduction across devices and XLA can emit that all-reduce (sum, max,
min, prod; and/or on booleans); bitwise and/or/xor on integers and xor on booleans have
no collective combiner, and for `argmax`/`argmin` a local index is meaningless
globally, so those reduced dims are need-replication.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p

from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule

_COMBINABLE = [p.reduce_sum_p, p.reduce_max_p, p.reduce_min_p, p.reduce_prod_p]


_COMBINE = {
    p.reduce_sum_p: "sum",
    p.reduce_max_p: "max",
    p.reduce_min_p: "min",
    p.reduce_prod_p: "prod",
    p.reduce_and_p: "and",
    p.reduce_or_p: "or",
}


def reduce_rule(eqn: JaxprEqn, kind: FactorKind = FactorKind.REDUCTION) -> Rule:
    """Kept dims pass through; reduced dims get ``kind`` (combined like the reduction).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: x.sum(1))(jnp.ones((4, 8))).eqns[0]
        >>> print(reduce_rule(eqn))
        ([a, b])->([a]) reduction={b} {a=4, b=8}
    """
    shape = eqn.invars[0].aval.shape
    axes = set(eqn.params["axes"])
    b = RuleBuilder(1, 1, ([len(shape)], [len(shape) - len(axes)]))
    _reduced(b, 0, shape, axes, kind, _COMBINE.get(eqn.primitive, "sum"))
    return b.build()


def _reduced(b: RuleBuilder, t: int, shape, axes, kind: FactorKind, combine: str) -> None:
    """Operand ``t``'s factors into result ``t``: ``axes`` reduced (``kind``, combined by
    ``combine``), the other dims kept in order."""
    out = 0
    for d, size in enumerate(shape):
        if d in axes:
            b.add_factor({t: d}, {}, size, kind, combine=combine)
        else:
            b.add_factor({t: d}, {t: out}, size)
            out += 1


register_rule(*_COMBINABLE)(reduce_rule)


@register_rule(p.argmax_p, p.argmin_p, p.reduce_xor_p)
def arg_reduce_rule(eqn: JaxprEqn) -> Rule:
    """Like `reduce_rule`, but the reduced dim is need-replication."""
    return reduce_rule(eqn, FactorKind.NEED_REPLICATION)


@register_rule(p.reduce_and_p, p.reduce_or_p)
def logical_reduce_rule(eqn: JaxprEqn) -> Rule:
    """A reduction on booleans (all-reduce and/or exists); need-replication on integers.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: x.any(1))(jnp.ones((4, 8), bool)).eqns[0]
        >>> print(logical_reduce_rule(eqn))
        ([a, b])->([a]) reduction={b:or} {a=4, b=8}
    """
    boolean = eqn.invars[0].aval.dtype == bool
    return reduce_rule(eqn, FactorKind.REDUCTION if boolean else FactorKind.NEED_REPLICATION)


_COLLECTIVE_COMBINE = {p.psum_p: "sum", p.pmax_p: "max", p.pmin_p: "min"}


@register_rule(*_COLLECTIVE_COMBINE)
def positional_collective_rule(eqn: JaxprEqn) -> Rule | None:
    """A ``psum``/``pmax``/``pmin`` over positional axes only (``vmap`` with an
    ``axis_name`` turns ``lax.psum(x, name)`` into one over the mapped dim): each operand
    reduced over those dims into its own result, as `reduce_rule`. Over a named mesh axis
    (inside a ``shard_map`` body, which is not planned) there is nothing to read: None.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.vmap(lambda r: jax.lax.psum(r, "i"), axis_name="i")
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((4, 8))).eqns[0]
        >>> print(positional_collective_rule(eqn))
        ([a, b])->([b]) reduction={a} {a=4, b=8}
    """
    axes = eqn.params["axes"]
    if eqn.params.get("axis_index_groups") is not None or not all(isinstance(a, int) for a in axes):
        return None
    combine = _COLLECTIVE_COMBINE[eqn.primitive]
    shapes = [v.aval.shape for v in eqn.invars]
    b = RuleBuilder(
        len(shapes), len(shapes), ([len(s) for s in shapes], [len(s) - len(axes) for s in shapes])
    )
    for t, shape in enumerate(shapes):
        _reduced(b, t, shape, axes, FactorKind.REDUCTION, combine)
    return b.build()
