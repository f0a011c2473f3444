"""Planning speed: jaxshard's pipeline stage by stage, against JAX's own tracing.

Each workload is planned on the 2x4 (data, model) mesh with the hints of
``examples/gpt.py`` (the batch, query projections and first MLP matrices), calling the
stages of `jaxshard.plan.make_plan` one by one so each can be timed:

- ``make_jaxpr``: `jax.make_jaxpr` of the train step (a fresh wrapper each time, so JAX's
  cache of the top-level trace is not hit);
- ``trace``: `jaxshard.trace.trace` (make_jaxpr plus naming every leaf);
- ``graph``: `jaxshard.graph.build_graph`;
- ``propagate``: hint matching, `Propagator` construction, pins and the fixed point;
- ``decide``: the defaults for open dims and `Plan` (reshards, costs, in/out specs);
- ``replay`` and ``stablehlo``: `jaxshard.lower.Lowered(plan)` and its ``.lower(...)``,
  split in two — ``replay`` builds the program and traces it with `jax.jit(...).trace`
  (the jaxpr replayed with its sharding constraints: a second trace of the whole step),
  ``stablehlo`` is ``.lower()`` of that trace; together they are exactly
  ``Lowered.lower``;
- ``plain_stablehlo``: for reference, ``.lower()`` of `jax.jit(step).trace(...)` of the
  plain step — the StableHLO lowering every jitted program pays;
- ``compile``: XLA's compile of jaxshard's lowered program, once.

jaxshard's overhead = graph + propagate + decide + replay + stablehlo: everything it adds
on top of JAX's tracing and XLA's compile. The issue's ratio is overhead / make_jaxpr. A
second ratio counts only the part of StableHLO lowering beyond what the plain step's
costs (which a user of plain `jax.jit` pays anyway):
(graph + propagate + decide + replay + max(0, stablehlo − plain_stablehlo)) / make_jaxpr.

Every stage is measured warm: one untimed pass of the whole pipeline runs first (for the
24- and 48-layer steps, an untimed `make_jaxpr`: the smaller steps already warmed the
same inner functions at the same shapes), so JAX's caches of inner jitted functions and
lowering rules are as warm for `make_jaxpr` as for jaxshard's stages, and the first-call
costs of a fresh process are not billed to either.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import jax
import jaxshard.rules  # noqa: F401  (registers the rule catalogue)
import numpy as np

from jaxshard.annotate import match_hints, merge_pins
from jaxshard.graph import build_graph
from jaxshard.lower import Lowered
from jaxshard.plan import Plan, auto_view, mesh_axis_sizes
from jaxshard.propagate import Propagator
from jaxshard.trace import trace

from .workloads import SPEED_HINTS, Workload, count_equations, gpt_speed, llama_speed, meshes

STAGES = (
    "make_jaxpr", "trace", "graph", "propagate", "decide", "replay", "stablehlo", "plain_stablehlo",
)  # fmt: skip
OVERHEAD = ("graph", "propagate", "decide", "replay", "stablehlo")
DEFAULT_TEXT = "replicated: no hint or propagation reached it"


@dataclass
class SpeedRow:
    name: str
    layers: int
    scan: bool
    equations: int = 0
    top_level_equations: int = 0
    reps: int = 0
    runs: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    compile_s: float | None = None
    compile_note: str = ""

    def median(self, stage: str) -> float:
        return statistics.median(self.runs[stage])

    @property
    def overhead(self) -> float:
        return sum(self.median(s) for s in OVERHEAD)

    @property
    def lower(self) -> float:
        return self.median("replay") + self.median("stablehlo")

    @property
    def plan_total(self) -> float:
        return self.median("trace") + self.overhead

    @property
    def ratio(self) -> float:
        return self.overhead / self.median("make_jaxpr")

    @property
    def net_ratio(self) -> float:
        extra = max(self.median("stablehlo") - self.median("plain_stablehlo"), 0.0)
        net = self.overhead - self.median("stablehlo") + extra
        return net / self.median("make_jaxpr")


def plan_once(w: Workload, mesh, hints, times: dict[str, list[float]]):
    """Run `make_plan`'s stages and `Lowered` one by one; append each stage's seconds."""
    sizes = mesh_axis_sizes(mesh)
    clock = time.perf_counter

    t0 = clock()
    fresh = lambda *a: w.step(*a)  # noqa: E731  (a new function: no top-level trace cache)
    jax.make_jaxpr(fresh)(*w.args)
    times["make_jaxpr"].append(clock() - t0)

    t0 = clock()
    with jax.set_mesh(auto_view(mesh)):
        traced = trace(w.step, w.args, {})
    t1 = clock()
    graph = build_graph(traced, sizes)
    t2 = clock()
    names = list(traced.in_names) + list(traced.out_names)
    vids = list(graph.in_vids) + list(graph.out_vids)
    pins = dict(graph.pins)
    for i, pin in match_hints(hints, names, [graph.shapes[v] for v in vids], sizes).items():
        vid = vids[i]
        pins[vid] = merge_pins(pins[vid], pin, names[i]) if vid in pins else pin
    prop = Propagator(graph, sizes)
    for vid, pin in pins.items():
        prop.pin(vid, pin)
    prop.run()
    t3 = clock()
    prop.default(graph.in_vids, DEFAULT_TEXT)
    prop.default(range(len(graph.shapes)), DEFAULT_TEXT)
    plan = Plan(traced, graph, prop, mesh)
    t4 = clock()
    lowered = Lowered(plan)
    flat = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for x, s in zip(jax.tree.leaves(w.args), lowered.in_shardings, strict=True)
    ]
    with jax.set_mesh(lowered.mesh):  # Lowered.lower(flat), in its two steps
        replayed = lowered.jitted.trace(*flat)
        t5 = clock()
        program = replayed.lower()
    t6 = clock()
    stages = ("trace", "graph", "propagate", "decide", "replay", "stablehlo")
    for stage, seconds in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
        times[stage].append(seconds)

    plain = jax.jit(lambda *a: w.step(*a)).trace(*w.args)
    t0 = clock()
    plain.lower()
    times["plain_stablehlo"].append(clock() - t0)
    return traced, program


def run(
    layers=(1, 4, 12, 24, 48),
    scan_layers: int = 48,
    compile_max_layers: int = 12,
    reps_small: int = 5,
    reps_large: int = 3,
    log=print,
) -> list[SpeedRow]:
    """Time planning of the unrolled GPT series and the scan-stacked Llama.

    XLA's CPU compile grows faster than linearly with the unrolled program (26-56 s at
    12 layers, 12 minutes at 48 on 2 busy cores), so unrolled programs above
    ``compile_max_layers`` are not compiled; the scan model always is.
    """
    mesh = meshes()["2x4 (data, model)"]
    work = [(gpt_speed(n), n, False) for n in layers] + [
        (llama_speed(scan_layers), scan_layers, True)
    ]
    rows = []
    for w, n, scan in work:
        hints = SPEED_HINTS[w.model]
        row = SpeedRow(w.name, n, scan)
        if scan or n <= 12:  # warm JAX's caches (inner jitted functions, lowering rules)
            plan_once(w, mesh, hints, {s: [] for s in STAGES})
        else:  # the smaller GPTs warmed the same functions at the same shapes already
            jax.make_jaxpr(lambda *a, w=w: w.step(*a))(*w.args)
        row.reps = reps_small if n <= 12 else reps_large
        for _ in range(row.reps):
            traced, program = plan_once(w, mesh, hints, row.runs)
        row.equations = count_equations(traced.jaxpr)
        row.top_level_equations = len(traced.jaxpr.jaxpr.eqns)
        if scan or n <= compile_max_layers:
            t0 = time.perf_counter()
            program.compile()
            row.compile_s = time.perf_counter() - t0
        else:
            row.compile_note = f"not compiled (> {compile_max_layers} unrolled layers; see notes)"
        log(
            f"[speed] {w.name}: {row.equations} eqns, make_jaxpr {row.median('make_jaxpr'):.3f} s, "
            f"propagate {row.median('propagate'):.3f} s, plan {row.plan_total:.3f} s, "
            f"ratio {row.ratio:.2f}, compile {row.compile_s if row.compile_s is not None else '-'}"
        )
        rows.append(row)
    return rows


# --- linearity ------------------------------------------------------------------------


@dataclass
class Fit:
    """How close one stage's seconds are to proportional to equations over a series."""

    stage: str
    per_kilo_eqn: list[float]  # seconds per 1000 equations, per row of the series
    slope: float  # least-squares seconds per 1000 equations of t = b·n (through the origin)
    max_deviation: float  # max |t / (b·n) - 1| over the series
    exponent: float  # least-squares slope of log t vs log n; 1.0 is linear


def _series(rows, stage):
    if stage == "plan_total":
        return [r.plan_total for r in rows]
    if stage == "overhead":
        return [r.overhead for r in rows]
    return [r.median(stage) for r in rows]


LINEARITY_STAGES = ("plan_total", "overhead", "propagate", "replay", "make_jaxpr")


def linearity(rows: list[SpeedRow], stages=LINEARITY_STAGES) -> list[Fit]:
    """Per stage over the unrolled series: the line t = b·n through the origin (time
    proportional to equations), each point's deviation from it, and the log-log slope."""
    series = [r for r in rows if not r.scan]
    n = np.array([r.equations for r in series], float)
    fits = []
    for stage in stages:
        t = np.array(_series(series, stage))
        b = float(n @ t / (n @ n))
        deviation = float(np.max(np.abs(t / (b * n) - 1)))
        k = float(np.polyfit(np.log(n), np.log(t), 1)[0]) if len(n) > 1 else float("nan")
        fits.append(Fit(stage, list(1e3 * t / n), 1e3 * b, deviation, k))
    return fits


# --- tables and plot ------------------------------------------------------------------


def speed_table(rows: list[SpeedRow]) -> str:
    head = (
        "| model | eqns (top level) | make_jaxpr s | trace s | graph s | propagate s | "
        "decide s | replay s | StableHLO s | plan total s | StableHLO s, plain jit | "
        "XLA compile s | overhead / make_jaxpr | net of plain StableHLO |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        compile_text = f"{r.compile_s:.1f}" if r.compile_s is not None else "not compiled"
        m = r.median
        lines.append(
            f"| {r.name} | {r.equations} ({r.top_level_equations}) | {m('make_jaxpr'):.3f} | "
            f"{m('trace'):.3f} | {m('graph'):.3f} | {m('propagate'):.3f} | {m('decide'):.3f} | "
            f"{m('replay'):.3f} | {m('stablehlo'):.3f} | {r.plan_total:.3f} | "
            f"{m('plain_stablehlo'):.3f} | {compile_text} | **{r.ratio:.2f}x** | {r.net_ratio:.2f}x |"
        )
    return head + "\n".join(lines) + "\n"


STAGE_NAMES = {
    "plan_total": "total planning",
    "overhead": "jaxshard overhead (graph+propagate+decide+replay+StableHLO)",
    "propagate": "propagation",
    "replay": "replay (second trace, in lowering)",
    "make_jaxpr": "jax.make_jaxpr (reference)",
}


def linearity_table(rows: list[SpeedRow], fits: list[Fit]) -> str:
    series = [r for r in rows if not r.scan]
    sizes = " | ".join(f"{r.layers}L" for r in series)
    head = (
        f"| stage | seconds per 1k equations: {sizes} | fit t = b·n: b per 1k eqns | "
        "max deviation from the fit | log-log slope (1.0 = linear) |\n"
        f"|---|{'---|' * len(series)}---|---|---|\n"
    )
    return (
        head
        + "\n".join(
            f"| {STAGE_NAMES.get(f.stage, f.stage)} | "
            + " | ".join(f"{c:.3f}" for c in f.per_kilo_eqn)
            + f" | {f.slope:.3f} | {100 * f.max_deviation:.0f}% | {f.exponent:.2f} |"
            for f in fits
        )
        + "\n"
    )


def plot(rows: list[SpeedRow], path: str) -> None:
    """Planning time vs equations: one line per stage, the scan model as separate points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [r for r in rows if not r.scan]
    scans = [r for r in rows if r.scan]
    x = [r.equations for r in series]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    lines = [
        ("total planning", lambda r: r.plan_total, "o-"),
        ("jaxshard overhead", lambda r: r.overhead, "s-"),
        ("jax.make_jaxpr", lambda r: r.median("make_jaxpr"), "^--"),
        ("lower (replay + StableHLO)", lambda r: r.lower, "v-"),
        ("propagate", lambda r: r.median("propagate"), "d-"),
    ]
    for label, get, style in lines:
        (h,) = ax.plot(x, [get(r) for r in series], style, label=label)
        for r in scans:
            ax.plot([r.equations], [get(r)], style[0], color=h.get_color(), markersize=11,
                    markerfacecolor="none")  # fmt: skip
    for r in series:
        ax.annotate(f"{r.layers}L", (r.equations, r.plan_total), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)  # fmt: skip
    for r in scans:
        ax.annotate(f"scan {r.layers}L", (r.equations, r.plan_total), textcoords="offset points",
                    xytext=(6, -10), fontsize=8)  # fmt: skip
    ax.set_xlabel("jaxpr equations (nested jaxprs counted)")
    ax.set_ylabel("seconds (median)")
    ax.set_title("jaxshard planning time vs program size\nGPT train step, 1–48 unrolled layers; "
                 "hollow: 48-layer scan-stacked Llama", fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
