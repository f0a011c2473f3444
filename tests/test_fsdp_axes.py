"""State stored over the mesh's FSDP axes (`auto_shard`'s ``fsdp_axes``; by default the
axis named ``fsdp``): parameters and optimizer state split over them between steps,
gathered at their uses, the sharded steps equal to the unsharded ones, and the plan's
estimates and predicted collectives holding once compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_steps_match
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.baseline import compiled_cost

OPT = optax.adamw(1e-3)


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@pytest.fixture(scope="module")
def fsdp_mesh():
    return jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def args():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k1, (64, 256)) / 8,
        "b1": jnp.zeros(256),
        "w2": jax.random.normal(k2, (256, 64)) / 16,
    }
    batch = {"x": jax.random.normal(k3, (16, 64)), "y": jax.random.normal(k4, (16, 64))}
    return params, OPT.init(params), batch


HINTS = {r"batch/.*": P("fsdp")}  # as MaxText lays its batch out: "tensor" is the plan's


@pytest.fixture(scope="module")
def planned(fsdp_mesh, args):
    stored = jaxshard.auto_shard(fsdp_mesh, HINTS)(_step)
    kept = jaxshard.auto_shard(fsdp_mesh, HINTS, fsdp_axes=())(_step)
    return stored, stored.plan(*args), kept.plan(*args)


def _stored_axes(spec) -> set:
    return {a for d in spec if d for a in ((d,) if isinstance(d, str) else d)}


def test_the_fsdp_axis_stores_parameters_and_their_moments(planned):
    _, plan, kept = planned
    params, (adam, *_) = plan.in_specs[0], plan.in_specs[1]
    for name in ("w1", "w2"):
        assert "fsdp" in _stored_axes(params[name]), params
        assert adam.mu[name] == params[name] and adam.nu[name] == params[name], adam
        assert "fsdp" not in _stored_axes(kept.in_specs[0][name]), kept.in_specs[0]
    assert "fsdp" not in _stored_axes(params["b1"]), params  # 1 KiB: not worth two collectives
    assert "stored over 'fsdp' (fsdp_axes)" in plan.explain()
    assert plan.estimated_memory.total < kept.estimated_memory.total


def test_stored_state_trains_like_the_unsharded_step(planned, args):
    stored, _, _ = planned
    assert_steps_match(stored, jax.jit(_step), *args, state=True)


def test_stored_state_estimates_hold_once_compiled(planned, fsdp_mesh, args):
    stored, plan, _ = planned
    lowered = stored.lower(*args)
    check = plan.verify(lowered)
    assert check.ok, check.surprises
    cost = compiled_cost(lowered.compile(), fsdp_mesh)
    assert plan.predicted_bytes == pytest.approx(cost.bytes, rel=0.05)
    assert plan.estimated_memory.total == pytest.approx(cost.memory, rel=0.10)


def test_fsdp_axes_names_any_axis(mesh, args):
    # on a (data, model) mesh nothing is stored apart unless asked: here over "data"
    hints = {r"batch/.*": P("data")}
    default = jaxshard.auto_shard(mesh, hints)(_step).plan(*args)
    asked = jaxshard.auto_shard(mesh, hints, fsdp_axes="data")(_step).plan(*args)
    assert "data" not in _stored_axes(default.in_specs[0]["w1"]), default.in_specs[0]
    assert "data" in _stored_axes(asked.in_specs[0]["w1"]), asked.in_specs[0]
    assert asked.estimated_memory.total < default.estimated_memory.total
