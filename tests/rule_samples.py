"""Small programs that exercise every primitive the rule catalogue covers (or will cover).

`SAMPLES` is a table of ``(id, fn, args)``: ``fn(*args)`` contains at least one equation
of the primitive the id names. Arguments are concrete arrays with small even dims (so
every factor can be split over 2 devices), values inside each primitive's domain (results
are finite) and valid indices for gathers, scatters and dynamic slices. A scatter that
overwrites (``.set``) gets unique indices so its result does not depend on the order the
updates are applied in.

`tests/test_rule_execution.py` runs every equation of every sample whose primitive has a
rule under the shardings the rule implies; a new rule without a sample fails its coverage
test, so add a sample here together with the rule.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint
from jaxshard.rules.attention import bind_forward

from jaxshard.jax_compat import cudnn_attention as _cudnn
from jaxshard.jax_compat import cudnn_attention_impl, cudnn_attention_params, optional_primitive
from jaxshard.jax_compat import lax_linalg as _linalg
from jaxshard.jax_compat import philox2x32 as _philox2x32
from jaxshard.jax_compat import philox4x32 as _philox4x32
from jaxshard.jax_compat import prng as _prng
from jaxshard.jax_compat import select_and_scatter as _select_and_scatter
from jaxshard.jax_compat import threefry4x32 as _threefry4x32
from jaxshard.rule import primitive

_rng = np.random.default_rng(0)


def _f32(*shape: int, lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    return _rng.uniform(lo, hi, shape).astype(np.float32)


def _i32(*shape: int, lo: int = -8, hi: int = 8) -> np.ndarray:
    return _rng.integers(lo, hi, shape).astype(np.int32)


def _index(n: int, *shape: int) -> np.ndarray:
    """Valid indices into a dim of size ``n`` (with repeats when there are more than n)."""
    return ((np.arange(int(np.prod(shape))) * 3 + 1) % n).astype(np.int32).reshape(shape)


# Shared inputs: 1-D for the long elementwise tables (one factor, one compile each),
# 2-D (4, 8) where dims, broadcasting or reductions matter.
V = _f32(8)  # any sign
POS = _f32(8, lo=0.5, hi=2.0)  # log, sqrt, rsqrt, lgamma, digamma, ...
UNIT = _f32(8, lo=-0.9, hi=0.9)  # asin, acos, atanh, erf_inv, tan
GT1 = _f32(8, lo=1.1, hi=3.0)  # acosh, zeta's x
FRAC = _f32(8, lo=0.1, hi=0.9)  # betainc's x
INT = _i32(8)
NONZERO_INT = np.array([3, -2, 5, 1, -7, 4, 2, -3], np.int32)
SHIFT = (np.arange(8) % 5).astype(np.int32)
BOOL = np.array([True, False, True, True, False, False, True, False])
BOOL2 = np.array([False, False, True, False, True, False, True, True])
CPLX = (_f32(8) + 1j * _f32(8)).astype(np.complex64)
X = _f32(4, 8)
Y = _f32(4, 8)
POS2 = _f32(4, 8, lo=0.5, hi=2.0)
NEAR1 = _f32(4, 8, lo=0.9, hi=1.1)  # reduce_prod, cumprod
INT2 = _i32(4, 8)
BOOL_2D = _rng.integers(0, 2, (4, 8)).astype(bool)
DISTINCT = _rng.permutation(32).astype(np.float32).reshape(4, 8)  # sorts, argmax: no ties


def _scatter_ids() -> np.ndarray:
    """Four distinct rows of a 16-row table, as (4, 1) scatter indices for ``.set``."""
    return np.array([[3], [0], [9], [14]], np.int32)


# --- elementwise -----------------------------------------------------------------------

_UNARY = [
    ("abs", lax.abs, V),
    ("acos", lax.acos, UNIT),
    ("acosh", lax.acosh, GT1),
    ("asin", lax.asin, UNIT),
    ("asinh", lax.asinh, V),
    ("atan", lax.atan, V),
    ("atanh", lax.atanh, UNIT),
    ("bessel_i0e", lax.bessel_i0e, V),
    ("bessel_i1e", lax.bessel_i1e, V),
    ("cbrt", lax.cbrt, V),
    ("ceil", lax.ceil, V),
    ("clz", lax.clz, INT),
    ("conj", lax.conj, CPLX),
    ("cos", lax.cos, V),
    ("cosh", lax.cosh, V),
    ("digamma", lax.digamma, POS),
    ("erf", lax.erf, V),
    ("erf_inv", lax.erf_inv, UNIT),
    ("erfc", lax.erfc, V),
    ("exp", lax.exp, V),
    ("exp2", lax.exp2, V),
    ("expm1", lax.expm1, V),
    ("floor", lax.floor, V),
    ("imag", lax.imag, CPLX),
    ("integer_pow", lambda x: lax.integer_pow(x, 3), V),
    ("integer_pow-neg", lambda x: lax.integer_pow(x, -2), POS),
    ("is_finite", lax.is_finite, V),
    ("lgamma", lax.lgamma, POS),
    ("log", lax.log, POS),
    ("log1p", lax.log1p, POS),
    ("logistic", lax.logistic, V),
    ("neg", lax.neg, V),
    ("not-bool", lax.bitwise_not, BOOL),
    ("not-int", lax.bitwise_not, INT),
    ("population_count", lax.population_count, INT),
    ("real", lax.real, CPLX),
    ("round", lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), V),
    ("round-away", lax.round, V),
    ("rsqrt", lax.rsqrt, POS),
    ("sign", lax.sign, V),
    ("sin", lax.sin, V),
    ("sinh", lax.sinh, V),
    ("sqrt", lax.sqrt, POS),
    ("square", lax.square, V),
    ("tan", lax.tan, UNIT),
    ("tanh", lax.tanh, V),
    ("convert-f32-i32", lambda x: x.astype(jnp.int32), V),
    ("convert-f32-bf16", lambda x: x.astype(jnp.bfloat16), V),
    ("convert-i32-bool", lambda x: x.astype(bool), INT),
    ("convert-bool-f32", lambda x: x.astype(jnp.float32), BOOL),
    ("reduce_precision", lambda x: lax.reduce_precision(x, 5, 10), V),
    ("copy", lambda x: jnp.array(x, copy=True), V),
    ("stop_gradient", lax.stop_gradient, V),
]

_BINARY = [
    ("add", lax.add, V, POS),
    ("add-int", lax.add, INT, NONZERO_INT),
    ("sub", lax.sub, V, POS),
    ("mul", lax.mul, V, POS),
    ("div", lax.div, V, POS),
    ("div-int", lax.div, INT, NONZERO_INT),
    ("rem", lax.rem, V, POS),
    ("rem-int", lax.rem, INT, NONZERO_INT),
    ("pow", lax.pow, POS, V),
    ("max", lax.max, V, POS),
    ("min", lax.min, V, POS),
    ("atan2", lax.atan2, V, POS),
    ("and-bool", lax.bitwise_and, BOOL, BOOL2),
    ("and-int", lax.bitwise_and, INT, NONZERO_INT),
    ("or-bool", lax.bitwise_or, BOOL, BOOL2),
    ("or-int", lax.bitwise_or, INT, NONZERO_INT),
    ("xor-bool", lax.bitwise_xor, BOOL, BOOL2),
    ("xor-int", lax.bitwise_xor, INT, NONZERO_INT),
    ("eq", lax.eq, INT, NONZERO_INT),
    ("ne", lax.ne, V, POS),
    ("lt", lax.lt, V, POS),
    ("le", lax.le, INT, NONZERO_INT),
    ("gt", lax.gt, V, POS),
    ("ge", lax.ge, V, POS),
    ("eq_to", primitive("eq_to").bind, V, POS),
    ("le_to", primitive("le_to").bind, V, POS),
    ("lt_to", primitive("lt_to").bind, V, POS),
    ("nextafter", lax.nextafter, V, POS),
    ("shift_left", lax.shift_left, INT, SHIFT),
    ("shift_right_arithmetic", lax.shift_right_arithmetic, INT, SHIFT),
    ("shift_right_logical", lax.shift_right_logical, INT, SHIFT),
    ("complex", lax.complex, V, POS),
    ("igamma", lax.igamma, POS, POS),
    ("igammac", lax.igammac, POS, POS),
    ("igamma_grad_a", lax.igamma_grad_a, POS, POS),
    ("polygamma", lax.polygamma, np.ones(8, np.float32), POS),
    ("zeta", lax.zeta, GT1 + 1.0, POS),
]

SAMPLES: list[tuple[str, object, tuple]] = [(i, fn, (x,)) for i, fn, x in _UNARY]
SAMPLES += [(i, fn, (x, y)) for i, fn, x, y in _BINARY]
SAMPLES += [
    ("betainc", lax.betainc, (POS, POS, FRAC)),
    ("select_n-bool", lax.select_n, (BOOL, V, POS)),
    ("select_n-int", lax.select_n, (np.arange(8, dtype=np.int32) % 3, V, POS, -POS)),
    ("select_n-scalar-pred", lax.select_n, (np.bool_(True), V, POS)),
    ("clamp", lax.clamp, (-POS, V, POS)),
    ("clamp-scalar-bounds", lambda x: lax.clamp(-1.0, x, 1.0), (V,)),
    ("add-2d", lax.add, (X, Y)),
    ("mul-scalar-literal", lambda x: x * 2.0, (X,)),
    ("mul-scalar-arg", lax.mul, (X, np.float32(3.0))),
    ("select_n-2d", lax.select_n, (BOOL_2D, X, Y)),
    ("where-broadcast", lambda c, x: jnp.where(c[:, None], x, 0.0), (BOOL_2D[:, 0], X)),
    ("add_any", jax.grad(lambda x: (x * x).sum()), (X,)),
    ("relu", jax.nn.relu, (X,)),
]


def _program_order(x):
    from jax.experimental.overlap import program_order

    return program_order(lambda y: jnp.tanh(y) @ y.T, enforce=False)(x)


def _xla_metadata_call(x):
    from jax.experimental.xla_metadata import xla_metadata_call

    return xla_metadata_call(lambda y: jnp.tanh(y) * 2.0, scheduling_group="a")(x)


# primitives newer releases add, sampled where this release has them
SAMPLES += [
    (name, fn, args)
    for name, fn, args in [
        ("log2", lambda x: lax.log2(x), (POS,)),
        ("one_minus_square", lambda x: lax.one_minus_square(x), (UNIT,)),
        ("polynomial", lambda x: lax.polynomial(x, [1.0, -2.0, 0.5]), (X,)),
        ("polynomial-array-coefficients", lambda x, c: lax.polynomial(x, [c, 2.0, c]), (X, Y)),
        ("program_order", _program_order, (X,)),
        ("xla_metadata_call", _xla_metadata_call, (X,)),
    ]
    if optional_primitive(name.split("-")[0]) is not None
]

# --- contractions ----------------------------------------------------------------------

SAMPLES += [
    ("matmul", jnp.matmul, (_f32(8, 4), _f32(4, 8))),
    ("matvec", jnp.matmul, (X, _f32(8))),
    ("dot-vec-vec", jnp.dot, (V, POS)),
    ("einsum-batch", lambda a, b: jnp.einsum("bsd,bde->bse", a, b), (_f32(2, 4, 8), _f32(2, 8, 4))),
    ("einsum-contract-major", lambda a, b: jnp.einsum("kn,km->nm", a, b), (X, Y)),
    ("einsum-outer-batch", lambda a, b: jnp.einsum("bi,bj->bij", a, b), (X, _f32(4, 2))),
    (
        "einsum-two-contracting",
        lambda a, b: jnp.einsum("abc,bcd->ad", a, b),
        (_f32(2, 4, 8), _f32(4, 8, 2)),
    ),
    (
        "dot-preferred-f32",
        lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32),
        (X.astype(jnp.bfloat16), _f32(8, 4).astype(jnp.bfloat16)),
    ),
    (
        "dot-int8-to-int32",
        lambda a, b: lax.dot_general(
            a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32
        ),
        (INT2.astype(np.int8), _i32(8, 4).astype(np.int8)),
    ),
]

# --- reductions ------------------------------------------------------------------------

SAMPLES += [
    ("sum-axis0", lambda x: x.sum(0), (X,)),
    ("sum-axis1", lambda x: x.sum(1), (X,)),
    ("sum-all", jnp.sum, (X,)),
    ("sum-int", lambda x: x.sum(1), (INT2,)),
    ("max-axis1", lambda x: x.max(1), (X,)),
    ("min-axis0", lambda x: x.min(0), (X,)),
    ("prod-axis1", lambda x: x.prod(1), (NEAR1,)),
    ("all-axis1", lambda x: x.all(1), (BOOL_2D,)),
    ("any-axis0", lambda x: x.any(0), (BOOL_2D,)),
    ("reduce_xor", lambda x: lax.reduce_xor(x, (1,)), (INT2,)),
    ("reduce_xor-bool", lambda x: lax.reduce_xor(x, (1,)), (BOOL_2D,)),
    ("reduce_and-int", lambda x: lax.reduce_and(x, (1,)), (INT2,)),
    ("reduce_or-int", lambda x: lax.reduce_or(x, (0,)), (INT2,)),
    (
        "reduce-variadic",
        lambda x, y: lax.reduce(
            (x, y), (np.float32(0), np.float32(1)), lambda a, b: (a[0] + b[0], a[1] * b[1]), (1,)
        ),
        (X, NEAR1),
    ),
    ("argmax", lambda x: jnp.argmax(x, 1), (DISTINCT,)),
    ("argmin", lambda x: jnp.argmin(x, 0), (DISTINCT,)),
    # vmap turns a collective over its named axis into one over the mapped dim
    ("psum-vmapped", jax.vmap(lambda r: lax.psum((r, r * 2), "i"), axis_name="i"), (X,)),
    ("pmax-vmapped", jax.vmap(lambda r: lax.pmax(r, "i"), axis_name="i"), (X,)),
    ("pmin-vmapped", jax.vmap(lambda r: lax.pmin(r, "i"), axis_name="i"), (X,)),
]

# --- shapes ----------------------------------------------------------------------------

SAMPLES += [
    ("broadcast-new-major", lambda x: jnp.broadcast_to(x, (4, 8)), (V,)),
    ("broadcast-size1", lambda x: jnp.broadcast_to(x, (4, 8)), (_f32(4, 1),)),
    ("broadcast-scalar", lambda s: jnp.broadcast_to(s, (4, 8)), (np.float32(2.0),)),
    ("broadcast-new-minor", lambda x: lax.broadcast_in_dim(x, (4, 8, 2), (0, 1)), (X,)),
    ("reshape-merge", lambda x: x.reshape(32), (X,)),
    ("reshape-split", lambda x: x.reshape(4, 8), (_f32(32),)),
    ("reshape-split-minor", lambda x: x.reshape(4, 2, 4), (X,)),
    ("reshape-insert-singleton", lambda x: x.reshape(4, 1, 8), (X,)),
    ("reshape-drop-singleton", lambda x: x.reshape(4, 8), (_f32(4, 1, 8),)),
    ("reshape-merge-leading", lambda x: x.reshape(8, 8), (_f32(2, 4, 8),)),
    ("reshape-regroup", lambda x: x.reshape(4, 8), (_f32(8, 4),)),
    ("reshape-entangled", lambda x: x.reshape(6, 4), (_f32(4, 6),)),
    ("transpose", lambda x: x.T, (X,)),
    ("transpose-3d", lambda x: x.transpose(2, 0, 1), (_f32(2, 4, 8),)),
    ("squeeze", lambda x: jnp.squeeze(x, 1), (_f32(4, 1, 8),)),
    ("squeeze-leading", lambda x: jnp.squeeze(x, 0), (_f32(1, 8),)),
    ("rev", lambda x: jnp.flip(x, 0), (X,)),
    ("pad-edges", lambda x: jnp.pad(x, ((2, 2), (0, 0))), (X,)),
    ("pad-interior", lambda x: lax.pad(x, 0.0, ((0, 0, 0), (1, 1, 1))), (X,)),
    ("pad-negative", lambda x: lax.pad(x, 0.0, ((0, 0, 0), (-2, 2, 0))), (X,)),
    ("concatenate", lambda a, b: jnp.concatenate([a, b], 1), (X, Y)),
    ("concatenate-major", lambda a, b: jnp.concatenate([a, b], 0), (X, Y)),
    ("split", lambda x: tuple(jnp.split(x, 2, axis=1)), (X,)),
    ("split-uneven", lambda x: tuple(jnp.split(x, [2], axis=0)), (X,)),
    ("slice", lambda x: x[:, 2:6], (X,)),
    ("slice-strided", lambda x: x[::2], (_f32(8, 4),)),
    ("dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, 0), (2, 8)), (X, np.int32(1))),
    ("dynamic-index", lambda x, i: x[i], (X, np.int32(2))),
    ("dynamic_slice-constant", lambda x: lax.dynamic_slice(x, (2, 4), (2, 4)), (X,)),
    (
        "dynamic_update_slice-constant",
        lambda x, u: lax.dynamic_update_slice(x, u, (2, 4)),
        (X, _f32(2, 4)),
    ),
    (
        "dynamic_update_slice",
        lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)),
        (X, _f32(2, 8), np.int32(1)),
    ),
    (
        "dynamic_update_slice-minor",
        lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)),
        (X, _f32(4, 2), np.int32(5)),
    ),
    ("iota", lambda: lax.iota(jnp.int32, 8), ()),
    ("iota-2d", lambda: lax.broadcasted_iota(jnp.int32, (4, 8), 1), ()),
    ("arange-f32", lambda: jnp.arange(8, dtype=jnp.float32), ()),
]

# --- indexing --------------------------------------------------------------------------

TABLE = _f32(16, 8)
IDS = _index(16, 4, 2)

_VMAPPED_INDEX = jax.vmap(lambda w, i: jax.lax.dynamic_index_in_dim(w, i, 0, False))

SAMPLES += [
    ("embedding-lookup", lambda t, i: t[i], (TABLE, IDS)),
    ("take_along_axis", lambda x, i: jnp.take_along_axis(x, i, 1), (X, _index(8, 4, 8))),
    ("take_along_axis-axis0", lambda x, i: jnp.take_along_axis(x, i, 0), (X, _index(4, 2, 8))),
    ("gather-rows", lambda x, i: x[i], (_f32(8, 4), _index(8, 4))),
    ("gather-columns", lambda x, i: x[:, i], (X, _index(8, 4))),
    ("take-clip", lambda x, i: jnp.take(x, i, axis=1, mode="clip"), (X, _index(8, 2))),
    ("gather-point", lambda x, i, j: x[i, j], (X, _index(4, 4), _index(8, 4))),
    (  # a per-row dynamic index (a circular pipeline's chunk): the whole dims pass
        "vmapped-dynamic-index",
        _VMAPPED_INDEX,
        # data of its own: drawing from the shared generator would change every later
        # sample's (a reduction's rounding is then checked on other numbers)
        (np.linspace(-2, 2, 256, dtype=np.float32).reshape(4, 2, 8, 4), _index(2, 4)),
    ),
    (  # its gradient: a scatter-add whose whole dims pass too
        "vmapped-dynamic-index-grad",
        lambda w, i, g: jax.vjp(lambda w: _VMAPPED_INDEX(w, i), w)[1](g)[0],
        (
            np.linspace(-2, 2, 256, dtype=np.float32).reshape(4, 2, 8, 4),
            _index(2, 4),
            np.linspace(-1, 1, 128, dtype=np.float32).reshape(4, 8, 4),
        ),
    ),
    (
        "embedding-grad",
        lambda i, u: jnp.zeros((16, 8)).at[i].add(u),
        (IDS, _f32(4, 2, 8)),
    ),
    ("scatter-add-columns", lambda x, i, u: x.at[:, i].add(u), (X, _index(8, 4), _f32(4, 4))),
    ("segment_sum", lambda u, i: jax.ops.segment_sum(u, i, 4), (X, _index(4, 4))),
    ("scatter-set", lambda t, i, u: t.at[i[:, 0]].set(u), (TABLE, _scatter_ids(), _f32(4, 8))),
    ("scatter-mul", lambda t, i, u: t.at[i].multiply(u), (TABLE, _index(16, 4), _f32(4, 8))),
    ("scatter-min", lambda t, i, u: t.at[i].min(u), (TABLE, _index(16, 4), _f32(4, 8))),
    ("scatter-max", lambda t, i, u: t.at[i].max(u), (TABLE, _index(16, 4), _f32(4, 8))),
]

# --- families whose rules are on their way (skipped until registered) ------------------

IMAGE = _f32(2, 4, 8, 8)  # NCHW
_NHWC = ("NHWC", "HWIO", "NHWC")
_DISTINCT_IMAGE = _rng.permutation(256).astype(np.float32).reshape(2, 8, 8, 2)  # no ties


def _grouped_kernel_grad(groups: int):
    """The kernel gradient of a 'SAME' convolution with ``groups`` feature groups."""
    conv = functools.partial(
        lax.conv_general_dilated, window_strides=(1, 1), padding="SAME",
        feature_group_count=groups, dimension_numbers=_NHWC,
    )  # fmt: skip
    return jax.grad(lambda x, w: jnp.sum(jnp.square(conv(x, w))), argnums=1)


_GROUPS = np.array([2, 6], np.int32)  # uneven, so a shard cannot guess where groups start
_RAGGED_CONTRACTING = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [0]), ([], [])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[]
)
_RAGGED_BATCH = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([2], [1]), ([0], [0])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)

SAMPLES += [
    (
        "conv2d",
        lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"),
        (IMAGE, _f32(4, 4, 2, 2)),
    ),
    (
        "conv2d-grouped",
        lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=2),
        (IMAGE, _f32(4, 2, 2, 2)),
    ),
    (
        "conv1d-nwc",
        lambda x, w: lax.conv_general_dilated(
            x, w, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")
        ),
        (_f32(2, 8, 4), _f32(2, 4, 8)),
    ),
    (  # spatial dims split: halo exchanges, forward and both gradients, strided
        "conv2d-grad-strided",
        jax.grad(
            lambda x, w: jnp.sum(
                jnp.sin(lax.conv_general_dilated(x, w, (2, 1), "SAME", dimension_numbers=_NHWC))
            ),
            argnums=(0, 1),
        ),
        (_f32(2, 8, 8, 2), _f32(3, 3, 2, 2)),
    ),
    (
        "conv2d-grad-dilated",
        jax.grad(
            lambda x, w: jnp.sum(
                jnp.sin(
                    lax.conv_general_dilated(
                        x, w, (1, 1), ((2, 2), (0, 0)), rhs_dilation=(2, 1), dimension_numbers=_NHWC
                    )
                )
            ),
            argnums=(0, 1),
        ),
        (_f32(2, 8, 4, 2), _f32(3, 1, 2, 2)),
    ),
    (  # the kernel gradient is a convolution with batch_group_count 2
        "conv2d-grouped-grad",
        _grouped_kernel_grad(2),
        (_f32(2, 8, 8, 4, lo=0.1, hi=1.0), _f32(2, 2, 2, 4, lo=0.1, hi=1.0)),
    ),
    (  # depthwise: one input feature per group
        "conv2d-depthwise-grad",
        _grouped_kernel_grad(4),
        (_f32(2, 8, 8, 4, lo=0.1, hi=1.0), _f32(2, 2, 1, 4, lo=0.1, hi=1.0)),
    ),
    (
        "maxpool-3x3-stride1-grad",
        jax.grad(
            lambda x: jnp.sum(
                lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME") ** 2
            )
        ),
        (_DISTINCT_IMAGE,),
    ),
    (
        "avgpool-2x2-grad",
        jax.grad(
            lambda x: jnp.sum(
                lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") ** 2
            )
        ),
        (_f32(2, 8, 8, 2),),
    ),
    ("roll-shift", lambda x: jnp.roll(x, 1, axis=0), (X,)),
    ("cumsum", lambda x: jnp.cumsum(x, 1), (X,)),
    ("cumsum-reverse", lambda x: lax.cumsum(x, 0, reverse=True), (X,)),
    ("cumsum-int", lambda x: jnp.cumsum(x, 0), (INT2,)),
    ("cumprod", lambda x: jnp.cumprod(x, 1), (NEAR1,)),
    ("cummax", lambda x: lax.cummax(x, 1), (X,)),
    ("cummin", lambda x: lax.cummin(x, 0), (X,)),
    ("cumlogsumexp", lambda x: lax.cumlogsumexp(x, 1), (X,)),
    (
        "reduce_window_sum",
        lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 2), "VALID"),
        (X,),
    ),
    (
        "reduce_window_max",
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID"),
        (X,),
    ),
    (
        "reduce_window_min-same",
        lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 3), (1, 1), "SAME"),
        (X,),
    ),
    (
        "reduce_window-generic",
        lambda x: lax.reduce_window(x, 1.0, lax.mul, (1, 2), (1, 2), "VALID"),
        (NEAR1,),
    ),
    (
        "select_and_scatter_add",
        jax.grad(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID").sum()),
        (DISTINCT,),
    ),
    (
        "select_and_scatter",
        lambda x, src: _select_and_scatter(
            x, lax.ge, (1, 2), (1, 2), ((0, 0), (0, 0)), src, np.float32(0.0), lax.add
        ),
        (DISTINCT, _f32(4, 4)),
    ),
    (
        "select_and_gather_add",
        lambda x, t: jax.jvp(
            lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID"), (x,), (t,)
        ),
        (DISTINCT, X),
    ),
    ("sort", lambda x: jnp.sort(x, 1), (DISTINCT,)),
    ("sort-axis0", lambda x: jnp.sort(x, 0), (DISTINCT,)),
    ("argsort", lambda x: jnp.argsort(x, 1), (DISTINCT,)),
    ("sort-multi-operand", lambda k, v: lax.sort((k, v), dimension=1, num_keys=1), (DISTINCT, X)),
    ("top_k", lambda x: lax.top_k(x, 2), (DISTINCT,)),
    ("approx_max_k", lambda x: lax.approx_max_k(x, 2), (DISTINCT,)),
    ("random_bits", lambda k: jax.random.bits(k, (4, 8)), (jax.random.key(0),)),
    (
        "random_bits-keys",
        jax.vmap(lambda k: jax.random.bits(k, (8,))),
        (jax.random.split(jax.random.key(1), 4),),
    ),
    ("random_split", lambda k: jax.random.split(k, 4), (jax.random.key(2),)),
    (
        "random_split-keys",
        lambda k: jax.vmap(jax.random.split)(k),
        (jax.random.split(jax.random.key(3), 4),),
    ),
    (
        "random_fold_in",
        jax.vmap(jax.random.fold_in),
        (jax.random.split(jax.random.key(4), 4), np.arange(4, dtype=np.uint32)),
    ),
    ("random_wrap", jax.random.wrap_key_data, (np.arange(8, dtype=np.uint32).reshape(4, 2),)),
    ("random_unwrap", jax.random.key_data, (jax.random.split(jax.random.key(5), 4),)),
    ("random_seed", jax.random.key, (np.int32(7),)),
    ("random_clone", jax.random.clone, (jax.random.split(jax.random.key(6), 4),)),
    ("random_gamma", lambda k, a: jax.random.gamma(k, a), (jax.random.key(9), POS2)),
    # Stateful: two runs draw different numbers, so only a rule without split factors
    # (need-replication throughout) can pass here.
    ("rng_uniform", lambda: lax.rng_uniform(0.0, 1.0, (4, 8)), ()),
    ("random_uniform", lambda k: jax.random.uniform(k, (4, 8)), (jax.random.key(8),)),
    (
        "threefry2x32",
        lambda k1, k2, x1, x2: tuple(jex_random.threefry2x32_p.bind(k1, k2, x1, x2)),
        (
            np.uint32(1),
            np.uint32(2),
            np.arange(32, dtype=np.uint32).reshape(4, 8),
            np.arange(32, 64, dtype=np.uint32).reshape(4, 8),
        ),
    ),
    (
        "rng_bit_generator",
        lambda k: lax.rng_bit_generator(k, (4, 8)),
        (np.arange(4, dtype=np.uint32),),
    ),
    ("optimization_barrier", lambda x, y: lax.optimization_barrier((x, y)), (X, V)),
    ("bitcast-same-width", lambda x: lax.bitcast_convert_type(x, jnp.int32), (X,)),
    ("bitcast-narrow", lambda x: lax.bitcast_convert_type(x, jnp.uint8), (X,)),
    (
        "bitcast-widen",
        lambda x: lax.bitcast_convert_type(x, jnp.float32),
        (np.arange(32, dtype=np.uint8).reshape(8, 4),),
    ),
    ("device_put", jax.device_put, (X,)),
    ("checkpoint_name", lambda x: checkpoint_name(x, "h"), (X,)),
    ("ragged_dot", lax.ragged_dot, (_f32(8, 4), _f32(2, 4, 8), _GROUPS)),
    (
        "ragged_dot-contracting",
        lambda a, w, g: lax.ragged_dot_general(a, w, g, _RAGGED_CONTRACTING),
        (X, _f32(8, 4), _GROUPS),
    ),
    (
        "ragged_dot-batch",
        lambda a, w, g: lax.ragged_dot_general(a, w, g, _RAGGED_BATCH),
        (_f32(4, 2, 8), _f32(4, 8, 2), np.array([1, 3], np.int32)),
    ),
]

# --- stacking, tiling, fft, linear algebra ---------------------------------------------


def _spd(batch: int, n: int) -> np.ndarray:
    """Well-conditioned symmetric positive definite matrices (cholesky, eigh)."""
    m = _f32(batch, n, n)
    return (m @ m.transpose(0, 2, 1) + n * np.eye(n, dtype=np.float32)).astype(np.float32)


_U32_4 = tuple(np.arange(32 * i, 32 * i + 32, dtype=np.uint32).reshape(4, 8) for i in range(4))
MATS = _f32(2, 4, 4) + 4 * np.eye(4, dtype=np.float32)  # a batch of 2 invertible 4x4
SPD = _spd(2, 4)
_QR_A, _QR_TAUS = (np.asarray(r) for r in _linalg.geqrf(MATS))

SAMPLES += [
    ("stack", lambda a, b: jnp.stack([a, b], 1), (X, Y)),
    ("stack-leading", lambda a, b: jnp.stack([a, b]), (X, Y)),
    ("unstack", lambda x: jnp.unstack(x, axis=0), (_f32(2, 8),)),
    ("unstack-minor", lambda x: jnp.unstack(x, axis=1), (_f32(4, 2),)),
    ("tile", lambda x: jnp.tile(x, (2, 1)), (X,)),
    ("tile-minor", lambda x: jnp.tile(x, (1, 2)), (X,)),
    (
        "mulhi",
        lax.mul_hi if hasattr(lax, "mul_hi") else primitive("mulhi").bind,
        (INT, NONZERO_INT),
    ),
    ("fft", jnp.fft.fft, (X,)),
    ("rfft", jnp.fft.rfft, (X,)),
    (
        "irfft",
        lambda x: jnp.fft.irfft(x, n=6),
        ((_f32(4, 4) + 1j * _f32(4, 4)).astype(np.complex64),),
    ),
    ("fft2", jnp.fft.fft2, (_f32(2, 4, 8),)),
    ("scatter-sub", lambda t, i, u: t.at[i].subtract(u), (TABLE, _index(16, 4), _f32(4, 8))),
    ("cholesky", jnp.linalg.cholesky, (SPD,)),
    ("cholesky_update", lax.linalg.cholesky_update, (np.linalg.cholesky(SPD[0]).T, _f32(4))),
    (
        "triangular_solve-left",
        lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
        (MATS, _f32(2, 4, 2)),
    ),
    (
        "triangular_solve-right",
        lambda a, b: lax.linalg.triangular_solve(a, b, left_side=False, transpose_a=True),
        (MATS, _f32(2, 2, 4)),
    ),
    ("qr", jnp.linalg.qr, (MATS,)),
    ("qr-pivoting", lambda a: lax.linalg.qr(a, pivoting=True), (MATS,)),
    ("geqrf", _linalg.geqrf, (MATS,)),
    ("geqp3", _linalg.geqp3, (MATS, np.zeros((2, 4), np.int32))),
    ("householder_product", lax.linalg.householder_product, (_QR_A, _QR_TAUS)),
    ("ormqr", lambda a, t, c: lax.linalg.ormqr(a, t, c), (_QR_A, _QR_TAUS, _f32(2, 4, 2))),
    ("eigh", jnp.linalg.eigh, (SPD,)),
    ("eig", lambda a: lax.linalg.eig(a, compute_left_eigenvectors=False), (SPD,)),
    ("svd", jnp.linalg.svd, (MATS,)),
    ("lu", lax.linalg.lu, (MATS,)),
    (
        "lu_pivots_to_permutation",
        lambda p: lax.linalg.lu_pivots_to_permutation(p, 4),
        (np.array([[1, 3, 2, 3], [0, 2, 2, 3]], np.int32),),
    ),
    ("hessenberg", lax.linalg.hessenberg, (MATS,)),
    ("schur", lax.linalg.schur, (MATS,)),
    ("tridiagonal", lax.linalg.tridiagonal, (SPD,)),
    (
        "symmetric_product",
        lambda a, c: lax.linalg.symmetric_product(a, c),
        (_f32(2, 4, 2), SPD),
    ),
    (
        "tridiagonal_solve",
        lax.linalg.tridiagonal_solve,
        (
            np.concatenate([np.zeros((2, 1)), _f32(2, 3)], 1).astype(np.float32),
            _f32(2, 4, lo=4.0, hi=6.0),
            np.concatenate([_f32(2, 3), np.zeros((2, 1))], 1).astype(np.float32),
            _f32(2, 4, 2),
        ),
    ),
    (
        "scaled_dot",
        lambda a, b, sa, sb: lax.scaled_dot(
            a, b, lhs_scale=sa, rhs_scale=sb, preferred_element_type=jnp.float32
        ),
        (
            _f32(4, 8).astype(jnp.float8_e4m3fn),
            _f32(8, 6).astype(jnp.float8_e4m3fn),
            _f32(4, 2, lo=0.5, hi=4.0).astype(jnp.float8_e8m0fnu),
            _f32(2, 6, lo=0.5, hi=4.0).astype(jnp.float8_e8m0fnu),
        ),
    ),
    (
        "scaled_dot-batch",
        lambda a, b, sa, sb: lax.scaled_dot(
            a,
            b,
            lhs_scale=sa,
            rhs_scale=sb,
            dimension_numbers=(((2,), (1,)), ((0,), (0,))),
            preferred_element_type=jnp.float32,
        ),
        (
            _f32(2, 4, 8).astype(jnp.float8_e4m3fn),
            _f32(2, 8, 4).astype(jnp.float8_e4m3fn),
            _f32(2, 4, 2, lo=0.5, hi=4.0).astype(jnp.float8_e8m0fnu),
            _f32(2, 2, 4, lo=0.5, hi=4.0).astype(jnp.float8_e8m0fnu),
        ),
    ),
    ("threefry4x32", lambda *a: tuple(_threefry4x32.threefry4x32_p.bind(*a)), _U32_4 + _U32_4),
    ("philox2x32", lambda *a: tuple(_philox2x32.philox2x32_p.bind(*a)), _U32_4[:3]),
    ("philox4x32", lambda *a: tuple(_philox4x32.philox4x32_p.bind(*a)), _U32_4 + _U32_4[:2]),
    ("iota_2x32_shape", lambda: _prng.iota_2x32_shape((4, 8)), ()),
    ("platform_index", lambda x: lax.platform_dependent(x, cpu=jnp.sin, default=jnp.cos), (V,)),
    (
        "layout_constraint",
        # x + 0 so that eager interpretation hands the constraint a jax.Array
        lambda x: with_layout_constraint(x + 0, Layout(major_to_minor=(0, 1))),
        (X,),
    ),
]

# --- cuDNN fused attention: traced everywhere, run only where cuDNN is ------------------
# tests/test_attention_rule.py validates these rules' factors on the XLA reference
# implementation (jax.nn.dot_product_attention(implementation="xla")) of the same shapes.


_ATTENTION = dict(
    scale=0.25, seed=42, dropout_rate=0.0, variadic_args=(False, False),
    mask_type=_cudnn.MaskType.NO_MASK, layout=_cudnn.AttentionLayout.BTNH.value,
    sliding_window_length=None,
)  # fmt: skip


def _unused(q) -> tuple:
    """The seven placeholder operands (bias, lengths, offsets, page tables)."""
    return (jnp.zeros(0, q.dtype),) * 7


def _attention_bwd(q, k, v, out, stat, dout):
    unused = jnp.zeros(0, q.dtype)
    return tuple(
        _cudnn._dot_product_attention_bwd_p_wrapper.bind(
            q, k, v, unused, unused, unused, unused, unused, unused, unused, stat, out, dout,
            **cudnn_attention_params(
                scale=1.0 / q.shape[-1] ** 0.5, seed=42, dropout_rate=0.0,
                variadic_args=(False, False), mask_type=_cudnn.MaskType.NO_MASK,
                layout=_cudnn.AttentionLayout.BTNH.value, sliding_window_length=None,
            ),
        )
    )  # fmt: skip


_Q = _f32(2, 8, 4, 16).astype(jnp.bfloat16)  # (B, T, N, H)
_KV = _f32(2, 8, 2, 16).astype(jnp.bfloat16)  # grouped-query: 2 kv heads for 4 query heads
REFERENCE_SAMPLES = [
    ("attention-fwd", lambda q, k, v: tuple(bind_forward(q, k, v)), (_Q, _Q, _Q)),
    ("attention-fwd-gqa", lambda q, k, v: tuple(bind_forward(q, k, v)), (_Q, _KV, _KV)),
    (
        "attention-fwd-causal-training",
        lambda q, k, v: tuple(bind_forward(q, k, v, causal=True, training=True)),
        (_Q, _Q, _Q),
    ),
    (
        "attention-bwd",
        _attention_bwd,
        (_Q, _Q, _Q, _Q, np.ones((2, 4, 8), np.float32), _Q),
    ),
    # the primitives the wrappers bind when they are lowered
    (
        "attention-fwd-inner",
        lambda q, k, v: tuple(
            cudnn_attention_impl(True, q, k, v, *_unused(q), **_ATTENTION, is_training=False)
        ),
        (_Q, _Q, _Q),
    ),
    (
        "attention-bwd-inner",
        lambda q, k, v, out, stat, dout: tuple(
            cudnn_attention_impl(False, q, k, v, *_unused(q), stat, out, dout, **_ATTENTION)
        ),
        (_Q, _Q, _Q, _Q, np.ones((2, 4, 8), np.float32), _Q),
    ),
]
if jax.default_backend() == "gpu":  # run them for real, like every other sample
    SAMPLES += REFERENCE_SAMPLES
