"""Comparison helpers: when a sharded run "matches" the unsharded one.

In float32, the loss matches to rtol 1e-5 and each gradient or updated-parameter leaf to
1e-4 of that leaf's largest magnitude (`assert_leaves_match`): a per-leaf scale, so a
small leaf is not judged by a large one's error. Compare gradients, or parameters after
SGD steps, rather than Adam updates: Adam divides by the gradient's own scale, so a
gradient 4x too large (a missing or doubled reduction) gives the same Adam update.
"""

import jax
import numpy as np


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
