"""The search at scale: a Llama-3-8B-shaped AdamW step on an 8x8 (data, model) mesh.

    python -m benchmarks.scale            # the 8B shape, 80 GiB budget
    python -m benchmarks.scale --quick    # a small Llama on the same mesh

The step is `examples/models.py`'s Llama (32 layers under `lax.scan` with a remat body,
d 4096, 32/8 GQA heads, ffn 14336, vocab 128256, seq 4096, batch 64) with abstract
arguments, compiled for 64 simulated CPU devices (this module asks for them before JAX
loads). Rows: `auto_shard(search=True)` from the batch hint alone with an 80 GiB
memory budget, and the hand-written Megatron tensor-parallel + data-parallel layout.
Columns: plan + search seconds, compiled memory per device (`memory_analysis`),
compiled collective bytes per device per step (ring volumes), and the collectives that
run once per layer iteration (inside the scan's loop) against those that run once per
step: a stacked weight the plan stores split on its layer dim is gathered where the
loop reads it, and this shows whether that is once per step or once per layer.
"""

from __future__ import annotations

import os
import re

os.environ["XLA_FLAGS"] = (
    re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    + " --xla_force_host_platform_device_count=64"
).strip()

import time  # noqa: E402

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from benchmarks import layouts  # noqa: E402
from benchmarks.pipeline import command_line, llama_8b, log, write_result  # noqa: E402
from benchmarks.quality import expert_layout  # noqa: E402
from jaxshard.baseline import compiled_cost  # noqa: E402
from jaxshard.cost import human_bytes  # noqa: E402
from jaxshard.hlo import compiled_collectives  # noqa: E402

BUDGET = 80 * 2**30


def _loop_split(compiled, mesh, layers: int) -> tuple[float, float]:
    """(bytes in collectives run once per layer iteration or more, bytes in the rest)."""
    per_layer = once = 0.0
    for c in compiled_collectives(compiled.as_text(), mesh):
        total = c.ring_bytes * (c.runs or 1)
        if (c.runs or 1) >= layers:
            per_layer += total
        else:
            once += total
    return per_layer, once


def run(quick: bool = False, log=print) -> tuple[list, object]:
    w = llama_8b(quick)
    mesh = jax.make_mesh((8, 8), ("data", "model"))
    budget = BUDGET if not quick else 64 * 2**20
    rows = []
    log(f"{w.name}: search ...")
    start = time.perf_counter()
    fn = jaxshard.auto_shard(mesh, {r"batch/.*": P("data")}, search=True, memory_budget=budget)
    fn = fn(w.step)
    plan = fn.plan(*w.args)
    seconds = time.perf_counter() - start
    compiled = fn.lower(*w.args).compile()
    stacked = {
        name: spec
        for name, spec in plan.in_specs[0]["layers"].items()
        if len(spec) and spec[0] is not None
    }
    rows.append(("search, batch hint, memory budget", seconds, compiled, stacked))
    log(f"{w.name}: Megatron ...")
    built = expert_layout(w, mesh, layouts.megatron("llama"))
    rows.append(("Megatron TP + DP (hand-written)", None, built.compiled, {}))
    out = []
    for name, secs, comp, stacked in rows:
        cost = compiled_cost(comp, mesh)
        per_layer, once = _loop_split(comp, mesh, w.cfg.n_layers)
        out.append((name, secs, cost, per_layer, once, stacked))
    return out, w


def report(rows, w, budget: float) -> str:
    mega = rows[-1][2]
    lines = [
        "# The search at scale",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        f"{w.describe()}; mesh (data=8, model=8), 64 devices; budget {human_bytes(budget)}.",
        "",
        "| layout | plan + search s | memory / device | within budget | collective bytes / device "
        "| vs Megatron | per layer iteration | once per step | stacked leaves split on the layer dim |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, secs, cost, per_layer, once, stacked in rows:
        split = ", ".join(f"{k} `{v}`" for k, v in stacked.items()) or "none"
        lines.append(
            f"| {name} | {'—' if secs is None else f'{secs:.1f}'} | {human_bytes(cost.memory)} | "
            f"{'yes' if cost.memory <= budget else 'no'} | {human_bytes(cost.bytes)} | "
            f"{cost.bytes / mega.bytes:.2f}x | {human_bytes(per_layer)} | {human_bytes(once)} | "
            f"{split} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    quick = command_line(argv, __doc__)
    rows, w = run(quick=quick, log=log)
    write_result("scale", report(rows, w, BUDGET if not quick else 64 * 2**20), quick)


if __name__ == "__main__":
    main()
