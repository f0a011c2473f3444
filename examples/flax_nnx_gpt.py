"""Train a Flax NNX GPT whose parameters carry partial sharding metadata, with jaxshard.

The model states only part of its layout, in Flax's own metadata: query projections
``nnx.Param(..., out_sharding=(P.UNCONSTRAINED, "model"))`` (dim 0 left open), output
projections ``("model",)`` (dim 1 left open), and the MLP's first matrix
``nnx.with_partitioning(init, (None, "model"))``. Keys, values, second MLP matrices,
embeddings, norms and the optimizer state carry nothing: jaxshard's planner decides them.
The train step is plain NNX functional style, ``nnx.merge`` / ``nnx.split`` around a
``nnx.value_and_grad``, with the graph definition a static argument; the state is
created directly in its planned sharding by `AutoShard.init_sharded`. Runs on 8
simulated CPU devices and prints every parameter's metadata and planned spec, then the
losses next to an unsharded run:

    python examples/flax_nnx_gpt.py [--steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard.explain import human_bytes  # noqa: E402

HINTS = {r"batch/.*": P("data")}


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


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], scale: float) -> jax.Array:
    return jax.random.normal(rngs.params(), shape, jnp.float32) * scale


class Attention(nnx.Module):
    """Causal multi-head attention; wq and wo carry partial metadata, wk and wv none."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d, s = cfg.d_model, cfg.d_model**-0.5
        self.n_heads = cfg.n_heads
        self.wq = nnx.Param(_normal(rngs, (d, d), s), out_sharding=(P.UNCONSTRAINED, "model"))
        self.wk = nnx.Param(_normal(rngs, (d, d), s))
        self.wv = nnx.Param(_normal(rngs, (d, d), s))
        self.wo = nnx.Param(_normal(rngs, (d, d), s), out_sharding=("model",))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        q, k, v = (
            (x @ w[...]).reshape(b, s, self.n_heads, d // self.n_heads)
            for w in (self.wq, self.wk, self.wv)
        )
        logits = jnp.einsum("bshd,bthd->bhst", q, k) / (d // self.n_heads) ** 0.5
        mask = jnp.tril(jnp.ones((s, s), bool))
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        out = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, axis=-1), v)
        return out.reshape(b, s, d) @ self.wo[...]


class Block(nnx.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        column = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.w1 = nnx.Linear(cfg.d_model, cfg.d_ff, kernel_init=column, rngs=rngs)
        self.w2 = nnx.Linear(cfg.d_ff, cfg.d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.w2(jax.nn.gelu(self.w1(self.ln2(x))))


class GPT(nnx.Module):
    """A GPT-2 style decoder."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.wte = nnx.Param(_normal(rngs, (cfg.vocab, cfg.d_model), 0.02))
        self.wpe = nnx.Param(_normal(rngs, (cfg.seq, cfg.d_model), 0.02))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, rngs=rngs)

    def __call__(self, tok: jax.Array) -> jax.Array:
        x = self.wte[...][tok] + self.wpe[...][: tok.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def create(cfg: Config, key: jax.Array, learning_rate: float = 0.1):
    """The model and its optimizer (plain SGD, so sharded and unsharded runs compare
    exactly). `nnx.split` gives the graph definition and the state.

    Example:
        >>> graphdef, state = nnx.split(nnx.eval_shape(lambda: create(Config(), jax.random.key(0))))
        >>> state[0]["blocks"][0]["attn"]["wq"].out_sharding
        (UNCONSTRAINED, 'model')
    """
    model = GPT(cfg, nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.sgd(learning_rate), wrt=nnx.Param)


def make_batch(cfg: Config, seed: int = 1) -> dict[str, np.ndarray]:
    """Random tokens and next-token targets, ``{"tok", "tgt"}`` of shape (batch, seq)."""
    toks = np.random.default_rng(seed).integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1), np.int32)
    return {"tok": toks[:, :-1], "tgt": toks[:, 1:]}


def train_step(state: nnx.State, batch: dict[str, jax.Array], graphdef: nnx.GraphDef):
    """One SGD step in NNX functional style: merge, differentiate, update, split."""
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
        logits = model(batch["tok"])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, batch["tgt"][..., None], axis=-1).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss


def run(mesh: jax.sharding.Mesh, cfg: Config = Config(), steps: int = 3) -> dict:
    """Plan, create the state sharded, train ``steps`` steps sharded and unsharded.

    Returns the sharded step, its plan, the metadata of every parameter, the losses of
    both runs and both final states.

    Example:
        >>> result = run(jax.make_mesh((2, 4), ("data", "model")))  # doctest: +SKIP
    """
    with nnx.use_eager_sharding(False):  # abstract: no mesh needed, nothing allocated
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: create(cfg, jax.random.key(0))))
    batch = make_batch(cfg)
    step = jaxshard.auto_shard(mesh, HINTS, static_argnames="graphdef")(train_step)
    (state,) = step.init_sharded(
        lambda key: (nnx.state(create(cfg, key)),), jax.random.key(0), rest=(batch, graphdef)
    )
    plan = step.plan(state, batch, graphdef)
    ref_state = jax.device_get(state)  # the unsharded run starts from the same values
    reference = jax.jit(train_step, static_argnames="graphdef")
    losses, ref_losses = [], []
    for _ in range(steps):
        state, loss = step(state, batch, graphdef)
        ref_state, ref_loss = reference(ref_state, batch, graphdef)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    metadata = {
        jax.tree_util.keystr(path, simple=True, separator="/"): v.get_metadata().get("out_sharding")
        for path, v in jax.tree_util.tree_flatten_with_path(
            abstract[0], is_leaf=lambda x: isinstance(x, nnx.Variable)
        )[0]
    }
    return dict(
        step=step,
        plan=plan,
        metadata=metadata,
        losses=losses,
        ref_losses=ref_losses,
        state=state,
        ref_state=ref_state,
    )


def _decided_by(meta, rank: int) -> str:
    if not meta:
        return "planner"
    if len(meta) < rank or P.UNCONSTRAINED in meta:
        return "metadata + planner"
    return "metadata"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    result = run(mesh, steps=args.steps)
    plan = result["plan"]
    specs = plan.in_specs[0][0]  # the model's part of the state
    print(f"{'parameter':<20} {'metadata':<26} {'planned spec':<18} decided by")
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    for (path, spec), aval in zip(leaves, plan.traced.in_avals):  # the model's leaves come first
        name = jax.tree_util.keystr(path[:-1], simple=True, separator="/")
        meta = result["metadata"][name]
        by = _decided_by(meta, len(aval.shape))
        print(f"{name:<20} {meta!s:<26} {spec!s:<18} {by}")
    device, total = plan.per_device_bytes("state/")
    print(
        f"model + optimizer state: {human_bytes(device)} per device, "
        f"{human_bytes(total)} replicated"
    )
    for i, (loss, ref) in enumerate(zip(result["losses"], result["ref_losses"])):
        print(f"step {i}: loss {loss:.6f} (unsharded {ref:.6f})")


if __name__ == "__main__":
    main()
