"""End to end: sharded train steps match unsharded ones, on Auto and Explicit meshes, and
the compiled program's collectives agree with the plan."""

import functools

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from helpers import assert_leaves_match
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.verify import hlo_collectives, predicted_kinds

GPT_HINTS = {
    r"batch/.*": P("data"),
    r"params/.*/wq": P(None, "model"),
    r"params/.*/w1": P(None, "model"),
}
MLP_HINTS = {r"batch/.*": P("data"), r"params/layers/0/w": P(None, "model")}


@pytest.fixture(scope="module")
def gpt():
    cfg = models.GPTConfig()
    params = models.init_gpt(jax.random.key(0), cfg)
    batch = models.make_batch_gpt(jax.random.key(1), cfg)
    return functools.partial(models.gpt_loss, cfg=cfg), params, batch


@pytest.fixture(scope="module")
def mlp():
    cfg = models.MLPConfig()
    return (
        functools.partial(models.mlp_loss, cfg=cfg),
        models.init_mlp(jax.random.key(0), cfg),
        models.make_batch_mlp(jax.random.key(1), cfg),
    )


def _model(request, name):
    loss, params, batch = request.getfixturevalue(name)
    return loss, params, batch, GPT_HINTS if name == "gpt" else MLP_HINTS


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_loss_and_gradients_match(request, mesh, name):
    loss, params, batch, hints = _model(request, name)

    def loss_and_grad(params, batch):
        return jax.value_and_grad(loss)(params, batch)

    sharded = jaxshard.auto_shard(mesh, hints)(loss_and_grad)
    value, grads = sharded(params, batch)
    ref_value, ref_grads = jax.jit(loss_and_grad)(params, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert_leaves_match(grads, ref_grads)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_sgd_params_match_after_three_steps(request, mesh, name):
    loss, params, batch, hints = _model(request, name)
    opt = optax.sgd(0.1)
    step = models.make_train_step(loss, opt)
    sharded = jaxshard.auto_shard(mesh, hints)(step)
    p, s = params, opt.init(params)
    rp, rs = params, opt.init(params)
    for _ in range(3):
        p, s, _ = sharded(p, s, batch)
        rp, rs, _ = jax.jit(step)(rp, rs, batch)
    assert_leaves_match(p, rp)
    assert sharded.plans_made == 1


@pytest.fixture(scope="module")
def gpt_adamw(gpt, mesh):
    loss, params, batch = gpt
    opt = optax.adamw(1e-3)
    step = models.make_train_step(loss, opt)
    return jaxshard.auto_shard(mesh, GPT_HINTS)(step), step, params, opt.init(params), batch


def test_gpt_adamw_losses_track_unsharded(gpt_adamw):
    sharded, step, params, state, batch = gpt_adamw
    p, s, rp, rs = params, state, params, state
    for _ in range(3):
        p, s, loss = sharded(p, s, batch)
        rp, rs, ref = jax.jit(step)(rp, rs, batch)
        np.testing.assert_allclose(loss, ref, rtol=1e-4)


def test_gpt_megatron_pattern_by_propagation(gpt_adamw):
    sharded, _, params, state, batch = gpt_adamw
    plan = sharded.plan(params, state, batch)
    param_specs, state_specs, _ = plan.in_specs
    for layer in param_specs["layers"]:
        assert layer["attn"] == {
            "wq": P(None, "model"),
            "wk": P(None, "model"),
            "wv": P(None, "model"),
            "wo": P("model"),
        }
        assert layer["mlp"]["w1"] == P(None, "model") and layer["mlp"]["w2"] == P("model")
    assert state_specs[0].mu == param_specs and state_specs[0].nu == param_specs
    assert state_specs[0].count == P()
    assert plan.out_specs[0] == param_specs and plan.out_specs[1] == state_specs
    device, total = plan.per_device_bytes("params/")
    assert device < total / 2


def test_gpt_compiled_collectives_agree_with_plan(gpt_adamw):
    sharded, _, params, state, batch = gpt_adamw
    plan = sharded.plan(params, state, batch)
    found = hlo_collectives(sharded.lower(params, state, batch).compile().as_text())
    assert set(found) <= predicted_kinds(plan), (found, predicted_kinds(plan))
    assert found["all-reduce"] > 0


def test_no_predicted_reshard_means_no_collective(mesh):
    def f(x, w):  # data parallel forward: nothing to communicate
        return jnp.tanh(x @ w)

    sharded = jaxshard.auto_shard(mesh, {"x": P("data")})(f)
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    assert sharded.plan(x, w).reshards == ()
    assert sum(hlo_collectives(sharded.lower(x, w).compile().as_text()).values()) == 0


@pytest.mark.parametrize("which", ["mesh", "explicit_mesh"])
def test_auto_and_explicit_meshes(request, which, mlp):
    mesh = request.getfixturevalue(which)
    loss, params, batch = mlp
    opt = optax.adamw(1e-2)
    step = models.make_train_step(loss, opt)
    sharded = jaxshard.auto_shard(mesh, MLP_HINTS)(step)
    p, s, value = sharded(params, opt.init(params), batch)
    _, _, ref = jax.jit(step)(params, opt.init(params), batch)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    assert p["layers"][0]["w"].sharding.spec == P(None, "model")
    assert p["layers"][0]["w"].sharding.mesh.axis_types == mesh.axis_types
    p2, _, _ = sharded(p, s, batch)  # outputs feed the next step without re-planning
    assert sharded.plans_made == 1 and p2["layers"][1]["w"].sharding.spec == P("model")


def test_explicit_mesh_inside_set_mesh(explicit_mesh):
    sharded = jaxshard.auto_shard(explicit_mesh, {"x": P("data")})(lambda x: jnp.sin(x) * 2)
    with jax.set_mesh(explicit_mesh):
        x = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(explicit_mesh, P("data")))
        np.testing.assert_allclose(sharded(x), jnp.sin(jnp.ones((8, 4))) * 2, rtol=1e-6)


def test_abstract_arguments_plan_like_concrete(mesh, mlp):
    loss, params, batch = mlp
    sharded = jaxshard.auto_shard(mesh, MLP_HINTS)(loss)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, batch))
    assert sharded.plan(*abstract).in_specs == sharded.plan(params, batch).in_specs
    assert sharded.plans_made == 1


def test_explain_names_paths_specs_and_origins(gpt_adamw):
    sharded, _, params, state, batch = gpt_adamw
    text = sharded.plan(params, state, batch).explain()
    assert "params/layers/0/attn/wk" in text and "P(None, 'model')" in text
    assert "propagated from params/layers/0/attn/wq" in text
    assert "opt_state/0/mu/layers/1/mlp/w2" in text
    assert "predicted communication" in text


def test_compiled_programs_are_named_after_the_function(mesh):
    # XLA dumps and profiles name modules by the program: each step must be told apart
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)

    def forward_step(x):
        return jnp.tanh(x)

    def eval_step(x):
        return jnp.sin(x)

    for fn in (forward_step, eval_step):
        text = jaxshard.auto_shard(mesh, {"x": P("data")})(fn).lower(x).as_text()
        assert f"module @jit_{fn.__name__} " in text


def test_arguments_already_laid_out_as_planned_are_passed_as_they_are():
    # on one device an array's own SingleDeviceSharding is the planned layout: placing
    # each leaf again would copy every parameter at every step
    from jax.sharding import AxisType, NamedSharding

    from jaxshard.api import _place

    one = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    x = jnp.ones((4, 8))
    assert _place(x, NamedSharding(one, P())) is x
    step = jaxshard.auto_shard(one)(lambda w, b: jnp.tanh(b @ w))
    np.testing.assert_allclose(step(x.T, x), jnp.tanh(x @ x.T))
