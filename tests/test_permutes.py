"""Moves XLA's partitioner makes with collective-permutes: a dim that changes mesh axes in
place, shards that only change devices, or an all-to-all of a dim's minor shards
followed by a permute that puts every axis where the destination wants it. Each move is compiled as jaxshard lowers it
(through `reshard_steps`' layouts) and its collectives compared with the plan's
prediction (`reshard_collectives`), kind, axes and bytes; then a step whose weight is
stored on one axis and read on another is planned, verified and run against `jax.jit`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_leaves_match
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.cost.collectives import reshard_collectives, reshard_steps
from jaxshard.hlo import compiled_collectives


def _spec(layout):
    return P(*[d or None for d in layout])


def _compiled_move(mesh, src, dst, shape):
    """The collectives XLA compiles for moving an array from ``src`` to ``dst`` through
    the layouts jaxshard's lowering constrains it to."""
    steps = reshard_steps(src, dst, dict(mesh.shape))

    def move(x):
        y = x * 2  # a value of the program, not the argument buffer itself
        for step in steps:
            y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, _spec(step)))
        return y * 3

    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, _spec(src)))
    jitted = jax.jit(move, out_shardings=NamedSharding(mesh, _spec(dst)))
    return sorted(str(c) for c in compiled_collectives(jitted.lower(x).compile().as_text(), mesh))


MESHES = {
    "2x4": ((2, 4), ("fsdp", "tensor")),
    "4x2": ((4, 2), ("fsdp", "tensor")),
    "2x2x2": ((2, 2, 2), ("a", "b", "c")),
}
MOVES = [  # (mesh, src, dst, what XLA does)
    ("2x4", [("fsdp",), ()], [("tensor",), ()], "slice, then permute"),
    ("2x4", [("tensor",), ()], [("fsdp",), ()], "permute, then gather the major half"),
    ("4x2", [("fsdp",), ()], [("tensor",), ()], "permute, then gather the major half"),
    ("2x4", [("fsdp",), ()], [("tensor", "fsdp"), ()], "slice, then permute"),
    ("2x4", [("tensor",), ()], [("fsdp", "tensor"), ()], "slice, then permute"),
    ("2x4", [(), ("fsdp",)], [(), ("tensor",)], "slice, then permute"),
    ("2x2x2", [("a",), ("b", "c")], [("c",), ("a", "b")], "the same shards elsewhere"),
    ("2x2x2", [("a",), ("b",)], [("b",), ("a",)], "the same shards elsewhere"),
    ("2x2x2", [("a",), ()], [("b", "c"), ()], "slice, then permute"),
    ("2x4", [("fsdp",), ()], [("fsdp", "tensor"), ()], "a local slice"),
    ("2x4", [("fsdp", "tensor"), ()], [("fsdp",), ()], "a gather"),
    ("2x4", [("tensor",), ()], [("fsdp",), ("tensor",)], "exchange the minor half, permute"),
    ("4x2", [("fsdp",), ()], [("tensor",), ("fsdp",)], "exchange the minor half, permute"),
    ("2x4", [(), ("tensor",)], [("tensor",), ("fsdp",)], "an all-to-all, then a slice (last dim)"),
    ("2x4", [(), ("tensor",), ()], [("tensor",), ("fsdp",), ()], "exchange, permute (3 dims)"),
    ("2x2x2", [("b", "c"), ()], [("a",), ("b", "c")], "exchange the minor axis, permute"),
    ("2x4", [("fsdp",), (), ("tensor",)], [("tensor", "fsdp"), (), ()], "all-to-all, reorder"),
    ("2x2x2", [("b", "c"), (), ("a",)], [("c", "b", "a"), (), ()], "all-to-all, reorder"),
    ("2x2x2", [(), ("c", "b"), ("a",)], [(), ("a",), ("c", "b")], "the minor axis, permute"),
    ("2x2x2", [("c", "b", "a"), (), ()], [("a",), ("c", "b"), ()], "the minor two, permute"),
    ("2x2x2", [("a", "c"), (), ("b",)], [("c", "b"), ("a",), ()], "all-to-all, permute all"),
    ("4x2", [(), ("fsdp",), ("tensor",)], [(), (), ()], "one gather per dim, the last first"),
    ("2x2x2", [("a", "c"), ("b",)], [("a",), ()], "one gather per dim, the last first"),
    ("2x2x2", [("b",), ()], [("a",), ("b",)], "an all-to-all, then a slice (c untouched)"),
    ("2x2x2", [("b",), ()], [("c",), ("b",)], "an all-to-all, then a slice (a untouched)"),
]


@pytest.fixture(scope="module")
def meshes():
    return {
        name: jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
        for name, (shape, axes) in MESHES.items()
    }


@pytest.mark.parametrize("name, src, dst, how", MOVES)
def test_a_move_compiles_to_the_collectives_the_plan_predicts(meshes, name, src, dst, how):
    mesh = meshes[name]
    shape = (64, 32, 16)[: len(src)]
    predicted = sorted(
        str(c) for c in reshard_collectives(shape, np.float32, src, dst, dict(mesh.shape))
    )
    assert predicted == _compiled_move(mesh, src, dst, shape), how


@pytest.mark.parametrize(
    "stored, read",
    [("fsdp", "tensor"), ("tensor", "fsdp")],
    ids=["finer", "coarser"],
)
def test_a_weight_stored_on_one_axis_and_read_on_another_verifies(meshes, stored, read):
    """MaxText's MoE router weight: stored split over one axis, its rows contracted with
    activations whose features are split over the other."""
    mesh = meshes["2x4"]
    params = {"router": jnp.arange(64 * 4, dtype=jnp.float32).reshape(64, 4) / 256}
    x = jnp.sin(jnp.arange(8 * 64, dtype=jnp.float32)).reshape(8, 64)

    def step(params, x):
        return jnp.tanh(x @ params["router"]).sum(axis=0)

    hints = {r"params/router": P(stored, None), r"x": P(None, read)}
    sharded = jaxshard.auto_shard(mesh, hints)(step)
    plan = sharded.plan(params, x)
    checked = plan.verify()
    assert checked.ok, checked.surprises
    assert_leaves_match(sharded(params, x), jax.jit(step)(params, x))
