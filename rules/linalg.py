"""Linear algebra (`jax.lax.linalg`) and `fft`: batch dims free, core dims replicated.

Every `lax.linalg` primitive acts on the trailing *core* dims of each operand (2 for a
matrix, 1 for a vector such as `householder_product`'s ``taus``) and maps the leading
*batch* dims, which all operands and results share, one problem per batch element
(JAX's own ``linalg_shape_rule``). So a batch dim passes through, and a core dim is
need-replication: a factorization, solve or decomposition reads its whole matrix. A
solve's right-hand-side count (the columns of ``B`` in ``A X = B``) would be free in the
math, but XLA all-gathers ``B`` when it is split there (measured by the rule execution
test, JAX 0.10 on CPU), so it is need-replication too.

`fft` transforms the trailing ``len(fft_lengths)`` dims, which need replication (a
Fourier transform mixes every element of a dim). Its leading dims would be free in the
math, but XLA's partitioner all-gathers an fft's operand whichever dim is split
(measured the same way), so every fft dim is need-replication: a plan that split them
would predict no communication where the compiled program gathers.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p

from jaxshard.errors import JaxshardBug
from jaxshard.jax_compat import lax_linalg
from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule, shapes_of

NEED = FactorKind.NEED_REPLICATION

# operand 0's core rank per primitive (the rest of its rank is batch dims), from the
# ``ranks`` each is declared with in jax/_src/lax/linalg.py
CORE_RANK = {
    lax_linalg.cholesky_p: 2,
    lax_linalg.cholesky_update_p: 2,
    lax_linalg.eig_p: 2,
    lax_linalg.eigh_p: 2,
    lax_linalg.hessenberg_p: 2,
    lax_linalg.householder_product_p: 2,
    lax_linalg.ormqr_p: 2,
    lax_linalg.lu_p: 2,
    lax_linalg.lu_pivots_to_permutation_p: 1,
    lax_linalg.geqrf_p: 2,
    lax_linalg.geqp3_p: 2,
    lax_linalg.qr_p: 2,
    lax_linalg.schur_p: 2,
    lax_linalg.svd_p: 2,
    lax_linalg.symmetric_product_p: 2,
    lax_linalg.triangular_solve_p: 2,
    lax_linalg.tridiagonal_p: 2,
    lax_linalg.tridiagonal_solve_p: 1,
}


def linalg_rule(eqn: JaxprEqn) -> Rule:
    """Batch dims shared by every operand and result; core dims need-replication.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(jnp.linalg.eigh)(jnp.ones((4, 8, 8))).eqns[0]
        >>> eqn = eqn.params["jaxpr"].eqns[-1]  # eigh inside jnp's jit
        >>> print(linalg_rule(eqn))
        ([a, b, c])->([a, d, e], [a, f]) need_replication={b, c, d, e, f}
        {a=4, b=8, c=8, d=8, e=8, f=8}
        >>> f = lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=True)
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((2, 8, 8)), jnp.ones((2, 8, 4))).eqns[0]
        >>> print(linalg_rule(eqn))
        ([a, b, c], [a, d, e])->([a, f, g]) need_replication={b, c, d, e, f, g}
        {a=2, b=8, c=8, d=8, e=4, f=8, g=4}
    """
    ins, outs = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    if eqn.primitive not in CORE_RANK:
        raise JaxshardBug(f"linalg rule: no core rank recorded for {eqn.primitive.name}")
    batch = len(ins[0]) - CORE_RANK[eqn.primitive]
    b = RuleBuilder(len(ins), len(outs), ([len(s) for s in ins], [len(s) for s in outs]))
    for d in range(batch):
        b.add_factor(
            dict.fromkeys(range(len(ins)), d), dict.fromkeys(range(len(outs)), d), ins[0][d]
        )
    for i, shape in enumerate(ins):
        for d in range(batch, len(shape)):
            b.add_factor({i: d}, {}, shape[d], NEED)
    for i, shape in enumerate(outs):
        for d in range(batch, len(shape)):
            b.add_factor({}, {i: d}, shape[d], NEED)
    return b.build()


register_rule(*CORE_RANK)(linalg_rule)


@register_rule(p.fft_p)
def fft_rule(eqn: JaxprEqn) -> Rule:
    """Leading dims are shared need-replication factors (see the module docstring); the
    ``len(fft_lengths)`` transformed dims are need-replication per tensor (their sizes may
    change: a real FFT halves the last).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(jnp.fft.rfft)(jnp.ones((4, 8))).eqns[0]
        >>> print(fft_rule(eqn.params["jaxpr"].eqns[-1]))
        ([a, b])->([a, c]) need_replication={a, b, c} {a=4, b=8, c=5}
    """
    (shape,), (out,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    lead = len(shape) - len(eqn.params["fft_lengths"])
    b = RuleBuilder(1, 1, ([len(shape)], [len(out)]))
    for d in range(lead):
        b.add_factor({0: d}, {0: d}, shape[d], NEED)
    for d in range(lead, len(shape)):
        b.add_factor({0: d}, {}, shape[d], NEED)
    for d in range(lead, len(out)):
        b.add_factor({}, {0: d}, out[d], NEED)
    return b.build()
