"""MaxText's own train step under jaxshard against MaxText's own sharding.

    python -m benchmarks.maxtext     # needs MaxText installed (the README says how)

For MaxText's tiny llama2 (dense) and mixtral (MoE) decoders, layers scanned and
unrolled, on 8 simulated CPU devices with its fsdp x tensor mesh: one AdamW step's loss,
compiled collective bytes and memory per device of MaxText's own program (``jax.jit``
with the shardings its logical axis rules give) and of jaxshard's plans from MaxText's
rules, from the batch hint alone, and from the search with MaxText's memory as budget
(`examples/maxtext_llama.py` builds and measures each). Then the same at real sizes:
MaxText's llama2-7b and mixtral-8x7b steps on 64 simulated devices (fsdp=8 x tensor=8),
batch 64, sequence 2048, float32, with abstract arguments, compiled and not run (each in
a process of its own with 64 devices). Writes ``benchmarks/results/maxtext.md``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import maxtext_llama  # noqa: E402 - sets XLA_FLAGS before JAX loads

from benchmarks.environment import write_result  # noqa: E402

CASES = [("llama2", True), ("llama2", False), ("mixtral", True), ("mixtral", False)]
REAL_CASES = ["llama2", "mixtral"]  # layers scanned, as MaxText trains them


def real_sections() -> list[str]:
    """`maxtext_llama.compare_real`'s table per model, each from a process with 64
    devices."""
    example = os.path.join(os.path.dirname(HERE), "examples", "maxtext_llama.py")
    env = {**os.environ, "JAXSHARD_MAXTEXT_DEVICES": "64"}
    sections = []
    for model in REAL_CASES:
        print(f"{model} at its real size ...", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, example, model, "true", "real"],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        sections.append(done.stdout[done.stdout.index("### ") :].strip())
    return sections


def main() -> None:
    import jax

    start = time.perf_counter()
    sections = []
    for model, scan in CASES:
        print(f"{model}, scan={scan} ...", file=sys.stderr, flush=True)
        m, rows = maxtext_llama.compare(model, scan)
        sections.append(maxtext_llama.table(m, rows))
    head = (
        "# MaxText's train step: jaxshard against MaxText's own sharding\n\n"
        f"`python -m benchmarks.maxtext` (tiny steps {time.perf_counter() - start:.0f} s): "
        f"MaxText 0.2.4, JAX {jax.__version__}, 8 simulated CPU devices, mesh fsdp=2 x tensor=4; "
        "tiny configs (`examples/maxtext_llama.py`). Bytes are compiled collective ring "
        "volumes per device per step, memory is arguments + results + temporaries per "
        "device, neither program donating its state.\n"
    )
    tiny = time.perf_counter() - start
    real = real_sections()
    head += (
        "\n## Real sizes\n\nMaxText's own llama2-7b and mixtral-8x7b configs (layers scanned, "
        "dense expert matmuls), 64 simulated CPU devices, mesh fsdp=8 x tensor=8, batch 64, "
        "sequence 2048, float32; abstract arguments, so the programs are compiled, not run "
        f"({time.perf_counter() - start - tiny:.0f} s). Each jaxshard row shows its "
        "predicted bytes and estimated memory next to the compiled program's.\n\n"
        + "\n\n".join(real)
        + "\n\n## Tiny sizes\n"
    )
    write_result("maxtext", head + "\n" + "\n\n".join(sections) + "\n", quick=False)


if __name__ == "__main__":
    main()
