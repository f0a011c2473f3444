"""Train a small MLP sharded by jaxshard on a 2x4 (data, model) mesh.

The batch is hinted on "data" and the first layer's weight column-parallel on "model";
propagation makes the next layer row-parallel and shards the AdamW state to match.

    python examples/mlp.py [--steps 5]
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

HINTS = {r"batch/.*": P("data"), r"params/layers/0/w": P(None, "model")}


def factory():
    """The train step, its example arguments, and the hints.

    Example:
        >>> step, (params, opt_state, batch), hints = factory()  # doctest: +SKIP
    """
    cfg = models.MLPConfig()
    params = models.init_mlp(jax.random.key(0), cfg)
    optimizer = optax.adamw(1e-2)
    batch = models.make_batch_mlp(jax.random.key(1), cfg)
    step = models.make_train_step(functools.partial(models.mlp_loss, cfg=cfg), optimizer)
    return step, (params, optimizer.init(params), batch), HINTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    train_step, (params, opt_state, batch), hints = factory()
    step = jaxshard.auto_shard(mesh, hints=hints)(train_step)
    print(step.plan(params, opt_state, batch).explain().split("\n\nreshards")[0])
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, batch)
        print(f"step {i}: loss {float(loss):.6f}")


if __name__ == "__main__":
    main()
