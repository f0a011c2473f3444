"""Train a U-Net on one large image, split along its rows over 8 devices.

With a batch of one image there is no batch to split: the only way to share the work is
along the image's rows. Hinting the image's rows on ``"x"`` is enough: every 3x3
convolution, pooling and upsampling of the U-Net keeps its rows split, each device
exchanging one row with each neighbour per convolution (a halo, by collective-permutes),
and the small weights stay replicated. The plan is checked against the compiled program,
and the memory per device compared with the one-device program's.

    python examples/unet_spatial.py [--image 512] [--steps 3]
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
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard.baseline import compiled_memory  # noqa: E402

HINTS = {r"batch/image": P(None, "x"), r"batch/mask": P(None, "x")}


def factory(image: int = 64, batch_size: int = 1):
    """The train step, its example arguments (``batch_size`` pictures of ``image`` x
    ``image``), and the hints.

    Example:
        >>> step, (params, opt_state, batch), hints = factory(64)  # doctest: +SKIP
    """
    cfg = models.UNetConfig(image=image)
    params = models.init_unet(jax.random.key(0), cfg)
    optimizer = optax.adamw(1e-3)
    batch = models.make_batch_unet(jax.random.key(1), cfg, batch_size=batch_size)
    step = models.make_train_step(functools.partial(models.unet_loss, cfg=cfg), optimizer)
    return step, (params, optimizer.init(params), batch), HINTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    train_step, (params, opt_state, batch), hints = factory(args.image)
    step = jaxshard.auto_shard(mesh, hints=hints)(train_step)
    plan = step.plan(params, opt_state, batch)
    print(plan.explain().split("\n\nreshards")[0])
    check = plan.verify(step.lower(params, opt_state, batch))
    print(check)
    one = compiled_memory(jax.jit(train_step).lower(params, opt_state, batch).compile())
    print(
        f"memory per device: {check.compiled_memory / 2**20:.1f} MiB compiled, "
        f"{plan.estimated_memory.total / 2**20:.1f} MiB estimated; one device: "
        f"{one / 2**20:.1f} MiB ({check.compiled_memory / one:.2f}x)"
    )
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, batch)
        print(f"step {i}: loss {float(loss):.6f}")


if __name__ == "__main__":
    main()
