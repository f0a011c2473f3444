"""Cumulative scans: `cumsum`, `cumprod`, `cummax`, `cummin`, `cumlogsumexp`.

Each result element depends on every operand element before it along the scanned axis,
so that axis is need-replication (a device's shard would need its predecessors'
totals); every other dim passes through. `along_axis_rule` is shared with the sorts.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p

from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule, shapes_of


def along_axis_rule(eqn: JaxprEqn, axis: int) -> Rule:
    """Operands and results of one shape: dim ``axis`` is need-replication, the rest pass.

    One factor per dim, shared by every tensor.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: jnp.cumsum(x, axis=1))(jnp.ones((4, 8))).eqns[0]
        >>> print(along_axis_rule(eqn, 1))
        ([a, b])->([a, b]) need_replication={b} {a=4, b=8}
    """
    ins, outs = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    shape = outs[0]
    axis %= max(len(shape), 1)
    b = RuleBuilder(len(ins), len(outs), ([len(s) for s in ins], [len(s) for s in outs]))
    for d, size in enumerate(shape):
        kind = FactorKind.NEED_REPLICATION if d == axis else FactorKind.PASS
        b.add_factor(
            dict.fromkeys(range(len(ins)), d), dict.fromkeys(range(len(outs)), d), size, kind
        )
    return b.build()


@register_rule(p.cumsum_p, p.cumprod_p, p.cummax_p, p.cummin_p, p.cumlogsumexp_p)
def cumulative_rule(eqn: JaxprEqn) -> Rule:
    """The scanned ``axis`` is need-replication, whatever the direction.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: jax.lax.cummax(x, axis=0))(jnp.ones((4, 8))).eqns[0]
        >>> print(cumulative_rule(eqn))
        ([a, b])->([a, b]) need_replication={a} {a=4, b=8}
    """
    return along_axis_rule(eqn, eqn.params["axis"])
