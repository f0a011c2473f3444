"""User kernels: custom_partitioning's own rules, `with_rule`, `check_rule`, and the example.

Each rule case states the custom_partitioning-style rule and the jaxshard rule it
becomes; the example's sharded steps are compared with unsharded ones.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import kernels as example
import numpy as np
import pytest
from helpers import assert_leaves_match
from jax.experimental.custom_partitioning import (
    BATCHING,
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.errors import JaxshardWarning, ShardingError
from jaxshard.kernels import sdy_rule, to_rule


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize(
    "rule, kwargs, in_shapes, out_shapes, expected",
    [
        pytest.param(
            "i j, j k -> i k", {"reduction_factors": ("j",)}, [(2, 4), (4, 6)], [(2, 6)],
            "([i, j], [j, k])->([i, k]) reduction={j} {i=2, j=4, k=6}", id="matmul-reduction",
        ),
        pytest.param(
            "... s d -> ... s d", {"need_replication_factors": ("s",)}, [(2, 3, 8, 4)],
            [(2, 3, 8, 4)],
            "([b0, b1, s, d])->([b0, b1, s, d]) need_replication={s} {b0=2, b1=3, s=8, d=4}",
            id="ellipsis-need-replication",
        ),
        pytest.param(
            "(a b) c -> a b c", {}, [(6, 4)], [(2, 3, 4)],
            "([ab, c])->([a, b, c]) {a=2, b=3, c=4}", id="compound",
        ),
        pytest.param(
            "i j, i j -> i j", {}, [(4, 1), (4, 6)], [(4, 6)],
            "([i, 1], [i, j])->([i, j]) {i=4, j=6}", id="broadcast-size-1",
        ),
        pytest.param(
            "i j -> i", {}, [(4, 6)], [(4,)],
            "([i, j])->([i]) need_replication={j} {i=4, j=6}", id="undeclared-operand-only",
        ),
    ],
)  # fmt: skip
def test_rule_conversion(rule, kwargs, in_shapes, out_shapes, expected):
    assert str(to_rule(sdy_rule(rule, **kwargs), in_shapes, out_shapes, "op")) == expected


def test_sdy_rule_object_with_compound_and_batching():
    sdy = SdyShardingRule(
        (ArrayMapping(BATCHING, CompoundFactor("h", "d")),),
        (ArrayMapping(BATCHING, "h"),),
        reduction_factors=("d",),
        d=4,
    )
    rule = to_rule(sdy, [(2, 8)], [(2, 2)], "op")
    assert str(rule) == "([b0, hd])->([b0, h]) reduction={d} {b0=2, h=2, d=4}"


def test_rule_that_does_not_fit_names_the_call():
    f = jaxshard.with_rule("i j -> i j")(jnp.sin)
    with pytest.raises(ShardingError, match=r"with_rule\(sin\).*rank 3"):
        jaxshard.make_plan(f, (jnp.ones((2, 4, 2)),), {}, jax.make_mesh((8,), ("x",)))


def _cp_sum_rows(rule: str | None):
    f = custom_partitioning(lambda x: x * 2)
    f.def_partition(partition=lambda mesh, args, res: None, sharding_rule=rule)
    return f


def test_custom_partitioning_rule_propagates(mesh):
    f = lambda x, w: _cp_sum_rows("b h -> b h")(x) @ w  # noqa: E731
    args = (jnp.ones((8, 4)), jnp.ones((4, 8)))
    plan = jaxshard.make_plan(f, args, {}, mesh, {"x": P("data")})
    # the batch crosses the kernel and reaches the matmul's result
    assert plan.out_specs == P("data")


def test_custom_partitioning_without_rule_is_a_boundary(mesh):
    f = lambda x, w: _cp_sum_rows(None)(x) @ w  # noqa: E731
    args = (jnp.ones((8, 4)), jnp.ones((4, 8)))
    with pytest.warns(JaxshardWarning, match="no sharding rule for: custom_partitioning"):
        plan = jaxshard.make_plan(f, args, {}, mesh, {"x": P("data")})
    assert plan.out_specs == P()


def test_with_rule_runs_unchanged_and_keeps_its_custom_vjp():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (3.0 * g,))  # deliberately not cos
    wrapped = jaxshard.with_rule("i -> i")(f)
    x = jnp.linspace(0.0, 1.0, 4)
    np.testing.assert_array_equal(wrapped(x), jnp.sin(x))
    np.testing.assert_allclose(jax.grad(lambda x: wrapped(x).sum())(x), 3.0 * jnp.ones(4))
    np.testing.assert_allclose(jax.jit(jax.vmap(wrapped))(x[None]), jnp.sin(x)[None])


def test_with_rule_grad_of_calls_with_different_shapes():
    """Each call keeps its own backward pass (two shapes in one differentiated function)."""
    wrapped = jaxshard.with_rule("i j -> i j")(lambda x: jnp.sin(x) * x)
    f = lambda a, b: wrapped(a).sum() + 2 * wrapped(b).sum()  # noqa: E731
    plain = lambda a, b: (jnp.sin(a) * a).sum() + 2 * (jnp.sin(b) * b).sum()  # noqa: E731
    a, b = jnp.linspace(0, 1, 8).reshape(2, 4), jnp.linspace(-1, 1, 18).reshape(3, 6)
    for got, want in zip(jax.grad(f, (0, 1))(a, b), jax.grad(plain, (0, 1))(a, b)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_check_rule_accepts_a_right_rule():
    x, w = jnp.ones((4, 6)), jnp.ones((6, 8))
    assert jaxshard.check_rule(jnp.matmul, "i j, j k -> i k", x, w, reduction_factors=("j",)) == [
        "i",
        "j",
        "k",
    ]


@pytest.mark.parametrize(
    "fn, rule, kwargs, factor",
    [
        pytest.param(lambda x: jnp.cumsum(x, axis=1), "b s -> b s", {}, "s", id="scan-dim-as-pass"),
        pytest.param(
            lambda x: jnp.max(x, axis=1), "b s -> b", {"reduction_factors": ("s",)}, "s",
            id="max-declared-sum",
        ),
        pytest.param(lambda x: x.T, "i j -> i j", {}, "i", id="transpose-as-identity"),
    ],
)  # fmt: skip
def test_check_rule_names_the_failing_factor(fn, rule, kwargs, factor):
    x = jnp.arange(16.0).reshape(4, 4)
    with pytest.raises(jaxshard.RuleCheckError, match=f"factor '{factor}'"):
        jaxshard.check_rule(fn, rule, x, **kwargs)


@pytest.fixture(scope="module")
def example_step(mesh):
    train_step, args, hints = example.factory()
    return jaxshard.auto_shard(mesh, hints=hints)(train_step), train_step, args


def test_example_plans_across_both_kernels_without_warning(example_step):
    step, _, (params, batch) = example_step
    with warnings.catch_warnings():
        warnings.simplefilter("error", JaxshardWarning)
        plan = step.plan(params, batch)
    assert plan.in_specs[0] == {"w1": P(None, "model"), "w2": P("model")}
    names = {app.eqn.primitive.name for app in plan.graph.apps if app.eqn is not None}
    assert {"with_rule", "custom_partitioning"} <= names
    assert plan.verify().ok


def test_example_matches_unsharded(example_step):
    step, train_step, (params, batch) = example_step
    ref_params, ref = params, jax.jit(train_step)
    for _ in range(2):
        params, loss = step(params, batch)
        ref_params, ref_loss = ref(ref_params, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        assert_leaves_match(params, ref_params)


def test_example_kernel_rules_check():
    example.check_rules()


def _attention_fwd(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v), lse


@jax.custom_vjp
def _attention(q, k, v):
    return _attention_fwd(q, k, v)[0]


def _attention_bwd(res, do):
    q, k, v, o, lse = res
    p = jnp.exp(jnp.einsum("bqhd,bkhd->bhqk", q, k) - lse[..., None])
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, v)
    ds = p * (dp - jnp.einsum("bqhd,bqhd->bhq", do, o)[..., None])
    dq, dk = jnp.einsum("bhqk,bkhd->bqhd", ds, k), jnp.einsum("bhqk,bqhd->bkhd", ds, q)
    return dq, dk, jnp.einsum("bhqk,bqhd->bkhd", p, do)


_attention.defvjp(
    lambda q, k, v: (lambda o, lse: (o, (q, k, v, o, lse)))(*_attention_fwd(q, k, v)),
    _attention_bwd,
)


def test_with_rule_saved_values_follow_the_factors_they_scale_with(mesh):
    """Attention saving its log-sum-exp (b, h, q), a value that is neither an operand nor a
    result: its dims are found by shape probing, so head-parallel attention stays local."""
    flash = jaxshard.with_rule(
        "b q h d, b k h d, b k h d -> b q h d", need_replication_factors=("k",)
    )(_attention)

    def step(p, x):
        def loss(p):
            q, k, v = (jnp.einsum("bsd,dhe->bshe", x, p[n]) for n in ("wq", "wk", "wv"))
            return jnp.mean(jnp.einsum("bshe,hed->bsd", flash(q, k, v), p["wo"]) ** 2)

        value, grads = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value

    keys = jax.random.split(jax.random.key(0), 5)
    p = {n: jax.random.normal(k, (8, 4, 2)) * 0.3 for n, k in zip(("wq", "wk", "wv"), keys)}
    p["wo"] = jax.random.normal(keys[3], (4, 2, 8)) * 0.3
    x = jax.random.normal(keys[4], (2, 4, 8))
    sharded = jaxshard.auto_shard(mesh, hints={"x": P("data"), "p/wq": P(None, "model")})(step)
    plan = sharded.plan(p, x)
    (forward,) = [
        a for a in plan.graph.apps if a.eqn is not None and a.eqn.primitive.name == "with_rule"
    ]
    lse = plan.dims[forward.results[-1]]
    assert lse == (("data",), ("model",), ()), lse
    assert plan.in_specs[0]["wo"] == P("model")
    (new_p, loss), (ref_p, ref_loss) = sharded(p, x), jax.jit(step)(p, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_leaves_match(new_p, ref_p)
    assert plan.verify().ok
