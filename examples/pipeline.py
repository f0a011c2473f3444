"""A Llama-style train step pipelined over a "stage" mesh axis, from unchanged code.

The step is `models.make_train_step` of `models.llama_loss`: the usual
`jax.value_and_grad` of a loss whose layers run as `jax.lax.scan` over stacked
parameters with a `jax.checkpoint`ed body, then an optax update. `auto_shard` with
``pipeline=jaxshard.Pipeline("stage", microbatches)`` runs the scan as a GPipe pipeline
(``--schedule 1f1b``: one forward and one backward microbatch per iteration, the loss
head run per microbatch; ``--repeats 2``: a circular one, each stage holding two chunks
of layers)
over the stage axis of a (stage=2, data=2, model=2) mesh, with tensor parallelism inside
each stage and the batch on (data, stage). The example prints the plan's pipeline
section, checks the losses and the parameters after SGD steps against the unsharded
`jax.jit` step, and reads the collective-permutes and memory from the compiled program.

    python examples/pipeline.py [--steps 2] [--microbatches 4] [--schedule 1f1b] [--repeats 2]
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

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard.baseline import compiled_cost  # noqa: E402
from jaxshard.cost import human_bytes  # noqa: E402
from jaxshard.hlo import compiled_collectives  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

HINTS = {
    r"batch/.*": P(("data", "stage")),
    r"params/layers/wq": P(None, None, "model"),
    r"params/layers/w_gate": P(None, None, "model"),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument(
        "--repeats", type=int, default=1, help="above 1: the circular schedule, chunks per stage"
    )
    args = parser.parse_args(argv)

    cfg = models.LlamaConfig(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, seq=32, d_ff=256)
    params = models.init_llama(jax.random.key(0), cfg)
    batch = models.make_batch_llama(jax.random.key(1), cfg, 16)
    opt = optax.sgd(0.1)
    train_step = models.make_train_step(functools.partial(models.llama_loss, cfg=cfg), opt)

    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
    schedule = "circular" if args.repeats > 1 else args.schedule
    pipeline = jaxshard.Pipeline(
        axis="stage", microbatches=args.microbatches, schedule=schedule, repeats=args.repeats
    )
    step = jaxshard.auto_shard(mesh, HINTS, pipeline=pipeline)(train_step)
    plan = step.plan(params, opt.init(params), batch)
    explained = plan.explain()
    print(explained[explained.index("pipeline (") :].split("\n\n")[0])
    print("layer stack stored as:", plan.in_specs[0]["layers"]["wq"])

    ref = jax.jit(train_step)
    mine, theirs = (params, opt.init(params)), (params, opt.init(params))
    for i in range(args.steps):
        *mine, loss = step(*mine, batch)
        *theirs, ref_loss = ref(*theirs, batch)
        print(f"step {i}: loss {float(loss):.6f} (unsharded {float(ref_loss):.6f})")
    worst = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(mine[0]), jax.tree.leaves(theirs[0]))
    )
    print(f"parameters after {args.steps} SGD steps: worst leaf error {worst:.2e} of its scale")

    compiled = step.lower(params, opt.init(params), batch).compile()
    permutes = [
        c for c in compiled_collectives(compiled.as_text(), mesh) if c.kind == "collective-permute"
    ]
    cost = compiled_cost(compiled, mesh)
    print(
        f"compiled: {len(permutes)} collective-permutes over "
        f"{sorted({a for c in permutes for a in c.axes})}, "
        f"{human_bytes(cost.bytes)} collectives and {human_bytes(cost.memory)} memory per device"
    )
    print(plan.verify())


if __name__ == "__main__":
    main()
