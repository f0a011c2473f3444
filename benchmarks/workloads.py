"""The benchmarked train steps: model configs, abstract arguments, hints, equation counts.

Every workload is an optax AdamW train step ``(params, opt_state, batch) -> (params,
opt_state, loss)`` built from ``examples/models.py``. Arguments are abstract
(`jax.eval_shape`), so planning and compiling allocate nothing; concrete arrays are made
only to time steps.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import optax
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)
import models  # noqa: E402


@dataclass
class Workload:
    """A train step, its abstract arguments, and how to make concrete ones."""

    name: str
    model: str  # key of examples/models.MODELS
    cfg: Any
    batch_size: int
    step: Callable
    args: tuple  # (params, opt_state, batch) as ShapeDtypeStructs

    def concrete_args(self) -> tuple:
        _, init, _, make_batch = models.MODELS[self.model]
        params = init(jax.random.key(0), self.cfg)
        opt_state = _OPTIMIZER.init(params)
        return params, opt_state, make_batch(jax.random.key(1), self.cfg, self.batch_size)

    def describe(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in vars(self.cfg).items())
        return f"{self.name}: {type(self.cfg).__name__}({fields}), batch {self.batch_size}"


_OPTIMIZER = optax.adamw(1e-3)


def workload(name: str, model: str, cfg: Any, batch_size: int) -> Workload:
    """A `Workload` for ``examples.models.MODELS[model]`` with config ``cfg``."""
    _, init, loss, make_batch = models.MODELS[model]
    params = jax.eval_shape(lambda: init(jax.random.key(0), cfg))
    opt_state = jax.eval_shape(_OPTIMIZER.init, params)
    batch = jax.eval_shape(lambda: make_batch(jax.random.key(1), cfg, batch_size))
    step = models.make_train_step(functools.partial(loss, cfg=cfg), _OPTIMIZER)
    return Workload(name, model, cfg, batch_size, step, (params, opt_state, batch))


# --- planning speed: small widths (planning cost depends on equations, not sizes) -----

SPEED_WIDTHS = dict(d_model=128, n_heads=4, d_ff=512, seq=64, vocab=256)
SPEED_BATCH = 16


def gpt_speed(n_layers: int) -> Workload:
    cfg = models.GPTConfig(n_layers=n_layers, **SPEED_WIDTHS)
    return workload(f"GPT {n_layers}L (unrolled)", "gpt", cfg, SPEED_BATCH)


def llama_speed(n_layers: int) -> Workload:
    cfg = models.LlamaConfig(n_layers=n_layers, n_kv_heads=4, **SPEED_WIDTHS)
    return workload(f"Llama {n_layers}L (scan)", "llama", cfg, SPEED_BATCH)


SPEED_HINTS = {  # as examples/gpt.py: the batch, query projections and first MLP matrices
    "gpt": {
        r"batch/.*": P("data"),
        r"params/.*/wq": P(None, "model"),
        r"params/.*/w1": P(None, "model"),
    },
    "llama": {
        r"batch/.*": P("data"),
        r"params/layers/wq": P(None, None, "model"),
        r"params/layers/w_gate": P(None, None, "model"),
    },
}


# --- plan quality: moderate sizes -----------------------------------------------------


def quality_workloads(quick: bool = False) -> list[Workload]:
    """GPT-style, Llama-scan, MoE and conv net at moderate sizes (the examples' tiny
    defaults with ``quick``)."""
    if quick:
        return [
            workload("GPT", "gpt", models.GPTConfig(), 8),
            workload("Llama-scan", "llama", models.LlamaConfig(n_heads=4, n_kv_heads=4), 8),
            workload("MoE", "moe", models.MoEConfig(n_experts=8), 8),
            workload("conv", "conv", models.ConvConfig(), 8),
        ]
    text = dict(vocab=1024, seq=64)
    return [
        workload(
            "GPT",
            "gpt",
            models.GPTConfig(n_layers=2, d_model=256, n_heads=8, d_ff=1024, **text),
            16,
        ),
        workload(
            "Llama-scan",
            "llama",
            models.LlamaConfig(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=768, **text),
            16,
        ),  # fmt: skip
        workload(
            "MoE", "moe", models.MoEConfig(d_model=256, n_experts=8, top_k=2, d_ff=512, **text), 16
        ),
        workload("conv", "conv", models.ConvConfig(image=32, widths=(32, 64, 128)), 16),
    ]


def quality_hints(model: str, axis_sizes: Mapping[str, int]) -> dict[str, P]:
    """The batch hint plus one weight hint (layout a, and the pins of "Shardy alone").

    On the 2x4 mesh the weight hint is tensor parallel on "model" (the MLP's first
    matrix, the experts dim of the MoE's first expert matrix, the first conv of each
    block). On the 8 (data) mesh the one weight hint is the FSDP-style split of that
    weight's input dim on "data" (for the MoE: its experts dim on "data", GShard-style).
    """
    batch = {r"batch/.*": P("data")}
    if "model" in axis_sizes:
        weight = {
            "gpt": {r"params/layers/\d+/mlp/w1": P(None, "model")},
            "llama": {r"params/layers/w_gate": P(None, None, "model")},
            "moe": {r"params/experts/w_in": P("model")},
            "conv": {r"params/blocks/\d+/conv1": P(None, None, None, "model")},
        }[model]
    else:
        weight = {
            "gpt": {r"params/layers/\d+/mlp/w1": P("data")},
            "llama": {r"params/layers/w_gate": P(None, "data")},
            "moe": {r"params/experts/w_in": P("data")},
            "conv": {r"params/blocks/\d+/conv1": P(None, None, "data")},
        }[model]
    return {**batch, **weight}


# --- meshes and counting --------------------------------------------------------------


def meshes() -> dict[str, jax.sharding.Mesh]:
    """The two benchmark meshes, with Auto axes (what `jax.jit` shardings expect)."""
    return {
        "8 (data)": jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)),
        "2x4 (data, model)": jax.make_mesh(
            (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
        ),
    }


def count_equations(jaxpr: Jaxpr | ClosedJaxpr) -> int:
    """Equations of a jaxpr, counting nested jaxprs (jit, custom_jvp/vjp, remat, scan
    bodies, cond branches) recursively, each once per occurrence in the program text.

    Example:
        >>> import jax.numpy as jnp
        >>> count_equations(jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) + 1)(1.0))
        3
    """
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (Jaxpr, ClosedJaxpr)):
                    n += count_equations(sub)
    return n
