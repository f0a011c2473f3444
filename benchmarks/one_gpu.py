"""jaxshard's program against plain `jax.jit` on one accelerator: what the planned program
costs where nothing is split.

On one device every layout is replicated, so jaxshard's program differs from the user's
only by what jaxshard writes into it: sharding constraints (no-ops on one device) and the
jaxpr rewrites of `jaxshard.rewrite` (an average pooling's gradient as one window sum
over a base-dilated input). Each row times a train step (AdamW) both ways, in float32
and bfloat16 (parameters, optimizer state and inputs cast): the median of ``--runs``
steps of a training loop (each step's new parameters and optimizer state the next one's
arguments) after two warm-ups, each step's outputs blocked on, which counts the host's
per-call work (jaxshard's: the plan cache's key, one identity test per leaf) in full;
and the mean of as many steps dispatched back to back and blocked on once. Models: the U-Net of
``examples/models.py`` on 8 images of 512 x 512 (convolutions, pooling, upsampling),
and a GPT decoder (d 1024, 8 layers, sequence 1024, batch 16, attention by
`jax.nn.dot_product_attention`, cuDNN's fused kernel in bfloat16 where the backend has
it).

    python -m benchmarks.one_gpu [--runs 20] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

from .environment import environment, load_now, markdown_table, write_result

HERE = os.path.dirname(os.path.abspath(__file__))


def _median_ms(step, args, runs: int) -> tuple[float, float]:
    """Milliseconds per step of a training loop, each step's new parameters and optimizer
    state the next step's arguments: the median of ``runs`` steps each blocked on (host
    dispatch included), and the mean of ``runs`` steps dispatched back to back and
    blocked on once (how a training loop runs: dispatch overlaps the device's work)."""
    import jax

    params, opt_state, batch = args
    for _ in range(2):
        params, opt_state, loss = jax.block_until_ready(step(params, opt_state, batch))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        params, opt_state, loss = jax.block_until_ready(step(params, opt_state, batch))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(runs):
        params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready((params, opt_state, loss))
    return 1e3 * statistics.median(times), 1e3 * (time.perf_counter() - t0) / runs


def _gpt_loss(params, batch, cfg, implementation):
    """The GPT decoder of ``examples/models.py`` with fused attention."""
    import jax
    import jax.numpy as jnp
    import models

    tok = batch["tok"]
    x = params["wte"][tok] + params["wpe"][: tok.shape[1]]
    for p in params["layers"]:
        h = models._layer_norm(x, p["ln1"])
        b, s, d = h.shape
        heads = cfg.n_heads
        q, k, v = ((h @ p["attn"][w]).reshape(b, s, heads, d // heads) for w in ("wq", "wk", "wv"))
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        x = x + a.reshape(b, s, d) @ p["attn"]["wo"]
        h = models._layer_norm(x, p["ln2"])
        m = p["mlp"]
        x = x + jax.nn.gelu(h @ m["w1"] + m["b1"]) @ m["w2"] + m["b2"]
    logits = (models._layer_norm(x, params["ln_f"]) @ params["head"]).astype(jnp.float32)
    return models._cross_entropy(logits, batch["tgt"])


def run(runs: int, quick: bool) -> list[list[str]]:
    """Rows: model, dtype, then jax.jit ms, jaxshard ms and their ratio, blocked per step
    and in a loop.

    Example:
        >>> run(5, quick=True)  # doctest: +SKIP
    """
    import jax
    import jax.numpy as jnp
    import optax

    import jaxshard

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import models

    mesh = jax.make_mesh(
        (1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1]
    )
    optimizer = optax.adamw(1e-4)
    rows = []

    def cast(tree, dtype):
        return jax.tree.map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, tree)

    unet_cfg = models.UNetConfig(image=128 if quick else 512, widths=(32, 64, 128))
    gpt_cfg = models.GPTConfig(
        vocab=8192, d_model=256 if quick else 1024, n_heads=8, n_layers=2 if quick else 8,
        seq=256 if quick else 1024, d_ff=1024 if quick else 4096,
    )  # fmt: skip
    try:
        cudnn = jax.devices()[0].platform == "gpu"
    except RuntimeError:
        cudnn = False
    cases = [
        (
            "U-Net, 8 images",
            models.init_unet(jax.random.key(0), unet_cfg),
            models.make_batch_unet(jax.random.key(1), unet_cfg, batch_size=8),
            functools.partial(models.unet_loss, cfg=unet_cfg),
        ),
        (
            f"GPT d{gpt_cfg.d_model} x{gpt_cfg.n_layers}, seq {gpt_cfg.seq}",
            models.init_gpt(jax.random.key(0), gpt_cfg),
            models.make_batch_gpt(jax.random.key(1), gpt_cfg, batch_size=4 if quick else 16),
            functools.partial(_gpt_loss, cfg=gpt_cfg),
        ),
    ]
    for name, params, batch, loss in cases:
        for dtype in (jnp.float32, jnp.bfloat16):
            label, fn = name, loss
            if "GPT" in name:
                fused = cudnn and dtype == jnp.bfloat16  # cuDNN's kernel: 16-bit only
                fn = functools.partial(loss, implementation="cudnn" if fused else None)
                label += " (cuDNN attention)" if fused else ""
            step_fn = models.make_train_step(fn, optimizer)
            p, b = cast(params, dtype), cast(batch, dtype)
            args = jax.device_put((p, optimizer.init(p), b))
            plain, plain_loop = _median_ms(jax.jit(step_fn), args, runs)
            planned, planned_loop = _median_ms(jaxshard.auto_shard(mesh)(step_fn), args, runs)
            rows.append([label, jnp.dtype(dtype).name, f"{plain:.2f}", f"{planned:.2f}",
                         f"{planned / plain:.3f}", f"{plain_loop:.2f}", f"{planned_loop:.2f}",
                         f"{planned_loop / plain_loop:.3f}"])  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small shapes, a smoke run")
    args = parser.parse_args()
    import jax

    device = jax.devices()[0]
    rows = run(args.runs, args.quick)
    head = ["model", "dtype", "jax.jit ms", "jaxshard ms", "jaxshard / jax.jit",
            "jax.jit ms, loop", "jaxshard ms, loop", "loop ratio"]  # fmt: skip
    lines = [
        f"# One accelerator: jaxshard's program against plain jax.jit ({device.device_kind})",
        "",
        environment(),
        "",
        *markdown_table(head, rows),
        "",
        f"After two warm-ups: the median of {args.runs} steps, each step's outputs blocked "
        "on (the host's dispatch of every step counted in full), and *loop*: the mean of "
        f"{args.runs} steps dispatched back to back and blocked on once, as a training loop "
        "runs (dispatch overlapping the device's work). " + load_now(),
        "",
    ]
    write_result("one_gpu", "\n".join(lines), args.quick)


if __name__ == "__main__":
    main()
