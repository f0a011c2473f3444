"""The memory estimate against compiled programs, each built around one thing XLA does
with buffers that program order does not show: work that reads no loop result runs
before the loop, independent all-reduces are combined (on CPU, whatever their size), a
transpose is written by the equation it reads, and an elementwise fusion writes over an
operand that dies there."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import jax_compat
from jaxshard.baseline import compiled_memory

F32 = jnp.float32


def _ratio(mesh, fn, args, hints):
    step = jaxshard.auto_shard(mesh, hints)(fn)
    plan = step.plan(*args)
    return plan.estimated_memory.total / compiled_memory(step.lower(*args).compile())


@pytest.fixture(scope="module")
def line():
    return jax.make_mesh((8,), ("data",))


def test_work_that_reads_no_loop_result_is_alive_across_the_loop(line):
    # the sort reads only an argument: XLA's scheduler runs it before the scan, so its
    # 16 MiB result is alive while the loop's temporaries are
    def f(ws, table, c0):
        c, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), c0, ws)
        ranked = jnp.sort(table, axis=-1)
        return jnp.sum(c) + jnp.sum(ranked[:, :16] * jnp.mean(c))

    args = (
        jax.ShapeDtypeStruct((4, 1024, 1024), F32),
        jax.ShapeDtypeStruct((2048, 2048), F32),
        jax.ShapeDtypeStruct((2048, 1024), F32),
    )
    assert _ratio(line, f, args, {}) == pytest.approx(1.0, abs=0.03)


@pytest.mark.xfail(
    jax_compat.JAX_VERSION >= (0, 11),
    strict=True,
    reason="JAX 0.11+'s XLA writes the combined all-reduce's output and the transposed "
    "gradient into buffers of their own (3 x 16 MiB at once): 0.73x",
)
def test_a_gradient_summed_before_the_backward_loop_waits_for_the_combined_reduction(line):
    # the head's gradient is a partial sum over the batch's axis made before the
    # backward loop; XLA combines its all-reduce with the input projection's, after the
    # loop. The transpose that turns it into the gradient's layout is free.
    def loss(p, x):
        h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x @ p["proj"], p["layers"])
        return jnp.mean((h @ p["head"]) ** 2)

    params = {
        "proj": jax.ShapeDtypeStruct((512, 512), F32),
        "layers": jax.ShapeDtypeStruct((4, 512, 512), F32),
        "head": jax.ShapeDtypeStruct((512, 8192), F32),
    }
    args = (params, jax.ShapeDtypeStruct((2048, 512), F32))
    assert _ratio(line, jax.grad(loss), args, {"x": P("data")}) == pytest.approx(1.0, abs=0.10)
