"""Kernels the catalogue cannot see into, sharded like built-in primitives.

A small regression step calls a Pallas kernel (an activation with its own custom VJP,
whose backward is a second Pallas kernel; interpret mode on CPU, compiled on GPU/TPU)
and a `custom_partitioning` matmul. The Pallas kernels get their rules from
`jaxshard.with_rule` (checked first by `jaxshard.check_rule`); the matmul carries its
own Shardy ``sharding_rule``. From two hints — the batch on "data", ``w1``'s columns on
"model" — propagation crosses both kernels and makes ``w2`` row-parallel; every step
matches the unsharded one.

    python examples/kernels.py [--steps 3]
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.custom_partitioning import custom_partitioning  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402

HINTS = {r"batch/x": P("data"), r"params/w1": P(None, "model")}
INTERPRET = jax.default_backend() == "cpu"  # Pallas compiles on GPU and TPU


# --- a Pallas activation with its own derivative ---------------------------------------


def _act_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = x * jnp.tanh(x)


def _act_grad_kernel(x_ref, g_ref, o_ref):
    x, t = x_ref[...], jnp.tanh(x_ref[...])
    o_ref[...] = g_ref[...] * (t + x * (1 - t * t))


def _pallas(kernel, out_like, *args):
    out = jax.ShapeDtypeStruct(out_like.shape, out_like.dtype)
    return pl.pallas_call(kernel, out_shape=out, interpret=INTERPRET)(*args)


# the backward kernel is a kernel too: it gets its own rule
act_grad = jaxshard.with_rule("b h, b h -> b h")(lambda x, g: _pallas(_act_grad_kernel, x, x, g))


@jax.custom_vjp
def activation(x):
    """``x * tanh(x)`` as a Pallas kernel."""
    return _pallas(_act_kernel, x, x)


activation.defvjp(lambda x: (activation(x), x), lambda x, g: (act_grad(x, g),))
# elementwise: both factors pass through
sharded_activation = jaxshard.with_rule("b h -> b h")(activation)


# --- a custom_partitioning matmul with its own Shardy rule ------------------------------


def _spec_entry(spec: P, dim: int):
    return spec[dim] if dim < len(spec) else None


def _matmul_partition(mesh, arg_shapes, result_shape):
    """Each device multiplies its blocks; a split contraction is summed across devices."""
    a, b = (s.sharding.spec for s in arg_shapes)
    i, j, k = _spec_entry(a, 0), _spec_entry(a, 1), _spec_entry(b, 1)
    if k is not None and k in (i, j):
        k = None

    def lower(x, y):
        out = x @ y
        return jax.lax.psum(out, j) if j is not None else out

    specs = (NamedSharding(mesh, P(i, j)), NamedSharding(mesh, P(j, k)))
    return mesh, lower, NamedSharding(mesh, P(i, k)), specs


cp_matmul = custom_partitioning(lambda a, b: a @ b)
cp_matmul.def_partition(
    partition=_matmul_partition, sharding_rule="i j, j k -> i k", reduction_factors=("j",)
)


@jax.custom_vjp  # custom_partitioning has no derivative of its own
def matmul(a, b):
    """``a @ b`` as a custom_partitioning op."""
    return cp_matmul(a, b)


matmul.defvjp(
    lambda a, b: (cp_matmul(a, b), (a, b)),
    lambda res, g: (cp_matmul(g, res[1].T), cp_matmul(res[0].T, g)),
)


# --- the train step ----------------------------------------------------------------------


def loss_fn(params, batch):
    h = sharded_activation(batch["x"] @ params["w1"])
    return jnp.mean((matmul(h, params["w2"]) - batch["y"]) ** 2)


def train_step(params, batch):
    """One SGD step: the new parameters and the loss."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def factory(batch_size: int = 8, d_in: int = 16, hidden: int = 32, d_out: int = 8):
    """The train step, its example arguments, and the hints.

    Example:
        >>> step, (params, batch), hints = factory()  # doctest: +SKIP
    """
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k1, (d_in, hidden)) / d_in**0.5,
        "w2": jax.random.normal(k2, (hidden, d_out)) / hidden**0.5,
    }
    batch = {
        "x": jax.random.normal(k3, (batch_size, d_in)),
        "y": jax.random.normal(k4, (batch_size, d_out)),
    }
    return train_step, (params, batch), HINTS


def check_rules() -> None:
    """Check the Pallas kernels' rules by execution before planning relies on them."""
    x, g = jnp.linspace(-2, 2, 64).reshape(8, 8), jnp.linspace(1, 3, 64).reshape(8, 8)
    jaxshard.check_rule(activation, "b h -> b h", x)
    jaxshard.check_rule(lambda x, g: _pallas(_act_grad_kernel, x, x, g), "b h, b h -> b h", x, g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    check_rules()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    train_step, (params, batch), hints = factory()
    step = jaxshard.auto_shard(mesh, hints=hints)(train_step)
    print(step.plan(params, batch).explain().split("\n\nreshards")[0])
    reference = jax.jit(train_step)
    ref_params = params
    for i in range(args.steps):
        params, loss = step(params, batch)
        ref_params, ref_loss = reference(ref_params, batch)
        print(f"step {i}: loss {float(loss):.6f} (unsharded {float(ref_loss):.6f})")


if __name__ == "__main__":
    main()
