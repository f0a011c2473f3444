"""One process of a 2-process `jax.distributed` job on CPU, launched by test_multiprocess.

Usage: ``python tests/multiprocess_worker.py PROCESS_ID PORT``. Each process has 4 CPU
devices; the (data=2, model=4) mesh spans all 8, so every plan has devices this process
cannot address. The process plans a GPT train step (no communication: planning is
deterministic), builds its arguments as global arrays (parameters from the same seed on
every process; the batch from this process's rows only, with
`jax.make_array_from_process_local_data`), runs two SGD steps over gloo collectives on
the loopback interface, and prints one JSON line: its plan fingerprint and the losses.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

if __name__ == "__main__":  # a worker process; the test imports `setup` only
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import functools  # noqa: E402

import jax  # noqa: E402
import models  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402

HINTS = {
    r"batch/.*": P("data"),
    r"params/.*/wq": P(None, "model"),
    r"params/.*/w1": P(None, "model"),
}
CONFIG = models.GPTConfig(n_layers=1)
STEPS = 2


def setup():
    """The train step, parameters, optimizer state and (global, host) batch; shared with
    the test's single-process reference run."""
    params = jax.jit(models.init_gpt, static_argnums=1)(jax.random.key(0), CONFIG)
    optimizer = optax.sgd(0.1)
    batch = jax.device_get(
        jax.jit(models.make_batch_gpt, static_argnums=1)(jax.random.key(1), CONFIG)
    )
    loss = functools.partial(models.gpt_loss, cfg=CONFIG)
    return models.make_train_step(loss, optimizer), params, optimizer.init(params), batch


def main() -> None:
    process_id, port = int(sys.argv[1]), int(sys.argv[2])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    train_step, params, opt_state, batch = setup()
    step = jaxshard.auto_shard(mesh, HINTS)(train_step)
    plan = step.plan(params, opt_state, batch)
    text = plan.explain() + repr(plan.in_specs) + repr(plan.out_specs)
    # This process's rows of the batch, placed as one global array per leaf.
    batch_shardings = plan.in_shardings[2]
    local = {}
    for name, value in batch.items():
        sharding = batch_shardings[name]
        rows = [i[0] for i in sharding.addressable_devices_indices_map(value.shape).values()]
        start = min(r.start or 0 for r in rows)
        stop = max(value.shape[0] if r.stop is None else r.stop for r in rows)
        local[name] = jax.make_array_from_process_local_data(
            sharding, value[start:stop], value.shape
        )
    losses = []
    for _ in range(STEPS):
        params, opt_state, loss = step(params, opt_state, local)
        losses.append(float(loss))
    print(
        json.dumps(
            {
                "process": process_id,
                "fingerprint": hashlib.sha256(text.encode()).hexdigest(),
                "plans_made": step.plans_made,
                "addressable": len(plan.in_shardings[0]["wte"].addressable_devices),
                "losses": losses,
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
