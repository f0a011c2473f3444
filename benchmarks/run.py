"""Run every jaxshard benchmark, write ``benchmarks/results/*.md`` and the plot, print the tables.

    python -m benchmarks.run            # the full run (about 10-15 minutes on 2 cores)
    python -m benchmarks.run --quick    # a smoke run of every code path; writes results/quick/

Sections: planning speed (`benchmarks.speed`), plan quality (`benchmarks.quality`) and
step time on the simulated CPU mesh (noisy). Runs on 8 simulated CPU devices.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import subprocess
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/run.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"
import jax  # noqa: E402

import benchmarks  # noqa: E402, F401  (sets the simulated device count before JAX loads)
from benchmarks import quality, speed  # noqa: E402
from benchmarks.workloads import SPEED_BATCH, SPEED_WIDTHS, quality_workloads  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def environment() -> str:
    try:
        git = functools.partial(subprocess.run, cwd=HERE, capture_output=True, text=True)
        commit = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        if git(["git", "status", "--porcelain", "--", "../jaxshard", "../rules"]).stdout.strip():
            commit += " (with uncommitted changes to jaxshard/ or rules/)"
    except OSError:
        commit = "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"Measured {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} at commit {commit}: "
        f"JAX {jax.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores "
        f"(load average {load:.1f} at start), {jax.device_count()} simulated "
        f"{jax.devices()[0].platform.upper()} devices."
    )


SPEED_NOTES = """\
GPT-style AdamW train steps (`examples/models.py`, unrolled layers) and a scan-stacked
Llama (remat body), at widths {widths}, batch {batch}: planning cost depends on the
number of equations, not on array sizes. Planned on the 2x4 (data, model) mesh with the
hints of `examples/gpt.py` (batch on data; query projections and first MLP matrices column
parallel). Median of {reps_small} runs (≤ 12 layers) or {reps_large} runs (larger), seconds,
all warm: an untimed pass first fills JAX's caches of inner jitted functions and lowering
rules, for `make_jaxpr` and jaxshard's stages alike.
Equations count nested jaxprs (jit, custom_jvp/vjp, remat, scan body) once per occurrence;
in parentheses, the top-level count.

- Stages: *trace* `jaxshard.trace.trace` (make_jaxpr + naming leaves); *graph*
  `build_graph`; *propagate* hint matching, `Propagator` and its fixed point; *decide*
  defaults for open dims and `Plan` (reshards, costs, specs); *replay* + *StableHLO* =
  `Lowered(plan).lower(...)` split in two: `jax.jit(...).trace` of the replayed jaxpr
  with its sharding constraints (a second trace of the whole step), then `.lower()`.
- *overhead / make_jaxpr* (the issue's ratio): (graph + propagate + decide + replay +
  StableHLO) / make_jaxpr — everything jaxshard adds on top of JAX's own tracing and
  XLA's compile.
- *net of plain StableHLO*: the same, but counting only the StableHLO lowering time beyond
  what the plain `jax.jit(step)` lowering takes (which every jitted program pays anyway).
- *XLA compile*: of jaxshard's lowered program, once. XLA's CPU compile grows faster than
  linearly with unrolled programs (26–56 s at 12 layers in our runs; 12 minutes at 48
  layers on 2 busy cores, measured once by hand), so unrolled programs above {compile_max}
  layers are not compiled in this run; `--compile-all` compiles them.
"""

LINEARITY_NOTES = """\
Seconds per 1000 equations at each size; the fit is the least-squares line through the
origin (time proportional to equations), the deviation is each size's distance from it,
and the log-log slope is the exponent k of time ∝ equations^k (1.0 = linear). Small steps
carry fixed per-call costs, so their per-equation cost is higher.
"""

QUALITY_NOTES = """\
Each layout of each model is compiled for the mesh and measured from the compiled
program, per device and per train step (AdamW):

- *collectives / step*: collective instructions of `compiled.as_text()`, each executed
  once, or the trip count of its enclosing while loop (`known_trip_count` in the loop's
  backend config; failing that the loop condition's bound) — "N in HLO" is the static
  count. Kinds: AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all,
  CP collective-permute.
- *result bytes*: the sum of each executed collective's result-shape bytes (the
  per-device shape in the SPMD program). *ring bytes*: the bytes a device sends with ring
  algorithms, from the replica group size n: all-reduce 2(n−1)/n·S, all-gather and
  all-to-all (n−1)/n·S, reduce-scatter (n−1)·S, collective-permute S — the model
  jaxshard's cost estimates use, so *jaxshard predicted* (`plan.predicted_bytes`) compares
  with this column.
- *memory / dev*: `compiled.memory_analysis()`: argument + output + temporary − aliased
  bytes (no buffers are donated); in parentheses arguments and temporaries.
- Layouts: (a) jaxshard from the batch hint `batch/.*: P('data')` plus the one weight hint
  in the notes; (b) jaxshard with search — not built yet; (c) "Shardy alone": `jax.jit` of
  the plain step with the same hints as `in_shardings` of the arguments they match, every
  other argument replicated, results left to XLA; (d) hand-written expert layouts
  (`benchmarks/layouts.py`) as `in_shardings`/`out_shardings`, batch on data, AdamW state
  like its parameter, no activation constraints: Megatron tensor parallel + data parallel
  (on the 8 (data) mesh there is no model axis, so Megatron degenerates to plain data
  parallel), the same plus FSDP (every weight of rank ≥ 2 also split on data along its
  largest free dim), expert parallel for the MoE.

Models: {models}.
"""

STEP_NOTES = """\
**CPU-simulated, noisy.** Eight XLA host devices share {cores} CPU cores, so collectives are
memory copies and the devices contend for cores: these times say little about a real
accelerator mesh. Median of {runs} runs after one warm-up; arguments already in place.
The loss of the first run is compared with the unsharded `jax.jit` of the same step.
*compile s* is building the program (for jaxshard: planning, lowering and XLA's compile).
No accelerator was available, so the single-device GPU comparison of the planned program
against plain `jax.jit` is not reported.
"""


def load_now() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"Load average when this file was written: {load:.1f}."


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small models, few reps")
    parser.add_argument("--only", choices=("speed", "quality"), help="run one section")
    parser.add_argument("--compile-all", action="store_true",
                        help="also XLA-compile the 24- and 48-layer unrolled programs (slow)")  # fmt: skip
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)

    out = args.out or os.path.join(HERE, "results", "quick" if args.quick else "")
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    env = environment()
    print(env, flush=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    sections = []

    if args.only in (None, "speed"):
        if args.quick:
            cfg = dict(
                layers=(1, 2, 4), scan_layers=4, compile_max_layers=1, reps_small=1, reps_large=1
            )
        else:
            cfg = dict(layers=(1, 4, 12, 24, 48), scan_layers=48, reps_small=5, reps_large=3,
                       compile_max_layers=48 if args.compile_all else 12)  # fmt: skip
        t0 = time.perf_counter()
        rows = speed.run(log=log, **cfg)
        log(f"[speed] section took {time.perf_counter() - t0:.0f} s")
        fits = speed.linearity(rows)
        notes = SPEED_NOTES.format(
            widths=", ".join(f"{k}={v}" for k, v in SPEED_WIDTHS.items()), batch=SPEED_BATCH,
            reps_small=cfg["reps_small"], reps_large=cfg["reps_large"],
            compile_max=cfg["compile_max_layers"],
        )  # fmt: skip
        series = [r for r in rows if not r.scan]
        verdict = (
            f"Largest unrolled step ({series[-1].name}, {series[-1].equations} equations): "
            f"propagation {series[-1].median('propagate'):.2f} s; overhead "
            f"{series[-1].ratio:.2f}x make_jaxpr ({series[-1].net_ratio:.2f}x net of plain "
            f"StableHLO lowering). Total planning deviates at most "
            f"{100 * fits[0].max_deviation:.0f}% from time ∝ equations over the series "
            f"(log-log slope {fits[0].exponent:.2f})."
        )
        text = (
            f"# Planning speed\n\n{env} {load_now()}\n\n{notes}\n{speed.speed_table(rows)}\n{verdict}\n\n"
            f"## Linearity over the unrolled series (1→{series[-1].layers} layers)\n\n"
            f"{LINEARITY_NOTES}\n{speed.linearity_table(rows, fits)}\n"
            "![planning time vs equations](planning_speed.png)\n"
        )
        with open(os.path.join(out, "speed.md"), "w") as f:
            f.write(text)
        speed.plot(rows, os.path.join(out, "planning_speed.png"))
        sections.append(text)

    if args.only in (None, "quality"):
        runs = 2 if args.quick else 5
        t0 = time.perf_counter()
        rows = quality.run(quick=args.quick, step_runs=runs, log=log)
        log(f"[quality] section took {time.perf_counter() - t0:.0f} s")
        models = "; ".join(w.describe() for w in quality_workloads(args.quick))
        text = (
            f"# Plan quality\n\n{env} {load_now()}\n\n{QUALITY_NOTES.format(models=models)}\n"
            f"{quality.quality_table(rows)}"
        )
        with open(os.path.join(out, "quality.md"), "w") as f:
            f.write(text)
        sections.append(text)
        text = (
            f"# Step time (CPU-simulated, noisy)\n\n{env} {load_now()}\n\n"
            f"{STEP_NOTES.format(cores=os.cpu_count(), runs=runs)}\n{quality.step_table(rows)}"
        )
        with open(os.path.join(out, "step_time.md"), "w") as f:
            f.write(text)
        sections.append(text)

    print("\n\n".join(sections))
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
