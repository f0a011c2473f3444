"""Plans saved as JSON and reused: identical programs, and clear errors on mismatch."""

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import models
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Plan, ShardingError, make_plan
from jaxshard.lower import Lowered
from jaxshard.verify import compiled_collectives


def _mlp_step():
    cfg = models.MLPConfig()
    params = models.init_mlp(jax.random.key(0), cfg)
    opt = optax.sgd(0.1)
    step = models.make_train_step(functools.partial(models.mlp_loss, cfg=cfg), opt)
    return step, (params, opt.init(params), models.make_batch_mlp(jax.random.key(1), cfg))


def _compiled(plan):
    program = Lowered(plan)
    avals = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(plan.traced.in_avals, program.in_shardings)
    ]
    text = program.lower(avals).compile().as_text()
    found = compiled_collectives(text, plan.mesh)
    return program, Counter((c.kind, c.axes, c.bytes, c.runs) for c in found)


HINT_CHOICES = [
    {r"batch/.*": P("data")},
    {r"batch/.*": P("data"), r"params/layers/0/w": P(None, "model")},
    {r"params/layers/1/w": P("model")},
    {r"batch/x": P(None, "model")},
]


@settings(max_examples=4, deadline=None, derandomize=True)
@given(hints=st.sampled_from(HINT_CHOICES))
def test_json_round_trip_gives_an_identical_program(mesh, hints):
    step, args = _mlp_step()
    plan = make_plan(step, args, {}, mesh, hints)
    text = plan.to_json()
    again = make_plan(step, args, {}, mesh, saved=Plan.from_json(text))
    assert again.dims == plan.dims and again.out_dims == plan.out_dims
    assert again.to_json() == text  # deterministic
    program, collectives = _compiled(plan)
    program2, collectives2 = _compiled(again)
    assert (
        program.in_shardings == program2.in_shardings
        and program.out_shardings == program2.out_shardings
    )
    assert collectives == collectives2


def test_json_round_trip_of_a_scan_gives_an_identical_program(mesh):
    def f(x, w1, w2):  # a Megatron MLP applied 4 times by a scan: collectives in its body
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w1) @ w2, None), x, length=4)[0]

    args = (jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((32, 16)))
    hints = {"x": P("data"), "w1": P(None, "model"), "w2": P("model")}
    plan = make_plan(f, args, {}, mesh, hints)
    again = make_plan(f, args, {}, mesh, saved=Plan.from_json(plan.to_json()))
    assert again.reshards == plan.reshards
    program, collectives = _compiled(plan)
    program2, collectives2 = _compiled(again)
    assert (program.in_shardings, program.out_shardings) == (
        program2.in_shardings,
        program2.out_shardings,
    )
    assert collectives == collectives2
    assert collectives[("all-reduce", frozenset({"model"}), 256, 4)] == 1  # one, 4 runs


def test_auto_shard_reuses_a_saved_plan(mesh):
    step, args = _mlp_step()
    hints = {r"batch/.*": P("data"), r"params/layers/0/w": P(None, "model")}
    saved = Plan.from_json(jaxshard.auto_shard(mesh, hints)(step).plan(*args).to_json())
    reused = jaxshard.auto_shard(mesh, plan=saved)(step)
    assert reused.plan(*args).in_specs[0]["layers"][0]["w"] == P(None, "model")
    p, _, loss = reused(*args)
    _, _, ref = jax.jit(step)(*args)
    assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref))


def test_mismatched_shapes_list_the_differences(mesh):
    step, args = _mlp_step()
    saved = Plan.from_json(make_plan(step, args, {}, mesh, {r"batch/.*": P("data")}).to_json())
    params, state, batch = args
    bigger = {"x": jnp.ones((16, 16)), "y": jnp.ones((16, 8))}
    with pytest.raises(
        ShardingError,
        match=r"(?s)does not match.*input batch/x: saved batch/x float32\(8, 16\), now batch/x float32\(16, 16\)",
    ):
        make_plan(step, (params, state, bigger), {}, mesh, saved=saved)


def test_mismatched_mesh_is_an_error(mesh):
    step, args = _mlp_step()
    saved = Plan.from_json(make_plan(step, args, {}, mesh).to_json())
    other = jax.make_mesh((4, 2), ("data", "model"))
    with pytest.raises(
        ShardingError, match=r"mesh: saved .*'sizes': \[2, 4\].*now .*'sizes': \[4, 2\]"
    ):
        make_plan(step, args, {}, other, saved=saved)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not a jaxshard plan"),
        ('{"format": "x"}', "no 'format'"),
        ('{"format": "jaxshard-plan", "version": 99}', "version is 99"),
    ],
)
def test_bad_plan_files(text, message):
    with pytest.raises(ShardingError, match=message):
        Plan.from_json(text)
