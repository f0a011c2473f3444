"""Train a small GPT-style decoder sharded by jaxshard on a 2x4 (data, model) mesh.

Only the batch and two weight patterns are hinted — the query projections and the first
MLP matrices on "model" — and propagation shards every other weight of every layer
(keys, values, output projections, second MLP matrices: the Megatron pattern), their
AdamW state, activations and gradients. Runs on 8 simulated CPU devices, a GPU host or
a TPU slice alike:

    python examples/gpt.py [--steps 5] [--layers 2]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import models  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard.explain import human_bytes  # noqa: E402

HINTS = {
    r"batch/.*": P("data"),
    r"params/.*/wq": P(None, "model"),
    r"params/.*/w1": P(None, "model"),
}


def factory(layers: int = 2):
    """The train step, its example arguments, and the hints (for `jaxshard` tooling).

    Example:
        >>> step, (params, opt_state, batch), hints = factory()  # doctest: +SKIP
    """
    cfg = models.GPTConfig(n_layers=layers)
    params = models.init_gpt(jax.random.key(0), cfg)
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(params)
    batch = models.make_batch_gpt(jax.random.key(1), cfg)
    step = models.make_train_step(functools.partial(models.gpt_loss, cfg=cfg), optimizer)
    return step, (params, opt_state, batch), HINTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    train_step, (params, opt_state, batch), hints = factory(args.layers)
    step = jaxshard.auto_shard(mesh, hints=hints)(train_step)

    plan = step.plan(params, opt_state, batch)
    print("planned layouts of layer 0 and the embeddings:")
    layer0 = {"layers/0": plan.in_specs[0]["layers"][0], "wte": plan.in_specs[0]["wte"]}
    for path, spec in jax.tree_util.tree_flatten_with_path(layer0)[0]:
        print(f"  params/{jax.tree_util.keystr(path, simple=True, separator='/'):<24} {spec}")
    p_dev, p_all = plan.per_device_bytes("params/")
    o_dev, o_all = plan.per_device_bytes("opt_state/")
    print(
        f"params + optimizer state: {human_bytes(p_dev + o_dev)} per device, "
        f"{human_bytes(p_all + o_all)} replicated ({(p_all + o_all) / (p_dev + o_dev):.2f}x less)"
    )
    print(f"predicted communication: {human_bytes(plan.predicted_bytes)} per device per step")

    reference = jax.jit(train_step)
    ref_params, ref_state = params, opt_state
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, batch)
        ref_params, ref_state, ref_loss = reference(ref_params, ref_state, batch)
        print(f"step {i}: loss {float(loss):.6f} (unsharded {float(ref_loss):.6f})")


if __name__ == "__main__":
    main()
