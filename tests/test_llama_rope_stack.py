"""A hand-written Llama whose RoPE rotates interleaved pairs with `jnp.stack` (the common
way to write it): from hints on ``wq`` and the MLP gate alone, propagation shards every
attention and MLP weight Megatron-style across the stack, and SGD steps match unsharded.

Without a rule for `stack` the planner stops at RoPE: in the forward pass (and in the
train step too when `unstack`, stack's transpose, has no rule either) ``wk``, ``wv`` and
``wo`` stay replicated and the attention runs redundantly on every device of the model
axis.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_leaves_match
from jax.sharding import PartitionSpec as P

import jaxshard

VOCAB, D, HEADS, KV_HEADS, FF, SEQ, LAYERS = 64, 32, 8, 4, 64, 8, 2
DH = D // HEADS


def init(key):
    def dense(k, shape):
        return jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5

    names = {
        "wq": (D, HEADS * DH),
        "wk": (D, KV_HEADS * DH),
        "wv": (D, KV_HEADS * DH),
        "wo": (HEADS * DH, D),
        "w_gate": (D, FF),
        "w_up": (D, FF),
        "w_down": (FF, D),
    }
    keys = iter(jax.random.split(key, 2 + LAYERS * len(names)))
    layers = [
        {n: dense(next(keys), s) for n, s in names.items()} | {"norm": jnp.ones(D)}
        for _ in range(LAYERS)
    ]
    return {
        "embed": jax.random.normal(next(keys), (VOCAB, D)) * 0.02,
        "layers": layers,
        "head": dense(next(keys), (D, VOCAB)),
    }


def rope(x):
    """Rotate interleaved pairs (x[2i], x[2i+1]) of (B, S, H, Dh), GPT-J/Llama style."""
    b, s, h, dh = x.shape
    freqs = 10000.0 ** (-jnp.arange(dh // 2, dtype=jnp.float32) / (dh // 2))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    pairs = x.reshape(b, s, h, dh // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def loss_fn(params, batch):
    tok = batch["tok"]
    b, s = tok.shape
    x = params["embed"][tok]
    for p in params["layers"]:
        y = rms_norm(x, p["norm"])
        q = rope((y @ p["wq"]).reshape(b, s, HEADS, DH))
        k = rope((y @ p["wk"]).reshape(b, s, KV_HEADS, DH))
        v = (y @ p["wv"]).reshape(b, s, KV_HEADS, DH)
        k, v = jnp.repeat(k, HEADS // KV_HEADS, 2), jnp.repeat(v, HEADS // KV_HEADS, 2)
        logits = jnp.einsum("bshd,bthd->bhst", q, k) / DH**0.5
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e9)
        att = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, -1), v)
        x = x + att.reshape(b, s, D) @ p["wo"]
        y = rms_norm(x, p["norm"])
        x = x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]
    logp = jax.nn.log_softmax(x @ params["head"], -1)
    return -jnp.take_along_axis(logp, batch["tgt"][..., None], -1).mean()


HINTS = {
    r"batch/.*": P("data"),
    r"params/layers/\d+/wq": P(None, "model"),
    r"params/layers/\d+/w_gate": P(None, "model"),
}


@pytest.fixture(scope="module")
def llama(mesh):
    params = init(jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (4, SEQ + 1), 0, VOCAB)
    batch = {"tok": tok[:, :-1], "tgt": tok[:, 1:]}
    opt = optax.sgd(0.1)

    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return jaxshard.auto_shard(mesh, HINTS)(step), step, params, opt.init(params), batch


def test_rope_is_written_with_stack():
    x = jnp.ones((1, SEQ, HEADS, DH))
    names = {e.primitive.name for e in jax.make_jaxpr(rope)(x).eqns}
    assert "stack" in names


def test_megatron_layout_propagates_through_stack(llama):
    sharded, _, params, state, batch = llama
    plan = sharded.plan(params, state, batch)  # a JaxshardWarning (unknown primitive) fails
    _assert_megatron(plan.in_specs[0]["layers"])


def _assert_megatron(layers):
    for layer in layers:
        column = {n: layer[n] for n in ("wq", "wk", "wv", "w_gate", "w_up")}
        row = {n: layer[n] for n in ("wo", "w_down")}
        assert column == dict.fromkeys(column, P(None, "model")), column
        assert row == dict.fromkeys(row, P("model")), row


def test_forward_alone_crosses_stack(llama, mesh):
    """No backward pass to route around RoPE: q reaches attention only through `stack`."""
    _, _, params, _, batch = llama
    plan = jaxshard.auto_shard(mesh, HINTS)(loss_fn).plan(params, batch)
    _assert_megatron(plan.in_specs[0]["layers"])


def test_sgd_steps_match_unsharded(llama):
    sharded, step, params, state, batch = llama
    p, s, rp, rs = params, state, params, state
    for _ in range(2):
        p, s, loss = sharded(p, s, batch)
        rp, rs, ref = jax.jit(step)(rp, rs, batch)
        np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert_leaves_match(p, rp)
