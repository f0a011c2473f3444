"""The numbers a plan states against its compiled program, for every example model and
hint set at medium widths: estimated vs compiled memory per device, predicted vs compiled
collective bytes per device per step.

    python -m benchmarks.estimates          # on the installed JAX (about 3 minutes)

The models of ``examples/models.py`` (MLP, GPT, Llama with scanned layers, a GShard
mixture of experts, a small ResNet, a ViT) at widths where activations, not fixed costs,
fill memory (d_model 256, sequence 128, batch 32, vocabulary 4096), with an AdamW train
step and abstract arguments, planned by `jaxshard.auto_shard` with each of the model's
hint sets (`models.HINT_SETS`: tensor parallel, FSDP, FSDP + tensor or expert
parallel, batch only, sequence) on the 2x4 (data, model) mesh of 8 simulated CPU
devices. A row outside 10% is marked. ``--write`` also writes
``benchmarks/results/estimates.md`` for the installed JAX.
"""

from __future__ import annotations

import argparse
import os
import re
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(ROOT, "benchmarks", "results", "estimates.md")


def configs(models) -> dict:
    """The medium widths of each example model."""
    return {
        "mlp": models.MLPConfig(d_in=256, d_hidden=2048, d_out=256, n_layers=3),
        "gpt": models.GPTConfig(vocab=4096, d_model=256, n_heads=4, n_layers=2, seq=128, d_ff=1024),
        "llama": models.LlamaConfig(
            vocab=4096, d_model=256, n_heads=4, n_kv_heads=2, n_layers=2, seq=128, d_ff=1024
        ),
        "moe": models.MoEConfig(vocab=4096, d_model=256, d_ff=1024, seq=128),
        "conv": models.ConvConfig(image=32, widths=(32, 64)),
        "vit": models.ViTConfig(image=32, patch=4, d_model=256, n_layers=2),
    }  # fmt: skip


def rows(only: list[str] | None = None) -> list[dict]:
    """One row per (model, hint set): the plan's figures and the compiled program's."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxshard
    from benchmarks.workloads import meshes, models, workload
    from jaxshard.baseline import compiled_cost

    mesh = meshes()["2x4 (data, model)"]
    out = []
    for name, cfg in configs(models).items():
        if only and name not in only:
            continue
        w = workload(name, name, cfg, 32)
        step, args = w.step, w.args
        sets = models.HINT_SETS.get(name, {"batch": {r"batch/.*": P("data")}})
        for hint_set, hints in sets.items():
            start = time.perf_counter()
            sharded = jaxshard.auto_shard(mesh, hints)(step)
            plan = sharded.plan(*args)
            compiled = compiled_cost(sharded.lower(*args).compile(), mesh)
            out.append({
                "jax": jax.__version__, "model": name, "hints": hint_set,
                "estimated": plan.estimated_memory.total, "memory": compiled.memory,
                "predicted": plan.predicted_bytes, "bytes": compiled.bytes,
                "seconds": time.perf_counter() - start,
            })  # fmt: skip
            print(_line(out[-1]), flush=True)
    return out


def _ratio(a: float, b: float) -> str:
    if b == 0:
        return "1.00" if a == 0 else "-"
    mark = "" if abs(a / b - 1) <= 0.10 else " ◀"
    return f"**{a / b:.2f}**{mark}"


def _line(r: dict) -> str:
    mib = 2**20
    return (
        f"| {r['jax']} | {r['model']} | {r['hints']} | "
        f"{r['estimated'] / mib:.1f} / {r['memory'] / mib:.1f} MiB ({_ratio(r['estimated'], r['memory'])}) | "
        f"{r['predicted'] / mib:.2f} / {r['bytes'] / mib:.2f} MiB ({_ratio(r['predicted'], r['bytes'])}) |"
    )  # fmt: skip


HEADER = (
    "| JAX | model | hints | memory/device: estimated / compiled | "
    "collective bytes/device: predicted / compiled |\n|---|---|---|---|---|"
)


def table(found: list[dict]) -> str:
    return "\n".join([HEADER, *map(_line, found)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="only these models (default: all)")
    parser.add_argument("--write", action="store_true", help=f"write {RESULT}")
    options = parser.parse_args()
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    print(HEADER, flush=True)
    found = rows(options.models)
    if options.write:
        write(found)


def write(found: list[dict]) -> None:
    """Write the table to `RESULT`, keeping the rows another JAX release measured there."""
    import jax

    kept = []
    if os.path.exists(RESULT):
        with open(RESULT) as f:
            kept = [
                line.rstrip("\n")
                for line in f
                if re.match(r"\| \d+\.\d+", line) and not line.startswith(f"| {jax.__version__} |")
            ]
    seconds = sum(r["seconds"] for r in found)
    with open(RESULT, "w") as f:
        f.write(
            "# Estimates against compiled programs\n\n"
            f"`python -m benchmarks.estimates --write` (about {seconds:.0f} s per JAX release, "
            "2 CPU cores; run once with each JAX the package supports). "
            "The example models (`examples/models.py`) at medium widths (d_model 256, "
            "sequence 128, batch 32, vocabulary 4096), an AdamW train step, abstract "
            "arguments, each hint set of `models.HINT_SETS` on the 2x4 (data, model) mesh "
            "of 8 simulated CPU devices; memory is `compiled.memory_analysis()` (arguments + "
            "results + temporaries), bytes are the compiled collectives' ring volumes. A "
            "ratio outside 10% is marked ◀.\n\n"
        )
        f.write("\n".join([HEADER, *kept, *map(_line, found)]) + "\n")


if __name__ == "__main__":
    main()
