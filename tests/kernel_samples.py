"""Sample programs for the rules of user kernels (`rules/custom.py`), in the format of
`rule_samples.SAMPLES`: a `custom_partitioning` matmul carrying its own sharding rule
(with a reduction factor) and `jaxshard.with_rule` calls, so `test_rule_execution` runs
their rules sharded like every catalogue rule.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from kernels import cp_matmul  # the example's custom_partitioning matmul (examples/ is on the path)

import jaxshard

_rng = np.random.default_rng(1)
A = _rng.uniform(-1, 1, (4, 8)).astype(np.float32)
B = _rng.uniform(-1, 1, (8, 6)).astype(np.float32)

SAMPLES = [
    ("custom_partitioning", cp_matmul, (A, B)),
    ("with_rule-scale", jaxshard.with_rule("b d, d -> b d")(lambda x, s: x * s), (A, B[:, 0])),
    (
        "with_rule-sumsq",
        jaxshard.with_rule("b d -> b", reduction_factors=("d",))(lambda x: jnp.sum(x * x, axis=1)),
        (A,),
    ),
]
