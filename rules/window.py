"""Windowed reductions: `reduce_window_sum/max/min`, generic `reduce_window`, and the
pooling gradients `select_and_scatter_add`, `select_and_gather_add`, `select_and_scatter`.

A dim whose window is one element wide, with unit stride and no padding or dilation, is
untouched by the window: it passes through, shared by every array operand and result.
Every other dim is need-replication, one factor per tensor (a window straddling a shard
boundary would need its neighbour's halo). Init values are scalars and take part in no
factor.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p
from jaxshard.rules.shape import aligned_rule

from jaxshard.rule import Rule, register_rule


def windowed_dims(params) -> set[int]:
    """The dims a window touches: wider than 1, strided, padded or dilated.

    Example:
        >>> windowed_dims(dict(window_dimensions=(1, 3, 1), window_strides=(1, 1, 2),
        ...                    padding=((0, 0), (1, 1), (0, 0))))
        {1, 2}
    """
    rank = len(params["window_dimensions"])
    ones = (1,) * rank
    return {
        d
        for d, config in enumerate(
            zip(
                params["window_dimensions"],
                params["window_strides"],
                params.get("base_dilation", ones),
                params.get("window_dilation", ones),
            )
        )
        if config != (1, 1, 1, 1) or tuple(params["padding"][d]) != (0, 0)
    }


@register_rule(
    p.reduce_window_sum_p,
    p.reduce_window_max_p,
    p.reduce_window_min_p,
    p.reduce_window_p,
    p.select_and_scatter_add_p,
    p.select_and_gather_add_p,
    p.select_and_scatter_p,
)
def window_rule(eqn: JaxprEqn) -> Rule:
    """Dims outside the window pass through; windowed dims are need-replication.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> pool = lambda x: jax.lax.reduce_window(
        ...     x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        >>> eqn = jax.make_jaxpr(pool)(jnp.ones((8, 4, 4, 3))).eqns[0]
        >>> print(window_rule(eqn))
        ([a, b, d, f])->([a, c, e, f]) need_replication={b, c, d, e} {a=8, b=4, c=2, d=4,
        e=2, f=3}
    """
    return aligned_rule(eqn, windowed_dims(eqn.params))
