"""Spatial partitioning: a U-Net step on one large image, split over 8 devices.

The U-Net of ``examples/models.py`` (3x3 convolutions, 2x2 average pooling, nearest
upsampling by ``repeat``, skip concatenations, AdamW) on one ``--image`` square picture
(512 by default), on 8 simulated devices. Each row is one layout, compiled and read:

- replicated: every device runs the whole step (`jax.jit`, nothing split);
- jaxshard, rows hinted: the image's and mask's rows hinted ``P(None, "x")``;
- XLA alone, rows hinted: `jax.jit` with the same hints as ``in_shardings``;
- jaxshard, columns hinted;
- jaxshard search: no hints, ``memory_budget`` 0.3x the replicated program's memory;
- batch split, for scale: 8 such images, one per device (`jax.jit`, batch on ``"x"``):
  what each device holds when the batch, not the image, is split.

Memory is ``memory_analysis()`` per device, bytes the compiled collectives' ring volumes
per device per step; jaxshard's rows also give the predicted bytes, the estimated
memory and whether `verify()` found the compiled program as planned.

    python -m benchmarks.spatial [--image 512] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

from .environment import environment, load_now, markdown_table, write_result

HERE = os.path.dirname(os.path.abspath(__file__))


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def run(image: int) -> list[list[str]]:
    """The table's rows for one image size.

    Example:
        >>> run(64)  # doctest: +SKIP
    """
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxshard
    from jaxshard.baseline import compiled_cost, shardy_alone

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import unet_spatial

    step_fn, args, rows_hint = unet_spatial.factory(image)
    params, opt_state, _ = args
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    cols_hint = {r"batch/image": P(None, None, "x"), r"batch/mask": P(None, None, "x")}

    one = compiled_cost(jax.jit(step_fn).lower(*args).compile(), mesh)
    table = [["replicated (jax.jit)", _mib(one.memory), "1.00", "0.0", "-", "-", "-"]]

    def planned(label, step):
        plan = step.plan(*args)
        check = plan.verify(step.lower(*args))
        estimate = plan.estimated_memory.total
        table.append([
            label, _mib(check.compiled_memory), f"{check.compiled_memory / one.memory:.2f}",
            _mib(check.compiled_bytes), _mib(plan.predicted_bytes), _mib(estimate),
            "as planned" if check.ok else f"{len(check.surprises)} surprises",
        ])  # fmt: skip
        return plan

    planned("jaxshard, rows hinted", jaxshard.auto_shard(mesh, hints=rows_hint)(step_fn))
    alone = compiled_cost(shardy_alone(step_fn, args, mesh, rows_hint).compile(), mesh)
    table.append([
        "XLA alone (jax.jit), rows hinted", _mib(alone.memory),
        f"{alone.memory / one.memory:.2f}", _mib(alone.bytes), "-", "-", "-",
    ])  # fmt: skip
    planned("jaxshard, columns hinted", jaxshard.auto_shard(mesh, hints=cols_hint)(step_fn))
    searched = jaxshard.auto_shard(mesh, search=True, memory_budget=0.3 * one.memory)(step_fn)
    plan = planned("jaxshard search, no hints, budget 0.3x", searched)
    image_spec = plan.in_specs[2]["image"]
    table[-1][0] += f" (chose image {image_spec})"

    _, (_, _, many), _ = unet_spatial.factory(image, batch_size=8)
    split = NamedSharding(mesh, P("x"))
    whole = NamedSharding(mesh, P())
    shardings = (jax.tree.map(lambda _: whole, params), jax.tree.map(lambda _: whole, opt_state),
                 jax.tree.map(lambda _: split, many))  # fmt: skip
    batched = compiled_cost(
        jax.jit(step_fn, in_shardings=shardings).lower(params, opt_state, many).compile(), mesh
    )
    table.append([
        "batch split: 8 images, one per device (jax.jit)", _mib(batched.memory),
        f"{batched.memory / one.memory:.2f}", _mib(batched.bytes), "-", "-", "-",
    ])  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="a 128 x 128 image")
    args = parser.parse_args()
    image = 128 if args.quick else args.image
    rows = run(image)
    head = ["layout", "memory MiB", "vs replicated", "bytes MiB", "predicted MiB",
            "estimated MiB", "verify()"]  # fmt: skip
    text = "\n".join([
        f"# Spatial partitioning: U-Net on one {image} x {image} image, 8 devices", "",
        environment(), "",
        *markdown_table(head, rows), "",
        "Memory per device from `memory_analysis()`; bytes are the compiled collectives' "
        "ring volumes per device per step. " + load_now(), "",
    ])  # fmt: skip
    write_result("spatial", text, args.quick)


if __name__ == "__main__":
    main()
