"""Comparison helpers: when a sharded run "matches" the unsharded one.

In float32, the loss matches to rtol 1e-5 and each gradient or updated-parameter leaf to
1e-4 of that leaf's largest magnitude (`assert_leaves_match`): a per-leaf scale, so a
small leaf is not judged by a large one's error. Compare gradients, or parameters after
SGD steps, rather than Adam updates: Adam divides by the gradient's own scale, so a
gradient 4x too large (a missing or doubled reduction) gives the same Adam update.

Also one step shared by test modules: `maxtext_like`, a scanned step in MaxText's layouts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P


def assert_leaves_match(actual, expected, rel=1e-4):
    """The same tree structure, and each leaf within ``rel`` of that leaf's largest
    magnitude (typed PRNG keys: the same key data)."""
    got, want = jax.tree_util.tree_structure(actual), jax.tree_util.tree_structure(expected)
    assert got == want, f"tree structures differ:\n  actual   {got}\n  expected {want}"
    pairs = zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree_util.tree_leaves(actual))
    for (path, e), a in pairs:
        if jax.dtypes.issubdtype(getattr(e, "dtype", None), jax.dtypes.prng_key):
            assert getattr(a, "dtype", None) == e.dtype, f"{jax.tree_util.keystr(path)}: {a}"
            e, a = jax.random.key_data(e), jax.random.key_data(a)
        e, a = np.asarray(e), np.asarray(a)
        scale = max(float(np.abs(e).max(initial=0.0)), 1e-30)
        err = float(np.abs(a - e).max(initial=0.0))
        assert err <= rel * scale, (
            f"{jax.tree_util.keystr(path)}: max error {err:.3g} > {rel} x {scale:.3g}"
        )


def assert_steps_match(sharded, reference, params, opt_state, batch, steps=2, state=False):
    """Run ``steps`` train steps (``(params, opt_state, batch) -> (params, opt_state,
    loss)``) sharded and on the reference: each step's loss within 1e-5 and its new
    parameters (and with ``state`` its optimizer state) within `assert_leaves_match`."""
    p, s, rp, rs = params, opt_state, params, opt_state
    for i in range(steps):
        p, s, loss = sharded(p, s, batch)
        rp, rs, ref_loss = reference(rp, rs, batch)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), i
        assert_leaves_match(p, rp)
        if state:
            assert_leaves_match(s, rs)


def maxtext_like(layer_second: bool):
    """A 4-layer scanned step in MaxText's layouts: each layer's weights stored over the
    batch's axis on their embedding dim and over "model" on their hidden dim, the
    activations' embedding dim over "model". With ``layer_second`` (MaxText's
    ``param_scan_axis=1``) the weights are stacked with their layer dim second and moved
    to the front for the loop, the optimizer clips by the global norm before AdamW, and
    the step returns the gradients' norm too. Returns ``(step, args, hints)``."""
    layers, batch, seq, embed, hidden = 4, 8, 16, 64, 128
    act = P("data", None, "model")

    def loss(p, x):
        def body(h, w):
            h = jax.lax.with_sharding_constraint(h, act)
            u = jax.lax.with_sharding_constraint(jnp.tanh(h @ w["w1"]), act)
            return jax.lax.with_sharding_constraint(h + u @ w["w2"], act), None

        if layer_second:
            p = jax.tree.map(lambda w: jnp.moveaxis(w, 1, 0), p)
        return jnp.mean(jax.lax.scan(body, x, p)[0] ** 2)

    adamw = optax.adamw(1e-3)
    opt = optax.chain(optax.clip_by_global_norm(1.0), adamw) if layer_second else adamw

    def step(p, s, x):
        value, g = jax.value_and_grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        new = optax.apply_updates(p, u)
        return (new, s, value, optax.tree.norm(g)) if layer_second else (new, s, value)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w1, w2 = (embed, layers, hidden), (hidden, layers, embed)
    if not layer_second:
        w1, w2 = (layers, embed, hidden), (layers, hidden, embed)
    params = {
        "w1": jax.random.normal(k1, w1) / embed**0.5,
        "w2": jax.random.normal(k2, w2) / hidden**0.5,
    }
    x = jax.random.normal(k3, (batch, seq, embed))
    if layer_second:
        hints = {r".*w1": P("data", None, "model"), r".*w2": P("model", None, "data")}
    else:
        hints = {r".*w1": P(None, "data", "model"), r".*w2": P(None, "model", "data")}
    hints["x"] = act
    return step, (params, opt.init(params), x), hints
