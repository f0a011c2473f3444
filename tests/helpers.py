"""Comparison helpers: "match" as ../shared/DESIGN.md defines it."""

import jax
import numpy as np


def assert_leaves_match(actual, expected, rel=1e-4):
    """Each leaf within ``rel`` of that leaf's largest magnitude."""
    pairs = zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree_util.tree_leaves(actual))
    for (path, e), a in pairs:
        e, a = np.asarray(e), np.asarray(a)
        scale = max(float(np.abs(e).max(initial=0.0)), 1e-30)
        err = float(np.abs(a - e).max(initial=0.0))
        assert err <= rel * scale, (
            f"{jax.tree_util.keystr(path)}: max error {err:.3g} > {rel} x {scale:.3g}"
        )
