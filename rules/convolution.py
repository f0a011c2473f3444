"""Convolutions: `conv_general_dilated` with any dimension numbers and group counts.

The batch dim passes through from the lhs to the result, the kernel's output-feature
dim passes through to the result's feature dim, and the input feature dim, contracted
with the kernel's input-feature dim, is a reduction factor (a sharded input-feature dim
leaves partial sums), as for a matmul. A spatial dim is a windowed factor
(`jaxshard.rule.Window`): split, each device convolves its own rows after fetching its
neighbours' overlap of the kernel window (a halo, by collective-permutes). Where the
kernel window is no larger than the result (a forward convolution, the input gradient)
the factor links the lhs rows to the result rows and the kernel rows are their own
need-replication factor; where the window is larger (the kernel gradient, whose "kernel"
is the output gradient) it links the lhs rows to the window rows as a reduction, each
device summing its rows' contributions, and the result's (kernel-sized) rows are
need-replication. A pointwise dim (a 1-wide window with no stride, padding or dilation)
simply passes through.

With ``feature_group_count`` G > 1 the feature dims split group-major: the lhs feature
dim is ``[g, ci]``, the kernel's output-feature dim and the result's feature dim are
``[g, co]``. For a depthwise convolution (one input feature per group) the batch and
group factors pass through, as each device convolves its own channels; with several
input features per group XLA's partitioner gathers the operands whatever their
sharding, so every factor is need-replication.

With ``batch_group_count`` G > 1 (the kernel gradient of a grouped convolution) the lhs
batch dim is ``[g, n]`` and the kernel's and the result's output features ``[g, o]``:
group g's rows make group g's features, so ``g`` splits with no communication (a
depthwise kernel gradient split by channels), the rest is need-replication and the
input features still reduce.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p

from jaxshard.rule import FactorKind, Rule, RuleBuilder, Window, register_rule, shapes_of

NEED = FactorKind.NEED_REPLICATION
PASS = FactorKind.PASS


@register_rule(p.conv_general_dilated_p)
def conv_rule(eqn: JaxprEqn) -> Rule:
    """Batch and output features pass, input features reduce, spatial dims are windowed.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x, w: jax.lax.conv_general_dilated(
        ...     x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 6))).eqns[0]
        >>> print(conv_rule(eqn))
        ([a, c, e, g], [d, f, g, b])->([a, c, e, b]) reduction={g} need_replication={d, f}
        window={c, e} {a=2, b=6, c=8, d=3, e=8, f=3, g=4}
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
    if batch_groups > 1 and groups == 1:
        # the lhs batch is [group, row], the output features [group, feature]: each
        # group's rows make that group's features (a grouped convolution's kernel
        # gradient), so the group factor splits with no communication
        b.add_factor({0: lb, 1: ro}, {0: of}, batch_groups)
        b.add_factor({0: lb}, {0: ob}, lhs[lb] // batch_groups, NEED)
        b.add_factor({1: ro}, {0: of}, rhs[ro] // batch_groups, NEED)
    elif batch_groups == 1 and not grouped_gathers:
        b.add_factor({0: lb}, {0: ob}, lhs[lb])
    else:
        b.add_factor({0: lb}, {}, lhs[lb], NEED)
        b.add_factor({}, {0: ob}, out[ob], NEED)
    if groups > 1:
        b.add_factor({0: lf, 1: ro}, {0: of}, groups, NEED if grouped_gathers else PASS)
        if rhs[ro] > groups:  # a channel multiplier
            b.add_factor({1: ro}, {0: of}, rhs[ro] // groups, NEED)
    elif batch_groups == 1:
        b.add_factor({1: ro}, {0: of}, rhs[ro])
    # (with batch groups alone, the output features are the groups' factors above)
    strides, padding = params["window_strides"], params["padding"]
    lhs_dilation, rhs_dilation = params["lhs_dilation"], params["rhs_dilation"]
    for i, (ld, rd, od) in enumerate(zip(ls, rs, os)):
        if grouped_gathers:
            b.add_factor({0: ld}, {}, lhs[ld], NEED)
            b.add_factor({1: rd}, {}, rhs[rd], NEED)
            b.add_factor({}, {0: od}, out[od], NEED)
            continue
        pointwise = (
            rhs[rd] == 1
            and strides[i] == 1
            and tuple(padding[i]) == (0, 0)
            and lhs_dilation[i] == 1
            and lhs[ld] == out[od]
        )
        if pointwise:
            b.add_factor({0: ld}, {0: od}, lhs[ld])
        elif rhs[rd] <= out[od]:  # out[o] reads lhs[o * stride - low + j * rhs_dilation]
            window = Window(lhs[ld], out[od], rhs[rd], strides[i], padding[i][0],
                            rhs_dilation[i], lhs_dilation[i])  # fmt: skip
            b.add_factor({0: ld}, {0: od}, window=window)
            b.add_factor({1: rd}, {}, rhs[rd], NEED)
        else:  # summed over window rows q, each reading lhs[q * rhs_dilation - low + o * stride]
            window = Window(lhs[ld], rhs[rd], out[od], rhs_dilation[i], padding[i][0],
                            strides[i], lhs_dilation[i])  # fmt: skip
            b.add_factor({0: ld, 1: rd}, {}, kind=FactorKind.REDUCTION, window=window)
            b.add_factor({}, {0: od}, out[od], NEED)
    if groups == 1:
        b.add_factor({0: lf, 1: ri}, {}, in_group, FactorKind.REDUCTION)
    elif grouped_gathers:
        b.add_factor({0: lf, 1: ri}, {}, in_group, NEED)
    return b.build()
