"""Pipeline parallelism at scale: a Llama-3-8B-shaped AdamW step on 64 devices.

    python -m benchmarks.pipeline            # the 8B shape on (stage=4, data=4, model=4)
    python -m benchmarks.pipeline --quick    # a small Llama on the same mesh

The step is `examples/models.py`'s Llama (32 layers under `lax.scan` with a remat body,
d 4096, 32/8 GQA heads, ffn 14336, vocab 128256, seq 4096, batch 64) with abstract
arguments, so nothing is allocated: every figure is read from the program XLA compiles
for 64 simulated CPU devices (this module asks for them before JAX loads), or from the
plan. Layouts, all from the tensor-parallel hints (batch on data; wq and w_gate column
parallel on model):

- no pipeline, the stage axis idle (what the hints alone give on this mesh);
- no pipeline, the batch over (stage, data): 16-way data parallel x 4-way tensor parallel;
- `pipeline=Pipeline("stage", M)` for several M: GPipe over 4 stages, with the batch
  hinted on data only (the embedding, output head and loss then run on every stage for
  the stage's whole data shard) and on (data, stage) (those parts then use the stage
  devices as data parallelism too; the microbatches are gathered over the stage axis
  where the pipeline starts). The weight gradients are summed over "data" every
  iteration; one row shows `Pipeline(replicate=True)`, where each replica adds up its
  own and they are summed once per step.
- `Pipeline("stage", M, schedule="1f1b")`: one forward and one backward microbatch per
  iteration on every stage, the loss head run per microbatch inside the loop; each stage
  keeps the layer inputs of 2S−1 = 7 microbatches instead of GPipe's M+S−1.
- `Pipeline("stage", M, schedule="circular", repeats=2)`: each stage holds 2 chunks of 4
  layers (stage s: chunks s and s + 4) and every microbatch passes the stages twice; the
  stacked weights move from layer order to the stages' chunks once per step (an
  all-to-all) and their gradients back (collective-permutes). One row each with
  4 chunks of 2 layers per stage and with `replicate=True`.

Columns: memory per device (`memory_analysis`: arguments + results + temporaries −
aliased), the temporaries alone, collective bytes per device per step (compiled, ring
volumes), jaxshard's memory estimate (`Plan.estimated_memory`) and predicted bytes over
those compiled figures, compute per device (`jaxshard.cost.compute_flops`: XLA's cost
analysis counts a loop body once), and the modeled step time = compute / 1e14 FLOP/s +
bytes / 1e11 B/s, both per device, with no overlap. Then the bubble (S−1)/(M+S−1)
against M, and the compute the pipelined program does per device over the ideal share
(the plain data x tensor parallel layout's).
"""

from __future__ import annotations

import os
import re

os.environ["XLA_FLAGS"] = (
    re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    + " --xla_force_host_platform_device_count=64"
).strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from benchmarks.environment import write_result  # noqa: E402
from benchmarks.workloads import models, workload  # noqa: E402
from jaxshard.baseline import compiled_cost  # noqa: E402
from jaxshard.cost import compute_flops, human_bytes  # noqa: E402

PEAK_FLOPS, BANDWIDTH = 1e14, 1e11
MESH_SHAPE, MESH_AXES = (4, 4, 4), ("stage", "data", "model")
TP = {r"params/layers/wq": P(None, None, "model"), r"params/layers/w_gate": P(None, None, "model")}


def llama_8b(quick: bool):
    if quick:
        cfg = models.LlamaConfig(
            vocab=1024, d_model=256, n_heads=8, n_kv_heads=4, n_layers=8, seq=64, d_ff=768
        )
        return workload("Llama 8L (quick)", "llama", cfg, 64)
    cfg = models.LlamaConfig(
        vocab=128256, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32, seq=4096, d_ff=14336
    )
    return workload("Llama-3-8B shape", "llama", cfg, 64)


def measure(w, mesh, hints, pipeline=None) -> dict:
    """Plan, compile and read one layout."""
    start = time.perf_counter()
    fn = jaxshard.auto_shard(mesh, hints, pipeline=pipeline)(w.step)
    plan = fn.plan(*w.args)
    planned = time.perf_counter() - start
    compiled = fn.lower(*w.args).compile()
    cost = compiled_cost(compiled, mesh)
    flops = compute_flops(plan)
    return {
        "plan_s": planned,
        "memory": cost.memory,
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "bytes": cost.bytes,
        "predicted": plan.predicted_bytes,
        "estimated": plan.estimated_memory.total,
        "flops": flops,
        "time": flops / PEAK_FLOPS + cost.bytes / BANDWIDTH,
        "stack": plan.in_specs[0]["layers"]["wq"],
    }


def run(quick: bool = False, microbatches=(4, 8, 16), log=print) -> tuple[list, object]:
    """The table rows: (layout, measurements)."""
    w = llama_8b(quick)
    mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES)
    rows = []
    layouts = [
        ("no pipeline, stage axis idle", {r"batch/.*": P("data"), **TP}, None),
        ("no pipeline, batch over (stage, data)", {r"batch/.*": P(("stage", "data")), **TP}, None),
    ]
    outside = {r"batch/.*": P(("data", "stage")), **TP}
    layouts.append(
        (f"pipeline, M = {microbatches[-1]}, batch on data", {r"batch/.*": P("data"), **TP},
         jaxshard.Pipeline("stage", microbatches[-1]))
    )  # fmt: skip
    last = microbatches[-1]
    layouts.append(
        (f"pipeline, M = {last}, batch on (data, stage), replicate=True",
         outside, jaxshard.Pipeline("stage", last, replicate=True))
    )  # fmt: skip
    layouts += [
        (f"pipeline, M = {m}, batch on (data, stage)", outside, jaxshard.Pipeline("stage", m))
        for m in microbatches
    ]
    layouts += [
        (f"1F1B pipeline, M = {m}, batch on (data, stage)", outside,
         jaxshard.Pipeline("stage", m, schedule="1f1b"))
        for m in microbatches
    ]  # fmt: skip
    layouts += [
        (f"circular pipeline (v = 2), M = {m}, batch on (data, stage)", outside,
         jaxshard.Pipeline("stage", m, schedule="circular", repeats=2))
        for m in microbatches
    ]  # fmt: skip
    layouts += [
        (f"circular pipeline (v = 4), M = {last}, batch on (data, stage)", outside,
         jaxshard.Pipeline("stage", last, schedule="circular", repeats=4)),
        (f"circular pipeline (v = 2), M = {last}, batch on (data, stage), replicate=True",
         outside, jaxshard.Pipeline("stage", last, replicate=True, schedule="circular",
                                    repeats=2)),
    ]  # fmt: skip
    for name, hints, pipeline in layouts:
        log(f"{w.name}: {name} ...")
        rows.append((name, pipeline, measure(w, mesh, hints, pipeline)))
    return rows, w


def report(rows, w) -> str:
    stages = MESH_SHAPE[0]
    ideal = rows[1][2]["flops"]
    out = [
        "# Pipeline parallelism at scale",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        f"{w.describe()}; mesh (stage=4, data=4, model=4), 64 devices.",
        "",
        "| layout | memory / device | temporaries / device | collective bytes / device | "
        "jaxshard's estimate / compiled: memory, bytes | "
        "compute / device | modeled step time | vs 16-way DP x TP | wq stored as | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = rows[1][2]["time"]
    for name, _, m in rows:
        out.append(
            f"| {name} | {human_bytes(m['memory'])} | {human_bytes(m['temp'])} | "
            f"{human_bytes(m['bytes'])} | "
            f"{m['estimated'] / m['memory']:.2f}x, {m['predicted'] / m['bytes']:.2f}x | "
            f"{m['flops'] / 1e12:.1f} TFLOP | {m['time']:.2f} s | {m['time'] / base:.2f}x | "
            f"`{m['stack']}` | {m['plan_s']:.1f} |"
        )
    out += [
        "",
        "Bubble against schedule and microbatches (S = 4; v = 1 for GPipe and 1F1B): the "
        "analytic share of each stage's iterations that compute nothing kept, the compute "
        "the pipelined program does per device over the ideal share (the 16-way data x "
        "4-way tensor parallel layout's), and the temporaries against GPipe's at the same "
        "M. Iterations: vM+S-1 forward and as many backward; for 1F1B, M+2S-2 (S-1 forward "
        "only, M both ways, S-1 backward only).",
        "",
        "| schedule | M | iterations | bubble | compute / ideal - 1 | (S-1)/(vM) | "
        "memory / device | temporaries / device | vs GPipe's temporaries | "
        "collective bytes / device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    gpipe_temp = {
        p.microbatches: m["temp"]
        for name, p, m in rows
        if p is not None and p.schedule == "gpipe" and "(data, stage)" in name and not p.replicate
    }
    for name, pipeline, m in rows:
        if pipeline is None or "(data, stage)" not in name or pipeline.replicate:
            continue
        mb, v = pipeline.microbatches, pipeline.repeats
        schedule = pipeline.schedule + (f", v = {v}" if v > 1 else "")
        ticks = mb + 2 * stages - 2 if pipeline.schedule == "1f1b" else v * mb + stages - 1
        vs = m["temp"] / gpipe_temp[mb] if mb in gpipe_temp else float("nan")
        out.append(
            f"| {schedule} | {mb} | {ticks} | {pipeline.bubble(stages):.1%} | "
            f"{m['flops'] / ideal - 1:+.1%} | {(stages - 1) / (v * mb):.1%} | "
            f"{human_bytes(m['memory'])} | {human_bytes(m['temp'])} | {vs:.2f}x | "
            f"{human_bytes(m['bytes'])} |"
        )
    return "\n".join(out) + "\n"


def command_line(argv, doc: str) -> bool:
    """Parse ``--quick`` for a 64-device benchmark module; True when given."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small Llama, same mesh")
    return parser.parse_args(argv).quick


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv=None) -> None:
    quick = command_line(argv, __doc__)
    rows, w = run(quick=quick, log=log)
    write_result("pipeline", report(rows, w), quick)


if __name__ == "__main__":
    main()
