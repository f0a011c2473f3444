"""The model zoo: every primitive of every train step has a rule, the scan-stacked
Llama trains sharded with the layer dim of every stacked weight unsharded, and so does
its Mixtral-shaped variant (expert MLPs) under expert-parallel hints."""

import functools

import jax
import models
import numpy as np
import optax
import pytest
from helpers import assert_leaves_match
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.graph import build_graph
from jaxshard.plan import mesh_axis_sizes
from jaxshard.trace import trace
from jaxshard.verify import hlo_collectives, predicted_kinds


def _train_step(name):
    config_cls, init, loss, make_batch = models.MODELS[name]
    cfg = config_cls()
    params = init(jax.random.key(0), cfg)
    opt = optax.adamw(1e-3)
    step = models.make_train_step(functools.partial(loss, cfg=cfg), opt)
    return step, (params, opt.init(params), make_batch(jax.random.key(1), cfg))


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_every_primitive_has_a_rule(mesh, name):
    step, args = _train_step(name)
    graph = build_graph(trace(step, args, {}), mesh_axis_sizes(mesh))
    assert graph.unknown == {}


LLAMA_HINTS = {
    r"batch/.*": P("data"),
    r"params/layers/wq": P(None, None, "model"),
    r"params/layers/w_gate": P(None, None, "model"),
}


@pytest.fixture(scope="module")
def llama(mesh):
    cfg = models.LlamaConfig()
    params = models.init_llama(jax.random.key(0), cfg)
    batch = models.make_batch_llama(jax.random.key(1), cfg)
    opt = optax.sgd(0.1)
    step = models.make_train_step(functools.partial(models.llama_loss, cfg=cfg), opt)
    return jaxshard.auto_shard(mesh, LLAMA_HINTS)(step), step, params, opt.init(params), batch


def test_llama_stacked_weights_keep_layer_dim_unsharded(llama):
    sharded, _, params, state, batch = llama
    layers = sharded.plan(params, state, batch).in_specs[0]["layers"]
    for name, spec in layers.items():
        assert len(spec) == 0 or spec[0] is None, (name, spec)
    assert layers["wo"] == P(None, "model")  # row parallel, by propagation through the scan body
    assert layers["w_up"] == P(None, None, "model") and layers["w_down"] == P(None, "model")
    # 2 kv heads cannot be split over 4 devices: keys and values stay replicated
    assert layers["wk"] == P() and layers["wv"] == P()


def test_llama_sgd_steps_match_unsharded(llama):
    sharded, step, params, state, batch = llama
    p, s, rp, rs = params, state, params, state
    for _ in range(3):
        p, s, loss = sharded(p, s, batch)
        rp, rs, ref = jax.jit(step)(rp, rs, batch)
        np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert_leaves_match(p, rp)


def test_llama_collectives_agree_with_plan(llama):
    sharded, _, params, state, batch = llama
    found = hlo_collectives(sharded.lower(params, state, batch).compile().as_text())
    assert set(found) <= predicted_kinds(sharded.plan(params, state, batch)), found


MIXTRAL_HINTS = {  # experts over "model" (expert parallel), the batch over "data"
    r"batch/.*": P("data"),
    r"params/layers/(w_gate|w_up|w_down)": P(None, "model"),
}


def test_llama_with_expert_mlps_trains_sharded_as_unsharded(mesh):
    """The Mixtral-shaped variant (top-2 of 4 experts per layer, under the scan) with
    expert parallel hints: losses and parameters equal the unsharded steps', and every
    compiled collective is one the plan predicts."""
    cfg = models.LlamaConfig(n_experts=4)
    params = models.init_llama(jax.random.key(0), cfg)
    batch = models.make_batch_llama(jax.random.key(1), cfg)
    opt = optax.sgd(0.1)  # Adam's normalized update would magnify float rounding
    step = models.make_train_step(functools.partial(models.llama_loss, cfg=cfg), opt)
    sharded = jaxshard.auto_shard(mesh, MIXTRAL_HINTS)(step)
    p, s, rp, rs = params, opt.init(params), params, opt.init(params)
    for _ in range(2):
        p, s, loss = sharded(p, s, batch)
        rp, rs, ref = jax.jit(step)(rp, rs, batch)
        np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert_leaves_match(p, rp)
    plan = sharded.plan(params, opt.init(params), batch)
    assert plan.in_specs[0]["layers"]["w_up"] == P(None, "model")
    found = hlo_collectives(sharded.lower(params, opt.init(params), batch).compile().as_text())
    assert set(found) <= predicted_kinds(plan), found
