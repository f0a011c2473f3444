"""Sample programs for the rules of user kernels (`rules/custom.py`), in the format of
`rule_samples.SAMPLES`: a `custom_partitioning` matmul carrying its own sharding rule
(with a reduction factor) and `jaxshard.with_rule` calls, so `test_rule_execution` runs
their rules sharded like every catalogue rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxshard

_rng = np.random.default_rng(1)
A = _rng.uniform(-1, 1, (4, 8)).astype(np.float32)
B = _rng.uniform(-1, 1, (8, 6)).astype(np.float32)


def _entry(spec: P, dim: int):
    return spec[dim] if dim < len(spec) else None


def _matmul_partition(mesh, arg_shapes, result_shape):
    """Each device multiplies its blocks; a split contraction is summed across devices."""
    a, b = (s.sharding.spec for s in arg_shapes)
    i, j, k = _entry(a, 0), _entry(a, 1), _entry(b, 1)
    if k is not None and k in (i, j):
        k = None

    def lower(x, y):
        out = x @ y
        return jax.lax.psum(out, j) if j is not None else out

    specs = (NamedSharding(mesh, P(i, j)), NamedSharding(mesh, P(j, k)))
    return mesh, lower, NamedSharding(mesh, P(i, k)), specs


cp_matmul = custom_partitioning(lambda a, b: a @ b)
cp_matmul.def_partition(
    partition=_matmul_partition, sharding_rule="i j, j k -> i k", reduction_factors=("j",)
)

SAMPLES = [
    ("custom_partitioning", cp_matmul, (A, B)),
    ("with_rule-scale", jaxshard.with_rule("b d, d -> b d")(lambda x, s: x * s), (A, B[:, 0])),
    (
        "with_rule-sumsq",
        jaxshard.with_rule("b d -> b", reduction_factors=("d",))(lambda x: jnp.sum(x * x, axis=1)),
        (A,),
    ),
]
