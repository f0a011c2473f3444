"""Bad input gets a clear error naming the path, hint or source line, and the fix."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import JaxshardWarning, ShardingError

X = jax.ShapeDtypeStruct((8, 12), jnp.float32)


def f(params, batch):
    return jnp.tanh(batch["x"] @ params["w"])


ARGS = ({"w": jax.ShapeDtypeStruct((12, 16), jnp.float32)}, {"x": X})


@pytest.mark.parametrize(
    "hints, pattern",
    [
        ({r"params/w": P("nope")}, r"params/w .*'nope' is not in the mesh.*\('data', 'model'\)"),
        (
            {r"params/w": P(None, None, "data")},
            r"params/w: hint 'params/w'.* has 3 entries but the array has rank 2",
        ),
        ({r"params/w": P(("data", "data"))}, r"params/w .*'data' is used twice"),
        (
            {r"params/w": P("data"), r"params/.*": P("model")},
            r"params/w: hint 'params/w'.* and hint 'params/\.\*'.* disagree on dim 0",
        ),
        (
            {r"batch/x": P(None, ("data", "model"))},
            r"batch/x .*dim 1 has size 12, which mesh axes \('data', 'model'\) \(size 8\) "
            r"do not divide",
        ),
        ({r"batch/(x": P("data")}, r"hint key 'batch/\(x' is not a valid regex"),
        ({r"batch/x": ("data",)}, r"batch/x: .* give a jax.sharding.PartitionSpec"),
    ],
    ids=[
        "unknown-axis",
        "spec-too-long",
        "axis-twice",
        "hints-disagree",
        "not-divisible",
        "bad-regex",
        "not-a-spec",
    ],
)
def test_bad_hints_name_the_culprit(mesh, hints, pattern):
    with pytest.raises(ShardingError, match=pattern):
        jaxshard.auto_shard(mesh, hints)(f).plan(*ARGS)


def test_hint_matching_nothing_warns_and_lists_paths(mesh):
    with pytest.warns(JaxshardWarning, match=r"'params/w9' matched no .*params/w, batch/x, out"):
        jaxshard.auto_shard(mesh, {r"params/w9": P("data")})(f).plan(*ARGS)


def test_partial_hints_on_one_array_merge(mesh):
    plan = jaxshard.auto_shard(
        mesh, {r"params/w": P("data"), r"params/.*": P(P.UNCONSTRAINED, "model")}
    )(f).plan(*ARGS)
    assert plan.in_specs[0]["w"] == P("data", "model")


def test_hint_inside_function_names_source_line(mesh):
    def g(x):
        return jaxshard.hint(x, P("bogus"))

    with pytest.raises(ShardingError, match=r"jaxshard.hint at .*test_errors.py:\d+.*'bogus'"):
        jaxshard.auto_shard(mesh)(g).plan(X)


def test_non_array_leaf_names_its_path(mesh):
    with pytest.raises(ShardingError, match=r"argument leaf batch/act is a str"):
        jaxshard.auto_shard(mesh)(lambda batch: batch["x"]).plan({"x": X, "act": "relu"})


def test_mesh_must_be_a_mesh():
    with pytest.raises(ShardingError, match="needs a jax.sharding.Mesh"):
        jaxshard.auto_shard("data=2")(f)


def test_hint_is_identity_outside_jaxshard():
    x = jnp.arange(6.0).reshape(2, 3)
    assert (jax.jit(lambda a: jaxshard.hint(a, P("data")) * 2)(x) == x * 2).all()
    assert jax.grad(lambda a: jaxshard.hint(a, P("data")).sum())(x).shape == (2, 3)
