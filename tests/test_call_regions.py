"""Higher-order primitives that call one inner jaxpr positionally (`composite`,
`linear_call`, `remat_opt`, `custom_vmap_call`, and `custom_linear_solve`'s solve):
shardings propagate through the inner program, the plan lowers with the body rewritten
in place, and the sharded run matches unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.custom_derivatives import linear_call
from jax.sharding import PartitionSpec as P

import jaxshard

tanh2 = jax.lax.composite(lambda y: jnp.tanh(y) * 2.0, name="test.tanh2")


def scaled(y):
    return linear_call(lambda r, y: y * r, lambda r, t: t * r, 2.0, y)


sin_vjp = jax.custom_vjp(jnp.sin)
sin_vjp.defvjp(lambda y: (jnp.sin(y), jnp.cos(y)), lambda c, g: (c * g,), optimize_remat=True)


@jax.custom_batching.custom_vmap
def cube(y):
    return y**3


cube.def_vmap(lambda n, batched, y: (y**3, batched[0]))


def weight_grad(x, w):
    return jax.grad(lambda w: sin_vjp(x @ w).sum())(w)


CASES = [
    ("composite", lambda x, w: tanh2(x @ w), "composite", P("data", "model")),
    ("linear_call", lambda x, w: scaled(x @ w), "linear_call", P("data", "model")),
    ("remat_opt", weight_grad, "remat_opt", P(None, "model")),
    ("custom_vmap", lambda x, w: cube(x @ w), "custom_vmap_call", P("data", "model")),
]
HINTS = {"x": P("data", None), "w": P(None, "model")}


@pytest.mark.parametrize(
    "fn, primitive, out_spec", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_region_propagates_and_runs(mesh, fn, primitive, out_spec):
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    assert primitive in {e.primitive.name for e in jax.make_jaxpr(fn)(x, w).eqns}
    sharded = jaxshard.auto_shard(mesh, HINTS)(fn)
    assert sharded.plan(x, w).out_specs == out_spec
    np.testing.assert_allclose(sharded(x, w), jax.jit(fn)(x, w), rtol=1e-5, atol=1e-6)


def test_a_linear_solve_is_planned_through_its_solve(mesh):
    # jnp.linalg.solve is a custom_linear_solve around an LU solve: batched systems split
    # over "data" stay split through it and its derivative, with no collective
    def solved(a, b):
        s = a @ jnp.swapaxes(a, -1, -2) + 4 * jnp.eye(4)
        x = jnp.linalg.solve(s, b)
        return x, jax.grad(lambda b: jnp.linalg.solve(s, b).sum())(b)

    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, 4, 4)).astype(np.float32)
    b = rng.normal(size=(8, 4, 1)).astype(np.float32)
    sharded = jaxshard.auto_shard(mesh, {"a": P("data"), "b": P("data")})(solved)
    plan = sharded.plan(a, b)
    assert plan.out_specs == (P("data"), P("data"))
    check = plan.verify(sharded.lower(a, b))
    assert check.ok and not check.found, (check.surprises, check.found)
    for got, want in zip(sharded(a, b), jax.jit(solved)(a, b), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
