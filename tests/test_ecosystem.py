"""jaxshard in the JAX ecosystem: Flax metadata and logical axis rules as hints, the NNX
and Linen examples against unsharded runs, optax chains' state following its params,
sharded initialization, and jit semantics (static and donated arguments, the cache,
keyword arguments, dataclass pytrees)."""

import dataclasses
import re
import typing

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_leaves_match
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.flax_meta import flax_hints, logical_to_spec

U = P.UNCONSTRAINED


def entries(spec, rank):
    """A spec's per-dim entries, padded with None (replicated) to ``rank``."""
    out = [e if not (isinstance(e, tuple) and len(e) == 1) else e[0] for e in spec]
    return out + [None] * (rank - len(out))


def assert_follows(planned, meta, rank, where):
    """Every dim ``meta`` pins (not open, within its length) is planned that way."""
    got = entries(planned, rank)
    for d, want in enumerate(meta):
        if want is not U:
            assert got[d] == want, f"{where}: dim {d} planned {got[d]!r}, metadata says {want!r}"


def planned_leaves(plan):
    """``{argument leaf path: (planned spec, shape)}``."""
    return {
        name: (plan.spec(vid), aval.shape)
        for name, vid, aval in zip(plan.traced.in_names, plan.graph.in_vids, plan.traced.in_avals)
    }


# --- logical axis rules -------------------------------------------------------------------

RULES = [
    ("batch", "data"),
    ("vocab", "tensor"),  # no such axis in the test mesh: skipped
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("embed", "model"),
    ("embed", "data"),
    ("norm", None),
    ("fsdp", ("data", "model")),
]


@pytest.mark.parametrize(
    "names, expected",
    [
        pytest.param(
            ("embed", "mlp"), P("data", "model"), id="mlp-rule-first-then-embed-falls-back"
        ),
        pytest.param(("vocab", "embed"), P("model", "data"), id="missing-tensor-axis-skipped"),
        pytest.param(("norm",), P(None), id="rule-to-None-replicates"),
        pytest.param(("batch", "length", "embed"), P("data", U, "model"), id="unruled-name-open"),
        pytest.param(("fsdp", None), P(("data", "model"), None), id="multi-axis-rule"),
        pytest.param(
            ("fsdp", "embed"), P(None, "model"), id="earlier-rule-wins-later-name-replicated"
        ),
        pytest.param(("model", "embed"), P("model", "data"), id="mesh-axis-name-pins-first"),
        pytest.param((U, "mlp"), P(U, "model"), id="unconstrained-stays-open"),
    ],
)
def test_logical_rules_first_available_mesh_axis_wins(mesh, names, expected):
    assert logical_to_spec(names, mesh, RULES) == expected


@pytest.mark.parametrize(
    "names, rules, message",
    [
        pytest.param(("mlp",), (), r"'mlp'.*not a mesh axis.*logical_axis_rules", id="no-rules"),
        pytest.param((("data", "tensor"),), (), r"no 'tensor'", id="tuple-axis-missing"),
        pytest.param(
            ("mlp",), [("mlp",)], r"not a \(logical name, mesh axes\) pair", id="bad-rule"
        ),
    ],
)
def test_logical_rule_errors_say_the_fix(mesh, names, rules, message):
    with pytest.raises(jaxshard.ShardingError, match=message):
        logical_to_spec(names, mesh, rules, where="params/w")


def test_logical_names_in_hints(mesh):
    step = jaxshard.auto_shard(
        mesh, {"x": P("batch"), "w": ("embed", "mlp")}, logical_axis_rules=RULES
    )(lambda x, w: x @ w)
    plan = step.plan(
        jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.float32)
    )
    assert plan.in_specs == (P("data"), P("data", "model"))


# --- Flax metadata as hints ---------------------------------------------------------------


class TinyNNX(nnx.Module):
    def __init__(self, rngs):
        column = nnx.with_partitioning(nnx.initializers.lecun_normal(), (U, "mlp"))
        self.up = nnx.Linear(16, 64, kernel_init=column, rngs=rngs)
        self.down = nnx.Param(jnp.ones((64, 16)) * 0.1, out_sharding=("model",))
        with pytest.deprecated_call():  # Flax's older spelling, remapped to out_sharding
            self.gain = nnx.Param(jnp.ones((16,)), sharding=(None,))

    def __call__(self, x):
        return jax.nn.relu(self.up(x)) @ self.down[...] * self.gain[...]


@pytest.fixture(scope="module")
def nnx_split():
    with nnx.use_eager_sharding(False):
        model = TinyNNX(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return nnx.split((model, optimizer))


def nnx_step(state, x, graphdef):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss


def test_nnx_metadata_pins_params_and_their_optimizer_state(mesh, nnx_split):
    graphdef, state = nnx_split
    step = jaxshard.auto_shard(
        mesh, {"x": P("data")}, logical_axis_rules=[("mlp", "model")], static_argnums=2
    )(nnx_step)
    plan = step.plan(state, jnp.ones((8, 16)), graphdef)
    leaves = planned_leaves(plan)
    for prefix in ("state/0", "state/1/opt_state/0/mu", "state/1/opt_state/0/nu"):
        spec, shape = leaves[f"{prefix}/up/kernel/value"]
        assert_follows(spec, (U, "model"), 2, prefix)
        assert entries(leaves[f"{prefix}/down/value"][0], 2)[0] == "model"
        assert entries(leaves[f"{prefix}/gain/value"][0], 1) == [None]
        assert entries(leaves[f"{prefix}/up/bias/value"][0], 1) == ["model"]  # propagated
    assert leaves["state/1/opt_state/0/count/value"][0] == P()
    assert plan.out_specs[0] == plan.in_specs[0]  # the new state keeps its layout
    assert "Flax metadata on " in plan.explain()


def test_metadata_naming_an_unruled_logical_axis_names_the_argument_as_hints_do(mesh, nnx_split):
    """Without rules, a logical name in the metadata is an error naming the leaf by the
    path a hint would use (not its position in the arguments) and the ways to give rules."""
    graphdef, state = nnx_split
    step = jaxshard.auto_shard(mesh, {"x": P("data")}, static_argnums=2)(nnx_step)
    with pytest.raises(jaxshard.ShardingError) as caught:
        step.plan(state, jnp.ones((8, 16)), graphdef)
    message = str(caught.value)
    assert message.startswith("state/0/up/kernel/value (Flax metadata"), message
    assert "logical_axis_rules" in message and "nn.logical_axis_rules" in message


@pytest.fixture(scope="module")
def linen_params():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            up = nn.with_logical_partitioning(init, ("embed", "mlp"), rules=(("embed", None),))
            x = jax.nn.relu(nn.Dense(64, kernel_init=up)(x))
            return nn.Dense(16, kernel_init=nn.with_partitioning(init, ("model", None)))(x)

    model = MLP()
    return model, model.init(jax.random.key(0), jnp.ones((8, 16)))["params"]


def test_linen_boxed_params_use_their_metadata(mesh, linen_params):
    model, params = linen_params

    def loss(params, x):
        return jnp.mean(model.apply({"params": params}, x) ** 2)

    grad = jaxshard.auto_shard(mesh, {"x": P("data")}, logical_axis_rules=[("mlp", "model")])(
        jax.grad(loss)
    )
    x = jnp.ones((8, 16))
    plan = grad.plan(params, x)  # no warning: Linen's unbox adds no sharding_constraint here
    leaves = planned_leaves(plan)
    assert entries(leaves["params/Dense_0/kernel/value"][0], 2) == [None, "model"]  # own rule
    assert entries(leaves["params/Dense_1/kernel/value"][0], 2) == ["model", None]
    grads = grad(params, x)
    assert type(grads["Dense_0"]["kernel"]) is nn.LogicallyPartitioned  # boxes come back
    assert_leaves_match(grads, jax.jit(jax.grad(loss))(params, x))


def test_flax_hints_cover_unboxed_params(mesh, linen_params):
    model, params = linen_params
    hints = flax_hints(params, mesh, "params", logical_axis_rules=[("mlp", "model")], unboxed=True)
    assert hints == {
        re.escape("params/Dense_0/kernel"): P(None, "model"),
        re.escape("params/Dense_1/kernel"): P("model", None),
    }
    fn = jaxshard.auto_shard(mesh, hints)(lambda params, x: model.apply({"params": params}, x))
    plan = fn.plan(nn.unbox(params), jnp.ones((8, 16)))
    assert plan.in_specs[0]["Dense_0"]["kernel"] == P(None, "model")


def test_metadata_that_does_not_divide_names_path_and_metadata(mesh):
    params = {"w": nn.Partitioned(jnp.ones((6, 4)), names=("model", None))}
    fn = jaxshard.auto_shard(mesh)(lambda params: params["w"].value * 2)
    with pytest.raises(jaxshard.ShardingError, match=r"params/w/value.*Flax metadata"):
        fn.plan(params)


def test_metadata_disagreeing_with_a_hint_is_an_error_naming_both(mesh):
    params = {"w": nn.Partitioned(jnp.ones((8, 4)), names=("model", None))}
    fn = jaxshard.auto_shard(mesh, {r"params/.*": P("data")})(lambda params: params["w"].value)
    with pytest.raises(jaxshard.ShardingError, match=r"params/\.\*.*Flax metadata.*disagree"):
        fn.plan(params)


# --- the examples -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nnx_example(explicit_mesh):
    import flax_nnx_gpt

    cfg = flax_nnx_gpt.Config(vocab=64, d_model=32, d_ff=64, n_layers=1, seq=8)
    return flax_nnx_gpt.run(explicit_mesh, cfg, steps=2)


@pytest.fixture(scope="module")
def linen_example(mesh):
    import linen_logical_rules

    cfg = linen_logical_rules.Config(vocab=64, d_model=32, d_ff=64, n_layers=1, seq=8)
    return linen_logical_rules.run(mesh, cfg, steps=2)


@pytest.mark.parametrize("name", ["nnx_example", "linen_example"])
def test_example_matches_unsharded(request, name):
    result = request.getfixturevalue(name)
    np.testing.assert_allclose(result["losses"], result["ref_losses"], rtol=1e-5)
    key = "state" if name == "nnx_example" else "params"
    assert_leaves_match(result[key], result[f"ref_{key}"])
    assert result["step"].plans_made == 1  # init_sharded planned; plan() and steps reused it


def test_nnx_example_follows_metadata_and_plans_the_rest(nnx_example):
    plan, metadata = nnx_example["plan"], nnx_example["metadata"]
    leaves = planned_leaves(plan)
    for path, meta in metadata.items():
        spec, shape = leaves[f"state/0/{path}/value"]
        if meta:
            assert_follows(spec, meta, len(shape), path)
    attn = "state/0/blocks/0/attn"
    assert leaves[f"{attn}/wk/value"][0] == P(None, "model")  # no metadata: propagation
    assert leaves[f"{attn}/wq/value"][0] == P(None, "model")  # open dim 0 decided
    for leaf in jax.tree_util.tree_leaves(nnx_example["state"]):  # arrays as planned
        assert leaf.sharding.mesh.axis_names == ("data", "model")
    state_specs = jax.tree_util.tree_leaves(plan.in_specs[0], is_leaf=lambda x: isinstance(x, P))
    got = [leaf.sharding.spec for leaf in jax.tree_util.tree_leaves(nnx_example["state"])]
    assert [entries(s, 3) for s in got] == [entries(s, 3) for s in state_specs]


def test_linen_example_follows_logical_rules(linen_example):
    leaves = planned_leaves(linen_example["plan"])
    expected = {  # from LOGICAL_AXIS_RULES; "kv" is open, planned replicated here
        "Embed_0/embedding": ("model", None),
        "block_0/query/kernel": (None, "model", U),
        "block_0/out/kernel": ("model", U, None),
        "block_0/w1/kernel": (None, "model"),
        "block_0/w2/kernel": ("model", None),
        "block_0/LayerNorm_0/scale": (None,),
    }
    for path, meta in expected.items():
        for prefix in ("params", "opt_state/0/trace"):
            name = f"{prefix}/{path}/value"
            spec, shape = leaves[name]
            assert_follows(spec, meta, len(shape), name)
    assert entries(leaves["batch/tok"][0], 2)[0] == "data"  # hinted P("batch", "length")


# --- optax --------------------------------------------------------------------------------

MASK = {"w1": True, "b1": False, "w2": True, "b2": False}
CHAINS = {
    "adamw": lambda: optax.adamw(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    "lion": lambda: optax.lion(1e-3),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "masked_chain": lambda: optax.chain(
        optax.masked(optax.adam(1e-2), MASK),
        optax.masked(optax.sgd(0.1, momentum=0.9), {k: not v for k, v in MASK.items()}),
    ),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1, momentum=0.9)},
        {k: "adam" if v else "sgd" for k, v in MASK.items()},
    ),
    "multi_steps": lambda: optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2),
}


@pytest.fixture(scope="module")
def mlp_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (16, 64)) * 0.25,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 16)) * 0.125,
        "b2": jnp.zeros(16),
    }
    x = jax.random.normal(jax.random.key(1), (8, 16))
    return params, {"x": x, "y": jnp.tanh(x)}


def mlp_loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def make_step(optimizer):
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def expected_state_spec(param_spec, param_shape, shape):
    """A state leaf shaped like its param has its spec; one with a dim dropped (a factored
    second moment) has the spec without that dim; anything else (scalars, (1,) dummies)
    is replicated."""
    dims = entries(param_spec, len(param_shape))
    if tuple(shape) == tuple(param_shape):
        return dims
    for k in range(len(param_shape)):
        if tuple(shape) == tuple(param_shape[:k] + param_shape[k + 1 :]):
            return dims[:k] + dims[k + 1 :]
    return [None] * len(shape)


@pytest.mark.parametrize("chain", list(CHAINS))
def test_optax_state_follows_its_parameter(mesh, mlp_params, chain):
    params, batch = mlp_params
    optimizer = CHAINS[chain]()
    train_step = make_step(optimizer)
    step = jaxshard.auto_shard(mesh, {"batch/.*": P("data"), "params/w1": P(None, "model")})(
        train_step
    )
    state = optimizer.init(params)
    plan = step.plan(params, state, batch)
    leaves = planned_leaves(plan)
    sharded = 0
    for name, (spec, shape) in leaves.items():
        if not name.startswith("opt_state/"):
            continue
        key = name.rsplit("/", 1)[-1]
        if key in params:
            param_spec, param_shape = leaves[f"params/{key}"]
            want = expected_state_spec(param_spec, param_shape, shape)
        else:
            want = [None] * len(shape)  # counts, steps: replicated
        assert entries(spec, len(shape)) == want, (name, spec, want)
        sharded += any(want)
    assert sharded >= 2
    assert plan.out_specs[1] == plan.in_specs[1]  # no reshard between steps
    new_params, _, loss = step(params, state, batch)
    ref_params, _, ref_loss = jax.jit(train_step)(params, state, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_leaves_match(new_params, ref_params)


# --- sharded initialization ---------------------------------------------------------------

MiB = 1 << 20


def test_init_sharded_never_holds_the_full_parameters(mesh):
    d = 512
    optimizer = optax.adam(1e-3)

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {
            "w1": jax.random.normal(k1, (d, 2 * d)) * d**-0.5,
            "w2": jax.random.normal(k2, (2 * d, d)) * d**-0.5,
        }
        return params, optimizer.init(params)

    def train_step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]))(
            params
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    limit = 3 * MiB  # per device
    param_bytes = 2 * d * 2 * d * 4  # 4 MiB replicated
    assert param_bytes > limit
    hints = {"params/w1": P("data", "model"), "params/w2": P("model", "data"), "x": P("data")}
    step = jaxshard.auto_shard(mesh, hints)(train_step)
    x = jax.ShapeDtypeStruct((16, d), jnp.float32)
    params, opt_state = step.init_sharded(init, jax.random.key(0), rest=(x,))

    held: dict = {}
    for leaf in jax.tree_util.tree_leaves((params, opt_state)):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    print(
        f"\nsharded init: params+adam state {held[jax.devices()[0]] / MiB:.2f} MiB per device, "
        f"params alone {params['w1'].addressable_shards[0].data.nbytes * 2 / MiB:.2f} MiB per "
        f"device (replicated params: {param_bytes / MiB:.0f} MiB)"
    )
    assert len(held) == 8 and max(held.values()) <= limit
    shardings = jax.tree_util.tree_map(lambda a: a.sharding, (params, opt_state))
    memory = jax.jit(init, out_shardings=shardings).lower(jax.random.key(0)).compile()
    stats = memory.memory_analysis()
    peak = stats.output_size_in_bytes + stats.temp_size_in_bytes
    print(f"init program: {peak / MiB:.2f} MiB per device at its peak (outputs + temporaries)")
    assert peak < param_bytes and peak <= limit

    ref_params, _ = jax.jit(init)(jax.random.key(0))  # the same values as an unsharded init
    assert_leaves_match(params, ref_params, rel=1e-6)
    step(params, opt_state, jnp.ones((16, d)))
    assert step.plans_made == 1  # planned from abstract shapes once, reused by the call


# --- jit semantics ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scale:
    factor: float


def scaled(params, x, cfg, calls):
    calls.append(1)
    return {"w": params["w"] - cfg.factor * (x.T @ (x @ params["w"]))}, jnp.sum(x @ params["w"])


@pytest.mark.parametrize(
    "static",
    [dict(static_argnums=(2, 3)), dict(static_argnames=("cfg", "calls"))],
    ids=["argnums", "argnames"],
)
def test_static_args_are_closed_over_and_key_the_cache(mesh, static):
    calls: list = []
    step = jaxshard.auto_shard(mesh, {"x": P("data"), "params/w": P(None, "model")}, **static)(
        scaled
    )
    static_calls = _Calls(calls)
    params, x = {"w": jnp.ones((4, 8))}, jnp.ones((8, 4))
    plan = step.plan(params, x, Scale(0.1), static_calls)
    assert plan.traced.in_names == ("params/w", "x")  # statics are not traced leaves
    step(params, x, Scale(0.1), static_calls)
    step(params, x, cfg=Scale(0.1), calls=static_calls)  # keywords: a new signature, as in jit
    step(params, x, cfg=Scale(0.1), calls=static_calls)
    assert (len(calls), step.plans_made) == (2, 2)
    new, _ = step(params, x, Scale(0.2), static_calls)  # a new static value re-plans
    assert (len(calls), step.plans_made) == (3, 3)
    ref, _ = jax.jit(scaled, static_argnums=(2, 3))(params, x, Scale(0.2), static_calls)
    assert_leaves_match(new, ref)


class _Calls:
    """A hashable static argument that records traces in a list."""

    def __init__(self, calls):
        self.calls = calls

    def append(self, item):
        self.calls.append(item)

    def __hash__(self):
        return 0

    def __eq__(self, other):
        return isinstance(other, _Calls) and other.calls is self.calls


def test_second_call_traces_and_plans_nothing(mesh, mlp_params):
    params, batch = mlp_params
    traces = []

    def loss_and_grad(params, batch):
        traces.append(1)
        return jax.value_and_grad(mlp_loss)(params, batch)

    step = jaxshard.auto_shard(mesh, {"batch/.*": P("data")})(loss_and_grad)
    step(params, batch)
    assert (len(traces), step.plans_made) == (1, 1)
    for _ in range(2):
        step(params, batch)
        step(params=params, batch=batch)  # keyword arguments: a new cache entry...
    step.plan(
        *jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, batch))
    )
    assert (len(traces), step.plans_made) == (2, 2)  # ...planned once, then reused
    for e in step._cache.values():
        assert e.jitted._cache_size() <= 1  # XLA compiled each signature once


class Batch(typing.NamedTuple):
    x: jax.Array
    y: jax.Array


@flax.struct.dataclass
class TrainState:
    params: dict
    opt_state: optax.OptState
    step: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Metrics:
    loss: jax.Array
    grad_norm: jax.Array


def test_dataclass_namedtuple_and_flax_struct_pytrees(mesh, mlp_params):
    params, batch = mlp_params
    optimizer = optax.sgd(0.1, momentum=0.9)

    def train_step(state: TrainState, batch: Batch):
        loss, grads = jax.value_and_grad(mlp_loss)(state.params, batch._asdict())
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        new = TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1)
        return new, Metrics(loss, optax.tree.norm(grads))

    hints = {"batch/.*": P("data"), "state/params/w1": P(None, "model")}
    step = jaxshard.auto_shard(mesh, hints, donate_argnames="state")(train_step)
    fresh = jax.tree_util.tree_map(jnp.copy, params)  # donation must not eat the fixture
    state = TrainState(fresh, optimizer.init(fresh), jnp.zeros((), jnp.int32))
    nt = Batch(batch["x"], batch["y"])
    plan = step.plan(state, nt)
    assert "state/opt_state/0/trace/w1" in plan.traced.in_names
    assert "batch/x" in plan.traced.in_names
    state_specs, _ = plan.in_specs
    assert state_specs.params["w2"] == P("model") and state_specs.opt_state[0].trace["w2"] == P(
        "model"
    )
    assert plan.out_specs[0] == state_specs and isinstance(plan.out_specs[1], Metrics)
    ref_state, ref_metrics = jax.jit(train_step)(state, nt)
    new, metrics = step(state, nt)
    again, _ = step(new, nt)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(new))  # donated
    assert not nt.x.is_deleted()
    np.testing.assert_allclose(metrics.loss, ref_metrics.loss, rtol=1e-5)
    assert_leaves_match(jax.device_get(again.params), jax.jit(train_step)(ref_state, nt)[0].params)


@pytest.mark.parametrize(
    "donate, deleted",
    [
        (dict(), []),
        (dict(donate_argnums=0), ["params"]),
        (dict(donate_argnames="opt_state"), ["opt_state"]),
        (dict(donate_state=True), ["params", "opt_state"]),
    ],
    ids=["default-none", "argnums", "argnames", "state"],
)
def test_donation(mesh, mlp_params, donate, deleted):
    params, batch = mlp_params
    optimizer = optax.sgd(0.1, momentum=0.9)
    step = jaxshard.auto_shard(mesh, {"batch/.*": P("data")}, **donate)(make_step(optimizer))
    fresh = jax.tree_util.tree_map(jnp.copy, params)  # donation must not eat the fixture
    p, s, _ = step(fresh, optimizer.init(fresh), batch)
    args = {"params": p, "opt_state": s, "batch": batch}
    step(*args.values())
    for name, tree in args.items():
        state = {leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(tree)}
        assert state == {name in deleted}, name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(static_argnums=1), r"static argument 1 .* not hashable"),
        (dict(static_argnames="w", donate_argnums=1), r"both static and donated"),
        (dict(static_argnames="v"), r"'v', which is not a parameter"),
    ],
    ids=["unhashable-static", "static-and-donated", "unknown-name"],
)
def test_jit_argument_errors(mesh, kwargs, message):
    with pytest.raises(jaxshard.ShardingError, match=message):
        step = jaxshard.auto_shard(mesh, **kwargs)(lambda x, w: x * w["a"])
        step(jnp.ones(4), {"a": 2.0})
