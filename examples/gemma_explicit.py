# Copyright 2024 The Flax Authors.
# Copyright 2026 The jaxshard Authors (this reduction).
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#    http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Derived from Flax's Gemma example, github.com/google/flax, examples/gemma at commit
# 9bed4350e54c1b8e62cee4a76847c5ce6c6f1909: transformer_cfg.py (ShardingConfig,
# TransformerConfig), layers.py (RMSNorm), modules.py (ScaledEmbed, Attention, FeedForward,
# Block), transformer.py (Transformer, make_causal_attn_mask), train.py
# (compute_weighted_cross_entropy, the train step's loss and AdamW), and
# positional_embeddings.py (apply_rope) at commit f3c115183d9f82db3afefaddc7ab9743cbf2f667.
# Reduced: no KV cache, sampling, sow hooks, dropout, QK norm or checkpoint loading; the
# sharding configuration and every sharding annotation of the model are kept.
"""Flax's Gemma example, written for JAX's explicit sharding, planned by jaxshard.

The model fixes its whole FSDP+TP layout itself, as Flax's Gemma example does: its
``ShardingConfig.fsdp_tp_sharding`` puts a spec on every weight (``nnx.Param`` metadata
``out_sharding=``) and on the activations between layers (``out_sharding=`` of each
einsum, projection and embedding lookup). The train step (loss, gradient, one AdamW
update) runs twice on an Explicit (fsdp=2, tp=4) mesh of 8 devices:

- the example's own run: the model created under ``jax.set_mesh`` (its parameters and
  optimizer state placed by their metadata) and the step under plain `jax.jit`;
- jaxshard: ``auto_shard(mesh, hints={batch: P("fsdp")})`` on the same model code, the
  state passed unplaced; the model's annotations are its pins, the rest is planned.

Losses, collective bytes per device and memory per device come from the compiled
programs (`jaxshard.baseline.compiled_cost`):

    python examples/gemma_explicit.py [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from collections.abc import Iterable

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
from jaxshard.baseline import compiled_cost  # noqa: E402

K_MASK = -2.3819763e38  # the example's large negative logit for masked positions
HINTS = {r"batch/.*": P("fsdp")}  # the batch on the FSDP axis; nothing else


# --- transformer_cfg.py -------------------------------------------------------------


class AttentionType(enum.Enum):
    """Global attention, or attention within a sliding window (Gemma 2's local layers)."""

    GLOBAL = 1
    LOCAL_SLIDING = 2


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Specs of the weights (``*_weight_*``, ``emb_vd``) and of the activations between
    layers (``act_*``); letters name the dims: b batch, t sequence, d model, f hidden,
    n heads, h head dim, v vocabulary, c/s the stacked q/k/v."""

    emb_vd: P | None = None
    q_weight_ndh: P | None = None
    kv_weight_cndh: P | None = None
    qkv_weight_cndh: P | None = None
    o_weight_nhd: P | None = None
    ffw_weight_df: P | None = None
    ffw_weight_fd: P | None = None
    rms_norm_weight: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_btnh: P | None = None
    act_sbtnh: P | None = None
    fsdp_axis_name: str = "fsdp"
    tensor_parallel_axis_name: str = "tensor"

    @staticmethod
    def no_sharding() -> ShardingConfig:
        """No annotations at all.

        Example:
            >>> ShardingConfig.no_sharding().act_btd is None
            True
        """
        return ShardingConfig()

    @staticmethod
    def fsdp_tp_sharding(
        is_sampling: bool = False,
        fsdp_axis_name: str = "fsdp",
        tensor_parallel_axis_name: str = "tp",
    ) -> ShardingConfig:
        """The example's FSDP+TP layout: weights split over both axes, activations with
        the batch on the FSDP axis and the model, hidden and head dims on the TP axis.

        Example:
            >>> ShardingConfig.fsdp_tp_sharding().q_weight_ndh
            P('tp', 'fsdp', None)
        """
        fsdp = fsdp_axis_name if not is_sampling else None
        tp = tensor_parallel_axis_name
        return ShardingConfig(
            emb_vd=P(tp, fsdp),
            q_weight_ndh=P(tp, fsdp, None),
            kv_weight_cndh=P(None, tp, fsdp, None),
            qkv_weight_cndh=P(None, tp, fsdp, None),
            o_weight_nhd=P(tp, None, fsdp),
            ffw_weight_df=P(fsdp, tp),
            ffw_weight_fd=P(tp, fsdp),
            rms_norm_weight=P(tp),
            act_btd=P(fsdp, None, None if is_sampling else tp),
            act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None),
            act_sbtnh=P(None, fsdp, None, tp, None),
            fsdp_axis_name=fsdp_axis_name,
            tensor_parallel_axis_name=tensor_parallel_axis_name,
        )


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and switches of the text-only Gemma transformer."""

    num_layers: int
    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    final_logit_softcap: float | None
    use_post_attn_norm: bool
    use_post_ffw_norm: bool
    attention_types: Iterable[AttentionType]
    attn_logits_soft_cap: float | None = None
    sliding_window_size: int | None = None
    shd_config: ShardingConfig = ShardingConfig.no_sharding()

    def query_pre_attn_scalar(self) -> float:
        """Gemma's default query scaling, 1/sqrt(head_dim)."""
        return self.head_dim**-0.5

    @classmethod
    def tiny(cls, **override) -> TransformerConfig:
        """A Gemma 2 shaped model (local and global layers, post norms, soft caps), tiny
        enough to compile in a second or two on CPU.

        Example:
            >>> TransformerConfig.tiny(num_layers=1).attention_types
            (<AttentionType.LOCAL_SLIDING: 2>,)
        """
        num_layers = override.pop("num_layers", 2)
        config = dict(
            num_layers=num_layers,
            num_embed=128,
            embed_dim=32,
            hidden_dim=64,
            num_heads=4,
            head_dim=8,
            num_kv_heads=4,
            final_logit_softcap=30.0,
            use_post_attn_norm=True,
            use_post_ffw_norm=True,
            attention_types=(AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL)
            * ((num_layers + 1) // 2),
            attn_logits_soft_cap=50.0,
            sliding_window_size=8,
        )
        config.update(override)
        config["attention_types"] = tuple(config["attention_types"])[:num_layers]
        return cls(**config)


# --- layers.py, positional_embeddings.py ------------------------------------------


class RMSNorm(nnx.Module):
    """RMSNorm with a zero-initialized scale applied as ``1 + scale``."""

    def __init__(self, dim: int, *, scale_metadata: dict | None = None, rngs: nnx.Rngs):
        scale = nnx.initializers.zeros_init()(rngs.params(), dim, jnp.float32)
        self.scale = nnx.Param(scale, **(scale_metadata or {}))

    def __call__(self, x: jax.Array) -> jax.Array:
        mean2 = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(mean2 + 1e-06) * (1.0 + self.scale[...])


def apply_rope(
    inputs: jax.Array, positions: jax.Array, head_dim: int, max_wavelength: int = 10_000
) -> jax.Array:
    """Rotary position embedding of ``inputs`` [B, T, N, H] at ``positions`` [B, T]."""
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    timescale = max_wavelength**fraction
    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    sin, cos = jnp.sin(sinusoid_inp), jnp.cos(sinusoid_inp)
    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return jnp.concatenate([first_part, second_part], axis=-1).astype(inputs.dtype)


# --- modules.py ---------------------------------------------------------------------


class ScaledEmbed(nnx.Embed):
    """Token embedding scaled by sqrt(embed_dim); ``attend`` gives the logits."""

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        x = super().__call__(x, out_sharding)
        return x * jnp.sqrt(x.shape[-1])


class Attention(nnx.Module):
    """Multi-head (or grouped/multi-query) attention with RoPE, optional logit soft cap
    and sliding window; every projection carries its weight and output specs."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        features: int,
        head_dim: int,
        query_pre_attn_scalar: float,
        attn_type: AttentionType,
        *,
        rngs: nnx.Rngs,
        attn_logits_soft_cap: float | None = None,
        sliding_window_size: int | None = None,
        shd_config: ShardingConfig,
    ):
        if attn_type == AttentionType.LOCAL_SLIDING and sliding_window_size is None:
            raise ValueError("`sliding_window_size` must be set if `attn_type` is Local Sliding.")
        self.shd_config = shd_config
        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.attn_type = attn_type
        self.sliding_window_size = sliding_window_size
        self.attn_logits_soft_cap = attn_logits_soft_cap
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.attn_vec_einsum = nnx.Einsum(
            einsum_str="BTNH,NHD->BTD",
            kernel_shape=(num_heads, head_dim, features),
            kernel_metadata={"out_sharding": shd_config.o_weight_nhd},
            rngs=rngs,
        )
        self.act_cbtkh_shd = None
        self.use_qkv_einsum = num_heads == num_kv_heads
        if self.use_qkv_einsum:
            self.qkv_einsum = nnx.Einsum(
                einsum_str="BTD,SNDH->SBTNH",
                kernel_shape=(3, num_heads, features, head_dim),
                kernel_metadata={"out_sharding": shd_config.qkv_weight_cndh},
                rngs=rngs,
            )
        else:
            self.q_einsum = nnx.Einsum(
                einsum_str="BTD,NDH->BTNH",
                kernel_shape=(num_heads, features, head_dim),
                kernel_metadata={"out_sharding": shd_config.q_weight_ndh},
                rngs=rngs,
            )
            kv_weight = (
                shd_config.kv_weight_cndh
                if num_kv_heads > 1
                else P(None, None, shd_config.fsdp_axis_name, None)
            )
            self.kv_einsum = nnx.Einsum(
                einsum_str="BTD,CKDH->CBTKH",
                kernel_shape=(2, num_kv_heads, features, head_dim),
                kernel_metadata={"out_sharding": kv_weight},
                rngs=rngs,
            )
            if shd_config.kv_weight_cndh:
                self.act_cbtkh_shd = (
                    shd_config.act_sbtnh
                    if num_kv_heads > 1
                    else P(None, shd_config.fsdp_axis_name, None, None, None)
                )

    def __call__(self, x: jax.Array, segment_pos: jax.Array, attn_mask: jax.Array) -> jax.Array:
        if self.use_qkv_einsum:
            query_proj, key_proj, value_proj = self.qkv_einsum(
                x, out_sharding=self.shd_config.act_sbtnh
            )
        else:
            query_proj = self.q_einsum(x, out_sharding=self.shd_config.act_btnh)
            key_proj, value_proj = self.kv_einsum(x, out_sharding=self.act_cbtkh_shd)

        query_proj = apply_rope(query_proj, segment_pos, head_dim=self.head_dim)
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(key_proj, segment_pos, head_dim=self.head_dim)

        use_gqa = self.num_heads > self.num_kv_heads and self.num_kv_heads > 1
        b, t = query_scaled.shape[:2]
        if use_gqa:
            groups = self.num_heads // self.num_kv_heads
            grouped = query_scaled.reshape((b, t, self.num_kv_heads, groups, self.head_dim))
            logits = jnp.einsum("BTKGH,BSKH->BTKGS", grouped, key_proj)
            logits = logits.reshape((b, t, self.num_heads, -1))
        else:
            logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, key_proj)

        if self.attn_logits_soft_cap is not None:
            logits = jnp.tanh(logits / self.attn_logits_soft_cap) * self.attn_logits_soft_cap
        if self.attn_type == AttentionType.LOCAL_SLIDING:
            all_ones = jnp.ones(attn_mask.shape, dtype=attn_mask.dtype)
            sliding_mask = jnp.triu(all_ones, -1 * self.sliding_window_size + 1) * jnp.tril(
                all_ones, self.sliding_window_size - 1
            )
            attn_mask = sliding_mask * attn_mask

        padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
        if use_gqa:
            groups = self.num_heads // self.num_kv_heads
            probs = probs.reshape((b, t, self.num_kv_heads, groups, -1))
            encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value_proj)
            encoded = encoded.reshape((b, t, self.num_heads, self.head_dim))
        else:
            encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj)
        return self.attn_vec_einsum(encoded, out_sharding=self.shd_config.act_btd)


class FeedForward(nnx.Module):
    """Gated GELU MLP: ``down(gelu(gate(x)) * up(x))``."""

    def __init__(
        self, features: int, hidden_dim: int, *, rngs: nnx.Rngs, shd_config: ShardingConfig
    ):
        def linear(n_in: int, n_out: int, spec: P | None) -> nnx.Linear:
            return nnx.Linear(
                in_features=n_in,
                out_features=n_out,
                use_bias=False,
                rngs=rngs,
                kernel_init=nnx.initializers.normal(),
                kernel_metadata={"out_sharding": spec},
            )

        self.gate_proj = linear(features, hidden_dim, shd_config.ffw_weight_df)
        self.up_proj = linear(features, hidden_dim, shd_config.ffw_weight_df)
        self.down_proj = linear(hidden_dim, features, shd_config.ffw_weight_fd)
        self.shd_config = shd_config

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_value = nnx.gelu(self.gate_proj(x, out_sharding=self.shd_config.act_btf))
        ff1 = self.up_proj(x, out_sharding=self.shd_config.act_btf)
        return self.down_proj(gate_value * ff1, out_sharding=self.shd_config.act_btd)


class Block(nnx.Module):
    """Transformer block: pre/post-normed attention, then pre/post-normed MLP."""

    def __init__(self, config: TransformerConfig, attn_type: AttentionType, *, rngs: nnx.Rngs):
        shd = config.shd_config

        def norm() -> RMSNorm:
            return RMSNorm(
                config.embed_dim, scale_metadata={"out_sharding": shd.rms_norm_weight}, rngs=rngs
            )

        self.pre_attention_norm = norm()
        self.attn = Attention(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            features=config.embed_dim,
            head_dim=config.head_dim,
            query_pre_attn_scalar=config.query_pre_attn_scalar(),
            attn_type=attn_type,
            attn_logits_soft_cap=config.attn_logits_soft_cap,
            sliding_window_size=config.sliding_window_size,
            rngs=rngs,
            shd_config=shd,
        )
        self.post_attention_norm = norm() if config.use_post_attn_norm else None
        self.pre_ffw_norm = norm()
        self.mlp = FeedForward(config.embed_dim, config.hidden_dim, rngs=rngs, shd_config=shd)
        self.post_ffw_norm = norm() if config.use_post_ffw_norm else None

    def __call__(self, x: jax.Array, segment_pos: jax.Array, attn_mask: jax.Array) -> jax.Array:
        attn_output = self.attn(self.pre_attention_norm(x), segment_pos, attn_mask)
        if self.post_attention_norm is not None:
            attn_output = self.post_attention_norm(attn_output)
        x += attn_output
        ffw_outputs = self.mlp(self.pre_ffw_norm(x))
        if self.post_ffw_norm is not None:
            ffw_outputs = self.post_ffw_norm(ffw_outputs)
        return x + ffw_outputs


# --- transformer.py -----------------------------------------------------------------


class Transformer(nnx.Module):
    """Gemma text-only transformer: embed, blocks, final norm, tied-embedding logits."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.embedder = ScaledEmbed(
            config.num_embed,
            config.embed_dim,
            rngs=rngs,
            embedding_metadata={"out_sharding": config.shd_config.emb_vd},
        )
        self.layers = nnx.List(
            [
                Block(config, attn_type, rngs=rngs)
                for _, attn_type in zip(range(config.num_layers), config.attention_types)
            ]
        )
        self.final_norm = RMSNorm(
            config.embed_dim,
            scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
            rngs=rngs,
        )
        self.final_logits_softcap = config.final_logit_softcap
        self.shd_config = config.shd_config

    def __call__(
        self, last_tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array
    ) -> jax.Array:
        x = self.embedder(last_tokens, out_sharding=self.shd_config.act_btd)
        for layer in self.layers:
            x = layer(x, positions, attention_mask)
        x = self.final_norm(x)
        logits = self.embedder.attend(x, out_sharding=self.shd_config.act_btd)
        if self.final_logits_softcap is not None:
            logits /= self.final_logits_softcap
            logits = jnp.tanh(logits) * self.final_logits_softcap
        return logits


def make_causal_attn_mask(input_mask: jax.Array) -> jax.Array:
    """[B, L, L] mask: token i attends to non-padded tokens j <= i."""
    seq_len = input_mask.shape[-1]
    causal_mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))
    return input_mask[..., None, :] * causal_mask[None, ...]


def build_positions_from_mask(input_mask: jax.Array) -> jax.Array:
    """Positions for RoPE: 0-based counts of the non-padded tokens."""
    positions = jnp.cumsum(input_mask, axis=-1)
    return positions - (positions >= 1)


# --- train.py -----------------------------------------------------------------------


def compute_weighted_cross_entropy(logits, targets, weights):
    """Per-sample cross entropy [B], normalized by the number of non-padded tokens."""
    soft_targets = jax.nn.one_hot(targets, logits.shape[-1])
    loss = -jnp.sum(soft_targets * nnx.log_softmax(logits), axis=-1) * weights
    return loss.sum(axis=1) * len(loss) / weights.sum()


def make_optimizer(learning_rate: float = 1e-3) -> optax.GradientTransformation:
    """AdamW as the example configures it (its betas, eps and weight decay)."""
    return optax.adamw(learning_rate, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)


def create(config: TransformerConfig, seed: int = 0) -> tuple[Transformer, nnx.Optimizer]:
    """The model and its AdamW optimizer. Under ``jax.set_mesh`` (and Flax's eager
    sharding, on by default) each parameter and its optimizer state are created placed
    by their metadata; under ``nnx.use_eager_sharding(False)`` they are created unplaced,
    the metadata kept on the variables.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     model, _ = create(TransformerConfig.tiny(
        ...         shd_config=ShardingConfig.fsdp_tp_sharding()))
        >>> model.embedder.embedding.out_sharding
        P('tp', 'fsdp')
    """
    model = Transformer(config, rngs=nnx.Rngs(params=seed))
    return model, nnx.Optimizer(model, make_optimizer(), wrt=nnx.Param)


def train_step(state: nnx.State, batch: dict, graphdef: nnx.GraphDef):
    """One step in NNX functional style: the loss, its gradient, one AdamW update.
    Returns the new state and the loss.

    Example:
        >>> state, loss = jax.jit(train_step, static_argnames="graphdef")(
        ...     state, batch, graphdef)  # doctest: +SKIP
    """
    model, optimizer = nnx.merge(graphdef, state)
    inputs, targets = batch["inputs"], batch["targets"]
    input_mask = inputs > 0  # the example's pad id
    weights = input_mask.astype(jnp.float32)
    attention_mask = make_causal_attn_mask(input_mask)
    positions = build_positions_from_mask(input_mask)

    def loss_fn(model):
        logits = model(inputs, positions, attention_mask)
        return compute_weighted_cross_entropy(logits, targets, weights).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss


def make_batch(config: TransformerConfig, batch: int = 8, seq: int = 16, seed: int = 1) -> dict:
    """Random token ids (1.., no padding) as ``inputs`` and their next tokens as
    ``targets``, shape (batch, seq)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, config.num_embed, (batch, seq + 1), np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


# --- the two runs -------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One program's losses per step, final state and compiled cost."""

    name: str
    losses: list
    state: nnx.State
    comm_bytes: float  # collective ring bytes per device per step
    memory: int  # bytes per device: arguments + results + temporaries - aliased


def _train(name, fn, lower, mesh, steps, state, batch, graphdef) -> Run:
    """Compile once (reading the cost), then run ``steps`` steps of that program."""
    cost = compiled_cost(lower(state, batch, graphdef).compile(), mesh)
    losses = []
    for _ in range(steps):
        state, loss = fn(state, batch, graphdef)
        losses.append(float(loss))
    return Run(name, losses, state, cost.bytes, cost.memory)


def make_mesh() -> jax.sharding.Mesh:
    """The example's mesh: (fsdp=2, tp=4), axes Explicit (jax.make_mesh's default)."""
    return jax.make_mesh((2, 4), ("fsdp", "tp"))


def compare(
    config: TransformerConfig | None = None, steps: int = 2, mesh=None
) -> tuple[Run, Run, jaxshard.Plan]:
    """Train ``steps`` steps as the example does (plain `jax.jit`, state placed by its
    metadata) and with jaxshard (batch hint only, state unplaced); returns both runs and
    jaxshard's plan.

    Example:
        >>> example, sharded, plan = compare(steps=1)  # doctest: +SKIP
    """
    mesh = mesh or make_mesh()
    config = config or TransformerConfig.tiny(shd_config=ShardingConfig.fsdp_tp_sharding())
    host_batch = make_batch(config)
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: create(config)))

    # the example's own run: created under the mesh, so placed by the metadata (in one
    # jit, which creates each shard where it lives)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: nnx.state(create(config)))()
        batch = jax.device_put(host_batch, jax.NamedSharding(mesh, P("fsdp")))
        jitted = jax.jit(train_step, static_argnames="graphdef")
        example = _train("jax.jit, the example's FSDP+TP", jitted, jitted.lower, mesh, steps,
                         state, batch, graphdef)  # fmt: skip

    # jaxshard: the same code and starting values, nothing placed, only the batch hint
    step = jaxshard.auto_shard(mesh, HINTS, static_argnames="graphdef")(train_step)
    host_state = jax.device_get(state)  # NumPy arrays; the variables keep their metadata
    sharded = _train("jaxshard, batch hint only", step, step.lower, mesh, steps,
                     host_state, host_batch, graphdef)  # fmt: skip
    plan = step.plan(host_state, host_batch, graphdef)
    return example, sharded, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    example, sharded, plan = compare(steps=args.steps)
    print(f"{'program':32} {'losses':36} {'collective bytes/dev':>20} {'memory/dev':>11}")
    for r in (example, sharded):
        losses = " ".join(f"{x:.6f}" for x in r.losses)
        print(f"{r.name:32} {losses:36} {r.comm_bytes:>20,.0f} {r.memory:>11,}")
    print(
        f"\njaxshard / example: collective bytes {sharded.comm_bytes / example.comm_bytes:.3f}x, "
        f"memory {sharded.memory / example.memory:.3f}x"
    )
    rel = max(abs(a - b) / abs(b) for a, b in zip(sharded.losses, example.losses))
    print(f"losses: largest relative difference {rel:.1e}")


if __name__ == "__main__":
    main()
