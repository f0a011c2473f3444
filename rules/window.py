"""Windowed reductions: `reduce_window_sum/max/min`, generic `reduce_window`, and the
pooling gradients `select_and_scatter_add`, `select_and_gather_add`, `select_and_scatter`.

A dim whose window is one element wide, with unit stride and no padding or dilation, is
untouched by the window: it passes through, shared by every array operand and result.
Every other dim is a windowed factor (`jaxshard.rule.Window`): split, each shard reads
its neighbours' overlap of the window (a halo, sent by collective-permutes), none at all
where the windows line up with the shards (2x2 pooling with stride 2). The pooling
gradients, which scatter back into overlapping windows, and ops reading several arrays
through one window keep a dim windowed only where windows tile it exactly (stride =
extent, no padding or dilation), and need-replication otherwise. Init values are scalars
and take part in no factor.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn, Literal, new_jaxpr_eqn
from jax.extend.core import primitives as p
from jaxshard.rules.shape import aligned_rule

from jaxshard.rewrite import register_fold
from jaxshard.rule import Rule, Window, register_rule, shapes_of


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
    """Dims outside the window pass through; windowed dims are windowed factors.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> pool = lambda x: jax.lax.reduce_window(
        ...     x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        >>> eqn = jax.make_jaxpr(pool)(jnp.ones((8, 4, 4, 3))).eqns[0]
        >>> print(window_rule(eqn))
        ([a, b, c, d])->([a, b, c, d]) window={b, c} {a=8, b=2, c=2, d=3}
    """
    params = eqn.params
    ins = [s for s in shapes_of(eqn.invars) if s]
    rank = len(params["window_dimensions"])
    ones = (1,) * rank
    # the pooled operand and the pooled (window-sized) shape: select_and_scatter_add
    # takes (source, operand), select_and_scatter (operand, source)
    name = eqn.primitive.name
    scatters = name.startswith("select_and_scatter")
    read, pooled = {"select_and_scatter_add": (1, 0), "select_and_scatter": (0, 1)}.get(
        name, (0, None)
    )
    in_shape = ins[read]
    window_shape = shapes_of(eqn.outvars)[0] if pooled is None else ins[pooled]
    dims = windowed_dims(params)
    tiled_only = scatters or len(ins) > 1 or len(eqn.outvars) > 1
    windows = {}
    for d in dims:
        w = Window(
            in_shape[d], window_shape[d], params["window_dimensions"][d],
            params["window_strides"][d], params["padding"][d][0],
            params.get("window_dilation", ones)[d], params.get("base_dilation", ones)[d],
            operand=read,
        )  # fmt: skip
        tiles = (w.extent == w.stride and w.low == 0 and w.dilation == 1
                 and w.base_dilation == 1 and w.size == w.out * w.stride)  # fmt: skip
        if tiles or not tiled_only:
            windows[d] = w
    return aligned_rule(eqn, dims - set(windows), windows)


@register_fold(p.reduce_window_sum_p)
def pad_into_window_sum(pad: JaxprEqn, window: JaxprEqn) -> JaxprEqn | None:
    """A zero pad (adding rows, none cropped) read only by a window sum of no padding or
    dilation of its own: one window sum reading the pad's operand through the pad's
    padding, its interior padding as base dilation. An average pooling's gradient pads
    to 2x + 1 rows, a size no mesh axis divides; the folded sum splits with the pooled
    gradient's rows and no communication.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> pool = lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (2,), (2,), "VALID")
        >>> _, vjp = jax.vjp(pool, jnp.ones(8))
        >>> pad, window = jax.make_jaxpr(vjp)(jnp.ones(4)).eqns
        >>> pad_into_window_sum(pad, window).params["base_dilation"]
        (2,)
    """
    if pad.primitive is not p.pad_p or not isinstance(pad.invars[1], Literal):
        return None
    config = pad.params["padding_config"]
    if pad.invars[1].val != 0 or any(lo < 0 or hi < 0 for lo, hi, _ in config):
        return None
    params = dict(window.params)
    if any(tuple(pad) != (0, 0) for pad in params["padding"]) or any(
        d != 1 for d in params["base_dilation"]
    ):
        return None
    params["padding"] = tuple((int(lo), int(hi)) for lo, hi, _ in config)
    params["base_dilation"] = tuple(int(interior) + 1 for _, _, interior in config)
    return new_jaxpr_eqn(
        [pad.invars[0]], window.outvars, window.primitive, params, window.effects,
        window.source_info, window.ctx,
    )  # fmt: skip
