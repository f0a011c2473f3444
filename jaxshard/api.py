"""The public entry point: `auto_shard`, a `jax.jit`-like wrapper that plans, then runs.

A wrapped function plans once per argument structure (tree, shapes, dtypes), caches the
plan and its compiled program, and on every call places the arguments in their planned
layout, runs the program, and returns the results in their planned layout (on the
caller's mesh, Explicit axes included).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxshard.errors import ShardingError
from jaxshard.lower import Lowered
from jaxshard.plan import Plan, make_plan
from jaxshard.trace import abstractify, arg_names


class AutoShard:
    """A function planned and run sharded by jaxshard; made by `auto_shard`."""

    def __init__(self, fn: Callable, mesh: Mesh, hints: Mapping[str, PartitionSpec] | None):
        if not isinstance(mesh, Mesh):
            raise ShardingError(f"auto_shard needs a jax.sharding.Mesh, got {type(mesh).__name__}")
        self.fn, self.mesh, self.hints = fn, mesh, dict(hints or {})
        self._cache: dict[Any, Lowered] = {}
        self.plans_made = 0
        functools.update_wrapper(self, fn)

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        names = None
        sig = []
        for i, leaf in enumerate(leaves):
            try:
                a = abstractify(leaf, "")
            except ShardingError:
                names = names or arg_names(self.fn, args, kwargs)[0]
                abstractify(leaf, names[i])  # raises with the leaf's path
            sig.append((a.shape, a.dtype, a.weak_type))
        return tree, tuple(sig)

    def _lowered(self, args: tuple, kwargs: dict) -> Lowered:
        key = self._key(args, kwargs)
        lowered = self._cache.get(key)
        if lowered is None:
            plan = make_plan(self.fn, args, kwargs, self.mesh, self.hints)
            self.plans_made += 1
            lowered = self._cache[key] = Lowered(plan)
        return lowered

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for these arguments (arrays or `jax.ShapeDtypeStruct`s).

        Example:
            >>> plan = step.plan(params, opt_state, batch)  # doctest: +SKIP
            >>> print(plan.explain())  # doctest: +SKIP
        """
        return self._lowered(args, kwargs).plan

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """`jax.stages.Lowered` of the planned program; ``.compile().as_text()`` shows the
        collectives XLA inserted.

        Example:
            >>> hlo = step.lower(params, opt_state, batch).compile().as_text()  # doctest: +SKIP
        """
        lowered = self._lowered(args, kwargs)
        flat = jax.tree_util.tree_leaves((args, kwargs))
        abstract = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(flat, lowered.in_shardings)
        ]
        return lowered.lower(abstract)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lowered = self._lowered(args, kwargs)
        flat = jax.tree_util.tree_leaves((args, kwargs))
        placed = [_place(x, s) for x, s in zip(flat, lowered.in_shardings)]
        outs = lowered(placed)
        if lowered.mesh is not self.mesh:  # hand results back on the caller's (Explicit) mesh
            outs = [
                jax.device_put(o, NamedSharding(self.mesh, s.spec))
                for o, s in zip(outs, lowered.out_shardings)
            ]
        return jax.tree_util.tree_unflatten(lowered.plan.traced.out_tree, outs)


def _place(x: Any, sharding: NamedSharding) -> Any:
    if isinstance(x, jax.Array) and x.sharding != sharding:
        return jax.device_put(x, sharding)
    return x


def auto_shard(
    mesh: Mesh, hints: Mapping[str, PartitionSpec] | None = None
) -> Callable[[Callable], AutoShard]:
    """Decorate a function so jaxshard plans its sharding on ``mesh`` and runs it sharded.

    ``hints`` maps regexes, fully matched against argument and result key paths
    (``params/layers/0/attn/wq``, ``batch/tok``, ``out/2``), to partial PartitionSpecs:
    an entry naming axes pins that dim, ``None`` pins it replicated, ``P.UNCONSTRAINED``
    and dims past the spec's end are left to the planner.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> @auto_shard(mesh, hints={"x": P("data"), "w": P(None, "model")})
        ... def f(x, w):
        ...     return jnp.tanh(x @ w)
        >>> f.plan(jnp.ones((8, 4)), jnp.ones((4, 16))).out_specs
        P('data', 'model')
    """

    def wrap(fn: Callable) -> AutoShard:
        return AutoShard(fn, mesh, hints)

    return wrap
