"""A small transformer written in JAX's explicit-sharding style, sharded by jaxshard.

The model fixes a few layouts itself, as code for `jax.make_mesh`'s Explicit axes does:
the embedding lookup and the query/key/value, attention-output and MLP einsums carry
``out_sharding=`` (batch on "data", heads and the MLP hidden dim on "model"); everything
else, the parameters included, is unannotated. jaxshard reads every such annotation as a
pin with its source line, plans the rest from the batch hint alone (the parameters come
out tensor-parallel, Megatron style), and runs the step on the same Explicit mesh.

It is compared with plain `jax.jit` on that mesh, twice: with the parameters replicated
(what the model gives without a layout for its weights) and with Megatron layouts written
by hand into the parameters' types. Numbers (loss and the parameters after SGD steps),
collective bytes per device (ring volumes, from the compiled HLO) and memory per device
(`compiled.memory_analysis()`) are measured from the compiled programs.

    python examples/explicit_style.py [--steps 3]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard.hlo import compiled_collectives  # noqa: E402


@dataclass(frozen=True)
class Config:
    """Sizes of the tiny model (kept small: it compiles three times in the test)."""

    vocab: int = 64
    d: int = 32
    heads: int = 4
    head_dim: int = 8
    ff: int = 64
    layers: int = 2
    batch: int = 8
    seq: int = 16


def init(key: jax.Array, cfg: Config) -> dict:
    """Parameters as plain arrays (no sharding).

    Example:
        >>> params = init(jax.random.key(0), Config())
        >>> params["layers"][0]["wq"].shape
        (32, 4, 8)
    """
    keys = iter(jax.random.split(key, 1 + 6 * cfg.layers))
    normal = lambda shape, fan_in: jax.random.normal(next(keys), shape) / np.sqrt(fan_in)  # noqa: E731
    attn = (cfg.d, cfg.heads, cfg.head_dim)
    layers = [
        {
            "wq": normal(attn, cfg.d),
            "wk": normal(attn, cfg.d),
            "wv": normal(attn, cfg.d),
            "wo": normal((cfg.heads, cfg.head_dim, cfg.d), cfg.d),
            "w1": normal((cfg.d, cfg.ff), cfg.d),
            "w2": normal((cfg.ff, cfg.d), cfg.ff),
        }
        for _ in range(cfg.layers)
    ]
    return {"embed": normal((cfg.vocab, cfg.d), 1.0), "layers": layers}


def _norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


# the layouts the model fixes: batch on "data", heads and the MLP hidden dim on "model"
ACT = P("data", None, None)
HEADS = P("data", None, "model", None)
HIDDEN = P("data", None, "model")


def loss_fn(params: dict, tok: jax.Array, cfg: Config) -> jax.Array:
    """Next-token cross entropy of a causal transformer in explicit-sharding style.

    Example:
        >>> loss_fn(params, tok, Config())  # doctest: +SKIP
    """
    x = params["embed"].at[tok[:, :-1]].get(out_sharding=ACT)
    t = x.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for layer in params["layers"]:
        h = _norm(x)
        q = jnp.einsum("btd,dhk->bthk", h, layer["wq"], out_sharding=HEADS)
        k = jnp.einsum("btd,dhk->bthk", h, layer["wk"], out_sharding=HEADS)
        v = jnp.einsum("btd,dhk->bthk", h, layer["wv"], out_sharding=HEADS)
        s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(cfg.head_dim)
        p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
        o = jnp.einsum("bhts,bshk->bthk", p, v)
        x = x + jnp.einsum("bthk,hkd->btd", o, layer["wo"], out_sharding=ACT)
        u = jax.nn.gelu(jnp.einsum("btd,df->btf", _norm(x), layer["w1"], out_sharding=HIDDEN))
        x = x + jnp.einsum("btf,fd->btd", u, layer["w2"], out_sharding=ACT)
    logits = jnp.einsum("btd,vd->btv", _norm(x), params["embed"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1))


def make_step(cfg: Config, lr: float = 0.1):
    """One SGD step: ``(params, tok) -> (new params, loss)``.

    Example:
        >>> step = make_step(Config())
    """

    def step(params, tok):
        loss, grads = jax.value_and_grad(loss_fn)(params, tok, cfg)
        return jax.tree.map(lambda w, g: w - lr * g, params, grads), loss

    return step


# hand-written Megatron layouts, for the second jax.jit baseline
MEGATRON = {
    "wq": P(None, "model"),
    "wk": P(None, "model"),
    "wv": P(None, "model"),
    "wo": P("model"),
    "w1": P(None, "model"),
    "w2": P("model"),
}


def megatron_specs(params: dict) -> dict:
    """Per-leaf specs of the hand-written layout (embedding replicated).

    Example:
        >>> megatron_specs(init(jax.random.key(0), Config()))["layers"][0]["wo"]
        P('model',)
    """
    layers = [{name: MEGATRON[name] for name in layer} for layer in params["layers"]]
    return {"embed": P(), "layers": layers}


@dataclass
class Run:
    """What one program did: losses per step, final parameters, and compiled stats."""

    name: str
    losses: list
    params: dict
    comm_bytes: float  # ring bytes per device per call
    memory: int  # bytes per device: arguments + results + temporaries - aliased


def _stats(compiled, mesh) -> tuple[float, int]:
    collectives = compiled_collectives(compiled.as_text(), mesh)
    comm = sum(c.ring_bytes * (c.runs or 1) for c in collectives)
    mem = compiled.memory_analysis()
    memory = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )
    return comm, memory


def _train(name, fn, lower, params, tok, steps, mesh) -> Run:
    comm, memory = _stats(lower(params, tok).compile(), mesh)
    losses = []
    for _ in range(steps):
        params, loss = fn(params, tok)
        losses.append(float(loss))
    return Run(name, losses, params, comm, memory)


def compare(steps: int = 3, cfg: Config = Config(), mesh=None) -> list[Run]:
    """Train ``steps`` SGD steps three ways on an Explicit (data=2, model=4) mesh: plain
    `jax.jit` with replicated parameters, plain `jax.jit` with Megatron parameter types,
    and `jaxshard.auto_shard` with only the batch hint.

    Example:
        >>> runs = compare(steps=1)  # doctest: +SKIP
        >>> [r.name for r in runs]  # doctest: +SKIP
        ['jax.jit, replicated params', 'jax.jit, Megatron params', 'jaxshard']
    """
    mesh = mesh or jax.make_mesh((2, 4), ("data", "model"))
    params = init(jax.random.key(0), cfg)
    tok = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    step = make_step(cfg)
    put = lambda tree, specs: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
    )
    tok = jax.device_put(tok, NamedSharding(mesh, P("data")))
    runs = []
    jitted = jax.jit(step)
    with jax.set_mesh(mesh):
        for name, specs in (
            ("jax.jit, replicated params", jax.tree.map(lambda _: P(), params)),
            ("jax.jit, Megatron params", megatron_specs(params)),
        ):
            placed = put(params, specs)
            runs.append(_train(name, jitted, jitted.lower, placed, tok, steps, mesh))
    sharded = jaxshard.auto_shard(mesh, {r"tok": P("data")})(step)
    runs.append(_train("jaxshard", sharded, sharded.lower, params, tok, steps, mesh))
    return runs


def factory():
    """The train step, example arguments and the batch hint, for the ``jaxshard`` CLI
    (``jaxshard explain examples/explicit_style.py:factory``).

    Example:
        >>> step, (params, tok), hints = factory()
    """
    cfg = Config()
    params = init(jax.random.key(0), cfg)
    tok = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    return make_step(cfg), (params, tok), {r"tok": P("data")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    cfg = Config()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params = init(jax.random.key(0), cfg)
    tok = jnp.zeros((cfg.batch, cfg.seq + 1), jnp.int32)
    plan = jaxshard.auto_shard(mesh, {r"tok": P("data")})(make_step(cfg)).plan(params, tok)
    print(plan.explain().split("\n\nreshards")[0])
    print()
    runs = compare(args.steps, cfg, mesh)
    ref = runs[0]
    print(f"{'program':28} {'losses':36} {'collective bytes/dev':>20} {'memory/dev':>11}")
    for r in runs:
        losses = " ".join(f"{x:.6f}" for x in r.losses)
        print(f"{r.name:28} {losses:36} {r.comm_bytes:>20,.0f} {r.memory:>11,}")
    worst = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(runs[-1].params), jax.tree.leaves(ref.params))
    )
    print(f"\nparameters after {args.steps} steps, jaxshard vs jax.jit: max error {worst:.2e} "
          "of each leaf's largest magnitude")  # fmt: skip
    print(f"parameters returned on {runs[-1].params['layers'][0]['wq'].sharding}")


if __name__ == "__main__":
    main()
