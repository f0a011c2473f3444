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
