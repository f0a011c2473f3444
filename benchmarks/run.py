"""Run every jaxshard benchmark, write ``benchmarks/results/*.md`` and the plot, print the tables.

    python -m benchmarks.run            # the full run (about 10-15 minutes on 2 cores)
    python -m benchmarks.run --quick    # a smoke run of every code path; writes results/quick/

Sections: planning speed (`benchmarks.speed`), plan quality (`benchmarks.quality`), step
time on the simulated CPU mesh (noisy), every hint set against Shardy alone with the
Pareto pictures (`benchmarks.never_lose`), on 8 simulated CPU devices; and at the 8B
scale, pipeline parallelism (`benchmarks.pipeline`) and the search (`benchmarks.scale`),
each in its own process on 64.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/run.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

import benchmarks  # noqa: E402, F401  (sets the simulated device count before JAX loads)
from benchmarks import never_lose, quality, speed  # noqa: E402
from benchmarks.environment import environment, load_now  # noqa: E402
from benchmarks.workloads import SPEED_BATCH, SPEED_WIDTHS, quality_workloads  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


SPEED_NOTES = """\
GPT-style AdamW train steps (`examples/models.py`, unrolled layers) and a scan-stacked
Llama (remat body), at widths {widths}, batch {batch}: planning cost depends on the
number of equations, not on array sizes. Planned on the 2x4 (data, model) mesh with the
hints of `examples/gpt.py` (batch on data; query projections and first MLP matrices column
parallel). Wall-clock seconds, median of *reps* repetitions, all warm: an untimed pass
first fills JAX's caches of inner jitted functions and lowering rules, for `make_jaxpr`
and jaxshard's stages alike. The sizes are interleaved: each of {rounds} rounds plans every size
once (1 layer five times, 4 layers three times, 12 layers twice), so a change of load on this shared machine
weighs on all sizes alike; `gc.collect()` before each repetition. Python's garbage
collector otherwise runs as usual: a full collection (0.2–0.5 s at 48 layers) lands in
whichever stage crosses its threshold, JAX's or jaxshard's.
Equations count nested jaxprs (jit, custom_jvp/vjp, remat, scan body) once per occurrence;
in parentheses, the top-level count.

- Stages (`benchmarks/speed.py`): *graph* `build_graph`; *propagate* hint matching,
  `Propagator` and its fixed point; *decide* defaults for open dims and `Plan` (reshards,
  costs, specs); *build program* `Lowered(plan)` (the jaxpr rewritten with its sharding
  constraints) and the `jax.jit(...).trace` that binds it; *StableHLO* `.lower()` of
  jaxshard's program and, right after it in the same repetition, of plain
  `jax.jit(step)`; *extra* is the median over repetitions of the difference (0 if
  negative: never credited).
- **overhead** = graph + propagate + decide + build program + StableHLO extra: everything
  jaxshard adds on top of JAX's own tracing and XLA's compile (a user of plain
  `jax.jit` pays one trace, one StableHLO lowering and one XLA compile too).
  **overhead / make_jaxpr** divides it by the median `jax.make_jaxpr` time of the same
  step, measured in the same repetitions.
- *jaxshard trace*: `jaxshard.trace.trace` (make_jaxpr + naming leaves), the one trace
  jaxshard makes; *plan total* = jaxshard trace + jaxshard's stages + StableHLO of its
  program: what a user waits for before XLA's compile.
- *XLA compile*: of jaxshard's lowered program, once. XLA's CPU compile grows faster than
  linearly with unrolled programs (26–56 s at 12 layers in our runs; 12 minutes at 48
  layers on 2 busy cores, measured once by hand), so unrolled programs above {compile_max}
  layers are not compiled in this run; `--compile-all` compiles them.
"""

LINEARITY_NOTES = """\
**Criterion** ("no faster than linear, within {within}%"): over the unrolled series, the
seconds per equation of jaxshard's own stages together (graph + propagate + decide +
build program, each the median over repetitions) at the {largest}-layer step are at most
{within}% above those of every smaller step: planning time grows no faster than the
number of equations, so no faster than depth. A step dearer per equation than a larger
one is a fixed cost spread over fewer equations (the embedding and the head, a settling
pass priced per large unhinted leaf, which at 12 layers splits the head and the
embedding to save memory and at 24 layers finds no leaf large enough to price), not
growth. The stages alone are shown to locate a deviation (not checked: at a few
milliseconds each the small steps are noisy, and graph building is sublinear because a
rule is built once per distinct primitive, shapes and params and shared by repeated
layers); so are the overhead including the StableHLO extra (a difference of two lowerings
that also absorbs garbage-collector pauses) and JAX's own `make_jaxpr`, for reference. In
parentheses, how much dearer per equation the {largest}-layer step is than each size
(negative: cheaper); the log-log slope is the exponent k of time ∝ equations^k (1.0 =
linear).
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
  in the notes (on the 8 (data) mesh also the batch hint alone); (b) jaxshard with
  search: `auto_shard(search=True)` with only the batch hinted and a memory budget
  of jaxshard's estimate for the Megatron layout (d), the search's seconds in the notes;
  (c) "Shardy alone": `jax.jit` of the plain step with the same hints as `in_shardings`
  of the arguments they match, every other argument replicated, results left to XLA; (d) hand-written expert layouts
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


def _write(out: str, name: str, text: str) -> None:
    with open(os.path.join(out, name), "w") as f:
        f.write(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small models, few reps")
    parser.add_argument("--only", choices=("speed", "quality", "never_lose", "pipeline", "scale"),
                        help="run one section")  # fmt: skip
    parser.add_argument("--compile-all", action="store_true",
                        help="also XLA-compile the 24- and 48-layer unrolled programs (slow)")  # fmt: skip
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--no-readme", action="store_true",
                        help="do not rewrite README.md's Benchmarks section")  # fmt: skip
    args = parser.parse_args(argv)

    out = args.out or os.path.join(HERE, "results", "quick" if args.quick else "")
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    env = environment()
    print(env, flush=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    sections = []
    summary: dict = {}

    if args.only in (None, "speed"):
        if args.quick:
            cfg = dict(layers=(1, 2, 4), scan_layers=4, compile_max_layers=1, rounds=1)
        else:
            cfg = dict(layers=(1, 4, 12, 24, 48), scan_layers=48,
                       compile_max_layers=48 if args.compile_all else 12)  # fmt: skip
        t0 = time.perf_counter()
        rows = speed.run(log=log, **cfg)
        log(f"[speed] section took {time.perf_counter() - t0:.0f} s")
        fits = speed.linearity(rows)
        notes = SPEED_NOTES.format(
            widths=", ".join(f"{k}={v}" for k, v in SPEED_WIDTHS.items()), batch=SPEED_BATCH,
            compile_max=cfg["compile_max_layers"], rounds=cfg.get("rounds", 5),
        )  # fmt: skip
        series = [r for r in rows if not r.scan]
        big, total = series[-1], fits[0]
        checked = [f for f in fits if f.checked]
        failed = [speed.STAGE_NAMES[f.stage].strip("*") for f in checked if not f.linear]
        verdict = (
            f"**Largest unrolled step** ({big.name}, {big.equations} equations): propagation "
            f"{big.median('propagate'):.2f} s; overhead {big.overhead:.2f} s = "
            f"{big.ratio:.2f}x make_jaxpr ({big.median('make_jaxpr'):.2f} s): graph "
            f"{big.median('graph'):.2f} + propagate {big.median('propagate'):.2f} + decide "
            f"{big.median('decide'):.2f} + build program {big.median('build'):.2f} + StableHLO "
            f"extra {big.stablehlo_extra:.2f} (ours {big.median('stablehlo'):.2f} − plain jit "
            f"{big.median('plain_stablehlo'):.2f}). Python's cyclic garbage collector paused "
            f"(median seconds) {big.gc_median('make_jaxpr'):.2f} inside make_jaxpr, "
            f"{big.gc_median('build'):.2f} inside build program, "
            f"{big.gc_median('stablehlo'):.2f} inside our StableHLO lowering and "
            f"{big.gc_median('plain_stablehlo'):.2f} inside plain jit's: a full collection "
            "scans every live object (JAX's jaxprs and the plan alike) and lands in whichever "
            "stage crosses its threshold. **Linearity** over 1→"
            f"{big.layers} layers: "
            f"jaxshard's stages at {big.layers} layers are at most "
            f"{100 * total.max_deviation:.0f}% dearer per equation than at any smaller size "
            f"(log-log slope {total.exponent:.2f}); "
            + ("no faster than linear, within "
               f"{100 * speed.LINEAR_WITHIN:.0f}%." if not failed else
               f"faster than linear by more than {100 * speed.LINEAR_WITHIN:.0f}%: "
               f"{', '.join(failed)}.")
        )  # fmt: skip
        text = (
            f"# Planning speed\n\n{env} {load_now()}\n\n{notes}\n{speed.speed_table(rows)}\n"
            f"{verdict}\n\n## Linearity over the unrolled series (1→{big.layers} layers)\n\n"
            f"{LINEARITY_NOTES.format(within=round(100 * speed.LINEAR_WITHIN), largest=big.layers)}"
            f"\n{speed.linearity_table(rows, fits)}\n"
            "![planning time vs equations](planning_speed.png)\n"
        )
        _write(out, "speed.md", text)
        summary["speed"] = (rows, fits, verdict)
        speed.plot(rows, os.path.join(out, "planning_speed.png"))
        speed.dump(rows, os.path.join(out, "speed_runs.json"))
        sections.append(text)

    if args.only in (None, "quality"):
        runs = 2 if args.quick else 5
        t0 = time.perf_counter()
        rows = quality.run(quick=args.quick, step_runs=runs, log=log)
        summary["quality"] = rows
        log(f"[quality] section took {time.perf_counter() - t0:.0f} s")
        models = "; ".join(w.describe() for w in quality_workloads(args.quick))
        text = (
            f"# Plan quality\n\n{env} {load_now()}\n\n{QUALITY_NOTES.format(models=models)}\n"
            f"{quality.quality_table(rows)}"
        )
        _write(out, "quality.md", text)
        sections.append(text)
        text = (
            f"# Step time (CPU-simulated, noisy)\n\n{env} {load_now()}\n\n"
            f"{STEP_NOTES.format(cores=os.cpu_count(), runs=runs)}\n{quality.step_table(rows)}"
        )
        _write(out, "step_time.md", text)
        sections.append(text)

    if args.only in (None, "never_lose"):
        t0 = time.perf_counter()
        points = never_lose.run(quick=args.quick, log=log)
        summary["never_lose"] = points
        log(f"[never lose] section took {time.perf_counter() - t0:.0f} s")
        text = never_lose.report(points, out, f"{env} {load_now()}")
        _write(out, "never_lose.md", text)
        sections.append(text)

    for name in ("pipeline", "scale"):  # 64 simulated devices each: their own processes
        if args.only not in (None, name):
            continue
        t0 = time.perf_counter()
        command = [sys.executable, "-m", f"benchmarks.{name}"]
        command += ["--quick"] if args.quick else []
        done = subprocess.run(
            command, cwd=os.path.dirname(HERE), capture_output=True, text=True, check=True
        )
        log(f"[{name}] section took {time.perf_counter() - t0:.0f} s")
        sections.append(done.stdout)

    print("\n\n".join(sections))
    seconds = time.perf_counter() - start
    if len(summary) == 3:  # every section: the summary, and README's Benchmarks section
        text = summary_text(summary, env, seconds, args)
        _write(out, "summary.md", text)
        if not args.quick and args.out is None and not args.no_readme:
            update_readme(text)
            print(f"updated the Benchmarks section of {README}")
    print(f"wrote {out} in {seconds:.0f} s")


README = os.path.join(os.path.dirname(HERE), "README.md")
README_START = (
    "<!-- benchmarks: written by `python -m benchmarks.run`; edits here are overwritten -->"
)
README_END = "<!-- end of benchmarks -->"


def summary_text(summary: dict, env: str, seconds: float, args) -> str:
    """README's Benchmarks section: the command, the planning-speed table and plot, and the
    quality table of every model and mesh, from this run."""
    rows, fits, verdict = summary["speed"]
    series = [r for r in rows if not r.scan]
    total = fits[0]
    deviations = ", ".join(
        f"{r.layers}L {100 * d:+.0f}%" for r, d in zip(series[:-1], total.deviations)
    )
    errors = [r.loss_err for r in summary["quality"] if r.loss_err is not None]
    loss_err = max(errors, default=float("nan"))
    command = "python -m benchmarks.run" + (" --quick" if args.quick else "")
    models = dict.fromkeys(p.model for p in summary["never_lose"])
    pictures = "\n".join(f"![{m}](benchmarks/results/{never_lose.picture_name(m)})" for m in models)
    return f"""## Benchmarks

`{command}` measures everything below in one run ({seconds / 60:.1f} minutes for this
one) and writes `benchmarks/results/` (method, every table and the raw times:
[speed](benchmarks/results/speed.md), [quality](benchmarks/results/quality.md),
[step time](benchmarks/results/step_time.md); `benchmarks/README.md` says how). {env}

### Planning speed

Everything jaxshard adds on top of JAX's own tracing and XLA's compile — building the
graph, propagating, deciding, building the lowered program, and the part of StableHLO
lowering beyond what plain `jax.jit` of the same step takes — against `jax.make_jaxpr` of
the same step, measured in the same run (GPT AdamW train steps, 1 to {series[-1].layers}
unrolled layers, and a {rows[-1].layers}-layer scan-stacked Llama; wall-clock medians).

{speed.speed_table(rows)}
{verdict}

*No faster than linear, within {100 * speed.LINEAR_WITHIN:.0f}%* means: the seconds per
equation of jaxshard's stages together (graph + propagate + decide + build program) at the
{series[-1].layers}-layer step are at most {100 * speed.LINEAR_WITHIN:.0f}% above those of
any smaller step of the series (planning time grows no faster than depth); in this run
the {series[-1].layers}-layer step against each size: {deviations}.

![planning time vs equations](benchmarks/results/planning_speed.png)

### Plan quality

Each layout compiled for the mesh, measured from the compiled program: **ring bytes per
device per step** (collectives × trip counts, ring volumes) **·** **memory per device**
(arguments + outputs + temporaries). AdamW train steps; (a) the batch hint plus one weight
hint, (b) `auto_shard(search=True)` with only the batch hinted, within the Megatron
layout's memory, (c) `jax.jit` with the
same hints as (a) as input shardings and everything else left to XLA, (d) hand-written
expert layouts. Every layout's loss is compared with the unsharded step's: at most
{loss_err:.1e} relative error in this run. All rows, with collective counts and kinds,
jaxshard's predicted bytes and more jaxshard hint sets:
[quality.md](benchmarks/results/quality.md).

{quality.headline_table(summary["quality"])}
### Never lose to Shardy alone

Every hint set of every model on the 2x4 mesh, jaxshard against `jax.jit` with the same
hints ("Shardy alone"), as **ring bytes · memory per device**, from the compiled
programs. The guarantee is checked against Shardy alone returning the new parameters and
optimizer state in the layout it took them (what a training loop runs step after step):
at most 1.05x the bytes and 1.0x the memory. With results left free, XLA may return the
state in another layout than it took; that column is shown too. Method and pictures:
[never_lose.md](benchmarks/results/never_lose.md).

{never_lose.table(summary["never_lose"])}
{pictures}
"""


def update_readme(text: str) -> None:
    """Replace README's Benchmarks section (between the markers) with ``text``; without
    markers, insert it before the Layout section."""
    with open(README) as f:
        readme = f.read()
    block = f"{README_START}\n{text}{README_END}\n"
    if README_START in readme and README_END in readme:
        head, rest = readme.split(README_START, 1)
        tail = rest.split(README_END, 1)[1].lstrip("\n")
        readme = head + block + "\n" + tail
    else:
        at = readme.index("## Layout") if "## Layout" in readme else len(readme)
        readme = readme[:at] + block + "\n" + readme[at:]
    with open(README, "w") as f:
        f.write(readme)


if __name__ == "__main__":
    main()
