"""Train an Equinox GPT with jaxshard, passing the model as a module like `eqx.filter_jit`.

The model is plain ``eqx.nn``: `Embedding`, `LayerNorm`, `MultiheadAttention`, `MLP`,
`Linear`, with activation functions and sizes as non-array fields. The train step is
the one an Equinox user writes (``eqx.filter_value_and_grad``, optax over
``eqx.filter(model, eqx.is_array)``, ``eqx.apply_updates``) and takes the whole module;
``auto_shard(mesh, HINTS, static_leaves=True)`` treats every non-array leaf as static the
way ``eqx.filter_jit`` does, plans the arrays by their paths (``model/blocks/0/attn/
query_proj/weight``) from a few hints, and returns modules again. Runs on 8 simulated CPU
devices and prints the planned specs, then the losses next to ``eqx.filter_jit``:

    python examples/equinox_gpt.py [--steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402

# Megatron-style tensor parallelism stated on three matrices per block (eqx.nn.Linear
# weights are (out, in)); the rest (keys, values, output projections, embeddings, norms,
# optimizer state) is left to the planner.
HINTS = {
    r"batch/.*": P("data"),
    r"model/blocks/\d+/attn/query_proj/weight": P("model"),
    r"model/blocks/\d+/mlp/layers/0/weight": P("model"),
    r"model/blocks/\d+/mlp/layers/1/weight": P(None, "model"),
}


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


class Block(eqx.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, cfg: Config, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(cfg.d_model)
        self.attn = eqx.nn.MultiheadAttention(cfg.n_heads, cfg.d_model, key=k1)
        self.norm2 = eqx.nn.LayerNorm(cfg.d_model)
        self.mlp = eqx.nn.MLP(
            cfg.d_model, cfg.d_model, cfg.d_ff, depth=1, activation=jax.nn.gelu, key=k2
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        seq = x.shape[0]
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h, mask=causal)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class GPT(eqx.Module):
    """Token embedding, blocks, final norm and an untied output head (one sequence)."""

    embed: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, cfg: Config, key: jax.Array):
        keys = jax.random.split(key, cfg.n_layers + 2)
        self.embed = eqx.nn.Embedding(cfg.vocab, cfg.d_model, key=keys[0])
        self.blocks = [Block(cfg, k) for k in keys[1:-1]]
        self.norm = eqx.nn.LayerNorm(cfg.d_model)
        self.head = eqx.nn.Linear(cfg.d_model, cfg.vocab, use_bias=False, key=keys[-1])

    def __call__(self, tok: jax.Array) -> jax.Array:
        x = jax.vmap(self.embed)(tok)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def make_batch(cfg: Config, seed: int = 1) -> dict[str, np.ndarray]:
    """Random next-token data: ``tok`` and ``target``, (batch, seq) int32."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1), dtype=np.int32)
    return {"tok": tok[:, :-1], "target": tok[:, 1:]}


def make_step(optimizer: optax.GradientTransformation):
    """The train step an Equinox user writes, unchanged for jaxshard."""

    def train_step(model: GPT, opt_state, batch):
        def loss_fn(model):
            logits = jax.vmap(model)(batch["tok"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["target"]).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return loss, eqx.apply_updates(model, updates), opt_state

    return train_step


def run(
    mesh: jax.sharding.Mesh, cfg: Config = Config(), steps: int = 3, learning_rate: float = 0.1
) -> dict:
    """Train ``steps`` SGD steps with jaxshard and with ``eqx.filter_jit`` from one model.

    Returns the step, both runs' losses and final models, and the plan.
    """
    model = GPT(cfg, jax.random.key(0))
    optimizer = optax.sgd(learning_rate)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    batch = make_batch(cfg)
    train_step = make_step(optimizer)
    step = jaxshard.auto_shard(mesh, HINTS, static_leaves=True)(train_step)
    reference = eqx.filter_jit(train_step)
    plan = step.plan(model, opt_state, batch)
    sharded = (model, opt_state)
    plain = (model, opt_state)
    losses, ref_losses = [], []
    for _ in range(steps):
        loss, *sharded = step(*sharded, batch)
        ref_loss, *plain = reference(*plain, batch)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    return {
        "step": step,
        "plan": plan,
        "losses": losses,
        "ref_losses": ref_losses,
        "model": sharded[0],
        "ref_model": plain[0],
    }


def max_param_error(model: eqx.Module, ref_model: eqx.Module) -> float:
    """Largest difference of any parameter leaf relative to that leaf's max magnitude."""
    errors = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-30))
        for a, b in zip(
            jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)),
            jax.tree_util.tree_leaves(eqx.filter(ref_model, eqx.is_array)),
        )
    ]
    return max(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    steps = parser.parse_args().steps
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    out = run(mesh, steps=steps)
    plan = out["plan"]
    for name, spec in zip(
        plan.traced.in_names,
        jax.tree_util.tree_leaves(plan.in_specs, is_leaf=lambda x: isinstance(x, P)),
    ):
        if name.startswith("model/"):
            print(f"{name:45s} {spec}")
    for i, (a, b) in enumerate(zip(out["losses"], out["ref_losses"])):
        print(f"step {i}: jaxshard {a:.6f}  eqx.filter_jit {b:.6f}")
    print(
        f"largest parameter difference: {max_param_error(out['model'], out['ref_model']):.2e} "
        "of the leaf's max"
    )


if __name__ == "__main__":
    main()
