"""Real sizes: estimates against compiled programs for 8B, Mixtral and 70B shapes on 64
to 1024 devices, hand layouts under jaxshard and under XLA alone, and the search.

    python -m benchmarks.scale                          # 8B on 64 devices
    python -m benchmarks.scale --devices 64,256,1024    # and the 70B shape on 256, 1024
    python -m benchmarks.scale --fast                   # 2 layers of each shape, 64 devices
    python -m benchmarks.scale --mock-gpu 1x64x1 --fast --search none --dump DIR
                                                        # on one GPU: XLA's GPU compiler

``--mock-gpu SLICESxHOSTSxDEVICES`` runs on a GPU host in one process, with JAX's mocked
GPU topology (``jax_mock_gpu_topology``: one real GPU stands for every device of the
topology, the others exist for compiling only), so the same rows are compiled by XLA's
GPU backend instead of its CPU one; results go to ``results/scale_gpu.md``. ``--dump DIR``
writes each compiled program's text there, one file per row, to read what XLA did.

Steps are `examples/models.py`'s Llama (layers under `lax.scan` with a `jax.checkpoint`
body, GQA, SwiGLU, vocab 128256, seq 4096, AdamW, float32) with abstract arguments: the
Llama-3-8B shape (32 layers, d 4096, 32/8 heads, ffn 14336, batch 64), the Mixtral-8x7B
shape (the same with 8 experts per MLP, top 2, vocab 32000) and the 70B shape (80
layers, d 8192, 64/8 heads, ffn 28672, batch 256). Each device count runs in a
process of its own with that many simulated CPU devices. Hand layouts, given as hints:
Megatron tensor parallel + data parallel, FSDP (weights' other dim on the batch's axes) +
tensor parallel, the same with the sequence on the tensor axis, and FSDP over every
axis with the batch over every axis; for Mixtral also the experts over the tensor axis
with their model dim stored on the batch's (expert parallel + FSDP). "XLA alone" is
`jax.jit` with the hints as in/out shardings (`jaxshard.baseline.shardy_alone`). Columns: jaxshard's predicted
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

from benchmarks.environment import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LAYOUTS = ("megatron", "fsdp+tp", "fsdp+tp+seq", "fsdp-all")
SHAPES = {
    "8B": dict(d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32, d_ff=14336, batch=64),
    "70B": dict(d_model=8192, n_heads=64, n_kv_heads=8, n_layers=80, d_ff=28672, batch=256),
    "Mixtral": dict(
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        n_layers=32,
        d_ff=14336,
        batch=64,
        n_experts=8,
        top_k=2,
        vocab=32000,
    ),
}
MOE_LAYOUTS = (*LAYOUTS, "ep+fsdp")
# per device count: (model shape, mesh shape, mesh axes); "data" carries the batch and
# FSDP, "model" the tensor split; a 3-D mesh splits the data axes in two
MESHES = {
    64: [("8B", (8, 8), ("data", "model")), ("Mixtral", (8, 8), ("data", "model"))],
    256: [("70B", (32, 8), ("data", "model"))],
    1024: [("70B", (32, 32), ("data", "model")), ("70B", (16, 8, 8), ("data", "fsdp", "model"))],
}


# a hand layout's compiled memory times this is a search budget: the estimate's tolerance
SLACK = 1.1
SEARCH_DOC = (
    "The search (`search=True`) from the batch hint and from no hints at all, with each hand "
    "layout's compiled memory plus 10% (the estimate's tolerance) as `memory_budget` and "
    "that layout's batch layout as the batch hint. "
    '"fits": the searched plan\'s compiled memory is within the budget; "bytes vs it": its '
    "compiled collective bytes over those of the hand layout that moves the fewest among "
    "those whose compiled memory is within the budget (from the batch hint: among those "
    "that lay the batch out as the hint does)."
)


def hints_for(layout: str, axes: tuple[str, ...], experts: bool = False) -> dict:
    """Hints for ``layout`` on a mesh with ``axes`` (the last one tensor parallel); with
    ``experts`` the MLP weights carry an expert dim after the layer dim ("ep+fsdp": the
    experts over the tensor axis, their model dim stored on the batch's axes)."""
    from jax.sharding import PartitionSpec as P

    tp = axes[-1]
    data = axes[:-1] if len(axes) > 2 else axes[0]
    every = axes
    if layout == "fsdp-all":
        col, row = (None, every, None), (None, None, every)
        embed, head, batch = P(every, None), P(None, every), P(every)
    else:
        fsdp = data if layout != "megatron" else None
        col, row, embed, head = (None, fsdp, tp), (None, tp, fsdp), P(tp, fsdp), P(fsdp, tp)
        batch = P(data, tp) if layout == "fsdp+tp+seq" else P(data)
    hints = {r"batch/.*": batch, r"params/embed": embed, r"params/head": head}
    if not experts:  # one hint for the column-parallel weights, one for the row-parallel
        hints[r"params/layers/(wq|wk|wv|w_gate|w_up)"] = P(*col)
        hints[r"params/layers/(wo|w_down)"] = P(*row)
        return hints
    # (L, E, D, F) and (L, E, F, D)
    mlp_col, mlp_row = (None, None, *col[1:]), (None, None, *row[1:])
    if layout == "ep+fsdp":
        mlp_col, mlp_row = (None, tp, data, None), (None, tp, None, data)
    hints[r"params/layers/(wq|wk|wv)"] = P(*col)
    hints[r"params/layers/wo"] = P(*row)
    hints[r"params/layers/(w_gate|w_up)"] = P(*mlp_col)
    hints[r"params/layers/w_down"] = P(*mlp_row)
    return hints


def measure(devices: int, fast: bool, models_: str = "", search: str = "all") -> list[dict]:
    """Every row for one device count (this process has that many devices): of the
    shapes named in ``models_`` (comma-separated; all if empty), the searches for every
    budget (``search="all"``), the tightest with the batch hint only (``"tight"``), or
    none."""
    import jax

    sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
    import models

    import jaxshard
    from benchmarks.workloads import workload
    from jaxshard.baseline import compiled_cost, shardy_alone

    rows = []
    for shape, mesh_shape, axes in MESHES[devices]:
        if models_ and shape not in models_.split(","):
            continue
        spec = dict(SHAPES[shape])
        batch = spec.pop("batch")
        if fast:
            spec["n_layers"] = 2
        spec.setdefault("vocab", 128256)
        cfg = models.LlamaConfig(seq=4096, **spec)
        w = workload(f"{shape}", "llama", cfg, batch)
        mesh = jax.make_mesh(mesh_shape, axes)
        experts = cfg.n_experts > 0
        for layout in MOE_LAYOUTS if experts else LAYOUTS:
            hints = hints_for(layout, axes, experts)
            row = {"model": shape, "layers": cfg.n_layers, "mesh": "x".join(map(str, mesh_shape)),
                   "axes": ",".join(axes), "layout": layout}  # fmt: skip
            if layout == "fsdp-all" and batch % devices:
                row["error"] = f"n/a: a batch of {batch} does not split over {devices} devices"
                rows.append(row)
                continue
            # the hand layout as given: a mesh's "fsdp" axis stores nothing more
            if measured(row, jaxshard.auto_shard(mesh, hints, fsdp_axes=())(w.step), w, mesh):
                try:
                    alone = shardy_alone(w.step, w.args, mesh, hints).compile()
                    _dump(row, "xla-alone", alone)
                    row["xla_bytes"], row["xla_memory"] = compiled_cost(alone, mesh)
                except Exception as e:  # noqa: BLE001 - a row that fails says so in the table
                    _failed(row, e)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
        if search != "none":
            hand = [r for r in rows if "memory" in r and r["model"] == shape
                    and r["mesh"] == row["mesh"] and "budget" not in r]  # fmt: skip
            rows += search_rows(w, mesh, axes, hand, tight=search == "tight")
    return rows


DUMP: list[str] = []  # ``--dump``: the folder compiled programs are written to


def _dump(row: dict, tag: str, compiled) -> None:
    if DUMP:
        name = "-".join(str(row[k]) for k in ("model", "layers", "mesh", "layout") if k in row)
        name += f"-{row['budget']}" if "budget" in row else ""
        with open(os.path.join(DUMP[0], re.sub(r"[^\w.+-]", "_", f"{name}-{tag}.hlo")), "w") as f:
            f.write(compiled.as_text())


def measured(row: dict, step, w, mesh) -> bool:
    """Plan ``step`` (an `auto_shard` wrapper) on the workload's arguments and compile
    it, filling ``row``: planning seconds, predicted bytes, estimated memory, compiled
    bytes and memory; or the error, when planning or compiling fails (False)."""
    from jaxshard.baseline import compiled_cost

    try:
        start = time.perf_counter()
        plan = step.plan(*w.args)
        row["plan_s"] = time.perf_counter() - start
        row["predicted"] = plan.predicted_bytes
        row["estimated"] = plan.estimated_memory.total
        compiled = step.lower(*w.args).compile()
        _dump(row, "jaxshard", compiled)
        ours = compiled_cost(compiled, mesh)
        row["bytes"], row["memory"] = ours.bytes, ours.memory
    except Exception as e:  # noqa: BLE001 - a row that fails says so in the table
        _failed(row, e)
        return False
    return True


def _failed(row: dict, e: Exception) -> None:
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def search_rows(w, mesh, axes, hand: list[dict], tight: bool = False) -> list[dict]:
    """The search from the batch hint and from no hints, with each hand layout's compiled
    memory plus the estimate's 10% tolerance as budget: the plan's compiled memory and
    bytes against the hand layouts that fit that budget once compiled. ``tight``: the
    smallest budget, from the batch hint, only."""
    import jaxshard

    rows = []
    # each budget with the hand layout it comes from, whose batch layout is the hint
    budgets = sorted({(round(SLACK * r["memory"]), r["layout"]) for r in hand})
    for budget, source in budgets[:1] if tight else budgets:
        fitting = [r for r in hand if r["memory"] <= budget]
        batch = hints_for(source, axes)[r"batch/.*"]
        for hinted in (True,) if tight else (True, False):
            hints = {r"batch/.*": batch} if hinted else {}
            # the batch hint rules out the hand layouts that split the batch otherwise
            allowed = [r for r in fitting if not hinted
                       or hints_for(r["layout"], axes)[r"batch/.*"] == batch]  # fmt: skip
            best = min(allowed, key=lambda r: r["bytes"])
            row = {"model": best["model"], "layers": best["layers"], "mesh": best["mesh"],
                   "axes": best["axes"], "budget": budget, "hinted": hinted,
                   "batch": str(batch) if hinted else "",
                   "best": best["layout"], "best_bytes": best["bytes"],
                   "best_memory": best["memory"]}  # fmt: skip
            step = jaxshard.auto_shard(mesh, hints, search=True, memory_budget=budget)(w.step)
            measured(row, step, w, mesh)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def gib(b: float) -> str:
    """Bytes as GiB with one decimal, for the tables."""
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
            f"{head} {r['plan_s']:.1f} | {gib(r['predicted'])} / {gib(r['bytes'])} "
            f"(**{r['predicted'] / max(r['bytes'], 1):.2f}**) | {gib(r['estimated'])} / "
            f"{gib(r['memory'])} (**{r['estimated'] / r['memory']:.2f}**) | "
            f"{r['bytes'] / max(r['xla_bytes'], 1):.2f}, {r['memory'] / r['xla_memory']:.2f} |"
        )
    return "\n".join(lines)


def search_table(rows: list[dict]) -> str:
    lines = [
        "| model | mesh | search from | budget | plan s | compiled memory | fits | "
        "predicted / compiled bytes | estimated / compiled memory | best hand layout within "
        "budget: bytes, memory | bytes vs it |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = (f"| {r['model']} ({r['layers']}L) | {r['mesh']} ({r['axes']}) | "
                f"{'batch ' + r['batch'] if r['hinted'] else 'no hints'} | {gib(r['budget'])} |")  # fmt: skip
        hand = f"{r['best']}: {gib(r['best_bytes'])}, {gib(r['best_memory'])}"
        if "error" in r:
            lines.append(f"{head} — | {r['error']} | **no** | | | {hand} | |")
            continue
        fits = "yes" if r["memory"] <= r["budget"] else "**NO**"
        lines.append(
            f"{head} {r['plan_s']:.1f} | {gib(r['memory'])} | {fits} | "
            f"{gib(r['predicted'])} / {gib(r['bytes'])} "
            f"(**{r['predicted'] / max(r['bytes'], 1):.2f}**) | {gib(r['estimated'])} / "
            f"{gib(r['memory'])} (**{r['estimated'] / r['memory']:.2f}**) | {hand} | "
            f"{r['bytes'] / max(r['best_bytes'], 1):.2f} |"
        )
    return "\n".join(lines)


def run(device_counts: list[int], fast: bool, models_: str = "", search: str = "all") -> list[dict]:
    """Each device count in a subprocess with that many simulated CPU devices."""
    argv = ["--search", search] + (["--models", models_] if models_ else [])
    argv += ["--dump", DUMP[0]] if DUMP else []
    return per_device_count("benchmarks.scale", device_counts, argv + (["--fast"] if fast else []))


def per_device_count(module: str, counts: list[int], argv: list[str]) -> list[dict]:
    """The rows ``python -m module --one N *argv`` prints as JSON on its last line, for
    each device count N, each run in a process with N simulated CPU devices."""
    rows = []
    for n in counts:
        env = dict(os.environ)
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        env["JAX_PLATFORMS"] = "cpu"
        out = subprocess.run(
            [sys.executable, "-m", module, "--one", str(n), *argv], cwd=ROOT, env=env,
            check=True, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="64", help="device counts, e.g. 64,256,1024")
    parser.add_argument("--fast", action="store_true", help="2 layers of each shape")
    parser.add_argument("--models", default="", help="shapes to run, e.g. 8B,Mixtral (all)")
    parser.add_argument(
        "--search",
        default="all",
        choices=("all", "tight", "none"),
        help="searches: every budget, the tightest from the batch hint, none",
    )
    parser.add_argument(
        "--mock-gpu",
        default="",
        metavar="TOPOLOGY",
        help="on a GPU host: compile for a mocked topology, e.g. 1x64x1 (64 devices)",
    )
    parser.add_argument("--dump", default="", help="write each compiled program here")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one count, in-process
    args = parser.parse_args(argv)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        DUMP.append(args.dump)
    if args.mock_gpu:
        mock_gpu(args)
        return
    if args.one:
        print(json.dumps(measure(args.one, args.fast, args.models, args.search)))
        return
    start = time.perf_counter()
    counts = [int(n) for n in args.devices.split(",")]
    rows = run(counts, args.fast, args.models, args.search)
    import jax

    text = (
        "# Real sizes: estimates against compiled programs\n\n"
        + __doc__.split("\n\n", 2)[2].strip()
        + f"\n\n`python -m benchmarks.scale --devices {args.devices}"
        + (" --fast" if args.fast else "")
        + (f" --models {args.models}" if args.models else "")
        + (f" --search {args.search}" if args.search != "all" else "")
        + f"` ({time.perf_counter() - start:.0f} s, JAX {jax.__version__}, 2 CPU cores).\n\n"
        + table([r for r in rows if "budget" not in r])
        + "\n\n## The search\n\n"
        + SEARCH_DOC
        + "\n\n"
        + search_table([r for r in rows if "budget" in r])
        + "\n"
    )
    write_result("scale", text, quick=args.fast)


def mock_gpu(args) -> None:
    """The rows for one mocked GPU topology, in this process, on XLA's GPU backend."""
    import math

    import jax

    jax.config.update("jax_mock_gpu_topology", args.mock_gpu)
    devices = jax.devices()
    if devices[0].platform != "gpu":
        raise SystemExit(f"--mock-gpu needs a GPU backend; JAX runs on {devices[0].platform}")
    n = math.prod(int(x) for x in args.mock_gpu.split("x"))
    start = time.perf_counter()
    rows = measure(n, args.fast, args.models, args.search)
    text = (
        "# Real sizes on XLA's GPU compiler: estimates against compiled programs\n\n"
        f"The rows of `results/scale.md`, compiled by XLA's GPU backend ({devices[0].device_kind}"
        f", JAX {jax.__version__}) for a mocked topology of {n} devices "
        f"(`jax_mock_gpu_topology={args.mock_gpu}`).\n\n"
        f"`python -m benchmarks.scale --mock-gpu {args.mock_gpu}"
        + (" --fast" if args.fast else "")
        + (f" --models {args.models}" if args.models else "")
        + (f" --search {args.search}" if args.search != "all" else "")
        + f"` ({time.perf_counter() - start:.0f} s; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})."
        + "\n\n"
        + table([r for r in rows if "budget" not in r])
        + "\n"
    )
    if any("budget" in r for r in rows):
        text += "\n## The search\n\n" + search_table([r for r in rows if "budget" in r]) + "\n"
    write_result("scale_gpu", text, quick=False)


if __name__ == "__main__":
    main()
