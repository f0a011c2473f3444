"""MaxText's own train step under jaxshard, next to MaxText's own sharding.

MaxText (https://github.com/AI-Hypercomputer/maxtext) is the reference JAX trainer: its
config loader, its Flax NNX decoder (llama2-style dense or mixtral-style MoE blocks,
layers scanned or unrolled), its AdamW and its ``train_step``, all used here as they
are, at tiny sizes on 8 simulated CPU devices with MaxText's fsdp x tensor mesh
(fsdp=2, tensor=4; its other ten mesh axes have size 1). MaxText's own program is
``jax.jit`` of the step with the shardings its ``logical_axis_rules`` give the state and
the batch; jaxshard plans the same step three ways:

- ``rules``: MaxText's ``logical_axis_rules`` passed through (``logical_axis_rules=``;
  the state's NNX metadata and the model's activation constraints read by them);
- ``batch``: from the batch hint alone (``flax_metadata=False``): jaxshard lays out the
  state itself, stored over MaxText's ``fsdp`` axis (`auto_shard`'s ``fsdp_axes``);
- ``search``: ``search=True`` from the batch hint, with MaxText's compiled memory as
  ``memory_budget``; where the estimate puts every layout over that budget, the search
  is run again with ``calibrate_memory=True`` (it checks its plans against the compiled
  program), and the row says so.

Each row: one AdamW step's loss next to MaxText's, collective bytes and memory per device
of the compiled programs (ring volumes; arguments + results + temporaries - donated), and
what ``verify()`` says of jaxshard's predictions. MaxText needs Python 3.12+ and JAX
0.10.2 (MaxText 0.2.4), installed without its TPU and cloud extras; the README says how:

    python examples/maxtext_llama.py                # llama2, layers scanned
    python examples/maxtext_llama.py mixtral false  # mixtral, layers unrolled
    JAXSHARD_MAXTEXT_DEVICES=64 python examples/maxtext_llama.py llama2 true real

The last compiles MaxText's llama2-7b (or mixtral-8x7b) step on 64 simulated devices
(fsdp=8 x tensor=8) with abstract arguments: bytes and memory of the compiled programs
against jaxshard's predicted bytes and estimated memory (nothing runs).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText's switch: no cloud integrations
# 8 simulated devices for the tiny steps; the real sizes (`REAL`) ask for their mesh's 64
DEVICES = int(os.environ.get("JAXSHARD_MAXTEXT_DEVICES", "8"))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()

import dataclasses  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard.baseline import compiled_cost  # noqa: E402

TINY = [
    "hardware=cpu", "dataset_type=synthetic", "enable_checkpointing=false",
    "skip_jax_distributed_system=true", "run_name=jaxshard", "base_output_directory=/tmp/maxtext",
    "ici_fsdp_parallelism=2", "ici_tensor_parallelism=4", "per_device_batch_size=1",
    "max_target_length=32", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4",
    "head_dim=16", "base_mlp_dim=128", "base_num_decoder_layers=2", "vocab_size=256",
    "attention=dot_product", "dtype=float32", "weight_dtype=float32", "enable_dropout=false",
    "steps=10",
]  # fmt: skip
MIXTRAL = [
    "decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=128",
    "sparse_matmul=false", "megablox=false", "capacity_factor=-1",
]  # fmt: skip
# the real sizes: MaxText's own llama2-7b and mixtral-8x7b configs on 64 devices (fsdp=8 x
# tensor=8), batch 64, sequence 2048, float32, with abstract arguments (compiled, not run)
REAL_COMMON = [
    "hardware=cpu", "dataset_type=synthetic", "enable_checkpointing=false",
    "skip_jax_distributed_system=true", "run_name=jaxshard", "base_output_directory=/tmp/maxtext",
    "ici_fsdp_parallelism=8", "ici_tensor_parallelism=8", "per_device_batch_size=1",
    "max_target_length=2048", "attention=dot_product", "dtype=float32", "weight_dtype=float32",
    "enable_dropout=false", "steps=10",
]  # fmt: skip
REAL = {
    "llama2": ["model_name=llama2-7b"],
    "mixtral": ["model_name=mixtral-8x7b", "sparse_matmul=false", "megablox=false",
                "capacity_factor=-1"],
}  # fmt: skip


@dataclasses.dataclass
class MaxTextStep:
    """MaxText's step, built by MaxText: its config, mesh, step function and arguments
    (real arrays in MaxText's layouts), and the shardings MaxText jits it with."""

    name: str
    config: Any
    mesh: Mesh
    step: Any
    args: tuple
    in_shardings: Any
    out_shardings: Any
    batch_spec: Any

    def rules(self):
        """MaxText's logical axis rules as a context (its model's constraints read them)."""
        from flax.linen import partitioning

        return partitioning.axis_rules(self.config.logical_axis_rules)


def build(model: str = "llama2", scan: bool = True, real: bool = False) -> MaxTextStep:
    """MaxText's tiny ``model`` ("llama2" or "mixtral") train step, layers scanned or not;
    with ``real``, MaxText's llama2-7b or mixtral-8x7b on 64 devices (`REAL`: the process
    must have them, ``JAXSHARD_MAXTEXT_DEVICES=64``) with abstract arguments.

    Example:
        >>> maxtext = build("llama2", scan=True)  # doctest: +SKIP
    """
    import maxtext
    from flax import nnx
    from maxtext.common import train_state_nnx
    from maxtext.configs import pyconfig
    from maxtext.optimizers import optimizers
    from maxtext.trainers.pre_train import train
    from maxtext.utils import maxtext_utils, model_creation_utils, sharding

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    if real:
        sized = [*REAL_COMMON, *REAL[model]]
    else:
        sized = [*TINY, *(MIXTRAL if model == "mixtral" else [])]
    cfg = pyconfig.initialize([None, base, *sized, f"scan_layers={str(scan).lower()}"])
    mesh = Mesh(maxtext_utils.create_device_mesh(cfg, jax.devices()), cfg.mesh_axes)
    create, abstract_model = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
    schedule = maxtext_utils.create_learning_rate_schedule(cfg)
    tx = optimizers.get_optimizer(cfg, schedule, abstract_model)

    def init():
        m = create()
        return train_state_nnx.TrainStateNNX(m, nnx.Optimizer(m, tx, wrt=nnx.Param))

    _, _, state_shardings = maxtext_utils.get_abstract_state(cfg, mesh, init, True)
    from flax.linen import partitioning

    with partitioning.axis_rules(cfg.logical_axis_rules):
        graphdef, _ = nnx.split(nnx.eval_shape(init))
    data_sharding = sharding.get_input_data_sharding(cfg, mesh)
    shaped = maxtext_utils.get_shaped_batch(cfg, batch_sharding=data_sharding)
    step, in_shard, out_shard, _, _ = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, state_shardings, graphdef, cfg
    )
    name = f"{model}, layers {'scanned' if scan else 'unrolled'}"
    if real:
        with partitioning.axis_rules(cfg.logical_axis_rules):
            shapes = jax.eval_shape(lambda: nnx.state(init()))
        state = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            shapes,
            state_shardings,
        )
        batch = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=data_sharding)
            for k, v in shaped.items()
        }
        name = f"{REAL[model][0].split('=')[1]}, layers {'scanned' if scan else 'unrolled'}"
        return MaxTextStep(
            name, cfg, mesh, step, (state, batch), in_shard, out_shard, data_sharding.spec
        )
    with jax.set_mesh(mesh), partitioning.axis_rules(cfg.logical_axis_rules):
        state = jax.jit(lambda: nnx.state(init()), out_shardings=state_shardings)()
    rng = np.random.default_rng(0)
    batch = {}
    for key, leaf in shaped.items():
        if "segmentation" in key:
            value = np.ones(leaf.shape)
        elif "position" in key:
            value = np.broadcast_to(np.arange(leaf.shape[1]), leaf.shape)
        else:
            value = rng.integers(1, cfg.vocab_size, leaf.shape)
        batch[key] = jax.device_put(jnp.asarray(value, leaf.dtype), data_sharding)
    return MaxTextStep(
        name, cfg, mesh, step, (state, batch), in_shard, out_shard, data_sharding.spec
    )


@dataclasses.dataclass
class Row:
    """One program: its loss, compiled bytes and memory, and for jaxshard's the plan."""

    name: str
    loss: float
    bytes: float
    memory: int
    plan: Any = None
    seconds: float = 0.0
    surprises: int = 0


def _loss(metrics) -> float:
    return float(metrics["scalar"]["learning/loss"])


def maxtext_row(m: MaxTextStep) -> Row:
    """MaxText's own program: ``jax.jit`` with its shardings (the state donated)."""
    with jax.set_mesh(m.mesh), m.rules():
        jitted = jax.jit(m.step, in_shardings=m.in_shardings, out_shardings=m.out_shardings)
        compiled = jitted.lower(*m.args).compile()
        _, metrics = jitted(*m.args)
    cost = compiled_cost(compiled, m.mesh)
    return Row("MaxText's own sharding", _loss(metrics), cost.bytes, cost.memory)


MODES = {"rules": "MaxText's rules", "batch": "batch hint alone", "search": "search"}


def sharded(m: MaxTextStep, mode: str, budget: float | None = None, **extra: Any):
    """MaxText's step under `jaxshard.auto_shard` from the batch hint: ``mode`` "rules"
    passes MaxText's logical axis rules, "batch" reads no Flax metadata, "search" adds
    the search with ``budget`` as its memory budget (module doc); ``extra`` options go
    to `auto_shard` too.

    Example:
        >>> step = sharded(build("llama2"), "rules")  # doctest: +SKIP
    """
    options: dict[str, Any] = {}
    if mode == "rules":
        options["logical_axis_rules"] = m.config.logical_axis_rules
    else:
        options["flax_metadata"] = False
    if mode == "search":
        options.update(search=True, memory_budget=budget)
    return jaxshard.auto_shard(m.mesh, {r"data/.*": m.batch_spec}, **options, **extra)(m.step)


def jaxshard_row(m: MaxTextStep, mode: str, budget: float | None = None, **extra: Any) -> Row:
    """jaxshard's plan of the step: ``mode`` is "rules", "batch" or "search" (module doc);
    ``extra`` options go to `auto_shard`."""
    with m.rules():
        start = time.perf_counter()
        step = sharded(m, mode, budget, **extra)
        plan = step.plan(*m.args)
        seconds = time.perf_counter() - start
        compiled = step.lower(*m.args).compile()
        _, metrics = step(*m.args)
        checked = plan.verify()
    cost = compiled_cost(compiled, m.mesh)
    return Row(
        f"jaxshard, {MODES[mode]}",
        _loss(metrics),
        cost.bytes,
        cost.memory,
        plan,
        seconds,
        len(checked.surprises),
    )


def compare(model: str = "llama2", scan: bool = True) -> tuple[MaxTextStep, list[Row]]:
    """MaxText's own program and jaxshard's three plans of one step.

    Example:
        >>> maxtext, rows = compare("llama2", scan=True)  # doctest: +SKIP
    """
    m = build(model, scan)
    reference = maxtext_row(m)
    rows = [reference]
    for mode in ("rules", "batch", "search"):
        try:
            rows.append(jaxshard_row(m, mode, budget=reference.memory))
        except jaxshard.ShardingError as e:  # no layout fits the budget: said, not hidden
            smallest = getattr(e, "footprint", None)
            if mode == "search" and smallest is not None:
                # the estimate puts every layout over the budget: the search checks its
                # smallest against the compiled program instead (`calibrate_memory`)
                over = smallest.total / reference.memory
                try:
                    row = jaxshard_row(m, mode, reference.memory, calibrate_memory=True)
                except jaxshard.ShardingError:
                    pass
                else:
                    row.name += f", calibrated (smallest estimate {over:.2f}x)"
                    rows.append(row)
                    continue
            why = (
                f"no layout fits; smallest estimate {smallest.total / 1024:.1f} KiB "
                f"({smallest.total / reference.memory:.2f}x)"
                if smallest is not None
                else str(e).splitlines()[0][:60] + "..."
            )
            rows.append(Row(f"jaxshard, {mode}: {why}", np.nan, 0, 0))
    return m, rows


@dataclasses.dataclass
class Compiled:
    """One program at a real size, compiled only: jaxshard's predictions (bytes, memory)
    next to the compiled program's, or why there is no plan."""

    name: str
    bytes: float = 0.0
    memory: int = 0
    predicted: float | None = None
    estimated: float | None = None
    seconds: float = 0.0
    error: str = ""


def compare_real(model: str = "llama2", scan: bool = True) -> tuple[MaxTextStep, list[Compiled]]:
    """MaxText's own program and jaxshard's three plans of MaxText's real-size step
    (`build` with ``real``), compiled, not run: collective bytes and memory per device
    against jaxshard's predicted bytes and estimated memory.

    Example:
        >>> maxtext, rows = compare_real("llama2")  # doctest: +SKIP
    """
    m = build(model, scan, real=True)
    with jax.set_mesh(m.mesh), m.rules():
        jitted = jax.jit(m.step, in_shardings=m.in_shardings, out_shardings=m.out_shardings)
        own = compiled_cost(jitted.lower(*m.args).compile(), m.mesh)
    rows = [Compiled("MaxText's own sharding", own.bytes, own.memory)]
    for mode in ("rules", "batch", "search"):
        row = Compiled(f"jaxshard, {MODES[mode]}")
        with m.rules():
            start = time.perf_counter()
            step = sharded(m, mode, own.memory)
            try:
                plan = step.plan(*m.args)
            except jaxshard.ShardingError as e:  # no layout fits the budget: said, not hidden
                row.error = str(e).split(":")[0] + _smallest(e, own.memory)
                rows.append(row)
                continue
            row.seconds = time.perf_counter() - start
            got = compiled_cost(step.lower(*m.args).compile(), m.mesh)
        row.bytes, row.memory = got.bytes, got.memory
        row.predicted, row.estimated = plan.predicted_bytes, plan.estimated_memory.total
        rows.append(row)
    return m, rows


def _smallest(e: Exception, budget: float) -> str:
    smallest = getattr(e, "footprint", None)
    if smallest is None:
        return ""
    return f"; the smallest estimate is {smallest.total / 2**30:.2f} GiB ({smallest.total / budget:.2f}x)"


def real_table(m: MaxTextStep, rows: list[Compiled]) -> str:
    """`compare_real`'s rows as a markdown table, ratios to MaxText's own program."""
    base = rows[0]
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    out = [
        f"### {m.name}",
        "",
        "| program | collective bytes/device: predicted / compiled | memory/device: estimated "
        "/ compiled | vs MaxText (bytes, memory) | plan s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            out.append(f"| {r.name}: {r.error} | - | - | - | - |")
            continue
        moved = gib(r.bytes) if r.predicted is None else f"{gib(r.predicted)} / {gib(r.bytes)}"
        held = gib(r.memory) if r.estimated is None else f"{gib(r.estimated)} / {gib(r.memory)}"
        ratio = f"{r.bytes / base.bytes:.2f}x, {r.memory / base.memory:.2f}x"
        out.append(f"| {r.name} | {moved} | {held} | {ratio} | {r.seconds:.1f} |")
    return "\n".join(out)


def table(m: MaxTextStep, rows: list[Row]) -> str:
    """The rows as a markdown table, ratios to MaxText's own program."""
    base = rows[0]
    out = [
        f"### {m.name}",
        "",
        "| program | loss | collective bytes/device | memory/device | vs MaxText (bytes, memory) "
        "| verify surprises | plan s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r.bytes / base.bytes:.2f}x, {r.memory / base.memory:.2f}x" if r.memory else "-"
        out.append(
            f"| {r.name} | {r.loss:.6f} | {r.bytes / 1024:.1f} KiB | {r.memory / 1024:.1f} KiB | "
            f"{ratio} | {r.surprises if r.plan is not None else '-'} | "
            f"{r.seconds:.1f} |"
        )
    return "\n".join(out)


def main(argv: list[str]) -> None:
    model = argv[0] if argv else "llama2"
    scan = (argv[1] if len(argv) > 1 else "true").lower() != "false"
    if len(argv) > 2 and argv[2] == "real":
        if DEVICES != 64:
            sys.exit("the real sizes need 64 devices: JAXSHARD_MAXTEXT_DEVICES=64 python ...")
        m, rows = compare_real(model, scan)
        print(real_table(m, rows))
        return
    m, rows = compare(model, scan)
    print(table(m, rows))


if __name__ == "__main__":
    main(sys.argv[1:])
