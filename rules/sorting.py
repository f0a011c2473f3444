"""Sorts and top-k: `sort` (also what `argsort` lowers to), `top_k`, `approx_top_k`.

The sorted dim is need-replication: a shard's sorted order says nothing about where its
elements go globally. Every other dim passes through, shared by all operands and results
(a multi-operand sort permutes its values along with its keys). Top-k shrinks the
reduced dim from n to k, so it has one need-replication factor for the operand and
another for both results. `approx_top_k`'s other dims pass through; `top_k`'s are
need-replication too, because XLA's partitioner gathers a top-k operand whatever its
sharding (XLA of JAX 0.10.2).
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p
from jaxshard.rules.cumulative import along_axis_rule

from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule, shapes_of

NEED = FactorKind.NEED_REPLICATION


@register_rule(p.sort_p)
def sort_rule(eqn: JaxprEqn) -> Rule:
    """The sorted ``dimension`` is need-replication for every operand and result.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.ones((4, 8))
        >>> eqn = jax.make_jaxpr(lambda k, v: jax.lax.sort((k, v), dimension=1))(x, x).eqns[0]
        >>> print(sort_rule(eqn))
        ([a, b], [a, b])->([a, b], [a, b]) need_replication={b} {a=4, b=8}
    """
    return along_axis_rule(eqn, eqn.params["dimension"])


def top_k_rule(eqn: JaxprEqn, axis: int, batch: FactorKind = FactorKind.PASS) -> Rule:
    """Operand ``(..., n)`` to values and indices ``(..., k)`` along ``axis``; the other
    dims get ``batch``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: jax.lax.top_k(x, 3))(jnp.ones((4, 8))).eqns[0]
        >>> print(top_k_rule(eqn, axis=1))
        ([a, b])->([a, c], [a, c]) need_replication={b, c} {a=4, b=8, c=3}
    """
    (shape,), outs = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    axis %= len(shape)
    b = RuleBuilder(1, len(outs), ([len(shape)], [len(s) for s in outs]))
    for d, size in enumerate(shape):
        if d == axis:
            b.add_factor({0: d}, {}, size, NEED)
            b.add_factor({}, dict.fromkeys(range(len(outs)), d), outs[0][d], NEED)
        else:
            b.add_factor({0: d}, dict.fromkeys(range(len(outs)), d), size, batch)
    return b.build()


@register_rule(p.top_k_p)
def _top_k(eqn: JaxprEqn) -> Rule:
    # XLA's partitioner does not split its TopK op: it gathers the operand even along a
    # batch dim, so a sharded batch dim would only hide that gather.
    return top_k_rule(eqn, eqn.params.get("axis", -1), batch=NEED)


@register_rule(p.approx_top_k_p)
def _approx_top_k(eqn: JaxprEqn) -> Rule:
    return top_k_rule(eqn, eqn.params["reduction_dimension"])
