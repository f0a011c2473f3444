"""Elementwise primitives: every dim of the result passes through from each operand.

Operands of rank 0 (scalar literals) take part in no factor, and a size-1 dim of an
operand that broadcasts against the result takes part in no factor either.
Comparisons, logical ops, type conversions and identity-like primitives
(`copy`, `stop_gradient`, `reduce_precision`, `optimization_barrier`) share the rule.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn

from jaxshard.jax_compat import optional_primitives
from jaxshard.rule import Factor, Rule, primitive, register_rule

UNARY = (
    "abs",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "bessel_i0e",
    "bessel_i1e",
    "cbrt",
    "ceil",
    "clz",
    "conj",
    "cos",
    "cosh",
    "digamma",
    "erf",
    "erf_inv",
    "erfc",
    "exp",
    "exp2",
    "expm1",
    "floor",
    "imag",
    "integer_pow",
    "is_finite",
    "lgamma",
    "log",
    "log1p",
    "log2",
    "logistic",
    "neg",
    "not",
    "one_minus_square",
    "population_count",
    "real",
    "round",
    "rsqrt",
    "sign",
    "sin",
    "sinh",
    "sqrt",
    "square",
    "tan",
    "tanh",
    "convert_element_type",
    "reduce_precision",
    "copy",
    "stop_gradient",
)
NARY = (
    "add",
    "add_jaxvals",
    "sub",
    "mul",
    "div",
    "rem",
    "pow",
    "max",
    "min",
    "atan2",
    "and",
    "or",
    "xor",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "eq_to",
    "le_to",
    "lt_to",
    "nextafter",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "complex",
    "igamma",
    "igammac",
    "igamma_grad_a",
    "polygamma",
    "zeta",
    "regularized_incomplete_beta",
    "select_n",
    "clamp",
    "polynomial",  # x and its coefficients (scalars, or x's shape with size-1 dims)
)


def elementwise_rule(eqn: JaxprEqn) -> Rule:
    """One pass-through factor per result dim, shared by every non-scalar operand.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones((4, 8))).eqns[0]
        >>> print(elementwise_rule(eqn))
        ([a, b], [])->([a, b]) {a=4, b=8}
    """
    shape = eqn.outvars[0].aval.shape
    dims = tuple((i,) for i in range(len(shape)))
    factors = tuple(
        Factor("abcdefghijklmnopqrstuvwxyz"[i] if i < 26 else f"f{i}", s)
        for i, s in enumerate(shape)
    )
    operands = tuple(_operand_dims(getattr(v.aval, "shape", ()), shape) for v in eqn.invars)
    return Rule(factors, operands, (dims,) * len(eqn.outvars))


def _operand_dims(operand: tuple[int, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    if not operand:
        return ()
    return tuple((i,) if size == shape[i] else () for i, size in enumerate(operand))


# the primitives of this release (log2, one_minus_square and polynomial arrived in 0.11)
register_rule(*optional_primitives(*UNARY, *NARY))(elementwise_rule)
register_rule(primitive("mulhi"))(elementwise_rule)
