"""Primitives that fit no larger family: identities (`optimization_barrier`,
`device_put`, `name`, `layout_constraint`), `platform_index`, `bitcast_convert_type`, the
generic `reduce` and `ragged_dot_general`.

A layout constraint fixes the order of dims in memory, not which device holds what, but
XLA does not partition it: a split operand is all-gathered (measured by the rule
execution test), so its dims are need-replication.
`platform_index` has no operands and a scalar result: there is nothing to shard.

The identities pair operand i with result i, every dim passing through. A bitcast to a
narrower or wider type adds or drops a trailing dim, which is need-replication; the
leading dims pass through. A generic `reduce` runs a user computation that need not
combine across devices, so its reduced dims are need-replication. A ragged dot is a
dot whose lhs ragged dim is cut into groups by ``group_sizes``: the ragged dim and the
group dims are need-replication (a shard would not know where its groups start), the
remaining dims behave as in `dot_general`.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p
from jaxshard.rules.elementwise import elementwise_rule
from jaxshard.rules.random import leading_rule

from jaxshard.errors import JaxshardBug
from jaxshard.jax_compat import layout_constraint_p, platform_index_p
from jaxshard.rule import FactorKind, Rule, RuleBuilder, primitive, register_rule, shapes_of

NEED = FactorKind.NEED_REPLICATION


@register_rule(primitive("optimization_barrier"), p.device_put_p, p.name_p)
def pairwise_identity_rule(eqn: JaxprEqn) -> Rule:
    """Result i is operand i: every dim of each pair passes through.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x, y: jax.lax.optimization_barrier((x, y))
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones(3)).eqns[0]
        >>> print(pairwise_identity_rule(eqn))
        ([a, b], [c])->([a, b], [c]) {a=4, b=8, c=3}
    """
    ins = shapes_of(eqn.invars)
    ranks = [len(s) for s in ins]
    b = RuleBuilder(len(ins), len(ins), (ranks, ranks))
    for i, shape in enumerate(ins):
        for d, size in enumerate(shape):
            b.add_factor({i: d}, {i: d}, size)
    return b.build()


@register_rule(p.bitcast_convert_type_p)
def bitcast_rule(eqn: JaxprEqn) -> Rule:
    """Same width: elementwise. Otherwise the extra trailing dim is need-replication.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((4, 8))).eqns[0]
        >>> print(bitcast_rule(eqn))
        ([a, b])->([a, b, c]) need_replication={c} {a=4, b=8, c=4}
    """
    (shape,), (out,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    if len(shape) == len(out):
        return elementwise_rule(eqn)
    return leading_rule(eqn, min(len(shape), len(out)))


@register_rule(p.reduce_p)
def generic_reduce_rule(eqn: JaxprEqn) -> Rule:
    """Kept dims pass through, shared by every operand and result; reduced ``dimensions``
    are need-replication. The init values are scalars and take part in nothing.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x, y: jax.lax.reduce(
        ...     (x, y), (0.0, 0.0), lambda a, b: (a[0] + b[0], a[1] * b[1]), (1,))
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((4, 8))).eqns[0]
        >>> print(generic_reduce_rule(eqn))
        ([a, b], [a, b], [], [])->([a], [a]) need_replication={b} {a=4, b=8}
    """
    ins, outs = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    reduced = set(eqn.params["dimensions"])
    arrays = range(len(outs))  # operands n arrays then n init values
    b = RuleBuilder(len(ins), len(outs), ([len(s) for s in ins], [len(s) for s in outs]))
    out = 0
    for d, size in enumerate(ins[0]):
        if d in reduced:
            b.add_factor(dict.fromkeys(arrays, d), {}, size, NEED)
        else:
            b.add_factor(dict.fromkeys(arrays, d), dict.fromkeys(arrays, out), size)
            out += 1
    return b.build()


@register_rule(primitive("ragged_dot_general"))
def ragged_dot_rule(eqn: JaxprEqn) -> Rule:
    """``ragged_dot`` ``(m, k), (g, k, n), (g,) -> (m, n)``: m and g need-replication, n
    passes, k reduces; any dimension numbers and all three ragged modes.

    ``group_sizes`` may carry leading dims of the lhs (its batch dims and those before
    the ragged dim); they share the lhs dim's factor.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)
        >>> args = jnp.ones((8, 4)), jnp.ones((2, 4, 6)), jnp.array([3, 5])
        >>> eqn = jax.make_jaxpr(f)(*args).eqns[0]
        >>> print(ragged_dot_rule(eqn))
        ([a, d], [c, d, b], [c])->([a, b]) reduction={d} need_replication={a, c}
        {a=8, b=6, c=2, d=4}
    """
    dn = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    (ragged,) = dn.lhs_ragged_dimensions
    groups = set(dn.rhs_group_dimensions)
    lhs, rhs, sizes = shapes_of(eqn.invars)
    (out,) = shapes_of(eqn.outvars)
    lhs_free = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(rhs)) if d not in rc and d not in rb and d not in groups]
    if ragged in lhs_free:
        prefix = list(lb) + lhs_free[: lhs_free.index(ragged)]
    elif ragged in lc:
        prefix = list(lb) + list(lc)[: list(lc).index(ragged)]
    else:
        prefix = list(lb)[: list(lb).index(ragged)]
    gs_dim = dict(zip(prefix, range(len(sizes) - 1))) if len(sizes) > 1 else {}
    b = RuleBuilder(3, 1, ([len(lhs), len(rhs), len(sizes)], [len(out)]))

    def operand_dims(ld: int, rd: int | None = None) -> dict[int, int]:
        dims = {0: ld} if rd is None else {0: ld, 1: rd}
        return dims | ({2: gs_dim[ld]} if ld in gs_dim else {})

    out_dim = 0
    if ragged in lc:  # the result gains a leading group dim
        b.add_factor({2: len(sizes) - 1}, {0: 0}, sizes[-1], NEED)
        out_dim = 1
    for ld, rd in zip(lb, rb):
        kind = NEED if ld == ragged else FactorKind.PASS
        b.add_factor(operand_dims(ld, rd), {0: out_dim}, lhs[ld], kind)
        out_dim += 1
    for ld in lhs_free:
        kind = NEED if ld == ragged else FactorKind.PASS
        b.add_factor(operand_dims(ld), {0: out_dim}, lhs[ld], kind)
        out_dim += 1
    for rd in rhs_free:
        b.add_factor({1: rd}, {0: out_dim}, rhs[rd])
        out_dim += 1
    for rd in groups:
        b.add_factor({1: rd, 2: len(sizes) - 1}, {}, rhs[rd], NEED)
    if ragged in lb:
        b.add_factor({2: len(sizes) - 1}, {}, sizes[-1], NEED)
    for ld, rd in zip(lc, rc):
        kind = NEED if ld == ragged else FactorKind.REDUCTION
        b.add_factor(operand_dims(ld, rd), {}, lhs[ld], kind)
    return b.build()


@register_rule(platform_index_p)
def no_factor_rule(eqn: JaxprEqn) -> Rule:
    """Scalar operands and results only: a rule without factors.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x: jax.lax.platform_dependent(x, cpu=jnp.sin, default=jnp.cos)
        >>> eqn = jax.make_jaxpr(f)(jnp.ones(2)).eqns[0]
        >>> eqn.primitive.name, str(no_factor_rule(eqn))
        ('platform_index', '()->([]) {}')
    """
    ins, outs = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    if any(ins) or any(outs):
        raise JaxshardBug(f"{eqn.primitive.name}: expected scalars, got {ins} -> {outs}")
    return RuleBuilder(len(ins), len(outs), ([0] * len(ins), [0] * len(outs))).build()


@register_rule(layout_constraint_p)
def layout_constraint_rule(eqn: JaxprEqn) -> Rule:
    """Result is the operand; every dim is need-replication (XLA gathers it otherwise).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.experimental.layout import Layout, with_layout_constraint
        >>> f = lambda x: with_layout_constraint(x, Layout(major_to_minor=(0, 1)))
        >>> print(layout_constraint_rule(jax.make_jaxpr(f)(jnp.ones((4, 8))).eqns[0]))
        ([a, b])->([a, b]) need_replication={a, b} {a=4, b=8}
    """
    (shape,) = shapes_of(eqn.invars)
    b = RuleBuilder(1, 1, ([len(shape)], [len(shape)]))
    for d, size in enumerate(shape):
        b.add_factor({0: d}, {0: d}, size, NEED)
    return b.build()
