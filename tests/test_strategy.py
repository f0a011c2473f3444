"""Whole-strategy planning (`jaxshard.auto_parallel`) and topologies: the chosen mesh runs
and matches the unsharded step, its estimates hold once compiled, a device count plans
without devices, and what does not fit says what would."""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_leaves_match
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import CostModel, ShardingError, Topology
from jaxshard.baseline import compiled_memory, compiled_step_time
from jaxshard.strategy import hints_on

OPTIMIZER = optax.sgd(0.1)


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def train_step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def arrays():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (64, 256)) / 8,
        "w2": jax.random.normal(k2, (256, 64)) / 16,
    }
    batch = {"x": jax.random.normal(k3, (32, 64)), "y": jnp.ones((32, 64))}
    return params, OPTIMIZER.init(params), batch


HINTS = {r"batch/.*": P("data")}
MEMORY = 2**30
# slow devices, so that splitting the work pays for its collectives at these sizes
SLOW = CostModel(flops=1e9)


@pytest.fixture(scope="module")
def strategy():
    return jaxshard.auto_parallel(
        train_step, *arrays(), devices=jax.devices(), memory_per_device=MEMORY, hints=HINTS,
        cost_model=SLOW,
    )  # fmt: skip


def test_the_chosen_strategy_runs_and_matches_the_unsharded_step(strategy):
    args = arrays()
    step = strategy.auto_shard(train_step)
    assert_leaves_match(step(*args), jax.jit(train_step)(*args))
    assert strategy.mesh.size == len(jax.devices())
    assert strategy.best.time.compute < strategy.best.time.total  # it communicates


def test_the_winner_is_the_fastest_candidate_that_fits(strategy):
    fitting = [c for c in strategy.candidates if c.fits]
    assert strategy.best.fits and strategy.best is fitting[0]
    assert all(strategy.best.seconds_per_step <= c.seconds_per_step for c in fitting)
    # every tensor degree that divides 8 was weighed on a data x tensor mesh
    two_axis = {c.degrees.get("tensor", 1) for c in strategy.candidates if "fsdp" not in c.axes}
    assert two_axis == {1, 2, 4, 8}
    text = strategy.explain()
    assert "winner:" in text and all(c.describe() in text for c in strategy.candidates)


def test_estimates_hold_once_compiled(strategy):
    compiled = strategy.auto_shard(train_step).lower(*arrays()).compile()
    est, best = strategy.best.time, strategy.best
    got = compiled_step_time(compiled, strategy.mesh, strategy.cost_model)
    assert got.compute == pytest.approx(est.compute, rel=0.01)
    assert got.total == pytest.approx(est.total, rel=0.1)
    assert compiled_memory(compiled) <= MEMORY
    assert best.memory.total == pytest.approx(compiled_memory(compiled), rel=0.25)


def test_a_device_count_plans_on_an_abstract_mesh_and_does_not_run():
    shapes = jax.eval_shape(arrays)
    s = jaxshard.auto_parallel(
        train_step, *shapes, devices=64, memory_per_device=MEMORY, hints=HINTS,
        topology=Topology.h100(nodes=8),
    )  # fmt: skip
    assert isinstance(s.mesh, AbstractMesh) and s.mesh.size == 64
    # a tensor axis never leaves a node's NVLink; no layer stack: no pipeline weighed
    assert all(c.degrees.get("tensor", 1) <= 8 for c in s.candidates)
    assert not any("stage" in c.axes for c in s.candidates)
    step = s.auto_shard(train_step)
    assert step.plan(*shapes).mesh.size == 64
    with pytest.raises(ShardingError, match="cannot run a step planned on an AbstractMesh"):
        step(*arrays())


def test_nothing_fits_names_the_smallest_footprint_and_the_fixes():
    with pytest.raises(ShardingError) as e:
        jaxshard.auto_parallel(
            train_step, *jax.eval_shape(arrays), devices=8, memory_per_device=4096, hints=HINTS
        )
    text = str(e.value)
    assert "no parallel strategy fits 4.00 KiB per device on 8 devices" in text
    assert "smallest footprint found is" in text and "memory_per_device of at least" in text
    # this step has no layer stack to pipeline, and the error says so
    assert "devices" in text and "a pipeline (none was weighed: the step has no layer" in text


# --- pipelines: a stage axis over the slow links, for a step with a scanned layer stack


def stack_loss(params, batch):
    def layer(x, w):
        return jnp.tanh(x @ w), None

    x, _ = jax.lax.scan(layer, batch["x"], params["layers"])
    return jnp.mean((x - batch["y"]) ** 2)


def stack_step(params, opt_state, batch):
    value, grads = jax.value_and_grad(stack_loss)(params, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def stack_arrays():
    k1, k2 = jax.random.split(jax.random.key(1))
    params = {"layers": jax.random.normal(k1, (8, 128, 128)) / 12}
    batch = {"x": jax.random.normal(k2, (16, 128)), "y": jnp.zeros((16, 128))}
    return params, OPTIMIZER.init(params), batch


def two_nodes(across: float, flops: float) -> Topology:
    """8 devices: 4 per node on fast links, ``across`` bytes/s between the 2 nodes."""
    return Topology.generic([(4, 1e11, 1e-6), (2, across, 1e-5)], flops=flops)


@pytest.fixture(scope="module")
def piped():
    # 8 hosts of one device each on a slow network
    hosts = Topology.generic([(1, 1e11, 1e-6), (8, 1e7, 1e-5)], flops=1e12)
    return jaxshard.auto_parallel(
        stack_step, *stack_arrays(), devices=jax.devices(), memory_per_device=MEMORY,
        hints=HINTS, topology=hosts,
    )  # fmt: skip


def test_a_pipeline_over_slow_links_wins_runs_and_matches_the_unsharded_step(piped):
    # data parallelism would sum the weight gradients over the slow links; the pipeline
    # hands only each microbatch's activations across them
    best = piped.best
    assert best.degrees == {"stage": 8} and best.microbatches == 16  # 1 row each
    assert best.pipeline == jaxshard.Pipeline("stage", 16)
    assert any(c.fits and "stage" not in c.axes for c in piped.candidates[1:])
    assert {c.degrees["stage"] for c in piped.candidates if c.microbatches} == {2, 4, 8}
    args = stack_arrays()
    step = piped.auto_shard(stack_step)
    assert_leaves_match(step(*args), jax.jit(stack_step)(*args))
    (loop,) = step.plan(*args).pipelined
    assert (loop.stages, loop.microbatches) == (8, 16)
    compiled = step.lower(*args).compile()
    got = compiled_step_time(compiled, piped.mesh, piped.cost_model)
    assert got.total == pytest.approx(best.time.total, rel=0.1)
    assert compiled_memory(compiled) <= MEMORY
    assert "stage=8" in piped.explain() and "16 microbatches" in piped.explain()


def test_a_pipeline_its_bubble_cannot_pay_for_is_pruned_unsearched():
    # fast links everywhere and slow compute: the bubble alone costs more than the best
    s = jaxshard.auto_parallel(
        stack_step, *jax.eval_shape(stack_arrays), devices=8, memory_per_device=MEMORY,
        hints=HINTS, topology=two_nodes(across=1e11, flops=1e9),
    )  # fmt: skip
    # pruned (with the tensor degree of each of the two best meshes), it is not weighed
    # on the circular schedule either
    pipelines = [c for c in s.candidates if "stage" in c.axes]
    assert len({c.degrees.get("tensor", 1) for c in pipelines}) == len(pipelines) == 2
    for pipeline in pipelines:
        assert pipeline.status.startswith("pruned: at least") and pipeline.seconds == 0
        assert "not under the best" in pipeline.status and pipeline.repeats == 1
    assert "stage" not in s.best.axes


def test_the_best_pipeline_is_weighed_with_its_batch_axes_split_too():
    # collectives within a pair of devices are slow to start: the best pipeline puts its
    # 4 devices per stage on the batch, and is weighed again with them as data x fsdp,
    # a mesh of stage, data and fsdp that runs like the unsharded step
    k1, k2 = jax.random.split(jax.random.key(2))
    params = {"layers": jax.random.normal(k1, (8, 64, 64)) / 8}
    batch = {"x": jax.random.normal(k2, (64, 64)), "y": jnp.zeros((64, 64))}
    args = (params, OPTIMIZER.init(params), batch)
    levels = Topology.generic([(2, 1e11, 1e-3), (2, 1e10, 1e-6), (2, 1e7, 1e-6)], flops=1e12)
    s = jaxshard.auto_parallel(
        stack_step, *args, devices=jax.devices(), memory_per_device=MEMORY, hints=HINTS,
        topology=levels,
    )  # fmt: skip
    (split,) = [c for c in s.candidates if c.degrees == {"stage": 2, "data": 2, "fsdp": 2}]
    # the best pipeline is weighed on the circular schedule too (its 8 layers split into
    # 2 chunks per stage; here twice the transfers cost more than the bubble saves: its
    # lower bound prunes it), and the better of the two is the one split
    staged = [c for c in s.candidates if c.degrees == {"stage": 2, "data": 4}]
    assert sorted(c.repeats for c in staged) == [1, 2]
    (twin,) = [c for c in staged if c.repeats == 2]
    assert twin.status.startswith("pruned: at least") and twin.seconds == 0
    (piped,) = [c for c in staged if c.repeats == split.repeats]
    assert piped.repeats == 1
    assert piped.fits and split.fits and split.microbatches == piped.microbatches
    mesh = jax.make_mesh(split.shape, split.axes, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    step = jaxshard.auto_shard(
        mesh, split.hints, search=True, memory_budget=MEMORY, pipeline=split.pipeline
    )(stack_step)
    assert_leaves_match(step(*args), jax.jit(stack_step)(*args))
    assert "stage=2, data=2, fsdp=2" in s.explain()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"memory_per_device": 0}, r"memory_per_device=0\): give the bytes"),
        ({"devices": 0}, r"devices=0\): give a positive count"),
        ({"devices": []}, r"devices=\[\]\): give at least one device"),
        ({"topology": Topology.h100(nodes=2)}, "has 16 devices, but auto_parallel was given 8"),
        ({"hints": {"batch/x": P("model")}}, r"'batch/x'.*names axis 'model'.*roles"),
        ({"hints": {"batch/x": "data"}}, r"'batch/x': 'data' is not a PartitionSpec"),
        ({"pipeline": jaxshard.Pipeline()}, r"chooses the pipeline .* itself; leave pipeline="),
    ],
    ids=[
        "memory",
        "no-devices",
        "empty-devices",
        "topology-size",
        "non-role-axis",
        "not-a-spec",
        "pipeline",
    ],
)
def test_bad_input_names_the_argument(kwargs, error):
    options = {"devices": 8, "memory_per_device": MEMORY, **kwargs}
    with pytest.raises(ShardingError, match=error):
        jaxshard.auto_parallel(train_step, *jax.eval_shape(arrays), **options)


def test_role_hints_follow_the_mesh():
    hints = {"b": P("data", None, "tensor"), "w": P("fsdp")}
    assert hints_on(hints, ("data", "fsdp", "tensor")) == {
        "b": P(("data", "fsdp"), None, "tensor"),
        "w": P("fsdp"),
    }
    assert hints_on(hints, ("data", "tensor")) == {"b": P("data", None, "tensor"), "w": P("data")}
    assert hints_on(hints, ("tensor",)) == {"b": P(None, None, "tensor"), "w": P(None)}


def test_topologies_map_axes_to_the_links_they_span():
    h100 = Topology.h100(nodes=4)
    assert [lv.name for lv in h100.axis_levels((4, 8))] == ["InfiniBand", "NVLink"]
    assert [lv.name for lv in h100.axis_levels((2, 16))] == ["InfiniBand", "InfiniBand"]
    model = h100.cost_model(("data", "tensor"), (4, 8))
    assert model.flops == 989e12 and model.bandwidth == {"data": 50e9, "tensor": 450e9}
    tpu = Topology.tpu("v5e", chips=256, slices=2)
    assert tpu.devices == 512 and tpu.axis_levels((2, 256))[0].name == "DCN"
    assert Topology.generic([(4, 1e11, 1e-6), (None, 1e10, 1e-5)], flops=1e14).devices is None


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: Topology.tpu("v9"), r"version='v9'.*known versions are \['v5e', 'v5p'\]"),
        (lambda: Topology.h100(nodes=0), r"nodes=\.\.\.\) must be a positive int, not 0"),
        (lambda: Topology.generic([(None, 1e9, 0), (2, 1e9, 0)], 1e12), "only the outermost"),
        (lambda: Topology.generic([(4, 0.0, 0)], 1e12), "bandwidth must be positive"),
    ],
    ids=["tpu-version", "h100-nodes", "inner-without-size", "zero-bandwidth"],
)
def test_bad_topologies_say_what_is_wrong(make, error):
    with pytest.raises(ShardingError, match=error):
        make()


def test_the_best_pipeline_is_weighed_on_the_circular_schedule():
    # 8 layers over 2 stages split into 2 chunks each: the circular twin is searched;
    # moving the weight-heavy stack to the stages' chunks each step costs it more than
    # its smaller bubble saves, so GPipe stays the best
    layers = {"layers": jax.ShapeDtypeStruct((8, 256, 256), jnp.float32)}
    rows = {k: jax.ShapeDtypeStruct((16, 256), jnp.float32) for k in ("x", "y")}
    topology = Topology.generic([(4, 1e11, 1e-6), (2, 1e9, 1e-5)], flops=1e10)
    s = jaxshard.auto_parallel(
        stack_step, layers, jax.eval_shape(OPTIMIZER.init, layers), rows, devices=8,
        memory_per_device=MEMORY, hints=HINTS, topology=topology,
    )  # fmt: skip
    (circular,) = [c for c in s.candidates if c.repeats == 2]
    (gpipe,) = [c for c in s.candidates if c.microbatches and c.shape == circular.shape
                and c.repeats == 1]  # fmt: skip
    assert (gpipe.shape, gpipe.microbatches) == (circular.shape, circular.microbatches)
    assert circular.repeats == 2 and circular.fits and circular.seconds > 0
    assert circular.pipeline == jaxshard.Pipeline("stage", 8, schedule="circular", repeats=2)
    assert "circular x2" in circular.describe()
    assert s.best is gpipe and gpipe.seconds_per_step < circular.seconds_per_step
