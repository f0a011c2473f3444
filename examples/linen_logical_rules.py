"""Train a Flax Linen GPT annotated with logical axis names, sharded by MaxText-style rules.

Every parameter is created with ``nn.with_logical_partitioning(init, names)``: embeddings
``("vocab", "embed")``, attention kernels ``("embed", "heads", "kv")`` and
``("heads", "kv", "embed")``, MLP kernels ``("embed", "mlp")`` / ``("mlp", "embed")``,
norms ``("norm",)``. `LOGICAL_AXIS_RULES` maps them to the mesh the MaxText way: the
rules are ordered and, per array, each logical name takes the first rule whose mesh
axes exist and are still free. ``"vocab"`` tries a ``"tensor"`` axis this mesh lacks,
then ``"model"``; ``"embed"`` gets ``"model"`` only where no earlier name took it;
``"kv"`` has no rule, so jaxshard's planner decides it. The batch hint is written in
logical names too. The boxed variables go to the step as they are; jaxshard reads their
metadata. Runs on 8 simulated CPU devices, printing each parameter's logical names and
planned spec, then the losses next to an unsharded run:

    python examples/linen_logical_rules.py [--steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard.explain import human_bytes  # noqa: E402
from jaxshard.flax_meta import logical_to_spec  # noqa: E402

LOGICAL_AXIS_RULES = [
    ("batch", "data"),
    ("vocab", "tensor"),  # written for a bigger mesh: this one has no "tensor" axis...
    ("vocab", "model"),  # ...so the next rule for "vocab" wins
    ("mlp", "model"),
    ("heads", "model"),
    ("embed", "model"),  # only where "model" is still free in that array
    ("norm", None),  # replicated
]
HINTS = {r"batch/.*": P("batch", "length")}  # "length" has no rule: left to the planner


@dataclasses.dataclass(frozen=True)
class Config:
    """GPT sizes (tiny by default)."""

    vocab: int = 128
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq: int = 16
    d_ff: int = 256
    batch: int = 8


def _init(names: tuple[str, ...], init=None):
    return nn.with_logical_partitioning(init or nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    """Pre-LN transformer block with logically named parameters."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        dh = cfg.d_model // cfg.n_heads
        norm = dict(
            scale_init=_init(("norm",), nn.initializers.ones),
            bias_init=_init(("norm",), nn.initializers.zeros),
        )
        h = nn.LayerNorm(**norm)(x)
        qkv = [
            nn.DenseGeneral((cfg.n_heads, dh), kernel_init=_init(("embed", "heads", "kv")),
                            use_bias=False, name=name)(h)
            for name in ("query", "key", "value")
        ]  # fmt: skip
        q, k, v = qkv
        logits = jnp.einsum("bshd,bthd->bhst", q, k) / dh**0.5
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        att = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, axis=-1), v)
        x = x + nn.DenseGeneral(
            cfg.d_model, axis=(-2, -1), kernel_init=_init(("heads", "kv", "embed")),
            use_bias=False, name="out",
        )(att)  # fmt: skip
        h = nn.LayerNorm(**norm)(x)
        h = nn.Dense(cfg.d_ff, kernel_init=_init(("embed", "mlp")), name="w1")(h)
        return x + nn.Dense(cfg.d_model, kernel_init=_init(("mlp", "embed")), name="w2")(
            jax.nn.gelu(h)
        )


class GPT(nn.Module):
    """A GPT-2 style decoder."""

    cfg: Config

    @nn.compact
    def __call__(self, tok: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(
            cfg.vocab, cfg.d_model, embedding_init=_init(("vocab", "embed"), nn.initializers.normal(0.02))
        )  # fmt: skip
        x = embed(tok)
        for i in range(cfg.n_layers):
            x = Block(cfg, name=f"block_{i}")(x)
        x = nn.LayerNorm(
            scale_init=_init(("norm",), nn.initializers.ones),
            bias_init=_init(("norm",), nn.initializers.zeros),
        )(x)
        return embed.attend(x)


def make_batch(cfg: Config, seed: int = 1) -> dict[str, np.ndarray]:
    """Random tokens and next-token targets, ``{"tok", "tgt"}`` of shape (batch, seq)."""
    toks = np.random.default_rng(seed).integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1), np.int32)
    return {"tok": toks[:, :-1], "tgt": toks[:, 1:]}


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation):
    """``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` on boxed
    params (``model.init(...)["params"]``, ``nn.LogicallyPartitioned`` leaves)."""

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["tok"])
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.take_along_axis(logp, batch["tgt"][..., None], axis=-1).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def run(mesh: jax.sharding.Mesh, cfg: Config = Config(), steps: int = 3) -> dict:
    """Plan, create params and SGD-momentum state sharded, train ``steps`` steps sharded
    and unsharded. Returns the step, its plan, each parameter's logical names, the
    losses of both runs and both final parameter trees.

    Example:
        >>> result = run(jax.make_mesh((2, 4), ("data", "model")))  # doctest: +SKIP
    """
    model, optimizer = GPT(cfg), optax.sgd(0.1, momentum=0.9)
    batch = make_batch(cfg)
    train_step = make_train_step(model, optimizer)
    step = jaxshard.auto_shard(mesh, HINTS, logical_axis_rules=LOGICAL_AXIS_RULES)(train_step)

    def init(key):
        params = model.init(key, batch["tok"])["params"]
        return params, optimizer.init(params)

    params, opt_state = step.init_sharded(init, jax.random.key(0), rest=(batch,))
    plan = step.plan(params, opt_state, batch)
    ref_params, ref_state = jax.device_get((params, opt_state))  # the same start, unsharded
    reference = jax.jit(train_step)
    losses, ref_losses = [], []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        ref_params, ref_state, ref_loss = reference(ref_params, ref_state, batch)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    names = {
        jax.tree_util.keystr(path, simple=True, separator="/"): getattr(box, "names", None)
        for path, box in jax.tree_util.tree_flatten_with_path(
            ref_params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
        )[0]
    }
    return dict(
        step=step,
        plan=plan,
        names=names,
        losses=losses,
        ref_losses=ref_losses,
        params=params,
        ref_params=ref_params,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    result = run(mesh, steps=args.steps)
    plan = result["plan"]
    print(f"{'parameter':<26} {'logical names':<26} {'planned spec':<18} decided by")
    specs = jax.tree_util.tree_flatten_with_path(
        plan.in_specs[0], is_leaf=lambda x: isinstance(x, (nn.Partitioned, P))
    )[0]
    for path, box in specs:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        spec = box.value if isinstance(box, nn.Partitioned) else box
        names = result["names"][name]
        by = "planner"
        if names:
            rule = logical_to_spec(names, mesh, LOGICAL_AXIS_RULES)
            by = "rules + planner" if P.UNCONSTRAINED in rule else "rules"
        print(f"{name:<26} {names!s:<26} {spec!s:<18} {by}")
    device, total = plan.per_device_bytes("params/")
    print(f"params: {human_bytes(device)} per device, {human_bytes(total)} replicated")
    for i, (loss, ref) in enumerate(zip(result["losses"], result["ref_losses"])):
        print(f"step {i}: loss {loss:.6f} (unsharded {ref:.6f})")


if __name__ == "__main__":
    main()
