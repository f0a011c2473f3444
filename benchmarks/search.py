"""Fully automatic search against hand-written layouts, measured from the compiled program.

    python -m benchmarks.search                  # GPT 12 and 48 layers, Llama-scan, MoE
    python -m benchmarks.search --quick          # the examples' tiny models (a smoke run)
    python -m benchmarks.search --compile-large  # also compile the 48-layer GPT (minutes)
    python -m benchmarks.search --targets        # only the memory-bound targets table
    python -m benchmarks.search --sequence       # only the long-sequence table

*Targets* (first table; `targets`): the 12-layer GPT (d 768, seq 256, batch 16) on the
2x4 mesh against two hand layouts compiled by `jax.jit` with full in/out shardings
(`benchmarks.quality.expert_layout`): *Megatron TP + DP* and *ZeRO-3 over all devices*
(`benchmarks.layouts.zero3`: the batch over (data, model), every leaf split 8 ways).
Target (a): the batch hint only, ``memory_budget`` = Megatron's compiled memory; the
plan's compiled collective bytes at most 1.0x Megatron's, memory at most 1.05x, search
under 10 s; searched with the estimate alone, and with ``calibrate_memory=True`` (the
search compiles its plans; its seconds include those compiles). Target (b): no hints,
``cost_model=CostModel(default_bandwidth=1e11, flops=1e14)``, ``memory_budget`` = 0.85x
Megatron's compiled memory; compiled memory at most 0.9x Megatron's and modeled step
time (per-device flops / 1e14 + ring bytes / 1e11, both read from the compiled program:
``compiled.cost_analysis()['flops']`` and `benchmarks.hlo.collective_stats`) at most ZeRO-3's, search under 20 s.

*One long sequence* (second table; `sequence`, ``--sequence``): a 4-layer GPT (d 768,
seq 2048) with batch 1, so the batch dim cannot be split; no hints. The search within
0.6x the compiled memory of Megatron tensor parallelism (its data axis idle), which only
splitting the positions meets, and without a budget; against Megatron TP and Megatron TP
with the positions split over "data" by hand (context parallel), all compiled.

Every model is an AdamW train step (`benchmarks.workloads`) with abstract arguments, on
the 2x4 (data, model) mesh, with only the batch hinted (``batch/.*: P('data')``). Rows:

- *search, budget = Megatron*: `jaxshard.search.search_hints` with ``memory_budget`` set
  to the Megatron layout's estimated per-device memory (`Plan.estimated_memory` of its plan,
  the search's own measure): the least communication within what Megatron needs;
- *search, no budget*: the least communication, whatever the memory;
- *search, budget = 0.85 x Megatron*: a layout that fits, or the error naming the
  smallest footprint;
- where the model is compiled, *search, budget = 0.85 x Megatron compiled*: the budget in
  compiled bytes (0.85x Megatron's compiled memory), as a user sets one, searched with the
  estimate alone and with ``calibrate_memory=True`` (the search compiles its plans and
  rescales the budget until one fits in the compiled program; its *search s* includes
  those compiles);
- *Megatron TP + DP* and *Megatron + FSDP* (`benchmarks.layouts`): exact-path hints for
  every parameter (the optimizer state follows by propagation) plus the batch hint,
  planned by `jaxshard.make_plan`.

Columns: *search s* is `search_hints` (trace, coarsening, integer program, propagation of
the chosen hints); *auto_shard s* is all of ``auto_shard(mesh, hints, search=True,
memory_budget=...)(step).plan(...)``: the search plus building the lowered program (XLA's
compile not included). *predicted* is the plan's collective bytes per
device per step (ring volumes; `jaxshard.cost.step_bytes`: a scan body's reshards once
per iteration). From the compiled program (``auto_shard(mesh,
hints).lower(...).compile()``): *compiled ring* (`benchmarks.hlo.collective_stats`: ring
volumes per device, loop bodies times their trip counts — the same measure as
*predicted*), *compiled operands* (the sum of `jaxshard.verify.compiled_collectives`
bytes: each collective's per-device operand size, once per instruction), and *memory*
(``compiled.memory_analysis()``: arguments + outputs + temporaries − aliased).
*estimated memory* is jaxshard's own estimate (the budget's unit).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass

if __package__ in (None, ""):  # `python benchmarks/search.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"
import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import benchmarks  # noqa: E402, F401  (sets the simulated device count before JAX loads)
import jaxshard  # noqa: E402
from jaxshard.cost import CostModel, step_bytes  # noqa: E402
from jaxshard.verify import compiled_collectives  # noqa: E402

from . import layouts  # noqa: E402
from .hlo import collective_stats  # noqa: E402
from .layouts import BATCH, reference_hints  # noqa: E402, F401
from .quality import expert_layout  # noqa: E402
from .workloads import Workload, count_equations, meshes, models, workload  # noqa: E402

MiB = 2**20


@dataclass
class Row:
    layout: str
    search_s: float | None = None
    plan_s: float | None = None
    predicted: float | None = None
    estimated_memory: float | None = None
    ring: float | None = None
    operands: float | None = None
    memory: float | None = None
    optimal: bool | None = None
    flops: float | None = None  # per device, from compiled.cost_analysis()
    note: str = ""

    def step_time(self, flops_per_s: float, bandwidth: float) -> float | None:
        """Modeled seconds per step: per-device flops at ``flops_per_s`` plus the ring
        bytes at ``bandwidth`` (both read from the compiled program)."""
        if self.flops is None or self.ring is None:
            return None
        return self.flops / flops_per_s + self.ring / bandwidth


def workloads(quick: bool) -> list[tuple[Workload, bool]]:
    """``(workload, compile it)`` pairs."""
    if quick:
        return [
            (workload("GPT 2L (tiny)", "gpt", models.GPTConfig(), 8), True),
            (workload("Llama-scan (tiny)", "llama", models.LlamaConfig(), 8), True),
            (workload("MoE (tiny)", "moe", models.MoEConfig(n_experts=8), 8), True),
        ]
    gpt = dict(d_model=768, n_heads=12, d_ff=3072, seq=128, vocab=8192)
    text = dict(vocab=1024, seq=64)
    llama = models.LlamaConfig(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=768, **text)
    moe = models.MoEConfig(d_model=256, n_experts=8, top_k=2, d_ff=512, **text)
    return [
        (workload("GPT 12L", "gpt", models.GPTConfig(n_layers=12, **gpt), 16), True),
        (workload("GPT 48L", "gpt", models.GPTConfig(n_layers=48, **gpt), 16), False),
        (workload("Llama-scan 4L", "llama", llama, 16), True),
        (workload("MoE", "moe", moe, 16), True),
    ]


def measure_compiled(row: Row, w: Workload, step: jaxshard.AutoShard) -> None:
    """Fill ``row``'s compiled columns from ``step`` compiled on ``w``'s arguments."""
    measure(row, step.lower(*w.args).compile(), step.mesh)


def measure(row: Row, compiled, mesh) -> None:
    """Fill ``row``'s compiled columns (ring and operand bytes, memory, flops) from a
    program compiled on ``mesh``."""
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    row.flops = cost.get("flops") if cost else None
    row.ring = collective_stats(text, mesh.size).ring_bytes
    row.operands = sum(c.bytes for c in compiled_collectives(text, mesh))
    mem = compiled.memory_analysis()
    if mem is not None:
        row.memory = (
            mem.argument_size_in_bytes + mem.output_size_in_bytes
            + mem.temp_size_in_bytes - mem.alias_size_in_bytes
        )  # fmt: skip


def reference_row(label, w, mesh, layout, compile_it) -> tuple[Row, float]:
    hints = reference_hints(w, layout, mesh)
    t0 = time.perf_counter()
    plan = jaxshard.make_plan(w.step, w.args, {}, mesh, hints)
    row = Row(label, plan_s=time.perf_counter() - t0, predicted=step_bytes(plan))
    row.estimated_memory = plan.estimated_memory.total
    if compile_it:
        measure_compiled(row, w, jaxshard.auto_shard(mesh, hints)(w.step))
    return row, row.estimated_memory


def search_row(
    label, w, mesh, budget, compile_it, log, hints=BATCH, cost_model=None, calibrate=False
) -> Row:
    row = Row(label)
    step = jaxshard.auto_shard(
        mesh, hints, search=True, memory_budget=budget, cost_model=cost_model,
        calibrate_memory=calibrate,
    )(w.step)  # fmt: skip
    t0 = time.perf_counter()
    try:
        step.plan(*w.args)
    except jaxshard.ShardingError as e:
        row.note = str(e).split(", with ")[0]
        log(f"    {label}: {row.note}")
        return row
    row.plan_s = time.perf_counter() - t0
    result = step.search_result
    row.search_s, row.optimal = result.seconds, result.optimal
    row.predicted, row.estimated_memory = result.predicted_bytes, result.memory_bytes
    row.note = _summary(result.hints)
    if hints == {}:  # the search chose the batch's layout too
        tok = next((s for k, s in result.hints.items() if str(k).endswith("batch/tok")), None)
        row.note = f"batch/tok {tok}; {row.note}"
    log(f"    {label}: {result.explanation.splitlines()[0]}")
    if compile_it:
        measure_compiled(row, w, step)
    return row


def _summary(hints: dict[str, P]) -> str:
    """The distinct parameter specs, by group (layers folded), and the optimizer state
    stored sharded further than its parameter."""
    names = {key.replace("\\", ""): spec for key, spec in hints.items()}
    seen: dict[str, str] = {}
    further: set[str] = set()
    for name, spec in names.items():
        group = re.sub(r"/\d+/", "/*/", name)
        if name.startswith("params/") and spec != P(*([None] * len(spec))):
            seen.setdefault(group[len("params/") :], str(spec)[1:])
        elif name.startswith("opt_state/"):
            param = next((p for p in names if p.startswith("params/")
                          and name.endswith(p[len("params"):])), None)  # fmt: skip
            if param is not None and spec != names[param]:
                further.add(re.sub(r"/\d+/", "/*/", param)[len("params/") :])
    text = "; ".join(f"{k} {v}" for k, v in seen.items()) or "all replicated"
    if further:
        text += f"; optimizer state sharded further (ZeRO) for: {', '.join(sorted(further))}"
    return text


# --- the memory-bound targets -----------------------------------------------------------

TARGET_GPT = dict(n_layers=12, d_model=768, n_heads=12, d_ff=3072, seq=256, vocab=8192)
TARGET_FLOPS, TARGET_BANDWIDTH = 1e14, 1e11  # per device: FLOP/s, bytes/s


def hand_row(label: str, w: Workload, mesh, layout: layouts.Layout, batch: P) -> Row:
    """A hand layout compiled by `jax.jit` with full in/out shardings."""
    row = Row(label)
    measure(row, expert_layout(w, mesh, layout, batch).compiled, mesh)
    return row


def targets(log=print, quick: bool = False) -> str:
    """The memory-bound targets table (see the module docstring); ``quick``: the tiny
    GPT, for a smoke run."""
    mesh = meshes()["2x4 (data, model)"]
    cfg = models.GPTConfig() if quick else models.GPTConfig(**TARGET_GPT)
    w = workload("GPT 12L, seq 256" if not quick else "GPT (tiny)", "gpt", cfg, 16)
    log(f"[search targets] {w.describe()}")
    megatron = hand_row("Megatron TP + DP (jax.jit)", w, mesh, layouts.megatron("gpt"), P("data"))
    zero3 = hand_row(
        "ZeRO-3 over all devices (jax.jit)", w, mesh, layouts.zero3("gpt"), P(("data", "model"))
    )  # fmt: skip
    cost_model = CostModel(default_bandwidth=TARGET_BANDWIDTH, flops=TARGET_FLOPS)
    a = search_row("(a) search: batch hint, budget = Megatron", w, mesh, megatron.memory,
                   True, log)  # fmt: skip
    a_checked = search_row("(a) the same, calibrate_memory", w, mesh, megatron.memory, True,
                           log, calibrate=True)  # fmt: skip
    b = search_row(
        "(b) search: no hints, flops cost model, budget = 0.85 x Megatron", w, mesh,
        0.85 * megatron.memory, True, log, hints={}, cost_model=cost_model,
    )  # fmt: skip
    t_zero3 = zero3.step_time(TARGET_FLOPS, TARGET_BANDWIDTH)
    verdicts = {
        id(a): _verdict_a(a, megatron),
        id(a_checked): _verdict_a(a_checked, megatron),
        id(b): _verdict_b(b, megatron, t_zero3),
    }
    head = (
        f"\n### Targets: {w.describe()}, 2x4 (data, model)\n\n"
        "Modeled step = per-device flops / 1e14 + compiled ring bytes / 1e11 (both from the "
        "compiled program).\n\n"
        "| layout | search s | compiled ring MiB | memory MiB (compiled) | GFLOP per device | "
        "modeled step ms | vs Megatron: bytes, memory | target | notes |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in (a, a_checked, b, megatron, zero3):
        t = r.step_time(TARGET_FLOPS, TARGET_BANDWIDTH)
        versus = "—"
        if r.ring is not None and r.memory:
            versus = f"{_ratio(r.ring, megatron.ring)}, {r.memory / megatron.memory:.2f}x"
        secs = _search_seconds(r)
        gflop = "—" if r.flops is None else f"{r.flops / 1e9:.1f}"
        lines.append(
            f"| {r.layout} | {secs} | {_mib(r.ring)} | {_mib(r.memory)} | {gflop} | "
            f"{'—' if t is None else f'{t * 1e3:.2f}'} | {versus} | {verdicts.get(id(r), '')} | "
            f"{r.note} |"
        )
    text = head + "\n".join(lines) + "\n"
    log(text)
    return text


LONG_GPT = dict(n_layers=4, d_model=768, n_heads=12, d_ff=3072, seq=2048, vocab=8192)


def sequence(log=print, quick: bool = False) -> str:
    """One long sequence per step (batch 1: the batch dim cannot be split), no hints: the
    search within a budget that only splitting the positions meets, against Megatron
    tensor parallelism (its data axis idle) and the same with the positions split over
    "data" by hand (context parallel), all compiled."""
    mesh = meshes()["2x4 (data, model)"]
    cfg = models.GPTConfig(seq=256) if quick else models.GPTConfig(**LONG_GPT)
    w = workload("GPT, one long sequence" if not quick else "GPT (tiny), one sequence",
                 "gpt", cfg, 1)  # fmt: skip
    log(f"[search sequence] {w.describe()}")
    megatron = hand_row("Megatron TP (jax.jit)", w, mesh, layouts.megatron("gpt"), P())
    context = hand_row(
        "Megatron TP + positions on data (jax.jit)", w, mesh, layouts.megatron("gpt"),
        P(None, "data"),
    )  # fmt: skip
    budget = SEQUENCE_BUDGET * megatron.memory
    rows = [
        search_row(
            f"search: no hints, budget = {SEQUENCE_BUDGET} x Megatron TP",
            w,
            mesh,
            budget,
            True,
            log,
            hints={},
        ),  # fmt: skip
        search_row("search: no hints, no budget", w, mesh, None, True, log, hints={}),
        megatron,
        context,
    ]
    head = (
        f"\n### One long sequence: {w.describe()}, 2x4 (data, model)\n\n"
        "| layout | search s | predicted MiB | compiled ring MiB | memory MiB (compiled) | "
        "estimated memory MiB | vs Megatron TP: bytes, memory | tokens | notes |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        versus = "—"
        if r.ring is not None and r.memory:
            versus = f"{_ratio(r.ring, megatron.ring)}, {r.memory / megatron.memory:.2f}x"
        tokens = r.note.split("; ", 1)[0] if r.search_s is not None else "—"
        note = r.note.split("; ", 1)[-1] if r.search_s is not None else r.note
        lines.append(
            f"| {r.layout} | {_search_seconds(r)} | {_mib(r.predicted)} | {_mib(r.ring)} | "
            f"{_mib(r.memory)} | {_mib(r.estimated_memory)} | {versus} | {tokens} | {note} |"
        )
    text = head + "\n".join(lines) + "\n"
    log(text)
    return text


SEQUENCE_BUDGET = 0.6  # of Megatron TP's compiled memory: more than tensor parallelism gives


def _search_seconds(r: Row) -> str:
    """A row's search seconds, marked when the time limit stopped the solver."""
    secs = "—" if r.search_s is None else f"{r.search_s:.1f}"
    return secs + ("" if r.optimal in (None, True) else " (time limit)")


def _ratio(x: float, reference: float) -> str:
    """``x / reference`` to two decimals, or to as many as show it is not 1.00x."""
    digits = 2
    while digits < 6 and x != reference and f"{x / reference:.{digits}f}" == f"{1:.{digits}f}":
        digits += 1
    return f"{x / reference:.{digits}f}x"


def _verdict_a(r: Row, megatron: Row) -> str:
    if r.ring is None or r.memory is None:
        return "**missed** (no plan)"
    ok = [r.ring <= megatron.ring, r.memory <= 1.05 * megatron.memory, r.search_s < 10]
    what = "bytes <= 1.0x, memory <= 1.05x, < 10 s"
    return ("met" if all(ok) else "**missed**") + f": {what}: " + ", ".join(map(_yes, ok))


def _verdict_b(r: Row, megatron: Row, t_zero3: float | None) -> str:
    t = r.step_time(TARGET_FLOPS, TARGET_BANDWIDTH)
    if t is None or r.memory is None or t_zero3 is None:
        return "**missed** (no plan)"
    ok = [r.memory <= 0.9 * megatron.memory, t <= t_zero3, r.search_s < 20]
    what = "memory <= 0.9x Megatron, step <= ZeRO-3's, < 20 s"
    return ("met" if all(ok) else "**missed**") + f": {what}: " + ", ".join(map(_yes, ok))


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def run(quick: bool = False, compile_large: bool = False, log=print) -> str:
    mesh = meshes()["2x4 (data, model)"]
    tables = [targets(log, quick), sequence(log, quick)]
    for w, compile_it in workloads(quick):
        compile_it = compile_it or compile_large
        log(f"[search] {w.describe()}")
        equations = count_equations(jax.make_jaxpr(w.step)(*w.args))
        mega = layouts.megatron(w.model)
        megatron, budget = reference_row("Megatron TP + DP", w, mesh, mega, compile_it)
        fsdp, _ = reference_row("Megatron + FSDP", w, mesh, layouts.fsdp(mega, w.model), compile_it)
        rows = [
            search_row("search, budget = Megatron", w, mesh, budget, compile_it, log),
            search_row("search, no budget", w, mesh, None, compile_it, log),
            search_row(
                "search, budget = 0.85 x Megatron", w, mesh, 0.85 * budget, compile_it, log
            ),  # fmt: skip
            megatron,
            fsdp,
        ]
        if compile_it:  # a budget in compiled bytes, as a user sets one
            compiled = 0.85 * megatron.memory
            rows[3:3] = [
                search_row("search, budget = 0.85 x Megatron compiled", w, mesh, compiled,
                           True, log),
                search_row("search, budget = 0.85 x Megatron compiled, calibrate_memory", w,
                           mesh, compiled, True, log, calibrate=True),
            ]  # fmt: skip
        layers = getattr(w.cfg, "n_layers", 1)
        tables.append(table(w, layers, equations, rows, megatron))
        log(tables[-1])
    return "\n".join(tables)


def _mib(x) -> str:
    return "—" if x is None else f"{x / MiB:.1f}"


def table(w: Workload, layers: int, equations: int, rows: list[Row], megatron: Row) -> str:
    head = (
        f"\n### {w.name}: {layers} layers, {equations} equations\n\n{w.describe()}\n\n"
        "| layout | search s | auto_shard s | predicted MiB | compiled ring MiB | predicted / "
        "compiled | compiled operands MiB | memory MiB (compiled) | estimated memory MiB | "
        "vs Megatron: bytes, memory | notes |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        ratio = f"{r.predicted / r.ring:.2f}" if r.ring and r.predicted is not None else "—"
        versus = "—"
        if r.ring and megatron.ring and r.memory and megatron.memory:
            versus = f"{_ratio(r.ring, megatron.ring)}, {r.memory / megatron.memory:.2f}x"
        elif r.predicted is not None and megatron.predicted:
            versus = (
                f"{r.predicted / megatron.predicted:.2f}x predicted, "
                f"{r.estimated_memory / megatron.estimated_memory:.2f}x estimated"
            )
        secs = _search_seconds(r)
        plan_s = "—" if r.plan_s is None else f"{r.plan_s:.1f}"
        lines.append(
            f"| {r.layout} | {secs} | {plan_s} | {_mib(r.predicted)} | {_mib(r.ring)} | "
            f"{ratio} | {_mib(r.operands)} | {_mib(r.memory)} | {_mib(r.estimated_memory)} | "
            f"{versus} | {r.note} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the examples' tiny models")
    parser.add_argument("--compile-large", action="store_true", help="compile the 48-layer GPT")
    parser.add_argument("--targets", action="store_true", help="only the targets table")
    parser.add_argument("--out", help="also write the tables to this markdown file")
    parser.add_argument("--sequence", action="store_true", help="only the long-sequence table")
    args = parser.parse_args()
    if args.targets:
        text = targets(quick=args.quick)
    elif args.sequence:
        text = sequence(quick=args.quick)
    else:
        text = run(args.quick, args.compile_large)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Search against hand-written layouts\n" + text)


if __name__ == "__main__":
    main()
