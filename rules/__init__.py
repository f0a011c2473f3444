"""The rule catalogue: what each JAX primitive does with shardings, one module per family.

Importing this package registers every family with the engine's registry
(`jaxshard.rule`). Adding a primitive touches only this package and its tests.
"""

from jaxshard.rules import (
    attention,
    contraction,
    control_flow,
    convolution,
    cumulative,
    custom,
    elementwise,
    indexing,
    linalg,
    misc,
    random,
    reduction,
    shape,
    sorting,
    structure,
    window,
)

__all__ = [
    "attention",
    "contraction",
    "control_flow",
    "convolution",
    "cumulative",
    "custom",
    "elementwise",
    "indexing",
    "linalg",
    "misc",
    "random",
    "reduction",
    "shape",
    "sorting",
    "structure",
    "window",
]
