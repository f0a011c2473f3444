"""Real sizes: estimates against compiled programs for 8B and 70B shapes on 64 to 1024
devices, hand layouts under jaxshard and under XLA alone, and the search.

    python -m benchmarks.scale                          # 8B on 64 devices
    python -m benchmarks.scale --devices 64,256,1024    # and the 70B shape on 256, 1024
    python -m benchmarks.scale --fast                   # 2 layers of each shape, 64 devices

Steps are `examples/models.py`'s Llama (layers under `lax.scan` with a `jax.checkpoint`
body, GQA, SwiGLU, vocab 128256, seq 4096, AdamW, float32) with abstract arguments: the
Llama-3-8B shape (32 layers, d 4096, 32/8 heads, ffn 14336, batch 64) and the 70B shape
(80 layers, d 8192, 64/8 heads, ffn 28672, batch 256). Each device count runs in a
process of its own with that many simulated CPU devices. Hand layouts, given as hints:
Megatron tensor parallel + data parallel, FSDP (weights' other dim on the batch's axes) +
tensor parallel, the same with the sequence on the tensor axis, and FSDP over every
axis with the batch over every axis. "XLA alone" is `jax.jit` with the hints as
in/out shardings (`jaxshard.baseline.shardy_alone`). Columns: jaxshard's predicted
collective bytes against the compiled program's (ring volumes per device per step),
its estimated memory (`Plan.estimated_memory`) against `memory_analysis()`, and the
ratios to XLA alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LAYOUTS = ("megatron", "fsdp+tp", "fsdp+tp+seq", "fsdp-all")
SHAPES = {
    "8B": dict(d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32, d_ff=14336, batch=64),
    "70B": dict(d_model=8192, n_heads=64, n_kv_heads=8, n_layers=80, d_ff=28672, batch=256),
}
# per device count: (model shape, mesh shape, mesh axes); "data" carries the batch and
# FSDP, "model" the tensor split; a 3-D mesh splits the data axes in two
MESHES = {
    64: [("8B", (8, 8), ("data", "model"))],
    256: [("70B", (32, 8), ("data", "model"))],
    1024: [("70B", (32, 32), ("data", "model")), ("70B", (16, 8, 8), ("data", "fsdp", "model"))],
}


def hints_for(layout: str, axes: tuple[str, ...]) -> dict:
    """Hints for ``layout`` on a mesh with ``axes`` (the last one tensor parallel)."""
    from jax.sharding import PartitionSpec as P

    tp = axes[-1]
    data = axes[:-1] if len(axes) > 2 else axes[0]
    every = axes
    col, row = (P(None, None, tp), P(None, tp, None))
    hints = {r"batch/.*": P(data)}
    if layout == "fsdp-all":
        return {
            r"batch/.*": P(every),
            r"params/layers/(wq|wk|wv|w_gate|w_up)": P(None, every, None),
            r"params/layers/(wo|w_down)": P(None, None, every),
            r"params/embed": P(every, None),
            r"params/head": P(None, every),
        }
    fsdp = layout != "megatron"
    hints.update(
        {
            r"params/layers/(wq|wk|wv|w_gate|w_up)": P(None, data, tp) if fsdp else col,
            r"params/layers/(wo|w_down)": P(None, tp, data) if fsdp else row,
            r"params/embed": P(tp, data) if fsdp else P(tp, None),
            r"params/head": P(data, tp) if fsdp else P(None, tp),
        }
    )
    if layout == "fsdp+tp+seq":
        hints[r"batch/.*"] = P(data, tp)
    return hints


def measure(devices: int, fast: bool) -> list[dict]:
    """Every row for one device count (this process has that many devices)."""
    import jax

    sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
    import models

    import jaxshard
    from benchmarks.workloads import workload
    from jaxshard.baseline import compiled_cost, shardy_alone

    rows = []
    for shape, mesh_shape, axes in MESHES[devices]:
        spec = dict(SHAPES[shape])
        batch = spec.pop("batch")
        if fast:
            spec["n_layers"] = 2
        cfg = models.LlamaConfig(vocab=128256, seq=4096, **spec)
        w = workload(f"{shape}", "llama", cfg, batch)
        mesh = jax.make_mesh(mesh_shape, axes)
        for layout in LAYOUTS:
            hints = hints_for(layout, axes)
            row = {"model": shape, "layers": cfg.n_layers, "mesh": "x".join(map(str, mesh_shape)),
                   "axes": ",".join(axes), "layout": layout}  # fmt: skip
            if layout == "fsdp-all" and batch % devices:
                row["error"] = f"n/a: a batch of {batch} does not split over {devices} devices"
                rows.append(row)
                continue
            try:
                start = time.perf_counter()
                step = jaxshard.auto_shard(mesh, hints)(w.step)
                plan = step.plan(*w.args)
                row["plan_s"] = time.perf_counter() - start
                row["predicted"] = plan.predicted_bytes
                row["estimated"] = plan.estimated_memory.total
                ours = compiled_cost(step.lower(*w.args).compile(), mesh)
                row["bytes"], row["memory"] = ours.bytes, ours.memory
                alone = compiled_cost(shardy_alone(w.step, w.args, mesh, hints).compile(), mesh)
                row["xla_bytes"], row["xla_memory"] = alone.bytes, alone.memory
            except Exception as e:  # noqa: BLE001 - a row that fails says so in the table
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def table(rows: list[dict]) -> str:
    lines = [
        "| model | mesh | layout | plan s | predicted / compiled bytes | estimated / compiled "
        "memory | vs XLA alone (bytes, memory) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['model']} ({r['layers']}L) | {r['mesh']} ({r['axes']}) | {r['layout']} |"
        if "error" in r:
            lines.append(f"{head} — | {r['error']} | | |")
            continue
        lines.append(
            f"{head} {r['plan_s']:.1f} | {_gib(r['predicted'])} / {_gib(r['bytes'])} "
            f"(**{r['predicted'] / max(r['bytes'], 1):.2f}**) | {_gib(r['estimated'])} / "
            f"{_gib(r['memory'])} (**{r['estimated'] / r['memory']:.2f}**) | "
            f"{r['bytes'] / max(r['xla_bytes'], 1):.2f}, {r['memory'] / r['xla_memory']:.2f} |"
        )
    return "\n".join(lines)


def run(device_counts: list[int], fast: bool) -> list[dict]:
    """Each device count in a subprocess with that many simulated CPU devices."""
    rows = []
    for n in device_counts:
        env = dict(os.environ)
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        env["JAX_PLATFORMS"] = "cpu"
        argv = [sys.executable, "-m", "benchmarks.scale", "--one", str(n)]
        out = subprocess.run(
            argv + (["--fast"] if fast else []), cwd=ROOT, env=env, check=True,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="64", help="device counts, e.g. 64,256,1024")
    parser.add_argument("--fast", action="store_true", help="2 layers of each shape")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one count, in-process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.fast)))
        return
    start = time.perf_counter()
    counts = [int(n) for n in args.devices.split(",")]
    rows = run(counts, args.fast)
    import jax

    text = (
        "# Real sizes: estimates against compiled programs\n\n"
        + __doc__.split("\n\n", 2)[2].strip()
        + f"\n\n`python -m benchmarks.scale --devices {args.devices}"
        + (" --fast" if args.fast else "")
        + f"` ({time.perf_counter() - start:.0f} s, JAX {jax.__version__}, 2 CPU cores).\n\n"
        + table(rows)
        + "\n"
    )
    from benchmarks.pipeline import write_result

    write_result("scale", text, quick=args.fast)


if __name__ == "__main__":
    main()
