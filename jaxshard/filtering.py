"""Static leaves: non-array pytree leaves held out of tracing, as `eqx.filter_jit` does.

With ``auto_shard(..., static_leaves=True)`` every argument leaf that is not an array
(activation functions, ints, strings, whole callables inside an Equinox module) is
replaced by ``None`` before tracing, so the traced function sees only arrays and each
array keeps its key path (``model/layers/0/weight``). The held-out leaves key the plan
cache by hash, unhashable ones by identity, and are put back before the function runs;
non-array results are captured while tracing and put back into the returned trees. No
framework is imported: the test for "array" is Equinox's ``eqx.is_array`` plus abstract
shapes (`jax.ShapeDtypeStruct`), so any pytree works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


def is_array(x: Any) -> bool:
    """Whether a leaf is traced (an array) rather than static.

    Example:
        >>> import jax.numpy as jnp
        >>> is_array(jnp.ones(2)), is_array(np.ones(2)), is_array(1.0), is_array(jnp.tanh)
        (True, True, False, False)
    """
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


class _ByIdentity:
    """An unhashable static leaf, keyed by identity (Equinox's caveat: mutating it in place
    between calls is not seen, a new equal object plans again)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _ByIdentity) and other.value is self.value


def _key(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return _ByIdentity(value)
    return value


@dataclass(frozen=True)
class Partitioned:
    """A pytree split into its array part (non-arrays set to None) and its static part."""

    treedef: Any  # of the whole tree
    static: tuple[tuple[int, Any], ...]  # (flat index, leaf) of each non-array leaf

    def key(self) -> tuple:
        """The static part as a hashable cache key (structure, positions and values)."""
        return (self.treedef, tuple((i, _key(v)) for i, v in self.static))

    def combine(self, arrays_tree: Any) -> Any:
        """The whole tree again, from the array part (of the same structure with Nones)."""
        arrays = iter(jax.tree_util.tree_leaves(arrays_tree))
        statics = dict(self.static)
        leaves = [
            statics[i] if i in statics else next(arrays) for i in range(self.treedef.num_leaves)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def partition(tree: Any) -> tuple[Any, Partitioned]:
    """``tree`` with its non-array leaves set to None, and what puts them back.

    Example:
        >>> import jax.numpy as jnp
        >>> arrays, rest = partition({"w": jnp.ones(2), "act": jnp.tanh, "n": 3})
        >>> sorted(k for k, v in arrays.items() if v is not None)
        ['w']
        >>> rest.combine(arrays)["n"]
        3
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    static = tuple((i, x) for i, x in enumerate(leaves) if not is_array(x))
    arrays = [x if is_array(x) else None for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, arrays), Partitioned(treedef, static)


def _is_traced_array(x: Any) -> bool:
    return is_array(x) or isinstance(x, jax.core.Tracer)


def partition_outputs(out: Any) -> tuple[Any, Partitioned]:
    """Like `partition`, for a traced function's results: tracers count as arrays.

    Example:
        >>> import jax.numpy as jnp
        >>> arrays, rest = partition_outputs((jnp.ones(2), jnp.tanh))
        >>> arrays[1] is None, rest.combine(arrays)[1] is jnp.tanh
        (True, True)
    """
    leaves, treedef = jax.tree_util.tree_flatten(out)
    static = tuple((i, x) for i, x in enumerate(leaves) if not _is_traced_array(x))
    arrays = [x if _is_traced_array(x) else None for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, arrays), Partitioned(treedef, static)
