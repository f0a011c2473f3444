"""Small, standard model definitions and train steps written in pure JAX + optax.

Each model (an MLP, a GPT-2 style decoder, a Llama-style decoder with stacked
scanned layers, a top-k mixture of experts, a small ResNet and a ViT) comes as
a frozen config dataclass with tiny defaults, an ``init_<name>`` function that
returns a nested dict of float32 arrays, a ``<name>_loss`` function and a
``make_batch_<name>`` function producing random data.  ``make_train_step``
turns any loss into an optax train step, and ``MODELS`` indexes everything by
name so that examples and tests can loop over all models.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

Params = Any
Batch = dict[str, jax.Array]
LossFn = Callable[[Params, Batch], jax.Array]


# --- Shared building blocks ---


def _dense(key: jax.Array, shape: tuple[int, ...], fan_in: int | None = None) -> jax.Array:
    """Normal init scaled by 1/sqrt(fan_in); fan_in defaults to shape[-2]."""
    fan_in = shape[-2] if fan_in is None else fan_in
    return jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5


def _embed(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32) * 0.02


def _init_norm(d: int) -> dict[str, jax.Array]:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def _init_linear(key: jax.Array, d_in: int, d_out: int) -> dict[str, jax.Array]:
    return {"w": _dense(key, (d_in, d_out)), "b": jnp.zeros((d_out,), jnp.float32)}


def _linear(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x @ p["w"] + p["b"]


def _layer_norm(x: jax.Array, p: dict[str, jax.Array], axes: tuple[int, ...] = (-1,)) -> jax.Array:
    mean = x.mean(axes, keepdims=True)
    var = x.var(axes, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """Multi-head attention on (B, S, H, Dh) inputs."""
    logits = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    if causal:
        mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, axis=-1), v)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def _conv(x: jax.Array, w: jax.Array, stride: int = 1, padding: str = "SAME") -> jax.Array:
    return jax.lax.conv_general_dilated(
        x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _init_block(key: jax.Array, d: int, f: int) -> Params:
    """Pre-LN transformer block parameters (shared by GPT and ViT)."""
    ks = jax.random.split(key, 6)
    return {
        "ln1": _init_norm(d),
        "attn": {
            n: _dense(k, (d, d)) for n, k in zip(("wq", "wk", "wv", "wo"), ks[:4], strict=True)
        },
        "ln2": _init_norm(d),
        "mlp": {
            "w1": _dense(ks[4], (d, f)),
            "b1": jnp.zeros((f,), jnp.float32),
            "w2": _dense(ks[5], (f, d)),
            "b2": jnp.zeros((d,), jnp.float32),
        },
    }


def _block(p: Params, x: jax.Array, n_heads: int, causal: bool) -> jax.Array:
    b, s, d = x.shape
    h = _layer_norm(x, p["ln1"])
    q, k, v = ((h @ p["attn"][n]).reshape(b, s, n_heads, d // n_heads) for n in ("wq", "wk", "wv"))
    x = x + _attention(q, k, v, causal).reshape(b, s, d) @ p["attn"]["wo"]
    h = _layer_norm(x, p["ln2"])
    m = p["mlp"]
    return x + jax.nn.gelu(h @ m["w1"] + m["b1"]) @ m["w2"] + m["b2"]


def _token_batch(key: jax.Array, vocab: int, seq: int, batch_size: int) -> Batch:
    """Random token sequences with next-token targets."""
    toks = jax.random.randint(key, (batch_size, seq + 1), 0, vocab, jnp.int32)
    return {"tok": toks[:, :-1], "tgt": toks[:, 1:]}


def _image_batch(
    key: jax.Array, image: int, channels: int, n_classes: int, batch_size: int
) -> Batch:
    k1, k2 = jax.random.split(key)
    return {
        "image": jax.random.normal(k1, (batch_size, image, image, channels), jnp.float32),
        "label": jax.random.randint(k2, (batch_size,), 0, n_classes, jnp.int32),
    }


# --- MLP ---


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """MLP sizes: ``n_layers`` dense layers d_in -> d_hidden ... -> d_out."""

    d_in: int = 16
    d_hidden: int = 64
    d_out: int = 8
    n_layers: int = 2


def init_mlp(key: jax.Array, cfg: MLPConfig) -> Params:
    """Init an MLP with ``n_layers`` dense layers.

    >>> init_mlp(jax.random.key(0), MLPConfig())["layers"][-1]["w"].shape
    (64, 8)
    """
    dims = [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layers - 1) + [cfg.d_out]
    keys = jax.random.split(key, cfg.n_layers)
    layers = zip(keys, dims[:-1], dims[1:], strict=True)
    return {"layers": [_init_linear(k, d_in, d_out) for k, d_in, d_out in layers]}


def mlp_loss(params: Params, batch: Batch, cfg: MLPConfig) -> jax.Array:
    """Mean squared error of a ReLU MLP.

    >>> cfg, key = MLPConfig(), jax.random.key(0)
    >>> mlp_loss(init_mlp(key, cfg), make_batch_mlp(key, cfg), cfg).shape
    ()
    """
    *hidden, last = params["layers"]
    x = batch["x"]
    for layer in hidden:
        x = jax.nn.relu(_linear(layer, x))
    return jnp.mean((_linear(last, x) - batch["y"]) ** 2)


def make_batch_mlp(key: jax.Array, cfg: MLPConfig, batch_size: int = 8) -> Batch:
    """Random regression batch ``{"x": (B, d_in), "y": (B, d_out)}``.

    >>> make_batch_mlp(jax.random.key(0), MLPConfig())["x"].shape
    (8, 16)
    """
    k1, k2 = jax.random.split(key)
    return {
        "x": jax.random.normal(k1, (batch_size, cfg.d_in), jnp.float32),
        "y": jax.random.normal(k2, (batch_size, cfg.d_out), jnp.float32),
    }


# --- GPT (GPT-2 style, unrolled list of layers) ---


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """GPT-2 style decoder sizes."""

    vocab: int = 128
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq: int = 16
    d_ff: int = 256


def init_gpt(key: jax.Array, cfg: GPTConfig) -> Params:
    """Init a GPT-2 style decoder; ``layers`` is a Python list of per-layer dicts.

    >>> init_gpt(jax.random.key(0), GPTConfig())["layers"][0]["attn"]["wq"].shape
    (64, 64)
    """
    k_wte, k_wpe, k_head, *k_layers = jax.random.split(key, cfg.n_layers + 3)
    return {
        "wte": _embed(k_wte, (cfg.vocab, cfg.d_model)),
        "wpe": _embed(k_wpe, (cfg.seq, cfg.d_model)),
        "layers": [_init_block(k, cfg.d_model, cfg.d_ff) for k in k_layers],
        "ln_f": _init_norm(cfg.d_model),
        "head": _dense(k_head, (cfg.d_model, cfg.vocab)),
    }


def gpt_loss(params: Params, batch: Batch, cfg: GPTConfig) -> jax.Array:
    """Next-token cross-entropy of the GPT decoder.

    >>> cfg, key = GPTConfig(), jax.random.key(0)
    >>> gpt_loss(init_gpt(key, cfg), make_batch_gpt(key, cfg), cfg).shape
    ()
    """
    tok = batch["tok"]
    x = params["wte"][tok] + params["wpe"][: tok.shape[1]]
    for layer in params["layers"]:
        x = _block(layer, x, cfg.n_heads, causal=True)
    logits = _layer_norm(x, params["ln_f"]) @ params["head"]
    return _cross_entropy(logits, batch["tgt"])


def make_batch_gpt(key: jax.Array, cfg: GPTConfig, batch_size: int = 8) -> Batch:
    """Random token batch ``{"tok": (B, S), "tgt": (B, S)}`` (int32).

    >>> make_batch_gpt(jax.random.key(0), GPTConfig())["tok"].shape
    (8, 16)
    """
    return _token_batch(key, cfg.vocab, cfg.seq, batch_size)


# --- Llama (stacked layers, scan + remat, RMSNorm, RoPE, GQA, SwiGLU) ---


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama-style decoder sizes; ``n_heads`` must be a multiple of ``n_kv_heads``."""

    vocab: int = 128
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 2
    seq: int = 16
    d_ff: int = 128
    # > 0: each MLP is a top-k mixture of this many experts (Mixtral), tokens routed
    # within their sequence with a capacity of capacity_factor * seq * top_k / n_experts
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25


def init_llama(key: jax.Array, cfg: LlamaConfig) -> Params:
    """Init a Llama-style decoder with layer params stacked along a leading L dim.

    >>> init_llama(jax.random.key(0), LlamaConfig())["layers"]["wk"].shape
    (2, 64, 32)
    """
    L, D, F = cfg.n_layers, cfg.d_model, cfg.d_ff
    dh = D // cfg.n_heads
    shapes = {
        "wq": (L, D, cfg.n_heads * dh),
        "wk": (L, D, cfg.n_kv_heads * dh),
        "wv": (L, D, cfg.n_kv_heads * dh),
        "wo": (L, cfg.n_heads * dh, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    if cfg.n_experts:  # one MLP per expert, and the router
        E = cfg.n_experts
        shapes.update(w_gate=(L, E, D, F), w_up=(L, E, D, F), w_down=(L, E, F, D), router=(L, D, E))
    k_embed, k_head, *ks = jax.random.split(key, len(shapes) + 2)
    layers = {name: _dense(k, shape) for k, (name, shape) in zip(ks, shapes.items(), strict=True)}
    layers["attn_norm"] = jnp.ones((L, D), jnp.float32)
    layers["mlp_norm"] = jnp.ones((L, D), jnp.float32)
    return {
        "embed": _embed(k_embed, (cfg.vocab, D)),
        "layers": layers,
        "norm": jnp.ones((D,), jnp.float32),
        "head": _dense(k_head, (D, cfg.vocab)),
    }


def _rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding on (B, S, H, Dh), rotating the two halves of Dh."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # (S, half)
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def llama_loss(params: Params, batch: Batch, cfg: LlamaConfig) -> jax.Array:
    """Next-token cross-entropy; layers run under ``lax.scan`` with a checkpointed body.

    >>> cfg, key = LlamaConfig(), jax.random.key(0)
    >>> llama_loss(init_llama(key, cfg), make_batch_llama(key, cfg), cfg).shape
    ()
    """
    tok = batch["tok"]
    b, s = tok.shape
    h, kv = cfg.n_heads, cfg.n_kv_heads
    dh = cfg.d_model // h

    @jax.checkpoint
    def layer(x: jax.Array, p: Params) -> tuple[jax.Array, None]:
        y = _rms_norm(x, p["attn_norm"])
        q = _rope((y @ p["wq"]).reshape(b, s, h, dh))
        k = _rope((y @ p["wk"]).reshape(b, s, kv, dh))
        v = (y @ p["wv"]).reshape(b, s, kv, dh)
        k, v = jnp.repeat(k, h // kv, axis=2), jnp.repeat(v, h // kv, axis=2)
        x = x + _attention(q, k, v, causal=True).reshape(b, s, h * dh) @ p["wo"]
        y = _rms_norm(x, p["mlp_norm"])
        if cfg.n_experts:
            return x + _expert_mlp(y, p, cfg), None
        return x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"], None

    x, _ = jax.lax.scan(layer, params["embed"][tok], params["layers"])
    logits = _rms_norm(x, params["norm"]) @ params["head"]
    return _cross_entropy(logits, batch["tgt"])


def _expert_mlp(y: jax.Array, p: Params, cfg: LlamaConfig) -> jax.Array:
    """Top-k mixture of SwiGLU experts on y: (B, S, D), GShard-style einsum dispatch and
    combine, each sequence a routing group; tokens past an expert's capacity are dropped.

    >>> cfg = LlamaConfig(n_experts=4)
    >>> p = jax.tree.map(lambda w: w[0], init_llama(jax.random.key(0), cfg)["layers"])
    >>> _expert_mlp(jnp.ones((2, cfg.seq, cfg.d_model)), p, cfg).shape
    (2, 16, 64)
    """
    b, s, _ = y.shape
    e, k = cfg.n_experts, cfg.top_k
    capacity = math.ceil(cfg.capacity_factor * s * k / e)
    probs = jax.nn.softmax(y @ p["router"], axis=-1)  # (B, S, E)
    gates, idx = jax.lax.top_k(probs, k)  # (B, S, K)
    gates = gates / gates.sum(-1, keepdims=True)
    choice = jax.nn.one_hot(idx, e, dtype=y.dtype)  # (B, S, K, E)
    # each token's slot in its expert's buffer: k-th choices queue after (k-1)-th ones
    queued = choice.transpose(0, 2, 1, 3).reshape(b, k * s, e)
    pos = (jnp.cumsum(queued, axis=1) - 1).reshape(b, k, s, e).transpose(0, 2, 1, 3)
    slot = jnp.sum(pos * choice, axis=-1).astype(jnp.int32)  # (B, S, K)
    slot_1h = jax.nn.one_hot(slot, capacity, dtype=y.dtype)  # (B, S, K, C)
    dispatch = jnp.einsum("bske,bskc->bsec", choice, slot_1h)
    combine = jnp.einsum("bsk,bske,bskc->bsec", gates, choice, slot_1h)
    xe = jnp.einsum("bsec,bsd->becd", dispatch, y)
    h = jax.nn.silu(jnp.einsum("becd,edf->becf", xe, p["w_gate"]))
    h = h * jnp.einsum("becd,edf->becf", xe, p["w_up"])
    return jnp.einsum("bsec,becd->bsd", combine, jnp.einsum("becf,efd->becd", h, p["w_down"]))


def make_batch_llama(key: jax.Array, cfg: LlamaConfig, batch_size: int = 8) -> Batch:
    """Random token batch ``{"tok": (B, S), "tgt": (B, S)}`` (int32).

    >>> make_batch_llama(jax.random.key(0), LlamaConfig())["tgt"].dtype
    dtype('int32')
    """
    return _token_batch(key, cfg.vocab, cfg.seq, batch_size)


# --- Mixture of experts (top-k routing, einsum dispatch/combine, load-balancing loss) ---


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """MoE language model sizes; ``aux_loss_weight`` scales the load-balancing loss."""

    vocab: int = 128
    d_model: int = 64
    n_experts: int = 4
    top_k: int = 2
    d_ff: int = 128
    seq: int = 16
    capacity_factor: float = 2.0
    aux_loss_weight: float = 0.01


def init_moe(key: jax.Array, cfg: MoEConfig) -> Params:
    """Init an embedding -> residual MoE MLP -> head language model.

    >>> init_moe(jax.random.key(0), MoEConfig())["experts"]["w_in"].shape
    (4, 64, 128)
    """
    E, D, F = cfg.n_experts, cfg.d_model, cfg.d_ff
    k_embed, k_router, k_in, k_out, k_head = jax.random.split(key, 5)
    return {
        "embed": _embed(k_embed, (cfg.vocab, D)),
        "router": _dense(k_router, (D, E)),
        "experts": {"w_in": _dense(k_in, (E, D, F)), "w_out": _dense(k_out, (E, F, D))},
        "head": _dense(k_head, (D, cfg.vocab)),
    }


def _moe_layer(p: Params, x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """GShard-style top-k MoE on tokens x: (T, D); returns (output, aux loss)."""
    t, e, k = x.shape[0], cfg.n_experts, cfg.top_k
    capacity = math.ceil(cfg.capacity_factor * t * k / e)
    probs = jax.nn.softmax(x @ p["router"], axis=-1)  # (T, E)
    gates, idx = jax.lax.top_k(probs, k)  # (T, K)
    gates = gates / gates.sum(-1, keepdims=True)
    choice = jax.nn.one_hot(idx, e, dtype=x.dtype)  # (T, K, E)
    # Slot of each (token, choice) in its expert's buffer; k-th choices of all
    # tokens are queued after the (k-1)-th ones.
    queued = choice.transpose(1, 0, 2).reshape(k * t, e)
    pos = (jnp.cumsum(queued, axis=0) - 1).reshape(k, t, e).transpose(1, 0, 2)
    slot = jnp.sum(pos * choice, axis=-1).astype(jnp.int32)  # (T, K)
    # one_hot of an index >= capacity is all zeros, so overflowing tokens are dropped.
    slot_1h = jax.nn.one_hot(slot, capacity, dtype=x.dtype)  # (T, K, C)
    dispatch = jnp.einsum("tke,tkc->tec", choice, slot_1h)
    combine = jnp.einsum("tk,tke,tkc->tec", gates, choice, slot_1h)
    xe = jnp.einsum("tec,td->ecd", dispatch, x)
    he = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", xe, p["experts"]["w_in"]))
    ye = jnp.einsum("ecf,efd->ecd", he, p["experts"]["w_out"])
    y = jnp.einsum("tec,ecd->td", combine, ye)
    # Switch load-balancing loss: E * sum_e (fraction routed to e) * (mean prob of e).
    aux = e * jnp.sum(choice.mean((0, 1)) * probs.mean(0))
    return y, aux


def moe_loss(params: Params, batch: Batch, cfg: MoEConfig) -> jax.Array:
    """Next-token cross-entropy plus ``aux_loss_weight`` times the load-balancing loss.

    >>> cfg, key = MoEConfig(), jax.random.key(0)
    >>> moe_loss(init_moe(key, cfg), make_batch_moe(key, cfg), cfg).shape
    ()
    """
    tok = batch["tok"]
    x = params["embed"][tok].reshape(-1, cfg.d_model)
    y, aux = _moe_layer(params, x, cfg)
    logits = ((x + y) @ params["head"]).reshape(*tok.shape, cfg.vocab)
    return _cross_entropy(logits, batch["tgt"]) + cfg.aux_loss_weight * aux


def make_batch_moe(key: jax.Array, cfg: MoEConfig, batch_size: int = 8) -> Batch:
    """Random token batch ``{"tok": (B, S), "tgt": (B, S)}`` (int32).

    >>> make_batch_moe(jax.random.key(0), MoEConfig(), batch_size=2)["tok"].shape
    (2, 16)
    """
    return _token_batch(key, cfg.vocab, cfg.seq, batch_size)


# --- Conv (small ResNet, NHWC, per-example layer norm) ---


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """ResNet sizes; one stride-2 residual block per entry of ``widths``."""

    image: int = 16
    channels: int = 3
    widths: tuple[int, ...] = (8, 16)
    n_classes: int = 10


def _conv_w(key: jax.Array, k: int, c_in: int, c_out: int) -> jax.Array:
    return _dense(key, (k, k, c_in, c_out), fan_in=k * k * c_in)


def init_conv(key: jax.Array, cfg: ConvConfig) -> Params:
    """Init a ResNet: 3x3 stem, one stride-2 residual block per width, dense head.

    >>> init_conv(jax.random.key(0), ConvConfig())["blocks"][1]["proj"].shape
    (1, 1, 8, 16)
    """
    k_stem, k_head, *k_blocks = jax.random.split(key, len(cfg.widths) + 2)
    c_ins = (cfg.widths[0], *cfg.widths[:-1])
    blocks = []
    for k, c_in, c_out in zip(k_blocks, c_ins, cfg.widths, strict=True):
        k1, k2, k3 = jax.random.split(k, 3)
        blocks.append(
            {
                "conv1": _conv_w(k1, 3, c_in, c_out),
                "norm1": _init_norm(c_out),
                "conv2": _conv_w(k2, 3, c_out, c_out),
                "norm2": _init_norm(c_out),
                "proj": _conv_w(k3, 1, c_in, c_out),
            }
        )
    w0 = cfg.widths[0]
    return {
        "stem": {"w": _conv_w(k_stem, 3, cfg.channels, w0), "norm": _init_norm(w0)},
        "blocks": blocks,
        "head": _init_linear(k_head, cfg.widths[-1], cfg.n_classes),
    }


def conv_loss(params: Params, batch: Batch, cfg: ConvConfig) -> jax.Array:
    """Classification cross-entropy of the ResNet.

    >>> cfg, key = ConvConfig(), jax.random.key(0)
    >>> conv_loss(init_conv(key, cfg), make_batch_conv(key, cfg), cfg).shape
    ()
    """
    hwc = (1, 2, 3)  # normalize each example over H, W, C (no batch statistics)
    x = _conv(batch["image"], params["stem"]["w"])
    x = jax.nn.relu(_layer_norm(x, params["stem"]["norm"], hwc))
    for p in params["blocks"]:
        h = jax.nn.relu(_layer_norm(_conv(x, p["conv1"], stride=2), p["norm1"], hwc))
        h = _layer_norm(_conv(h, p["conv2"]), p["norm2"], hwc)
        x = jax.nn.relu(h + _conv(x, p["proj"], stride=2))
    return _cross_entropy(_linear(params["head"], x.mean((1, 2))), batch["label"])


def make_batch_conv(key: jax.Array, cfg: ConvConfig, batch_size: int = 8) -> Batch:
    """Random image batch ``{"image": (B, H, W, C) f32, "label": (B,) int32}``.

    >>> make_batch_conv(jax.random.key(0), ConvConfig())["image"].shape
    (8, 16, 16, 3)
    """
    return _image_batch(key, cfg.image, cfg.channels, cfg.n_classes, batch_size)


# --- U-Net (segmentation of one large image: 3x3 convolutions, pooling, skips) ---


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """U-Net sizes: ``widths`` per level (one 2x2 average pooling down per level after
    the first, one nearest 2x upsampling back); ``image`` divisible by 2**(levels-1)."""

    image: int = 64
    channels: int = 3
    widths: tuple[int, ...] = (8, 16, 32)
    n_classes: int = 4


def init_unet(key: jax.Array, cfg: UNetConfig) -> Params:
    """Init a U-Net: two 3x3 convolutions per level down and up, a 1x1 head.

    >>> init_unet(jax.random.key(0), UNetConfig())["up"][0]["conv1"].shape
    (3, 3, 48, 16)
    """
    keys = iter(jax.random.split(key, 4 * len(cfg.widths) + 1))
    down, c_in = [], cfg.channels
    for w in cfg.widths:
        down.append(
            {"conv1": _conv_w(next(keys), 3, c_in, w), "conv2": _conv_w(next(keys), 3, w, w)}
        )
        c_in = w
    up = []
    for w, below in zip(cfg.widths[-2::-1], cfg.widths[:0:-1]):
        up.append(
            {"conv1": _conv_w(next(keys), 3, w + below, w), "conv2": _conv_w(next(keys), 3, w, w)}
        )
    return {"down": down, "up": up, "head": _conv_w(next(keys), 1, cfg.widths[0], cfg.n_classes)}


def unet_loss(params: Params, batch: Batch, cfg: UNetConfig) -> jax.Array:
    """Per-pixel segmentation cross-entropy of the U-Net.

    >>> cfg, key = UNetConfig(image=16), jax.random.key(0)
    >>> unet_loss(init_unet(key, cfg), make_batch_unet(key, cfg), cfg).shape
    ()
    """
    x, skips = batch["image"], []
    for i, p in enumerate(params["down"]):
        if i:
            x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
        x = jax.nn.relu(_conv(jax.nn.relu(_conv(x, p["conv1"])), p["conv2"]))
        skips.append(x)
    for p, skip in zip(params["up"], skips[-2::-1]):
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)  # nearest upsampling
        x = jnp.concatenate([skip, x], axis=-1)
        x = jax.nn.relu(_conv(jax.nn.relu(_conv(x, p["conv1"])), p["conv2"]))
    logits = _conv(x, params["head"])
    labels = jax.nn.one_hot(batch["mask"], logits.shape[-1])
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))


def make_batch_unet(key: jax.Array, cfg: UNetConfig, batch_size: int = 1) -> Batch:
    """Random images and masks ``{"image": (B, H, W, C) f32, "mask": (B, H, W) int32}``.

    >>> make_batch_unet(jax.random.key(0), UNetConfig())["mask"].shape
    (1, 64, 64)
    """
    k_image, k_mask = jax.random.split(key)
    shape = (batch_size, cfg.image, cfg.image)
    return {
        "image": jax.random.normal(k_image, (*shape, cfg.channels), jnp.float32),
        "mask": jax.random.randint(k_mask, shape, 0, cfg.n_classes, jnp.int32),
    }


# --- ViT (conv patch embedding, class token, pre-LN blocks) ---


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """ViT sizes; ``image`` must be divisible by ``patch``."""

    image: int = 16
    patch: int = 4
    channels: int = 3
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 1
    n_classes: int = 10


def init_vit(key: jax.Array, cfg: ViTConfig) -> Params:
    """Init a ViT with a conv patch embedding and a class token.

    >>> init_vit(jax.random.key(0), ViTConfig())["pos"].shape
    (17, 64)
    """
    D, P = cfg.d_model, cfg.patch
    n_tokens = (cfg.image // P) ** 2 + 1
    k_patch, k_cls, k_pos, k_head, *k_layers = jax.random.split(key, cfg.n_layers + 4)
    return {
        "patch": {"w": _conv_w(k_patch, P, cfg.channels, D), "b": jnp.zeros((D,), jnp.float32)},
        "cls": _embed(k_cls, (D,)),
        "pos": _embed(k_pos, (n_tokens, D)),
        "layers": [_init_block(k, D, 4 * D) for k in k_layers],
        "ln_f": _init_norm(D),
        "head": _init_linear(k_head, D, cfg.n_classes),
    }


def vit_loss(params: Params, batch: Batch, cfg: ViTConfig) -> jax.Array:
    """Classification cross-entropy of the ViT, read from the class token.

    >>> cfg, key = ViTConfig(), jax.random.key(0)
    >>> vit_loss(init_vit(key, cfg), make_batch_vit(key, cfg), cfg).shape
    ()
    """
    p = params["patch"]
    x = _conv(batch["image"], p["w"], stride=cfg.patch, padding="VALID") + p["b"]
    b = x.shape[0]
    x = x.reshape(b, -1, cfg.d_model)
    cls = jnp.broadcast_to(params["cls"], (b, 1, cfg.d_model))
    x = jnp.concatenate([cls, x], axis=1) + params["pos"]
    for layer in params["layers"]:
        x = _block(layer, x, cfg.n_heads, causal=False)
    x = _layer_norm(x[:, 0], params["ln_f"])
    return _cross_entropy(_linear(params["head"], x), batch["label"])


def make_batch_vit(key: jax.Array, cfg: ViTConfig, batch_size: int = 8) -> Batch:
    """Random image batch ``{"image": (B, H, W, C) f32, "label": (B,) int32}``.

    >>> make_batch_vit(jax.random.key(0), ViTConfig())["label"].shape
    (8,)
    """
    return _image_batch(key, cfg.image, cfg.channels, cfg.n_classes, batch_size)


# --- Training ---


def make_train_step(
    loss_fn: LossFn, optimizer: optax.GradientTransformation
) -> Callable[[Params, optax.OptState, Batch], tuple[Params, optax.OptState, jax.Array]]:
    """Build ``train_step(params, opt_state, batch) -> (params, opt_state, loss)``.

    ``loss_fn(params, batch)`` must have its config already bound.

    >>> from functools import partial
    >>> cfg, key, opt = MLPConfig(), jax.random.key(0), optax.adamw(1e-3)
    >>> params = init_mlp(key, cfg)
    >>> step = jax.jit(make_train_step(partial(mlp_loss, cfg=cfg), opt))
    >>> params, opt_state, loss = step(params, opt.init(params), make_batch_mlp(key, cfg))
    """

    def train_step(params: Params, opt_state: optax.OptState, batch: Batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


# Model name -> (config class, init fn, loss fn, batch fn), e.g.
#   cfg_cls, init, loss, make_batch = MODELS["gpt"]
#   cfg = cfg_cls(); loss(init(key, cfg), make_batch(key, cfg), cfg)
MODELS: dict[str, tuple[type, Callable, Callable, Callable]] = {
    "mlp": (MLPConfig, init_mlp, mlp_loss, make_batch_mlp),
    "gpt": (GPTConfig, init_gpt, gpt_loss, make_batch_gpt),
    "llama": (LlamaConfig, init_llama, llama_loss, make_batch_llama),
    "moe": (MoEConfig, init_moe, moe_loss, make_batch_moe),
    "conv": (ConvConfig, init_conv, conv_loss, make_batch_conv),
    "vit": (ViTConfig, init_vit, vit_loss, make_batch_vit),
}


# Hint sets per model on a (data, model) mesh: tensor parallel ("tp"), FSDP (a weight dim
# stored on the batch's axis), FSDP + tensor parallel or expert parallel, and the batch
# alone, each with the batch on "data"; for GPT and Llama also the sequence's positions
# split ("seq", context parallel: on "model" beside the batch, or over both axes). The
# plan-quality tests and benchmarks use them.
_BATCH = {r"batch/.*": P("data")}
HINT_SETS: dict[str, dict[str, dict[str, P]]] = {
    "gpt": {
        "tp": {**_BATCH, r"params/layers/\d+/attn/wq": P(None, "model"), r"params/layers/\d+/mlp/w1": P(None, "model")},
        "fsdp": {**_BATCH, r"params/layers/\d+/mlp/w1": P("data")},
        "fsdp+tp": {**_BATCH, r"params/layers/\d+/attn/wq": P("data", "model"),
                    r"params/layers/\d+/mlp/w1": P("data", "model")},
        "batch": {**_BATCH},
        "seq": {r"batch/.*": P("data", "model")},
    },
    "llama": {
        "tp": {**_BATCH, r"params/layers/wq": P(None, None, "model"), r"params/layers/w_gate": P(None, None, "model")},
        "fsdp": {**_BATCH, r"params/layers/w_gate": P(None, "data")},
        "fsdp+tp": {**_BATCH, r"params/layers/wq": P(None, "data", "model"),
                    r"params/layers/w_gate": P(None, "data", "model")},
        "batch": {**_BATCH},
        "seq": {r"batch/.*": P(None, ("data", "model"))},
    },
    "moe": {
        "tp": {**_BATCH, r"params/experts/w_in": P(None, None, "model")},
        "fsdp": {**_BATCH, r"params/experts/w_in": P(None, "data")},
        "expert": {**_BATCH, r"params/experts/w_in": P("model")},
        "batch": {**_BATCH},
    },
    "conv": {
        "tp": {**_BATCH, r"params/blocks/\d+/conv1": P(None, None, None, "model")},
        "fsdp": {**_BATCH, r"params/blocks/\d+/conv1": P(None, None, "data")},
        "fsdp+tp": {**_BATCH, r"params/blocks/\d+/conv1": P(None, None, "data", "model")},
        "batch": {**_BATCH},
    },
    "vit": {
        "tp": {**_BATCH, r"params/layers/\d+/attn/wq": P(None, "model"), r"params/layers/\d+/mlp/w1": P(None, "model")},
        "fsdp": {**_BATCH, r"params/layers/\d+/mlp/w1": P("data")},
        "fsdp+tp": {**_BATCH, r"params/layers/\d+/attn/wq": P("data", "model"),
                    r"params/layers/\d+/mlp/w1": P("data", "model")},
        "batch": {**_BATCH},
    },
}  # fmt: skip
