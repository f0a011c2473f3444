"""Plan quality: every layout compiled and measured from the compiled program.

For each model and mesh, the layouts are:

- (a) jaxshard from the batch hint plus one weight hint (`workloads.quality_hints`);
- (b) jaxshard with search: ``auto_shard(mesh, batch hint, search=True,
  memory_budget=...)`` with the budget set to jaxshard's memory estimate of the
  Megatron layout (d) (as `benchmarks.search` does): the least estimated communication
  within the memory the expert layout needs;
- (c) "Shardy alone": `jax.jit` of the plain train step with the same hints as
  ``in_shardings`` of the hinted arguments, every other argument replicated (as the
  caller placed it), results left to XLA — what the compiler does with just those pins;
- (d) hand-written expert layouts (`layouts`), applied as ``in_shardings`` and
  ``out_shardings`` (results keep their argument's layout): Megatron tensor parallel +
  data parallel, the same + FSDP, and expert parallel for the MoE.

Measured per device from the compiled program: collectives executed per step and their
bytes (`hlo.collective_stats`), memory from ``compiled.memory_analysis()`` (arguments +
results + temporaries − aliased), and the step time on the simulated CPU mesh (median of
several runs; noisy). Every layout's loss is checked against the unsharded `jax.jit`.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.baseline import shardy_alone
from jaxshard.cost import human_bytes
from jaxshard.plan import mesh_axis_sizes

from . import layouts
from .hlo import collective_stats
from .layouts import reference_hints
from .workloads import SPEED_HINTS, Workload, meshes, quality_hints, quality_workloads


@dataclass
class Row:
    model: str
    mesh: str
    layout: str
    compile_s: float | None = None
    count: int | None = None
    static_count: int | None = None
    kinds: str = ""
    result_bytes: int | None = None
    ring_bytes: float | None = None
    predicted_bytes: float | None = None
    unknown_trips: int = 0
    mem_total: int | None = None
    mem_args: int | None = None
    mem_temp: int | None = None
    step_ms: float | None = None
    step_runs: list[float] = field(default_factory=list)
    loss_err: float | None = None
    note: str = ""


@dataclass
class Built:
    """A compiled layout: the executable, how to call it on (params, opt_state, batch)
    placed in its layout, and what jaxshard predicted (for jaxshard's layouts)."""

    compiled: Any
    place: Callable[[tuple], Any]  # concrete (params, opt_state, batch) -> placed arguments
    call: Callable[[Any], Any]  # placed arguments -> loss
    predicted: float | None = None
    note: str = ""


def _jaxshard(w: Workload, mesh, hints) -> Built:
    fn = jaxshard.auto_shard(mesh, hints)(w.step)
    plan = fn.plan(*w.args)
    compiled = fn.lower(*w.args).compile()
    shardings = jax.tree.leaves(plan.in_shardings)

    def place(args):
        return [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(args), shardings, strict=True)]

    return Built(compiled, place, lambda flat: compiled(*flat)[-1], plan.predicted_bytes)


def _search(w: Workload, mesh, hints) -> Built:
    """``auto_shard(search=True)`` with ``hints`` (the batch) within the Megatron
    layout's estimated memory, compiled."""
    megatron = reference_hints(w, layouts.megatron(w.model), mesh)
    budget = jaxshard.make_plan(w.step, w.args, {}, mesh, megatron).estimated_memory.total
    step = jaxshard.auto_shard(mesh, hints, search=True, memory_budget=budget)(w.step)
    compiled = step.lower(*w.args).compile()
    result = step.search_result
    shardings = jax.tree.leaves(result.plan.in_shardings)

    def place(args):
        return [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(args), shardings, strict=True)]

    status = "optimal" if result.optimal else "stopped at the time limit"
    note = f"search {result.seconds:.1f} s ({status})"
    return Built(compiled, place, lambda flat: compiled(*flat)[-1], result.plan.predicted_bytes,
                 note)  # fmt: skip


def _jit(w: Workload, mesh, in_specs, out_specs) -> Built:
    def named(tree):
        return jax.tree.map(
            lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, P)
        )

    in_shardings = named(in_specs)
    jitted = jax.jit(
        w.step,
        in_shardings=in_shardings,
        out_shardings=None if out_specs is None else named(out_specs),
    )
    compiled = jitted.lower(*w.args).compile()

    return Built(
        compiled, lambda args: jax.device_put(args, in_shardings), lambda args: compiled(*args)[2]
    )


def _shardy_alone(w: Workload, mesh, hints) -> Built:
    """The hints as in_shardings of the arguments they match; everything else replicated,
    results left to XLA (`jaxshard.baseline.shardy_alone`)."""
    compiled = shardy_alone(w.step, w.args, mesh, hints, results="free").compile()
    in_shardings = compiled.input_shardings[0]
    return Built(
        compiled, lambda args: jax.device_put(args, in_shardings), lambda args: compiled(*args)[2]
    )


def expert_layout(w: Workload, mesh, layout: layouts.Layout, batch_spec: P | None = None) -> Built:
    """A hand-written layout (`benchmarks.layouts`) as `jax.jit` in/out shardings, the batch
    on ``batch_spec`` (default ``P("data")``) and the AdamW state like its parameter,
    compiled."""
    batch_spec = P("data") if batch_spec is None else batch_spec
    params, opt_state, batch = w.args
    param_specs = layout(params, mesh_axis_sizes(mesh))
    opt_specs = layouts.opt_state_specs(opt_state, params, param_specs)
    batch_specs = jax.tree.map(lambda _: batch_spec, batch)
    return _jit(w, mesh, (param_specs, opt_specs, batch_specs), (param_specs, opt_specs, P()))


def layouts_for(w: Workload, mesh) -> list[tuple[str, Callable[[], Built] | None, str]]:
    """``(label, build, note)`` for every layout benchmarked on this model and mesh."""
    sizes = mesh_axis_sizes(mesh)
    hints = quality_hints(w.model, sizes)
    hint_text = ", ".join(f"{k}: {v}" for k, v in hints.items() if not k.startswith("batch"))
    tp = "model" in sizes
    rows: list[tuple[str, Callable[[], Built] | None, str]] = []
    batch_only = {k: v for k, v in hints.items() if k.startswith("batch")}
    if not tp:  # with only a data axis, the batch hint alone should give data parallelism
        rows.append(("(a) jaxshard: batch hint only", lambda: _jaxshard(w, mesh, batch_only), ""))
    rows += [
        ("(a) jaxshard: batch + 1 weight hint", lambda: _jaxshard(w, mesh, hints), hint_text),
        (
            "(b) jaxshard + search",
            lambda: _search(w, mesh, batch_only),
            "batch hint only; memory budget = Megatron's",
        ),
        (
            "(c) Shardy alone, same hints",
            lambda: _shardy_alone(w, mesh, hints),
            "results left to XLA",
        ),
    ]
    if tp and w.model in SPEED_HINTS:  # the examples' hints: attention too
        more = SPEED_HINTS[w.model]
        more_text = ", ".join(f"{k}: {v}" for k, v in more.items() if not k.startswith("batch"))
        rows.insert(
            len(rows) - 2,
            ("(a) jaxshard: batch + 2 weight hints", lambda: _jaxshard(w, mesh, more), more_text),
        )
    mega = layouts.megatron(w.model)
    rows.append(
        ("(d) Megatron TP + DP" if tp else "(d) Megatron TP + DP = DP",
         lambda: expert_layout(w, mesh, mega),
         "" if tp else "no model axis: Megatron degenerates to data parallel")
    )  # fmt: skip
    rows.append(
        ("(d) Megatron + FSDP" if tp else "(d) FSDP (ZeRO-3)",
         lambda: expert_layout(w, mesh, layouts.fsdp(mega, w.model)), "")
    )  # fmt: skip
    if w.model == "moe":
        rows.append(
            ("(d) expert parallel + DP", lambda: expert_layout(w, mesh, layouts.expert_parallel),
             "experts on " + ("model" if tp else "data"))
        )  # fmt: skip
    return rows


def measure(w: Workload, mesh_name: str, mesh, label: str, build, note: str,
            concrete: tuple, reference: float, step_runs: int) -> Row:  # fmt: skip
    row = Row(w.name, mesh_name, label, note=note)
    if build is None:
        return row
    try:
        t0 = time.perf_counter()
        built = build()
        row.compile_s = time.perf_counter() - t0
    except Exception as e:  # a layout that does not build is a result, not a crash
        row.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        traceback.print_exc()
        return row
    stats = collective_stats(built.compiled.as_text(), mesh.size)
    row.count, row.static_count, row.kinds = stats.count, stats.static_count, stats.kinds_text()
    row.result_bytes, row.ring_bytes = stats.result_bytes, stats.ring_bytes
    row.unknown_trips = stats.unknown_trip_counts
    row.predicted_bytes = built.predicted
    if built.note:
        row.note = f"{row.note}; {built.note}" if row.note else built.note
    mem = built.compiled.memory_analysis()
    if mem is not None:
        row.mem_args = mem.argument_size_in_bytes
        row.mem_temp = mem.temp_size_in_bytes
        row.mem_total = (
            mem.argument_size_in_bytes + mem.output_size_in_bytes
            + mem.temp_size_in_bytes - mem.alias_size_in_bytes
        )  # fmt: skip
    placed = jax.block_until_ready(built.place(concrete))
    loss = jax.block_until_ready(built.call(placed))  # warm-up run
    row.loss_err = abs(float(loss) - reference) / max(abs(reference), 1e-30)
    for _ in range(step_runs):
        t0 = time.perf_counter()
        jax.block_until_ready(built.call(placed))
        row.step_runs.append(time.perf_counter() - t0)
    row.step_ms = 1e3 * statistics.median(row.step_runs)
    return row


def run(quick: bool = False, step_runs: int = 5, log=print) -> list[Row]:
    """Measure every layout of every quality workload on both meshes (with ``quick``:
    the examples' tiny models on the 2x4 mesh only)."""
    rows = []
    for w in quality_workloads(quick):
        log(f"[quality] {w.describe()}")
        concrete = w.concrete_args()
        reference = float(jax.jit(w.step)(*concrete)[2])
        for mesh_name, mesh in meshes().items():
            if quick and "model" not in mesh.axis_names:
                continue
            for label, build, note in layouts_for(w, mesh):
                row = measure(
                    w, mesh_name, mesh, label, build, note, concrete, reference, step_runs
                )
                log(f"  {mesh_name:<18} {label:<38} {_short(row)}")
                rows.append(row)
    return rows


def _short(row: Row) -> str:
    if row.count is None:
        return row.note
    return (
        f"{row.count} collectives, {_size(row.ring_bytes)} ring, mem {_size(row.mem_total)}, "
        f"step {row.step_ms:.1f} ms, compile {row.compile_s:.1f} s"
    )


def _size(n: float | None) -> str:
    return "—" if n is None else human_bytes(n, 2)


# --- tables ---------------------------------------------------------------------------


def quality_table(rows: list[Row]) -> str:
    head = (
        "| model | mesh | layout | collectives / step (kinds) | result bytes / dev | "
        "ring bytes / dev | jaxshard predicted | memory / dev (args, temp) | notes |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if r.count is None:
            lines.append(f"| {r.model} | {r.mesh} | {r.layout} | — | — | — | — | — | {r.note} |")
            continue
        static = f", {r.static_count} in HLO" if r.static_count != r.count else ""
        trips = f" (≥, {r.unknown_trips} loop(s) of unknown trip count)" if r.unknown_trips else ""
        predicted = "" if r.predicted_bytes is None else _size(r.predicted_bytes)
        mem = f"{_size(r.mem_total)} ({_size(r.mem_args)}, {_size(r.mem_temp)})"
        lines.append(
            f"| {r.model} | {r.mesh} | {r.layout} | {r.count}{static}{trips}: {r.kinds} | "
            f"{_size(r.result_bytes)} | {_size(r.ring_bytes)} | {predicted} | {mem} | {r.note} |"
        )
    return head + "\n".join(lines) + "\n"


HEADLINE_COLUMNS = (  # (column, layout label prefixes tried in order)
    ("(a) jaxshard: batch + 1 weight hint", ("(a) jaxshard: batch + 1 weight hint",)),
    ("(b) jaxshard + search (batch hint only)", ("(b) jaxshard + search",)),
    ("(c) Shardy alone, same hints as (a)", ("(c) Shardy alone",)),
    ("(d) Megatron TP + DP", ("(d) Megatron TP + DP",)),
    ("(d) Megatron + FSDP, or FSDP", ("(d) Megatron + FSDP", "(d) FSDP")),
    ("(d) expert parallel", ("(d) expert parallel",)),
)


def headline_table(rows: list[Row]) -> str:
    """One line per model and mesh, one column per layout: ring bytes per device per step,
    then memory per device, both from the compiled program."""
    head = (
        "| model | mesh | "
        + " | ".join(c for c, _ in HEADLINE_COLUMNS)
        + " |\n|---|---|"
        + "---|" * len(HEADLINE_COLUMNS)
        + "\n"
    )
    lines = []
    for key in dict.fromkeys((r.model, r.mesh) for r in rows):
        mine = [r for r in rows if (r.model, r.mesh) == key]
        cells = []
        for _, prefixes in HEADLINE_COLUMNS:
            row = next((r for p in prefixes for r in mine if r.layout.startswith(p)), None)
            if row is None:
                cells.append("")
            elif row.count is None:
                cells.append("failed" if row.note.startswith("failed") else "—")
            else:
                cells.append(f"{_size(row.ring_bytes)} · {_size(row.mem_total)}")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def step_table(rows: list[Row]) -> str:
    head = (
        "| model | mesh | layout | step ms, median (CPU-simulated, noisy) | min–max ms | "
        "compile s | loss rel. err vs unsharded |\n|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if r.step_ms is None:
            continue
        runs = np.array(r.step_runs) * 1e3
        lines.append(
            f"| {r.model} | {r.mesh} | {r.layout} | {r.step_ms:.1f} | "
            f"{runs.min():.1f}–{runs.max():.1f} | {r.compile_s:.1f} | {r.loss_err:.1e} |"
        )
    return head + "\n".join(lines) + "\n"
