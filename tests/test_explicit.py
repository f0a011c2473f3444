"""Code in JAX's explicit-sharding style: its annotations are pins, the rest is planned,
and the program runs on the user's Explicit mesh with plain `jax.jit`'s numbers."""

import explicit_style
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_leaves_match
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.errors import ShardingError


def _data(shape_w=(8, 16), shape_x=(8, 8)):
    k = jax.random.split(jax.random.key(0), 2)
    return jax.random.normal(k[0], shape_w) * 0.5, jax.random.normal(k[1], shape_x)


def _run_both(fn, args, mesh, hints=None):
    """``fn`` under plain jax.jit on ``mesh`` and under auto_shard: (jit, jaxshard, plan)."""
    with jax.set_mesh(mesh):
        expected = jax.jit(fn)(*args)
    step = jaxshard.auto_shard(mesh, hints or {})(fn)
    return expected, step(*args), step.plan(*args)


def _value_dims(plan, primitive_name):
    """Planned dims of the first result of each equation of a primitive."""
    return [
        plan.dims[app.results[0]]
        for app in plan.graph.apps
        if app.kind == "eqn" and app.eqn.primitive.name == primitive_name
    ]


def mlp_loss(w, x):
    h = jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", "model"))
    y = jnp.einsum("bf,df->bd", jnp.tanh(h), w, out_sharding=P("data", None))
    return jnp.mean(jax.sharding.reshard(y, P()) ** 2)


def test_example_matches_jit_and_the_handwritten_layout():
    runs = explicit_style.compare(steps=2)
    replicated, megatron, sharded = runs
    np.testing.assert_allclose(sharded.losses, replicated.losses, rtol=1e-5)
    assert_leaves_match(sharded.params, replicated.params)
    assert sharded.comm_bytes <= 1.05 * megatron.comm_bytes < replicated.comm_bytes
    assert sharded.memory <= 1.05 * megatron.memory < replicated.memory
    wq = sharded.params["layers"][0]["wq"]
    assert wq.sharding.mesh.axis_types == (AxisType.Explicit,) * 2
    assert wq.sharding.spec == P(None, "model")


def test_annotations_pin_with_their_source_lines(explicit_mesh):
    w, x = _data()
    expected, got, plan = _run_both(jax.value_and_grad(mlp_loss), (w, x), explicit_mesh)
    assert_leaves_match(got, expected)
    text = plan.explain(intermediates=True)
    assert "out_sharding=P('data', 'model') of dot_general at " in text
    assert "test_explicit.py:" in text
    assert plan.traced.explicit
    # the annotation's axes hold on its value; w follows from it by propagation
    assert (("data",), ("model",)) in _value_dims(plan, "dot_general")
    assert plan.in_specs[0] == P(None, "model")


def test_unsharded_dims_of_an_annotation_are_left_to_the_planner(explicit_mesh):
    def f(w, x):
        return jnp.sum(jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", None)) ** 2)

    w, x = _data()
    expected, got, plan = _run_both(f, (w, x), explicit_mesh, {"w": P(None, "model")})
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert _value_dims(plan, "dot_general")[0] == (("data",), ("model",))


def test_argument_types_are_pins(explicit_mesh):
    w, x = _data()
    w = jax.device_put(w, NamedSharding(explicit_mesh, P(None, "model")))
    x = jax.device_put(x, NamedSharding(explicit_mesh, P("data")))
    grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
    expected, got, plan = _run_both(grad, (w, x), explicit_mesh)
    assert_leaves_match(got, expected)
    assert plan.in_specs == (P(None, "model"), P("data"))
    assert "the explicit sharding of argument w" in plan.origin_text(plan.graph.in_vids[0])


def test_a_hint_that_disagrees_with_an_annotation_names_both(explicit_mesh):
    def f(w, x):
        h = jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", "model"))
        return jnp.sum(jaxshard.hint(h, P("model")))

    with pytest.raises(ShardingError) as e:
        jaxshard.auto_shard(explicit_mesh)(f).plan(*_data())
    text = str(e.value)
    assert "out_sharding=P('data', 'model') of dot_general at" in text
    assert "jaxshard.hint at" in text and "test_explicit.py:" in text
    assert "change the annotation at that line" in text


def test_a_hint_that_disagrees_with_an_argument_type_names_both(explicit_mesh):
    w, x = _data()
    w = jax.device_put(w, NamedSharding(explicit_mesh, P(None, "model")))
    with pytest.raises(ShardingError, match=r"explicit sharding of argument w.*hint 'w'"):
        jaxshard.auto_shard(explicit_mesh, {"w": P(None, "data")})(mlp_loss).plan(w, x)


def test_mixed_explicit_and_auto_axes():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))

    def f(w, x):
        h = jnp.einsum("bd,df->bf", x, w, out_sharding=P("data"))
        return jnp.sum(jnp.tanh(h) ** 2)

    expected, got, plan = _run_both(jax.grad(f), _data(), mesh, {"w": P(None, "model")})
    assert_leaves_match(got, expected)
    assert plan.in_specs == (P(None, "model"), P("data"))


def test_scan_bodies_and_auto_axes_regions(explicit_mesh):
    def f(ws, x):
        def body(c, w):
            c = jnp.einsum("bd,de->be", c, w, out_sharding=P("data", None))
            return jnp.tanh(c), None

        c, _ = jax.lax.scan(body, x, ws)
        scaled = jax.sharding.auto_axes(
            lambda a: a * jnp.sum(a, 1, keepdims=True), out_sharding=P("data")
        )
        return jnp.sum(scaled(c) ** 2)

    ws, x = _data((3, 8, 8))
    grad = jax.value_and_grad(f)
    expected, got, _ = _run_both(grad, (ws, x), explicit_mesh, {"ws": P(None, None, "model")})
    assert_leaves_match(got, expected)


def test_code_for_sharding_constraints_still_traces_on_the_auto_view(explicit_mesh):
    def f(w, x):
        return jnp.sum(jax.lax.with_sharding_constraint(x @ w, P("data", "model")))

    plan = jaxshard.auto_shard(explicit_mesh)(f).plan(*_data())
    assert not plan.traced.explicit
    assert _value_dims(plan, "sharding_constraint")[0] == (("data",), ("model",))


def test_creation_and_indexing_annotations(explicit_mesh):
    def f(emb, idx):
        rows = emb.at[idx].get(out_sharding=P("data", None))
        bias = jnp.zeros((8, 16), out_sharding=P("data", "model"))
        out = jax.device_put(rows @ emb.T + bias, NamedSharding(explicit_mesh, P("data", None)))
        return jnp.sum(out**2)

    emb, _ = _data((16, 8))
    idx = jnp.arange(8) % 16
    expected, got, plan = _run_both(jax.value_and_grad(f), (emb, idx), explicit_mesh)
    assert_leaves_match(got, expected)
    text = plan.explain(intermediates=True)
    assert "out_sharding=P('data', 'model') of broadcast_in_dim at " in text
    assert "reshard at " in text  # the indexing's out_sharding
    assert "target=P('data', None) of device_put at " in text


def test_arguments_are_traced_with_their_types_as_jit_does(explicit_mesh):
    def f(x):  # explicit shard_map wants its operand typed as its in_specs say
        doubled = jax.shard_map(
            lambda b: b * 2, mesh=explicit_mesh, in_specs=P("data"), out_specs=P("data")
        )
        return jnp.sum(doubled(x) ** 2)

    _, x = _data()
    x = jax.device_put(x, NamedSharding(explicit_mesh, P("data")))
    expected, got, plan = _run_both(f, (x,), explicit_mesh)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert plan.traced.explicit


def test_flax_gemma_example_matches_its_own_fsdp_tp_run():
    # Flax's Gemma example (reduced, one layer): its FSDP+TP sharding config in the model,
    # the state passed unplaced and only the batch hinted, against the example's own
    # plain-jit run with the state placed by the same config
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    import gemma_explicit as gemma

    config = gemma.TransformerConfig.tiny(
        num_layers=1, shd_config=gemma.ShardingConfig.fsdp_tp_sharding()
    )
    example, sharded, plan = gemma.compare(config, steps=2)
    np.testing.assert_allclose(sharded.losses[0], example.losses[0], rtol=1e-5)
    np.testing.assert_allclose(sharded.losses, example.losses, rtol=1e-4)
    assert_leaves_match(jax.device_get(sharded.state), jax.device_get(example.state))
    assert sharded.comm_bytes <= 1.05 * example.comm_bytes
    # within 2%: the optimizer updates every weight on its shards (`store_updates`); with
    # three of them updated in the gathered layout it was 1.041x
    assert sharded.memory <= 1.02 * example.memory
    # the state is stored as the example stores it, and handed back on its Explicit mesh
    for got, want in zip(jax.tree.leaves(sharded.state), jax.tree.leaves(example.state)):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        assert got.sharding.mesh.axis_types == want.sharding.mesh.axis_types
    assert "Flax metadata on state/0/embedder/embedding/value" in plan.explain()
