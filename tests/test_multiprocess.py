"""Multi-process: two local CPU processes of 4 devices each, joined by
`jax.distributed` over loopback (gloo collectives), plan the same step without talking
to each other and train it; the plans agree and the losses match a single-process
unsharded run."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multiprocess_worker.py")
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_plan_alike_and_train_like_one():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(i), str(port)],
            # Different hash seeds: set and dict iteration over strings must not change plans.
            env={**env, "PYTHONHASHSEED": str(i + 1)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, f"worker failed:\n{err[-4000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    assert [r["process"] for r in results] == [0, 1]
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
    assert all(r["addressable"] == 4 and r["plans_made"] == 1 for r in results)

    sys.path.insert(0, HERE)
    from multiprocess_worker import STEPS, setup

    train_step, params, opt_state, batch = setup()
    reference = jax.jit(train_step)
    ref_losses = []
    for _ in range(STEPS):
        params, opt_state, loss = reference(params, opt_state, batch)
        ref_losses.append(float(loss))
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
