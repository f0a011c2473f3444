"""Contractions: `dot_general` with any dimension numbers.

Batch dims pass through to the leading result dims, each operand's free dims pass
through in order, and contracting dims are reduction factors: sharding one leaves the
result a pending partial sum (an all-reduce or reduce-scatter), as in Megatron's
row-parallel matmul.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p

from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule


@register_rule(p.dot_general_p)
def dot_general_rule(eqn: JaxprEqn) -> Rule:
    """``([b, m, k], [b, k, n])->([b, m, n]) reduction={k}`` for any dimension numbers.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(jnp.matmul)(jnp.ones((8, 4)), jnp.ones((4, 16))).eqns[0]
        >>> print(dot_general_rule(eqn))
        ([a, c], [c, b])->([a, b]) reduction={c} {a=8, b=16, c=4}
    """
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    b = RuleBuilder(2, 1, ([len(lhs), len(rhs)], [len(eqn.outvars[0].aval.shape)]))
    out = 0
    for ld, rd in zip(lb, rb):
        b.add_factor({0: ld, 1: rd}, {0: out}, lhs[ld])
        out += 1
    for ld in (d for d in range(len(lhs)) if d not in lc and d not in lb):
        b.add_factor({0: ld}, {0: out}, lhs[ld])
        out += 1
    for rd in (d for d in range(len(rhs)) if d not in rc and d not in rb):
        b.add_factor({1: rd}, {0: out}, rhs[rd])
        out += 1
    for ld, rd in zip(lc, rc):
        b.add_factor({0: ld, 1: rd}, {}, lhs[ld], FactorKind.REDUCTION)
    return b.build()
