"""User kernels: `custom_partitioning` ops and `jaxshard.with_rule` calls use their own rules.

A `custom_partitioning` equation carries the ``sharding_rule`` it gives Shardy (an
`SdyShardingRule`; a string is parsed into one when the op is defined): it becomes the
jaxshard rule, need-replication, reduction and compound factors included; a factor only
its operands have is a reduction, as Shardy reads it (the op's partition callback sums
it). Without one
(or with a rule computed by a callback at lowering time) the op stays a boundary and the
planner warns. A `with_rule` equation carries the user's rule for its first results;
constants the body captured and values it saves for the backward pass are appended as
operands and results: one that is a ruled operand or result keeps its factors, any other
gets factors by shape probing (`jaxshard.kernels.call_rule`).
"""

from __future__ import annotations

from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning_p
from jax.extend.core import JaxprEqn

from jaxshard.kernels import call_rule, to_rule, with_rule_p
from jaxshard.rule import FactorKind, Rule, register_rule, shapes_of


@register_rule(custom_partitioning_p)
def custom_partitioning_rule(eqn: JaxprEqn) -> Rule | None:
    """The op's own ``sharding_rule``; None (a boundary) when it has none to read.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.experimental.custom_partitioning import custom_partitioning
        >>> f = custom_partitioning(lambda a, b: a @ b)
        >>> f.def_partition(partition=None, sharding_rule="i j, j k -> i k",
        ...                 reduction_factors=("j",))
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((2, 4)), jnp.ones((4, 6))).eqns[0]
        >>> print(custom_partitioning_rule(eqn))
        ([i, j], [j, k])->([i, k]) reduction={j} {i=2, j=4, k=6}
    """
    sdy = eqn.params.get("sharding_rule")
    if not isinstance(sdy, SdyShardingRule):
        return None
    name = getattr(eqn.params.get("call"), "jaxpr", None)
    what = "custom_partitioning" + (f" ({_debug_name(name)})" if name is not None else "")
    # a factor only its operands have is one the op's partition callback reduces
    return to_rule(sdy, shapes_of(eqn.invars), shapes_of(eqn.outvars), what, FactorKind.REDUCTION)


def _debug_name(jaxpr) -> str:
    info = getattr(jaxpr, "debug_info", None)
    return getattr(info, "func_name", None) or "?"


@register_rule(with_rule_p)
def with_rule_rule(eqn: JaxprEqn) -> Rule:
    """The user's rule, extended over captured constants and saved residuals.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxshard.kernels import with_rule
        >>> f = with_rule("b d -> b d")(jnp.tanh)
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((4, 2))).eqns[0].params["call_jaxpr"].eqns[0]
        >>> print(with_rule_rule(eqn))
        ([b, d])->([b, d]) {b=4, d=2}
    """
    return call_rule(eqn.params, shapes_of(eqn.invars), shapes_of(eqn.outvars))
