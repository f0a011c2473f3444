"""Convolutions: `conv_general_dilated` with any dimension numbers and group counts.

The batch dim passes through from the lhs to the result, the kernel's output-feature
dim passes through to the result's feature dim, and the input feature dim, contracted
with the kernel's input-feature dim, is a reduction factor (a sharded input-feature dim
leaves partial sums), as for a matmul. Spatial dims are need-replication, with separate
factors for the lhs, the kernel window and the result: a spatial shard would need a halo
exchange with its neighbours. The exception is a pointwise dim (a 1-wide window with no
stride, padding or dilation), which passes through from the lhs to the result.

With ``feature_group_count`` G > 1 the feature dims split group-major: the lhs feature
dim is ``[g, ci]``, the kernel's output-feature dim and the result's feature dim are
``[g, co]``. For a depthwise convolution (one input feature per group) the batch and
group factors pass through, as each device convolves its own channels; with several
input features per group XLA's partitioner gathers the operands whatever their
sharding, so every factor is need-replication. With ``batch_group_count`` > 1 (the
kernel gradient of a grouped convolution) the batch and output-feature dims are
need-replication and the input features still reduce.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p

from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule, shapes_of

NEED = FactorKind.NEED_REPLICATION
PASS = FactorKind.PASS


@register_rule(p.conv_general_dilated_p)
def conv_rule(eqn: JaxprEqn) -> Rule:
    """Batch and output features pass, input features reduce, spatial dims replicate.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x, w: jax.lax.conv_general_dilated(
        ...     x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 6))).eqns[0]
        >>> print(conv_rule(eqn))
        ([a, c, f, i], [d, g, i, b])->([a, e, h, b]) reduction={i}
        need_replication={c, d, e, f, g, h} {a=2, b=6, c=8, d=3, e=8, f=8, g=3, h=8, i=4}
    """
    params = eqn.params
    dn = params["dimension_numbers"]
    groups, batch_groups = params["feature_group_count"], params["batch_group_count"]
    lhs, rhs = shapes_of(eqn.invars)
    (out,) = shapes_of(eqn.outvars)
    (lb, lf, *ls), (ro, ri, *rs), (ob, of, *os) = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    in_group = rhs[ri]  # input features per group
    # XLA partitions a grouped convolution only when each group has one input feature
    # (depthwise); otherwise it gathers even a batch-sharded lhs.
    grouped_gathers = groups > 1 and in_group > 1
    b = RuleBuilder(2, 1, ([len(lhs), len(rhs)], [len(out)]))
    if batch_groups == 1 and not grouped_gathers:
        b.add_factor({0: lb}, {0: ob}, lhs[lb])
    else:
        b.add_factor({0: lb}, {}, lhs[lb], NEED)
        b.add_factor({}, {0: ob}, out[ob], NEED)
    if groups > 1:
        b.add_factor({0: lf, 1: ro}, {0: of}, groups, NEED if grouped_gathers else PASS)
        if rhs[ro] > groups:  # a channel multiplier
            b.add_factor({1: ro}, {0: of}, rhs[ro] // groups, NEED)
    else:
        b.add_factor({1: ro}, {0: of}, rhs[ro], PASS if batch_groups == 1 else NEED)
    strides, padding = params["window_strides"], params["padding"]
    lhs_dilation = params["lhs_dilation"]
    for i, (ld, rd, od) in enumerate(zip(ls, rs, os)):
        pointwise = (
            not grouped_gathers
            and rhs[rd] == 1
            and strides[i] == 1
            and tuple(padding[i]) == (0, 0)
            and lhs_dilation[i] == 1
            and lhs[ld] == out[od]
        )
        if pointwise:
            b.add_factor({0: ld}, {0: od}, lhs[ld])
            continue
        b.add_factor({0: ld}, {}, lhs[ld], NEED)
        b.add_factor({1: rd}, {}, rhs[rd], NEED)
        b.add_factor({}, {0: od}, out[od], NEED)
    if groups == 1:
        b.add_factor({0: lf, 1: ri}, {}, in_group, FactorKind.REDUCTION)
    elif grouped_gathers:
        b.add_factor({0: lf, 1: ri}, {}, in_group, NEED)
    return b.build()
