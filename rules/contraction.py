"""Contractions: `dot_general` with any dimension numbers.

Batch dims pass through to the leading result dims, each operand's free dims pass
through in order, and contracting dims are reduction factors: sharding one leaves the
result a pending partial sum (an all-reduce or reduce-scatter), as in Megatron's
row-parallel matmul. `scaled_dot` (block-scaled low-precision matmuls) is the same with
each scale riding along its operand.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p

from jaxshard.jax_compat import scaled_dot_p
from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule

NEED = FactorKind.NEED_REPLICATION


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


@register_rule(scaled_dot_p)
def scaled_dot_rule(eqn: JaxprEqn) -> Rule:
    """`lax.scaled_dot`: ``(lhs * lhs_scale) @ (rhs * rhs_scale)``, each scale one entry
    per block of the contracting dim and the operand's size elsewhere. As `dot_general`,
    with each scale sharing its operand's batch and free factors; a contracting dim is
    ``[blocks, block]``: whole blocks are a reduction (each device sums its blocks with
    their scales), the within-block factor need-replication. Where the two scales cut a
    contracting dim into different block counts it is need-replication whole.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> l, r = jnp.ones((4, 8), jnp.float8_e4m3fn), jnp.ones((8, 6), jnp.float8_e4m3fn)
        >>> ls, rs = jnp.ones((4, 2), jnp.float8_e8m0fnu), jnp.ones((2, 6), jnp.float8_e8m0fnu)
        >>> f = lambda *a: jax.lax.scaled_dot(a[0], a[1], lhs_scale=a[2], rhs_scale=a[3])
        >>> print(scaled_dot_rule(jax.make_jaxpr(f)(l, r, ls, rs).eqns[0]))
        ([a, cd], [cd, b], [a, c], [c, b])->([a, b]) reduction={c} need_replication={d}
        {a=4, b=6, c=2, d=4}
    """
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs, lhs_scale, rhs_scale = (v.aval.shape for v in eqn.invars)
    b = RuleBuilder(
        4,
        1,
        ([len(lhs), len(rhs), len(lhs_scale), len(rhs_scale)], [len(eqn.outvars[0].aval.shape)]),
    )
    out = 0
    for ld, rd in zip(lb, rb):
        b.add_factor({0: ld, 1: rd, 2: ld, 3: rd}, {0: out}, lhs[ld])
        out += 1
    for ld in (d for d in range(len(lhs)) if d not in lc and d not in lb):
        b.add_factor({0: ld, 2: ld}, {0: out}, lhs[ld])
        out += 1
    for rd in (d for d in range(len(rhs)) if d not in rc and d not in rb):
        b.add_factor({1: rd, 3: rd}, {0: out}, rhs[rd])
        out += 1
    for ld, rd in zip(lc, rc):
        blocks = lhs_scale[ld]
        if blocks == rhs_scale[rd] and lhs[ld] % blocks == 0:
            b.add_factor({0: ld, 1: rd, 2: ld, 3: rd}, {}, blocks, FactorKind.REDUCTION)
            b.add_factor({0: ld, 1: rd}, {}, lhs[ld] // blocks, NEED)
        else:
            b.add_factor({0: ld, 1: rd}, {}, lhs[ld], NEED)
            b.add_factor({2: ld}, {}, lhs_scale[ld], NEED)
            b.add_factor({3: rd}, {}, rhs_scale[rd], NEED)
    return b.build()
