"""Planning speed: jaxshard's pipeline stage by stage, against JAX's own tracing.

Each workload is planned on the 2x4 (data, model) mesh with the hints of
``examples/gpt.py`` (the batch, query projections and first MLP matrices), calling the
stages of `jaxshard.plan.make_plan` one by one so each can be timed. Per repetition:

- ``make_jaxpr``: `jax.make_jaxpr` of the train step (a fresh wrapper each time, so JAX's
  cache of the top-level trace is not hit) — the reference every ratio divides by;
- ``trace``: `jaxshard.trace.trace` (make_jaxpr plus naming every leaf): JAX's tracing,
  which jaxshard needs once like any `jax.jit`;
- ``graph``: `jaxshard.graph.build_graph`;
- ``propagate``: `jaxshard.plan.propagate_hints`: hint matching, pins, the fixed point;
- ``decide``: `jaxshard.plan.decide`: the defaults for open dims and `Plan` (reshards,
  costs, in/out specs);
- ``build``: the lowered program: `jaxshard.lower.Lowered(plan)` (the jaxpr rewritten
  with its sharding constraints) and `jax.jit(...).trace` of it (one bind of the rewritten
  jaxpr), ready for ``.lower()``;
- ``stablehlo``: ``.lower()`` of that: JAX's StableHLO lowering of jaxshard's program;
- ``plain_stablehlo``: ``.lower()`` of `jax.jit(step).trace(...)` of the plain step — the
  StableHLO lowering every jitted program pays; measured right after ``stablehlo``.

graph, propagate and decide run with Python's cyclic GC paused, as `make_plan` runs them
(`Lowered` pauses it too); JAX's stages run as JAX runs them.

jaxshard's overhead is everything it adds on top of JAX's tracing and XLA's compile:
graph + propagate + decide + build + StableHLO extra, where StableHLO extra is the
median over repetitions of (stablehlo − plain_stablehlo), counted as 0 when negative
(never credited). The ratio is that overhead over the median ``make_jaxpr``.

Every stage is measured warm: one untimed pass of the whole pipeline runs first (for the
24- and 48-layer steps, an untimed `make_jaxpr`: the smaller steps already warmed the
same inner functions at the same shapes), so JAX's caches of inner jitted functions and
lowering rules are as warm for `make_jaxpr` as for jaxshard's stages. Sizes are
interleaved over rounds (see `run`). Before each repetition ``gc.collect()`` runs
(untimed), so every repetition starts from the same heap.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from dataclasses import dataclass, field

import jax
import jaxshard.rules  # noqa: F401  (registers the rule catalogue)
import numpy as np

from jaxshard.graph import build_graph
from jaxshard.lower import Lowered
from jaxshard.plan import auto_view, decide, gc_paused, mesh_axis_sizes, propagate_hints
from jaxshard.trace import trace

from .workloads import SPEED_HINTS, Workload, count_equations, gpt_speed, llama_speed, meshes

STAGES = (
    "make_jaxpr", "trace", "graph", "propagate", "decide", "build", "stablehlo",
    "plain_stablehlo",
)  # fmt: skip
JAXSHARD = ("graph", "propagate", "decide", "build")  # jaxshard's own work
# the criterion: the largest step's seconds per equation at most 25% above any smaller step's
LINEAR_WITHIN = 0.25


@dataclass
class SpeedRow:
    name: str
    layers: int
    scan: bool
    equations: int = 0
    top_level_equations: int = 0
    reps: int = 0
    runs: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    gc: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    compile_s: float | None = None
    compile_note: str = ""

    def gc_median(self, stage: str) -> float:
        """Median seconds the garbage collector paused inside a stage."""
        return statistics.median(self.gc[stage]) if self.gc.get(stage) else 0.0

    def median(self, stage: str) -> float:
        if stage == "jaxshard":
            return self.jaxshard
        if stage == "overhead":
            return self.overhead
        return statistics.median(self.runs[stage])

    @property
    def stablehlo_extra(self) -> float:
        """Median over repetitions of (our StableHLO lowering − plain jit's), ≥ 0."""
        ours, plain = self.runs["stablehlo"], self.runs["plain_stablehlo"]
        return max(statistics.median(a - b for a, b in zip(ours, plain, strict=True)), 0.0)

    @property
    def jaxshard(self) -> float:
        """graph + propagate + decide + build: the work jaxshard's own code does."""
        return sum(self.median(s) for s in JAXSHARD)

    @property
    def overhead(self) -> float:
        """Everything jaxshard adds to JAX's tracing and XLA's compile."""
        return self.jaxshard + self.stablehlo_extra

    @property
    def ratio(self) -> float:
        return self.overhead / self.median("make_jaxpr")

    @property
    def plan_total(self) -> float:
        """What a user waits for before XLA's compile: jaxshard's trace, its own stages
        and the StableHLO lowering of its program."""
        return self.median("trace") + self.jaxshard + self.median("stablehlo")


class GCClock:
    """Seconds Python's cyclic garbage collector has paused the program (a
    ``gc.callbacks`` hook), so each stage's share of collections can be reported."""

    def __init__(self):
        self.total = 0.0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.total += time.perf_counter() - self._start
            self._start = None

    def __enter__(self) -> GCClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def plan_once(w: Workload, mesh, hints, row: SpeedRow | None = None):
    """Run `make_plan`'s stages and `Lowered` one by one; append each stage's wall-clock
    seconds, CPU seconds and garbage-collector pauses to ``row``."""
    sizes = mesh_axis_sizes(mesh)
    marks: list[tuple[str | None, float, float, float]] = []
    with GCClock() as collector:

        def done(stage: str | None) -> None:  # the segment since the last mark was ``stage``
            marks.append((stage, time.perf_counter(), time.process_time(), collector.total))

        done(None)
        fresh = lambda *a: w.step(*a)  # noqa: E731  (a new function: no top-level trace cache)
        jax.make_jaxpr(fresh)(*w.args)
        done("make_jaxpr")
        with jax.set_mesh(auto_view(mesh)):
            traced = trace(w.step, w.args, {})
        done("trace")
        with gc_paused():  # as make_plan: build_graph, then plan_from_graph's two steps
            graph = build_graph(traced, sizes)
            done("graph")
            prop = propagate_hints(traced, graph, mesh, hints)
            done("propagate")
            plan = decide(traced, graph, prop, mesh)
        done("decide")
        lowered = Lowered(plan)
        flat = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(jax.tree.leaves(w.args), lowered.in_shardings, strict=True)
        ]
        with jax.set_mesh(lowered.mesh):  # Lowered.lower(flat), in its two steps
            replayed = lowered.jitted.trace(*flat)
            done("build")
            program = replayed.lower()
        done("stablehlo")
        plain = jax.jit(lambda *a: w.step(*a)).trace(*w.args)
        done(None)  # plain jit's trace: not timed
        plain.lower()
        done("plain_stablehlo")
    if row is not None:
        for (_, w0, c0, g0), (stage, w1, c1, g1) in zip(marks, marks[1:]):
            if stage is not None:
                row.runs[stage].append(w1 - w0)
                row.cpu[stage].append(c1 - c0)
                row.gc[stage].append(g1 - g0)
    return traced, program


def reps_per_round(layers: int, scan: bool) -> int:
    """Repetitions of a size in each round: more for the small steps, whose times are a
    few milliseconds, so one load spike weighs more."""
    if scan:
        return 1
    return 5 if layers <= 1 else 3 if layers <= 4 else 2 if layers <= 12 else 1


def run(
    layers=(1, 4, 12, 24, 48),
    scan_layers: int = 48,
    compile_max_layers: int = 12,
    rounds: int = 5,
    log=print,
) -> list[SpeedRow]:
    """Time planning of the unrolled GPT series and the scan-stacked Llama.

    The sizes are interleaved: each of ``rounds`` rounds plans every size once (the
    small ones `reps_per_round` times), so a change of machine load over the run weighs
    on all sizes alike and the per-equation comparison stays fair. XLA's CPU compile
    grows faster than linearly with the unrolled program (26-56 s at 12 layers, 12
    minutes at 48 on 2 busy cores), so unrolled programs above ``compile_max_layers``
    are not compiled; the scan model always is.
    """
    mesh = meshes()["2x4 (data, model)"]
    work = [(gpt_speed(n), n, False) for n in layers] + [
        (llama_speed(scan_layers), scan_layers, True)
    ]
    rows, programs = [], {}
    for w, n, scan in work:
        if scan or n <= 12:  # warm JAX's caches (inner jitted functions, lowering rules)
            plan_once(w, mesh, SPEED_HINTS[w.model])
        else:  # the smaller GPTs warmed the same functions at the same shapes already
            jax.make_jaxpr(lambda *a, w=w: w.step(*a))(*w.args)
        rows.append(SpeedRow(w.name, n, scan))
    for i in range(rounds):
        for (w, n, scan), row in zip(work, rows):
            for _ in range(reps_per_round(n, scan)):
                gc.collect()
                traced, programs[row.name] = plan_once(w, mesh, SPEED_HINTS[w.model], row)
                row.reps += 1
            if i == 0:
                row.equations = count_equations(traced.jaxpr)
                row.top_level_equations = len(traced.jaxpr.jaxpr.eqns)
        log(f"[speed] round {i + 1}/{rounds} done")
    for (w, n, scan), row in zip(work, rows):
        program = programs.pop(row.name)
        if scan or n <= compile_max_layers:
            t0 = time.perf_counter()
            program.compile()
            row.compile_s = time.perf_counter() - t0
        else:
            row.compile_note = f"not compiled (> {compile_max_layers} unrolled layers; see notes)"
        log(
            f"[speed] {w.name}: {row.equations} eqns, {row.reps} reps, make_jaxpr "
            f"{row.median('make_jaxpr'):.3f} s, propagate {row.median('propagate'):.3f} s, "
            f"jaxshard {row.jaxshard:.3f} s, StableHLO extra {row.stablehlo_extra:.3f} s, "
            f"ratio {row.ratio:.2f}, compile {row.compile_s if row.compile_s is not None else '-'}"
        )
    return rows


def dump(rows: list[SpeedRow], path: str) -> None:
    """Every repetition's seconds per stage (wall clock, CPU, GC pauses), as JSON."""
    record = [
        {
            "name": r.name, "layers": r.layers, "scan": r.scan, "equations": r.equations,
            "top_level_equations": r.top_level_equations, "wall_s": r.runs, "cpu_s": r.cpu,
            "gc_pause_s": r.gc, "xla_compile_s": r.compile_s,
        }
        for r in rows
    ]  # fmt: skip
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


# --- linearity ------------------------------------------------------------------------


@dataclass
class Fit:
    """Whether one stage's seconds grow no faster than equations over a series: the
    largest step's seconds per equation against each smaller step's. A fixed cost (the
    embedding, the head, a pass priced per large leaf) makes small steps dearer per
    equation, which is not growth; a largest step dearer per equation than a smaller one
    is."""

    stage: str
    per_kilo_eqn: list[float]  # seconds per 1000 equations, per row of the series
    deviations: list[float]  # per row: the largest step's per_kilo_eqn / this row's - 1
    max_deviation: float  # max deviation over the smaller rows (0 when none is positive)
    exponent: float  # least-squares slope of log t vs log n; 1.0 is linear
    checked: bool  # part of the criterion (else reported for reference)

    @property
    def linear(self) -> bool:
        return self.max_deviation <= LINEAR_WITHIN


# (stage, checked): the criterion is jaxshard's own stages together. Each stage alone is
# shown to locate a deviation: at a few milliseconds per stage the small steps are noisier,
# and graph building is sublinear (a rule is built once per distinct primitive, shapes and
# params, then shared by the repeated layers). The overhead with the StableHLO extra (a
# difference of two lowerings that also absorbs garbage-collector pauses) and JAX's
# make_jaxpr are references.
LINEARITY_STAGES = (
    ("jaxshard", True), ("graph", False), ("propagate", False), ("decide", False),
    ("build", False), ("overhead", False), ("make_jaxpr", False),
)  # fmt: skip


def linearity(rows: list[SpeedRow], stages=LINEARITY_STAGES) -> list[Fit]:
    """Per stage over the unrolled series: seconds per 1000 equations at each size, how
    much dearer per equation the largest step is than each (`Fit`), and the log-log
    slope."""
    series = [r for r in rows if not r.scan]
    n = np.array([r.equations for r in series], float)
    fits = []
    for stage, checked in stages:
        t = np.array([r.median(stage) for r in series])
        per = 1e3 * t / n
        dev = per[-1] / per - 1
        k = float(np.polyfit(np.log(n), np.log(t), 1)[0]) if len(n) > 1 else float("nan")
        worst = max(0.0, float(np.max(dev[:-1]))) if len(n) > 1 else 0.0
        fits.append(Fit(stage, list(per), list(dev), worst, k, checked))
    return fits


# --- tables and plot ------------------------------------------------------------------


def speed_table(rows: list[SpeedRow]) -> str:
    head = (
        "| model | eqns (top level) | reps | make_jaxpr s | graph s | propagate s | decide s | "
        "build program s | StableHLO s: ours − plain jit = extra | **overhead s** | "
        "**overhead / make_jaxpr** | jaxshard trace s | plan total s | XLA compile s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        compile_text = f"{r.compile_s:.1f}" if r.compile_s is not None else "not compiled"
        m = r.median
        lines.append(
            f"| {r.name} | {r.equations} ({r.top_level_equations}) | {r.reps} | "
            f"{m('make_jaxpr'):.3f} | {m('graph'):.3f} | {m('propagate'):.3f} | "
            f"{m('decide'):.3f} | {m('build'):.3f} | {m('stablehlo'):.3f} − "
            f"{m('plain_stablehlo'):.3f} = {r.stablehlo_extra:.3f} | **{r.overhead:.3f}** | "
            f"**{r.ratio:.2f}x** | {m('trace'):.3f} | {r.plan_total:.3f} | {compile_text} |"
        )
    return head + "\n".join(lines) + "\n"


STAGE_NAMES = {
    "jaxshard": "**jaxshard's stages: graph + propagate + decide + build**",
    "graph": "graph",
    "propagate": "propagate",
    "decide": "decide",
    "build": "build lowered program",
    "overhead": "overhead incl. StableHLO extra (reference)",
    "make_jaxpr": "jax.make_jaxpr (reference)",
}


def linearity_table(rows: list[SpeedRow], fits: list[Fit]) -> str:
    series = [r for r in rows if not r.scan]
    sizes = " | ".join(f"{r.layers}L ({r.equations})" for r in series)
    head = (
        f"| stage | ms per 1k equations: {sizes} | {series[-1].layers}L dearer per equation "
        f"than a smaller step by at most | within {100 * LINEAR_WITHIN:.0f}%? | log-log slope |\n"
        f"|---|{'---|' * len(series)}---|---|---|\n"
    )
    lines = []
    for f in fits:
        cells = " | ".join(
            f"{1e3 * p:.1f} ({100 * d:+.0f}%)" if i < len(series) - 1 else f"{1e3 * p:.1f}"
            for i, (p, d) in enumerate(zip(f.per_kilo_eqn, f.deviations))
        )
        verdict = (
            ("**yes**" if f.linear else "**no**")
            if f.checked
            else f"({'yes' if f.linear else 'no'}; not checked)"
        )
        lines.append(
            f"| {STAGE_NAMES.get(f.stage, f.stage)} | {cells} | {100 * f.max_deviation:.0f}% | "
            f"{verdict} | {f.exponent:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: list[SpeedRow], path: str) -> None:
    """Seconds vs equations: one line per stage, the scan model as separate points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [r for r in rows if not r.scan]
    scans = [r for r in rows if r.scan]
    x = [r.equations for r in series]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    lines = [
        ("jax.make_jaxpr (reference)", lambda r: r.median("make_jaxpr"), "^--"),
        ("StableHLO lowering of jaxshard's program", lambda r: r.median("stablehlo"), "x:"),
        ("StableHLO lowering, plain jax.jit", lambda r: r.median("plain_stablehlo"), "+:"),
        ("jaxshard overhead (all terms)", lambda r: r.overhead, "s-"),
        ("jaxshard's stages: graph + propagate + decide + build", lambda r: r.jaxshard, "o-"),
        ("propagate", lambda r: r.median("propagate"), "d-"),
    ]
    for label, get, style in lines:
        (h,) = ax.plot(x, [get(r) for r in series], style, label=label)
        for r in scans:
            ax.plot([r.equations], [get(r)], style[0], color=h.get_color(), markersize=11,
                    markerfacecolor="none")  # fmt: skip
    for r in series:
        ax.annotate(f"{r.layers}L: {r.ratio:.2f}x", (r.equations, r.overhead),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)  # fmt: skip
    for r in scans:
        ax.annotate(f"scan {r.layers}L", (r.equations, r.median("make_jaxpr")),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)  # fmt: skip
    ax.set_xlabel("jaxpr equations (nested jaxprs counted)")
    ax.set_ylabel("seconds (median)")
    ax.set_title("jaxshard planning time vs program size (labels: overhead / make_jaxpr)\n"
                 "GPT train step, 1–48 unrolled layers; hollow: 48-layer scan-stacked Llama",
                 fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
