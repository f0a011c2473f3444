"""The rule catalogue: what each JAX primitive does with shardings, one module per family.

Importing this package registers every family with the engine's registry
(`jaxshard.rule`). Adding a primitive touches only this package and its tests.
"""

from jaxshard.rules import contraction, elementwise, indexing, reduction, shape, structure

__all__ = ["contraction", "elementwise", "indexing", "reduction", "shape", "structure"]
