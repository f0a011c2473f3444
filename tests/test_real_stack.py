"""The stack users train with: typed PRNG keys in arguments, intermediates and results,
Flax NNX state that carries `nnx.Rngs`, every form of logical axis rules, and JAX
internals used in one module only (so a new JAX release is one file's work)."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_leaves_match
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import jax_compat
from jaxshard.cost import per_device_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _keyed_step(params, keys, batch, raw):
    """Dropout with one key per example, a key rebuilt from raw key data inside the step
    (a key-typed intermediate), and new keys returned."""
    noise_key = jax.random.wrap_key_data(raw)
    noise = jax.random.normal(noise_key, (batch["x"].shape[1],))

    def loss_fn(p):
        def one(key, x):
            h = jnp.tanh((x + noise) @ p["w1"])
            keep = jax.random.bernoulli(key, 0.9, h.shape)
            return ((jnp.where(keep, h / 0.9, 0.0) @ p["w2"]) ** 2).mean()

        return jax.vmap(one)(keys, batch["x"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    params = jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)
    new_keys = jax.vmap(lambda k: jax.random.split(k)[0])(keys)
    return params, new_keys, loss, jax.random.split(noise_key)[1]


@pytest.fixture(scope="module")
def keyed_args():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(16, 32)) * 0.3, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(32, 8)) * 0.3, jnp.float32),
    }
    batch = {"x": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)}
    keys = jax.random.split(jax.random.key(0), 8)
    raw = jax.random.key_data(jax.random.key(3))
    return params, keys, batch, raw


@pytest.mark.parametrize("search", [False, True], ids=["propagation", "search"])
def test_typed_keys_plan_run_and_come_back_as_keys(mesh, keyed_args, search):
    step = jaxshard.auto_shard(mesh, {r"batch/.*": P("data")}, search=search)(_keyed_step)
    got = step(*keyed_args)
    want = jax.jit(_keyed_step)(*keyed_args)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
    assert_leaves_match(got, want)  # keys compared by their key data
    assert jax.dtypes.issubdtype(got[1].dtype, jax.dtypes.prng_key)
    plan = step.plan(*keyed_args)
    # per-example keys split with their examples, and counted by their key data
    assert plan.in_specs[1] == P("data")
    assert plan.out_specs[1] == P("data")
    key_vid = plan.graph.in_vids[2]  # params/w1, params/w2, keys, ...
    assert plan.graph.dtypes[key_vid] == keyed_args[1].dtype
    assert per_device_bytes((8,), keyed_args[1].dtype, [("data",)], {"data": 2}) == 4 * 8
    assert "key<fry>" in plan.explain()
    assert plan.verify().ok


def test_abstract_keys_plan(mesh, keyed_args):
    params, keys, batch, raw = keyed_args
    abstract = jax.ShapeDtypeStruct(keys.shape, keys.dtype)
    plan = jaxshard.auto_shard(mesh, {r"batch/.*": P("data")})(_keyed_step).plan(
        params, abstract, batch, raw
    )
    assert plan.in_specs[1] == P("data")


def test_nnx_state_with_rngs_plans_and_runs_unchanged(mesh):
    nnx = pytest.importorskip("flax.nnx")
    import optax

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.25, rngs=rngs)
            self.l2 = nnx.Linear(32, 8, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(jax.nn.relu(self.l1(x))))

    model = MLP(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def train_step(state, batch, graphdef):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return ((model(batch["x"]) - batch["y"]) ** 2).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    batch = {"x": jnp.linspace(-1, 1, 8 * 16).reshape(8, 16), "y": jnp.zeros((8, 8))}
    step = jaxshard.auto_shard(mesh, {r"batch/.*": P("data")}, static_argnames="graphdef")(
        train_step
    )
    reference = jax.jit(train_step, static_argnames="graphdef")
    ours, theirs = state, state
    for _ in range(2):  # the dropout key advances: the second step's mask differs
        ours, loss = step(ours, batch, graphdef=graphdef)
        theirs, want = reference(theirs, batch, graphdef=graphdef)
        np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert_leaves_match(ours, theirs)
    text = step.plan(state, batch, graphdef=graphdef).explain()
    assert "rngs/key" in text and "key<fry>" in text


@pytest.mark.parametrize(
    "rules, expected",
    [
        pytest.param([("qkv", [])], P(None, "data"), id="empty-list-replicated"),
        pytest.param([("qkv", ())], P(None, "data"), id="empty-tuple-replicated"),
        pytest.param([("qkv", None)], P(None, "data"), id="None-replicated"),
        pytest.param([("qkv", "model")], P("model", "data"), id="string"),
        pytest.param([("qkv", ["model"])], P("model", "data"), id="list-of-one"),
        pytest.param([("qkv", ("data", "model"))], P(("data", "model"), None), id="rule-order"),
        pytest.param([("qkv", ["tensor", "model"])], P("model", "data"), id="absent-axis-drops"),
        pytest.param([("qkv", "tensor")], P(None, "data"), id="absent-axis-unavailable"),
        pytest.param(
            [("qkv", "tensor"), ("qkv", ["expert"]), ("qkv", "model")],
            P("model", "data"),
            id="next-rule-when-absent",
        ),
        pytest.param([("qkv", "stage")], P("stage", "data"), id="size-1-axis-kept"),
    ],
)
def test_every_form_of_logical_axis_rules(rules, expected):
    mesh = jax.make_mesh((1, 2, 4), ("stage", "data", "model"), devices=jax.devices()[:8])
    batch_rule = [("batch", ["data", "fsdp"])]
    assert jaxshard.logical_to_spec(("qkv", "batch"), mesh, rules + batch_rule) == expected


def test_one_rule_list_serves_several_meshes():
    rules = [("batch", ["data", "fsdp"]), ("mlp", ["tensor"]), ("mlp", "fsdp"), ("embed", [])]
    names = ("batch", "mlp", "embed")
    meshes = {
        ("data",): P("data", None, None),
        ("fsdp", "tensor"): P("fsdp", "tensor", None),
        ("data", "fsdp", "tensor"): P(("data", "fsdp"), "tensor", None),
    }
    for axes, expected in meshes.items():
        shape = {1: (8,), 2: (4, 2), 3: (2, 2, 2)}[len(axes)]
        mesh = jax.make_mesh(shape, axes)
        assert jaxshard.logical_to_spec(names, mesh, rules) == expected, axes


def _private_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if "_src" in n]
    return found


def test_jax_internals_are_used_in_one_module():
    files = [
        p
        for folder in ("jaxshard", "rules", "tests", "benchmarks", "examples")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if p.name != "jax_compat.py"
    ]
    found = [where for p in files for where in _private_imports(p)]
    assert not found, f"jax._src imported outside jaxshard/jax_compat.py: {found}"


def test_this_jax_is_within_the_supported_window():
    oldest, newest = jax_compat.SUPPORTED
    assert oldest <= jax_compat.JAX_VERSION[:3]
    assert jax_compat.JAX_VERSION[:2] <= newest[:2], (
        f"jax {jax.__version__} is newer than the newest release jaxshard is tested on "
        f"({'.'.join(map(str, newest))}): run the suite on it and raise SUPPORTED"
    )
