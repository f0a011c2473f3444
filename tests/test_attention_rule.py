"""The cuDNN attention rules, validated on the XLA reference implementation.

`dot_product_attention_fwd`/`_bwd` run only on a GPU with cuDNN (where
`rule_samples.REFERENCE_SAMPLES` join the execution test). Here each rule is built from
the traced cuDNN equation, and every pass-through factor it declares is checked on
`jax.nn.dot_product_attention(implementation="xla")`, the same math on the same shapes:
run under the shardings the rule implies for query, key, value and output (gradients
for the backward), the result must match the unsharded run and compile to a program
without collectives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from rule_samples import REFERENCE_SAMPLES

from jaxshard.jax_compat import cudnn_attention
from jaxshard.rule import FactorKind, rule_fn_for
from jaxshard.verify import hlo_collectives


def _cases():
    for sample_id, fn, args in REFERENCE_SAMPLES:
        eqn = jax.make_jaxpr(fn)(*args).eqns[-1]
        rule = rule_fn_for(eqn.primitive)(eqn)
        for f, factor in enumerate(rule.factors):
            if factor.kind is FactorKind.PASS and factor.size % 2 == 0:
                yield pytest.param(sample_id, eqn, rule, f, args, id=f"{sample_id}-{factor.name}")


CASES = list(_cases())


@pytest.fixture(scope="module")
def mesh2():
    return jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])


def _spec(rule, dims, f) -> P:
    return P(*("x" if d and d[0] == f else None for d in dims))


def _reference(eqn):
    causal = eqn.params["mask_type"] is not cudnn_attention.MaskType.NO_MASK

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    if "bwd" not in eqn.primitive.name:
        return forward, (0, 1, 2), ((True, 0),)

    def backward(q, k, v, dout):
        return jax.vjp(forward, q, k, v)[1](dout)

    return backward, (0, 1, 2, 12), ((False, 0), (False, 1), (False, 2))


def test_cases_are_collected():
    assert {c.values[0] for c in CASES} >= {"attention-fwd", "attention-fwd-gqa", "attention-bwd"}


@pytest.mark.parametrize("sample_id, eqn, rule, f, args", CASES)
def test_pass_factor_on_reference(sample_id, eqn, rule, f, args, mesh2):
    fn, operands, results = _reference(eqn)
    x = [jnp.asarray(args[i], jnp.float32) for i in (0, 1, 2)] + [jnp.asarray(args[0], jnp.float32)]
    x = x[: len(operands)]
    in_specs = [_spec(rule, rule.operands[i], f) for i in operands]
    out_specs = [_spec(rule, rule.results[i], f) for _, i in results]
    expected = fn(*x)
    shard = lambda s: NamedSharding(mesh2, s)  # noqa: E731
    out_shardings = out_specs[0] if len(out_specs) == 1 else tuple(out_specs)
    jitted = jax.jit(
        fn,
        in_shardings=tuple(shard(s) for s in in_specs),
        out_shardings=jax.tree.map(shard, out_shardings),
    )
    ops = [jax.device_put(a, shard(s)) for a, s in zip(x, in_specs)]
    compiled = jitted.lower(*ops).compile()
    actual = compiled(*ops)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)
    collectives = hlo_collectives(compiled.as_text())
    assert not collectives, (
        f"{sample_id}: factor {rule.factors[f].name} of {rule} is declared pass-through, but "
        f"the reference under in {in_specs} / out {out_specs} compiled {dict(collectives)}"
    )
