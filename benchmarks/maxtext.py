"""MaxText's own train step under jaxshard against MaxText's own sharding.

    python -m benchmarks.maxtext     # needs MaxText installed (the README says how)

For MaxText's tiny llama2 (dense) and mixtral (MoE) decoders, layers scanned and
unrolled, on 8 simulated CPU devices with its fsdp x tensor mesh: one AdamW step's loss,
compiled collective bytes and memory per device of MaxText's own program (``jax.jit``
with the shardings its logical axis rules give) and of jaxshard's plans from MaxText's
rules, from the batch hint alone, and from the search with MaxText's memory as budget
(`examples/maxtext_llama.py` builds and measures each). Writes
``benchmarks/results/maxtext.md``.
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import maxtext_llama  # noqa: E402 - sets XLA_FLAGS before JAX loads

from benchmarks.environment import write_result  # noqa: E402

CASES = [("llama2", True), ("llama2", False), ("mixtral", True), ("mixtral", False)]


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
        f"`python -m benchmarks.maxtext` ({time.perf_counter() - start:.0f} s): MaxText "
        f"0.2.4, JAX {jax.__version__}, 8 simulated CPU devices, mesh fsdp=2 x tensor=4; "
        "tiny configs (`examples/maxtext_llama.py`). Bytes are compiled collective ring "
        "volumes per device per step, memory is arguments + results + temporaries per "
        "device, neither program donating its state.\n"
    )
    write_result("maxtext", head + "\n" + "\n\n".join(sections) + "\n", quick=False)


if __name__ == "__main__":
    main()
