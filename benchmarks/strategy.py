"""Whole-strategy planning: `jaxshard.auto_parallel` against the hand strategies a person
would try, compiled for 64 and 1024 simulated devices.

    python -m benchmarks.strategy                 # 8B and Mixtral on 64, 70B on 1024
    python -m benchmarks.strategy --fast          # 2 layers of each shape

The steps are `benchmarks.scale`'s (Llama 8B shape with batch 64 and the Mixtral-8x7B
shape on 64 devices, Llama 70B shape with batch 256 on 1024; float32, AdamW, abstract
arguments). `auto_parallel` is given the devices, 80 GiB per device, the batch hint
``P('data')`` and a topology: 8 H100 nodes for 64 devices, one TPU v5p slice of 1024
chips. The hand strategies are `benchmarks.scale`'s layouts (Megatron TP + DP, FSDP +
TP, FSDP + TP + sequence, FSDP over everything; for Mixtral also EP + FSDP) on the
meshes a person would try: 8x8, 16x4 and 64 for 64 devices; 32x32, 64x16 and 128x8 for
1024. Every strategy is compiled; its step time is read from the compiled program under
the same cost model (matrix-multiply FLOPs over peak, plus each collective's bytes over
the bandwidth of the links its axes span: `jaxshard.baseline.compiled_step_time`), its
memory from `memory_analysis()`. "fits": compiled memory within 80 GiB (within its
own limit for an ``auto_parallel`` row run with a tighter one: 8B on 64 devices also
with 24 GiB, compared with the hand strategies that compile within it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.environment import write_result
from benchmarks.scale import LAYOUTS, MOE_LAYOUTS, SHAPES, gib, hints_for, per_device_count

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MEMORY = 80 * 2**30
# (shape, devices) -> tighter memory limits auto_parallel is given too: what it chooses
# when the strategies that win at 80 GiB do not fit
TIGHT = {("8B", 64): (24 * 2**30,)}
# per device count: the shapes, the hand meshes, and the topology's expression
CASES = {
    64: (("8B", "Mixtral"), ((8, 8), (16, 4), (64,)), "Topology.h100(nodes=8)"),
    1024: (("70B",), ((32, 32), (64, 16), (128, 8)), 'Topology.tpu("v5p", chips=1024)'),
}


def measure(devices: int, fast: bool, only: str = "") -> list[dict]:
    """Every row for one device count (this process has that many devices)."""
    import jax
    from jax.sharding import PartitionSpec as P

    sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
    import models

    import jaxshard
    from benchmarks.workloads import workload
    from jaxshard import Topology  # noqa: F401 - the topologies are written with it
    from jaxshard.baseline import compiled_memory, compiled_step_time

    shapes, meshes, topology_text = CASES[devices]
    topology = eval(topology_text)  # noqa: S307 - our own constant
    rows = []
    for shape in shapes:
        if only and shape not in only.split(","):
            continue
        spec = dict(SHAPES[shape])
        batch = spec.pop("batch")
        if fast:
            spec["n_layers"] = 2
        spec.setdefault("vocab", 128256)
        cfg = models.LlamaConfig(seq=4096, **spec)
        w = workload(shape, "llama", cfg, batch)
        experts = cfg.n_experts > 0
        base = {"model": shape, "layers": cfg.n_layers, "devices": devices,
                "topology": topology.describe()}  # fmt: skip

        def compiled(row, step, mesh, model, w=w):
            try:
                c = step.lower(*w.args).compile()
                t = compiled_step_time(c, mesh, model)
                row.update(time=t.total, compute=t.compute, memory=compiled_memory(c))
            except Exception as e:  # noqa: BLE001 - a row that fails says so in the table
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)

        for limit in (MEMORY, *TIGHT.get((shape, devices), ())):
            start = time.perf_counter()
            strategy = jaxshard.auto_parallel(
                w.step, *w.args, devices=jax.devices(), memory_per_device=limit,
                topology=topology, hints={r"batch/.*": P("data")},
            )  # fmt: skip
            best = strategy.best
            name = "auto_parallel" + ("" if limit == MEMORY else f", {gib(limit)}")
            row = {**base, "strategy": name, "mesh": _mesh_text(best.shape, best.axes),
                   "plan_s": time.perf_counter() - start, "estimated": best.time.total,
                   "estimated_memory": best.memory.total, "limit": limit,
                   "microbatches": best.microbatches,
                   "searched": sum(c.seconds > 0 for c in strategy.candidates)}  # fmt: skip
            compiled(row, strategy.auto_shard(w.step), strategy.mesh, strategy.cost_model)
        for shape_ in meshes:
            axes = ("data",) if len(shape_) == 1 else ("data", "tensor")
            mesh = jax.make_mesh(shape_, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
            model = topology.cost_model(axes, shape_)
            for layout in MOE_LAYOUTS if experts else LAYOUTS:
                if (len(axes) == 1) != (layout == "fsdp-all"):
                    continue  # one axis: only FSDP over everything; two: the tensor layouts
                row = {**base, "strategy": layout, "mesh": _mesh_text(shape_, axes)}
                if layout == "fsdp-all" and batch % devices:
                    row["error"] = f"n/a: a batch of {batch} does not split over {devices} devices"
                    rows.append(row)
                    continue
                hints = hints_for(layout, axes, experts)
                compiled(
                    row, jaxshard.auto_shard(mesh, hints, cost_model=model)(w.step), mesh, model
                )
    return rows


def _mesh_text(shape, axes) -> str:
    return "x".join(map(str, shape)) + " (" + ",".join(axes) + ")"


def table(rows: list[dict]) -> str:
    lines = [
        "| model | devices | strategy | mesh | plan s | estimated / compiled step s | "
        "estimated / compiled memory | fits | vs best hand that fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["devices"]), []).append(r)
    for (model, devices), group in groups.items():
        hand = [r for r in group if not r["strategy"].startswith("auto_parallel") and "time" in r]
        for r in group:
            mesh = r["mesh"] + (f", {r['microbatches']} microbatches" if r.get("microbatches")
                                else "")  # fmt: skip
            head = f"| {model} ({r['layers']}L) | {devices} | {r['strategy']} | {mesh} |"
            if "error" in r:
                lines.append(f"{head} — | {r['error']} | | | |")
                continue
            ours = r["strategy"].startswith("auto_parallel")
            limit = r.get("limit", MEMORY)
            fitting = [h for h in hand if h["memory"] <= limit]
            best = min(fitting, key=lambda h: h["time"]) if fitting else None
            plan = f"{r['plan_s']:.1f} ({r['searched']} meshes)" if ours else "—"
            step = f"{r['estimated']:.3f} / {r['time']:.3f}" if ours else f"— / {r['time']:.3f}"
            memory = (f"{gib(r['estimated_memory'])} / {gib(r['memory'])}" if ours
                      else f"— / {gib(r['memory'])}")  # fmt: skip
            fits = "yes" if r["memory"] <= limit else "no"
            versus = f"**{r['time'] / best['time']:.3f}**" if best and ours else ""
            if ours and best is None:
                versus = f"no hand strategy fits {gib(limit)}"
            if best is r:
                versus = "best hand"
            lines.append(f"{head} {plan} | {step} | {memory} | {fits} | {versus} |")
    return "\n".join(lines)


def run(counts: list[int], fast: bool, only: str) -> list[dict]:
    """Each device count in a subprocess with that many simulated CPU devices."""

    argv = (["--fast"] if fast else []) + (["--models", only] if only else [])
    return per_device_count("benchmarks.strategy", counts, argv)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="64,1024", help="device counts: 64, 1024 or both")
    parser.add_argument("--fast", action="store_true", help="2 layers of each shape")
    parser.add_argument("--models", default="", help="shapes to run, e.g. 8B,70B (all)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one count, in-process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.fast, args.models)))
        return
    start = time.perf_counter()
    rows = run([int(n) for n in args.devices.split(",")], args.fast, args.models)
    import jax

    topologies = sorted({f"{r['devices']} devices: {r['topology']}" for r in rows})
    text = (
        "# Whole-strategy planning against hand strategies\n\n"
        + __doc__.split("\n\n", 2)[2].strip()
        + "\n\nTopologies: " + "; ".join(topologies) + ".\n\n"
        + f"`python -m benchmarks.strategy --devices {args.devices}"
        + (" --fast" if args.fast else "")
        + (f" --models {args.models}" if args.models else "")
        + f"` ({time.perf_counter() - start:.0f} s, JAX {jax.__version__}, 2 CPU cores).\n\n"
        + table(rows)
        + "\n"
    )  # fmt: skip
    write_result("strategy", text, quick=args.fast)


if __name__ == "__main__":
    main()
