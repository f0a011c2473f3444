"""Layers rematerialized one by one outside a loop, at real widths: the memory estimate
against the compiled program, with and without ``jax.checkpoint``.

    python -m benchmarks.remat           # on the installed JAX

The step: four unrolled SwiGLU MLP blocks of the Llama-3-8B shape (d 4096, ffn 14336,
RMSNorm, residual), batch 64 x seq 4096, float32, a plain SGD update, abstract arguments,
on 64 simulated CPU devices (an 8x8 data x model mesh, the MLPs tensor parallel). Each
block is either under its own ``jax.checkpoint`` or not. XLA's CPU backend of JAX 0.10
merges the recomputation with the forward, so both compile to about the same memory;
from JAX 0.11 it recomputes (`jaxshard.jax_compat.CPU_RECOMPUTES_REMAT`). The table
prints the estimated and compiled memory per device and the predicted and compiled
collective bytes per device per step.
"""

from __future__ import annotations

import os
import re


def rows() -> list[dict]:
    """One row per setting (checkpointed or not): estimate and compiled figures."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import jaxshard
    from jaxshard.baseline import compiled_cost

    f32, d, ff = jnp.float32, 4096, 14336
    mesh = jax.make_mesh((8, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    layers = [
        {
            "wg": jax.ShapeDtypeStruct((d, ff), f32),
            "wu": jax.ShapeDtypeStruct((d, ff), f32),
            "wd": jax.ShapeDtypeStruct((ff, d), f32),
        }
        for _ in range(4)
    ]
    x = jax.ShapeDtypeStruct((64, 4096, d), f32)
    hints = {"x": P("data"), r".*/wg": P(None, "model"), r".*/wu": P(None, "model"),
             r".*/wd": P("model", None)}  # fmt: skip

    def block(p, x):
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)
        return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]

    out = []
    for remat in (True, False):
        layer = jax.checkpoint(block) if remat else block

        def loss(layers, x, layer=layer):
            for p in layers:
                x = layer(p, x)
            return jnp.mean(x**2)

        def step(layers, x, loss=loss):
            value, grads = jax.value_and_grad(loss)(layers, x)
            return jax.tree.map(lambda p, g: p - 1e-3 * g, layers, grads), value

        sharded = jaxshard.auto_shard(mesh, hints)(step)
        plan = sharded.plan(layers, x)
        compiled = compiled_cost(sharded.lower(layers, x).compile(), mesh)
        out.append({
            "jax": jax.__version__, "checkpoint": remat,
            "estimated": plan.estimated_memory.total, "memory": compiled.memory,
            "predicted": plan.predicted_bytes, "bytes": compiled.bytes,
        })  # fmt: skip
    return out


def table(found: list[dict]) -> str:
    gib = 2**30
    lines = [
        "| JAX | checkpoint per layer | memory/device: estimated / compiled | "
        "collective bytes/device: predicted / compiled |",
        "|---|---|---|---|",
    ]
    for r in found:
        lines.append(
            f"| {r['jax']} | {'yes' if r['checkpoint'] else 'no'} | "
            f"{r['estimated'] / gib:.2f} / {r['memory'] / gib:.2f} GiB "
            f"(**{r['estimated'] / r['memory']:.2f}**) | "
            f"{r['predicted'] / gib:.2f} / {r['bytes'] / gib:.2f} GiB |"
        )
    return "\n".join(lines)


def main() -> None:
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=64".strip()
    print(table(rows()))


if __name__ == "__main__":
    main()
