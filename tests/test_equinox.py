"""Equinox modules as arguments: ``auto_shard(..., static_leaves=True)`` against
``eqx.filter_jit`` (the example GPT's core, tiny), cache keys of static leaves, static
results, and modules whose arrays are already committed to a sharding."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxshard


@pytest.fixture(scope="module")
def gpt_run(explicit_mesh):
    import equinox_gpt

    cfg = equinox_gpt.Config(vocab=64, d_model=32, d_ff=64, n_layers=1, seq=8)
    return equinox_gpt.run(explicit_mesh, cfg, steps=2)


def test_gpt_matches_filter_jit(gpt_run):
    import equinox_gpt

    np.testing.assert_allclose(gpt_run["losses"], gpt_run["ref_losses"], rtol=1e-5)
    assert equinox_gpt.max_param_error(gpt_run["model"], gpt_run["ref_model"]) < 1e-4
    assert gpt_run["step"].plans_made == 1  # the returned module keys the same plan


def test_gpt_returns_modules_with_their_static_fields(gpt_run):
    model, ref = gpt_run["model"], gpt_run["ref_model"]
    assert type(model) is type(ref)
    assert jax.tree_util.tree_structure(model) == jax.tree_util.tree_structure(ref)
    assert model.blocks[0].mlp.activation is jax.nn.gelu


def test_gpt_arrays_planned_by_path_from_hints(gpt_run):
    plan = gpt_run["plan"]
    specs = dict(
        zip(
            plan.traced.in_names,
            jax.tree_util.tree_leaves(plan.in_specs, is_leaf=lambda x: isinstance(x, P)),
        )
    )
    assert specs["model/blocks/0/attn/query_proj/weight"] == P("model")
    assert specs["model/blocks/0/mlp/layers/1/weight"] == P(None, "model")
    assert specs["batch/tok"] == P("data")
    assert not any("activation" in name for name in plan.traced.in_names)


def _mlp_step(model, x):
    def loss_fn(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    return loss, eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), model.depth


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))


def _assert_arrays_close(model, ref):
    pairs = zip(*(jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (model, ref)))
    for a, b in pairs:
        np.testing.assert_allclose(a, b, atol=1e-4 * float(np.max(np.abs(b))))


X = jnp.arange(32.0).reshape(8, 4) / 32


def test_static_results_come_back_as_made(mesh, mlp):
    step = jaxshard.auto_shard(mesh, {"x": P("data")}, static_leaves=True)(_mlp_step)
    loss, new, depth = step(mlp, X)
    ref_loss, ref_new, _ = eqx.filter_jit(_mlp_step)(mlp, X)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert depth == 1 and new.activation is mlp.activation
    _assert_arrays_close(new, ref_new)


def test_static_leaves_key_the_cache_by_value(mesh, mlp):
    step = jaxshard.auto_shard(mesh, static_leaves=True)(_mlp_step)
    step(mlp, X)
    step(mlp, X)
    assert step.plans_made == 1
    other = eqx.tree_at(lambda m: m.activation, mlp, jax.nn.tanh)
    assert step(other, X)[1].activation is jax.nn.tanh
    assert step.plans_made == 2


class _Unhashable:
    __hash__ = None

    def __init__(self, scale):
        self.scale = scale


def test_unhashable_static_leaf_keys_by_identity(mesh):
    step = jaxshard.auto_shard(mesh, static_leaves=True)(lambda cfg, x: x * cfg["c"].scale)
    c = _Unhashable(3.0)
    np.testing.assert_allclose(step({"c": c}, X), X * 3)
    step({"c": c}, X)
    assert step.plans_made == 1
    np.testing.assert_allclose(step({"c": _Unhashable(2.0)}, X), X * 2)
    assert step.plans_made == 2


def test_module_with_committed_arrays_and_optax_state(mesh, mlp):
    optimizer = optax.sgd(0.1)
    placed = jax.tree.map(
        lambda a: (
            jax.device_put(a, NamedSharding(mesh, P(*(["model"] + [None] * (a.ndim - 1)))))
            if eqx.is_array(a) and a.shape[0] % 4 == 0
            else a
        ),
        mlp,
    )

    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return loss, eqx.apply_updates(model, updates), opt_state

    state = optimizer.init(eqx.filter(placed, eqx.is_array))
    sharded = jaxshard.auto_shard(mesh, {"x": P("data")}, static_leaves=True)(step)
    loss, new, _ = sharded(placed, state, X)
    ref_loss, ref_new, _ = eqx.filter_jit(step)(mlp, state, X)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _assert_arrays_close(new, ref_new)


def test_init_sharded_builds_modules_in_their_planned_layout(mesh):
    optimizer = optax.sgd(0.1)

    def init(key):
        model = eqx.nn.MLP(4, 2, 8, 1, key=key)
        return model, optimizer.init(eqx.filter(model, eqx.is_array))

    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return loss, eqx.apply_updates(model, updates), opt_state

    hints = {"x": P("data"), "model/layers/0/weight": P("model")}
    sharded = jaxshard.auto_shard(mesh, hints, static_leaves=True)(step)
    model, state = sharded.init_sharded(init, jax.random.key(0), rest=(X,))
    assert model.activation is jax.nn.relu
    assert model.layers[0].weight.sharding.spec == P("model")
    loss, _, _ = sharded(model, state, X)
    assert sharded.plans_made == 1
    np.testing.assert_allclose(
        loss, eqx.filter_jit(step)(*init(jax.random.key(0)), X)[0], rtol=1e-5
    )
