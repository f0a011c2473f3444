"""Never lose to Shardy alone: every hint set of every model, compiled three ways.

For each quality workload (``workloads.quality_workloads``: GPT, Llama-scan, MoE, conv
net at moderate sizes, AdamW) on the 2x4 (data, model) mesh and each hint set of
``examples/models.HINT_SETS`` (tensor parallel, FSDP, FSDP + tensor parallel or expert
parallel, batch only; for GPT and Llama also the positions split: context parallel),
three programs are compiled and read:

- jaxshard: ``auto_shard(mesh, hints)``; with its predicted collective bytes;
- Shardy alone, results keep their layout: `jax.jit` with the hints as ``in_shardings``,
  every other argument replicated, new parameters and optimizer state returned in the
  layout they came in (`jaxshard.baseline.shardy_alone`, what a training loop runs);
- Shardy alone, results free: the same with results left to XLA (it may return the state
  in another layout than it took, which the next step's call pays for).

and, for the picture, the hand-written layouts (Megatron, Megatron + FSDP, expert
parallel) and the search from the batch hint alone within the Megatron layout's memory.
Bytes are collective ring bytes per device per step, memory is ``memory_analysis()``
(arguments + results + temporaries − aliased) per device, both from the compiled
program (`jaxshard.baseline.compiled_cost`).

    python -m benchmarks.never_lose [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import jaxshard
from jaxshard.baseline import CompiledCost, compiled_cost, shardy_alone

from . import layouts, quality
from .environment import environment, load_now, require
from .layouts import BATCH, reference_hints
from .workloads import Workload, meshes, models, quality_workloads

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Point:
    """One compiled layout of one model: what it is and what it costs."""

    model: str
    label: str
    kind: str  # "jaxshard" | "keep" | "free" | "hand" | "search"
    cost: CompiledCost
    predicted: float | None = None
    seconds: float = 0.0


def _jaxshard(w: Workload, mesh, hints) -> tuple[CompiledCost, float, float]:
    t0 = time.perf_counter()
    step = jaxshard.auto_shard(mesh, hints)(w.step)
    predicted = step.plan(*w.args).predicted_bytes
    seconds = time.perf_counter() - t0
    return compiled_cost(step.lower(*w.args).compile(), mesh), predicted, seconds


def _hand(w: Workload, mesh, layout: layouts.Layout) -> CompiledCost:
    """A hand-written layout as `benchmarks.quality` compiles it."""
    return compiled_cost(quality.expert_layout(w, mesh, layout).compiled, mesh)


def run(quick: bool = False, log=print) -> list[Point]:
    """Every point of every model (see the module doc)."""
    mesh = meshes()["2x4 (data, model)"]
    points: list[Point] = []
    for w in quality_workloads(quick):
        log(f"[never lose] {w.describe()}")
        for name, hints in models.HINT_SETS[w.model].items():
            ours, predicted, seconds = _jaxshard(w, mesh, hints)
            points.append(Point(w.name, name, "jaxshard", ours, predicted, seconds))
            for results in ("keep", "free"):
                cost = compiled_cost(shardy_alone(w.step, w.args, mesh, hints, results).compile(),
                                     mesh)  # fmt: skip
                points.append(Point(w.name, name, results, cost))
            log(f"  {name:<8} jaxshard {_pair(ours)}  Shardy alone {_pair(points[-2].cost)}")
        hand = [("Megatron", layouts.megatron(w.model)),
                ("Megatron + FSDP", layouts.fsdp(layouts.megatron(w.model), w.model))]  # fmt: skip
        if w.model == "moe":
            hand.append(("expert parallel", layouts.expert_parallel))
        for label, layout in hand:
            points.append(Point(w.name, label, "hand", _hand(w, mesh, layout)))
        megatron = reference_hints(w, layouts.megatron(w.model), mesh)
        budget = jaxshard.make_plan(w.step, w.args, {}, mesh, megatron).estimated_memory.total
        t0 = time.perf_counter()
        step = jaxshard.auto_shard(mesh, BATCH, search=True, memory_budget=budget)(w.step)
        step.plan(*w.args)
        cost = compiled_cost(step.lower(*w.args).compile(), mesh)
        points.append(Point(w.name, "search, Megatron's memory", "search", cost,
                            seconds=time.perf_counter() - t0))  # fmt: skip
    return points


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def _pair(c: CompiledCost) -> str:
    return f"{_mib(c.bytes)} · {_mib(c.memory)}"


def _ratio(a: CompiledCost, b: CompiledCost) -> str:
    return f"{a.bytes / max(b.bytes, 1):.2f}x · {a.memory / b.memory:.2f}x"


def table(points: list[Point]) -> str:
    """One row per model and hint set: jaxshard, both Shardy-alone programs, the ratios
    (bytes · memory), and predicted / compiled bytes."""
    head = (
        "| model | hints | jaxshard: bytes · memory | predicted / compiled bytes | "
        "Shardy alone, results keep layout | vs it | Shardy alone, results free | vs it | "
        "never loses |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for p in (p for p in points if p.kind == "jaxshard"):
        keep, free = (
            next(q for q in points if (q.model, q.label, q.kind) == (p.model, p.label, k))
            for k in ("keep", "free")
        )  # fmt: skip
        holds = p.cost.bytes <= 1.05 * keep.cost.bytes and p.cost.memory <= keep.cost.memory
        lines.append(
            f"| {p.model} | {p.label} | {_pair(p.cost)} | "
            f"{p.predicted / max(p.cost.bytes, 1):.2f} | {_pair(keep.cost)} | "
            f"{_ratio(p.cost, keep.cost)} | {_pair(free.cost)} | {_ratio(p.cost, free.cost)} | "
            f"{'yes' if holds else '**no**'} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(points: list[Point], folder: str) -> list[str]:
    """One picture per model: collective bytes against memory per device for every
    layout (the Pareto front a user chooses from). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"jaxshard": ("o", "tab:blue", "jaxshard (hints)"),
             "keep": ("s", "tab:orange", "Shardy alone, results keep layout"),
             "free": ("x", "tab:red", "Shardy alone, results free"),
             "hand": ("D", "tab:green", "hand-written"),
             "search": ("*", "tab:purple", "jaxshard search (batch hint)")}  # fmt: skip
    files = []
    for model in dict.fromkeys(p.model for p in points):
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for kind, (marker, color, label) in style.items():
            mine = [p for p in points if p.model == model and p.kind == kind]
            if not mine:
                continue
            xs = [p.cost.memory / 2**20 for p in mine]
            ys = [p.cost.bytes / 2**20 for p in mine]
            ax.scatter(xs, ys, marker=marker, color=color, label=label, s=60)
            for p, x, y in zip(mine, xs, ys):
                ax.annotate(p.label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("memory per device (MiB)")
        ax.set_ylabel("collective bytes per device per step (MiB)")
        ax.set_title(f"{model} on 2x4 (data, model): lower left is better")
        ax.legend(fontsize=7)
        name = picture_name(model)
        fig.tight_layout()
        fig.savefig(os.path.join(folder, name), dpi=100)
        plt.close(fig)
        files.append(name)
    return files


def picture_name(model: str) -> str:
    """The file `plot` writes for ``model``."""
    return f"pareto_{model.lower().replace('-', '_')}.png"


NOTES = __doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]


def report(points: list[Point], folder: str, header: str) -> str:
    """The markdown of the never-lose section; writes the pictures into ``folder``."""
    pictures = plot(points, folder)
    shown = "\n".join(f"![{p}]({p})" for p in pictures)
    return f"# Never lose to Shardy alone\n\n{header}\n\n{NOTES}\n\n{table(points)}\n{shown}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the examples' tiny models")
    args = parser.parse_args()
    require("matplotlib", "the never-lose pictures")
    folder = os.path.join(HERE, "results", "quick" if args.quick else "")
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    points = run(args.quick)
    text = report(points, folder, f"{environment()} {load_now()}")
    with open(os.path.join(folder, "never_lose.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    print(f"took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
