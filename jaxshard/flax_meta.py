"""Flax sharding metadata and MaxText-style logical axis rules, read as jaxshard hints.

Flax puts sharding metadata on parameters: NNX ``nnx.with_partitioning(init, names)`` and
``nnx.Param(value, out_sharding=names)`` store ``names`` on the `nnx.Variable`; Linen
``nn.with_partitioning`` and ``nn.with_logical_partitioning`` wrap the value in an
``nn.Partitioned`` / ``nn.LogicallyPartitioned`` box. This module turns that metadata into
partial PartitionSpecs keyed by the exact key paths jaxshard names leaves by. A boxed
leaf's path ends in ``/value`` (``params/params/Dense_0/kernel/value``,
``state/layers/0/attn/wq/value``): the box is a pytree node whose child is ``value``.
`auto_shard` reads the metadata of boxed arguments itself; `flax_hints` gives the hints
for a tree that is passed unboxed (``nn.unbox``, ``nnx.to_pure_dict``).

Each metadata entry, per dim: ``None`` pins the dim replicated; ``P.UNCONSTRAINED``, and
every dim past the end of the names, is left to the planner; a mesh axis name (or a tuple
of them) pins it. Other names are logical and go through the rules, an ordered list of
``(logical name, mesh axes)`` pairs where mesh axes is a name, a tuple of names or None:
the first rule for a name whose mesh axes are all in the mesh and not already used by
another dim of the same array wins (MaxText's and Flax's order). A name whose rules are
all unavailable is replicated, as in Flax; a logical name no rule mentions is left to the
planner (write ``("name", None)`` to pin it replicated). Rules come from the box itself
(Linen ``rules=``, NNX ``sharding_rules=``) first, then ``auto_shard``'s
``logical_axis_rules``, then Flax's context rules (``nn.logical_axis_rules``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxshard.errors import ShardingError
from jaxshard.trace import path_name

Rules = Sequence[tuple[str, Any]]

_PENDING = object()  # a logical name not resolved yet


def check_rules(rules: Rules | None) -> tuple[tuple[str, Any], ...]:
    """Validate logical axis rules and return them as a tuple of ``(name, mesh axes)``.

    Example:
        >>> check_rules([("batch", "data"), ("mlp", ["model"]), ("embed", None)])
        (('batch', 'data'), ('mlp', ('model',)), ('embed', None))
    """
    checked = []
    for rule in rules or ():
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
        target = rule[1] if ok else None
        if ok and isinstance(target, (tuple, list)):
            target = tuple(target)
            ok = all(isinstance(a, str) for a in target)
        elif ok:
            ok = target is None or isinstance(target, str)
        if not ok:
            raise ShardingError(
                f"logical axis rule {rule!r} is not a (logical name, mesh axes) pair; write "
                "('mlp', 'model'), ('batch', ('data', 'fsdp')) or ('embed', None)"
            )
        checked.append((rule[0], target))
    return tuple(checked)


def logical_to_spec(
    names: Sequence[Any],
    mesh: Mesh | Sequence[str],
    rules: Rules | None = (),
    *,
    where: str = "metadata",
) -> PartitionSpec:
    """Resolve per-dim axis names (mesh axes or logical names) to a partial PartitionSpec.

    ``None`` stays replicated, ``P.UNCONSTRAINED`` stays open, mesh axes stay, and each
    logical name takes its first available rule: a rule's target is a mesh axis, a list
    or tuple of them, or ``None``/``[]``/``()`` (replicated); axes this mesh lacks drop
    out of a target, and a rule is available when some of its axes remain and none is
    used by another dim of the array. A name whose rules are all unavailable is
    replicated, a name no rule mentions is left open (`P.UNCONSTRAINED`). ``where``
    names the array in errors.

    Example:
        >>> import jax
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> rules = [("mlp", "tensor"), ("mlp", "model"), ("vocab", "model"), ("embed", "model")]
        >>> logical_to_spec(("embed", "mlp"), mesh, rules)  # "tensor" is not in this mesh
        P(None, 'model')
        >>> logical_to_spec(("vocab", "embed"), mesh, rules)
        P('model', None)
        >>> logical_to_spec(("kv", "data"), mesh, rules)  # no rule for "kv": the planner decides
        P(UNCONSTRAINED, 'data')
        >>> logical_to_spec(("qkv", "batch"), mesh, [("qkv", []), ("batch", ["data", "fsdp"])])
        P(None, 'data')
    """
    axes = set(mesh.axis_names if isinstance(mesh, Mesh) else mesh)
    rules = check_rules(rules)
    ruled = {name for name, _ in rules}
    out: list[Any] = []
    used: set[str] = set()
    for d, name in enumerate(names):
        if name is None or name is PartitionSpec.UNCONSTRAINED:
            out.append(name)
        elif isinstance(name, (tuple, list)):
            missing = [a for a in name if a not in axes]
            if missing:
                raise ShardingError(
                    f"{where}: dim {d} names mesh axes {tuple(name)!r}, but the mesh has no "
                    f"{missing[0]!r} (mesh axes: {sorted(axes)}). Fix the metadata or the mesh."
                )
            out.append(tuple(name))
            used.update(name)
        elif isinstance(name, str) and name in ruled:
            out.append(_PENDING)
        elif isinstance(name, str) and name in axes:
            out.append(name)
            used.add(name)
        elif isinstance(name, str) and rules:
            out.append(PartitionSpec.UNCONSTRAINED)  # a logical name no rule mentions
        elif isinstance(name, str):
            raise ShardingError(
                f"{where}: dim {d} names {name!r}, which is not a mesh axis "
                f"({sorted(axes)}), and no logical axis rules were given. Pass "
                f"auto_shard(mesh, logical_axis_rules=[({name!r}, 'model'), ...]), call the step "
                "inside `with nn.logical_axis_rules(...)` (rules set inside the step come "
                "after its arguments are read), or name a mesh axis."
            )
        else:
            raise ShardingError(
                f"{where}: dim {d} entry {name!r} is a {type(name).__name__}; use a mesh axis, "
                "a logical name, a tuple of mesh axes, None or P.UNCONSTRAINED"
            )
    for logical, target in rules:
        for d, name in enumerate(names):
            if out[d] is not _PENDING or name != logical:
                continue
            group = () if target is None else (target,) if isinstance(target, str) else target
            if not group:  # None, [] or (): replicated, as in Flax and MaxText
                out[d] = None
                continue
            # axes this mesh lacks drop out of the rule (one list serves several meshes);
            # a rule left with none is unavailable here and the next one is tried
            present = tuple(a for a in group if a in axes)
            if present and not used.intersection(present):
                out[d] = present[0] if len(present) == 1 else present
                used.update(present)
    return PartitionSpec(*(None if e is _PENDING else e for e in out))


# --- Flax boxes -----------------------------------------------------------------------


def _cache_once_found(fn):
    """Cache a lookup only once it finds something: flax may be imported after the first
    plan, and a cached "not imported" would then hide its boxes for good."""
    found = []

    @functools.wraps(fn)
    def wrapper():
        if not found:
            value = fn()
            if value is None:
                return None
            found.append(value)
        return found[0]

    return wrapper


@_cache_once_found
def _linen_types() -> tuple[type, type] | None:
    if "flax" not in sys.modules:  # boxes can only exist once flax is imported
        return None
    try:
        from flax.core.meta import Partitioned
        from flax.linen.spmd import LogicallyPartitioned
    except ImportError:  # pragma: no cover - a flax without Linen
        return None
    return Partitioned, LogicallyPartitioned


@_cache_once_found
def _nnx_variable() -> type | None:
    if "flax" not in sys.modules:
        return None
    try:
        from flax.nnx import Variable
    except ImportError:  # pragma: no cover - a flax without NNX
        return None
    return Variable


def _context_rules() -> tuple:
    if "flax" not in sys.modules:
        return ()
    try:
        from flax.core.spmd import get_logical_axis_rules
    except ImportError:  # pragma: no cover
        return ()
    return tuple(get_logical_axis_rules() or ())


def is_box(x: Any) -> bool:
    """Whether ``x`` is a Flax box that can carry sharding metadata (an `nnx.Variable`, an
    ``nn.Partitioned`` or ``nn.LogicallyPartitioned``).

    Example:
        >>> import jax.numpy as jnp
        >>> is_box(jnp.ones(3))
        False
    """
    linen, variable = _linen_types(), _nnx_variable()
    return (linen is not None and isinstance(x, linen[0])) or (
        variable is not None and isinstance(x, variable)
    )


def box_names(box: Any) -> tuple[tuple | None, tuple, bool]:
    """``(names, the box's own rules, whether names may be logical)`` of a Flax box;
    names is None when the box carries no sharding metadata.

    Example:
        >>> import flax.linen as nn, jax.numpy as jnp
        >>> box_names(nn.Partitioned(jnp.ones((2, 4)), names=(None, "model")))
        ((None, 'model'), (), False)
    """
    linen = _linen_types()
    if linen is not None and isinstance(box, linen[0]):
        logical = isinstance(box, linen[1])
        rules = tuple(getattr(box, "rules", None) or ()) if logical else ()
        return (tuple(box.names) if box.names is not None else None), rules, logical
    metadata = box.get_metadata()
    sharding = metadata.get("out_sharding")
    if isinstance(sharding, NamedSharding):
        sharding = sharding.spec
    if not sharding:
        return None, (), True
    return tuple(sharding), tuple(metadata.get("sharding_rules") or ()), True


def leaf_specs(
    tree: Any, mesh: Mesh, rules: Rules | None = (), names: Sequence[str] | None = None
) -> list[tuple[PartitionSpec, str] | None]:
    """Per leaf of ``tree`` (in `jax.tree_util.tree_leaves` order), the partial spec its
    Flax metadata gives and a description of where it came from, or None. ``names``
    (per leaf, in that order) name the leaves in errors, as hints spell them; without
    them an error names the leaf's key path in ``tree``.

    Example:
        >>> import jax, flax.linen as nn, jax.numpy as jnp
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> tree = {"b": jnp.ones(4), "w": nn.LogicallyPartitioned(jnp.ones((2, 4)), ("embed", "mlp"))}
        >>> leaf_specs(tree, mesh, [("mlp", "model")])
        [None, (P(UNCONSTRAINED, 'model'), "Flax metadata ('embed', 'mlp')")]
    """
    global_rules = check_rules(rules) + _context_rules()
    specs: list[tuple[PartitionSpec, str] | None] = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        count = len(jax.tree_util.tree_leaves(node)) if is_box(node) else 1
        boxed, own_rules, logical = box_names(node) if is_box(node) else (None, (), False)
        if boxed is None or count != 1:
            specs.extend([None] * count)
            continue
        leaf = names[len(specs)] if names is not None else jax.tree_util.keystr(path)
        where = f"{leaf} (Flax metadata {boxed!r}"
        where += ")" if logical else "; nn.Partitioned names are mesh axes, never logical)"
        spec = logical_to_spec(
            boxed, mesh, (own_rules + global_rules) if logical else (), where=where
        )
        specs.append((spec, f"Flax metadata {boxed!r}"))
    return specs


def flax_hints(
    tree: Any,
    mesh: Mesh,
    prefix: str = "",
    *,
    logical_axis_rules: Rules | None = (),
    unboxed: bool = False,
) -> dict[str, PartitionSpec]:
    """Hints (exact-path regex -> partial spec) from the Flax metadata in ``tree``.

    ``tree`` holds Flax boxes (Linen variables from ``init`` or ``jax.eval_shape``, NNX
    state from ``nnx.split``); ``prefix`` is the path the step sees it under (its
    parameter's name). With ``unboxed=True`` the paths are those of the unboxed tree
    (``nn.unbox(variables)``, ``nnx.to_pure_dict(state)``): without the trailing
    ``/value``. Boxed arguments need none of this: `auto_shard` reads their metadata.

    Example:
        >>> import jax, flax.linen as nn
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        ...         return nn.Dense(8, kernel_init=init)(x)
        >>> abstract = jax.eval_shape(MLP().init, jax.random.key(0), jax.numpy.ones((2, 4)))
        >>> flax_hints(abstract["params"], mesh, "params", logical_axis_rules=[("mlp", "model")],
        ...            unboxed=True)
        {'params/Dense_0/kernel': P(UNCONSTRAINED, 'model')}
    """
    specs = leaf_specs(tree, mesh, logical_axis_rules)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    hints = {}
    for path, spec in zip(paths, specs):
        if spec is None:
            continue
        if unboxed and path and getattr(path[-1], "name", None) == "value":
            path = path[:-1]
        name = path_name(prefix, path) if prefix else path_name("", path)[1:]
        hints[re.escape(name)] = spec[0]
    return hints


def resolve_hint_specs(
    hints: Mapping[str, Any], mesh: Mesh, rules: Rules | None
) -> dict[str, PartitionSpec]:
    """User hints with logical names resolved through ``rules``; a tuple of names works
    like a PartitionSpec. Without rules the hints are returned as they are.

    Example:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> resolve_hint_specs({"batch/.*": P("batch")}, mesh, [("batch", "data")])
        {'batch/.*': P('data',)}
    """
    rules = check_rules(rules)
    if not rules:
        return dict(hints)
    resolved = {}
    for key, spec in hints.items():
        if isinstance(spec, (PartitionSpec, tuple)):
            spec = logical_to_spec(tuple(spec), mesh, rules, where=f"hint {key!r}")
        resolved[key] = spec
    return resolved


# --- Linen boxes inside a traced step -------------------------------------------------
# Linen's ``Partitioned.unbox`` adds ``with_sharding_constraint`` when a mesh is set (and
# jaxshard traces under one), with Flax's reading of the names: open and unruled dims
# become replicated, which would pin what the hints leave to the planner. Inside the
# traced step the boxes are swapped for subclasses that unbox without the constraint
# (the metadata hints pin the layout), and swapped back on the way out, so the step's
# results keep the argument's tree structure.


@functools.cache
def _quiet_class(cls: type) -> type:
    def unbox(self, apply_constraint=True):
        return self.value

    return type(f"_Quiet{cls.__name__}", (cls,), {"unbox": unbox, "_loud": cls})


def _swap(tree: Any, make_quiet: bool) -> Any:
    linen = _linen_types()
    if linen is None:
        return tree

    def is_target(x):
        if not isinstance(x, linen[0]):
            return False
        return make_quiet != hasattr(type(x), "_loud")

    def swap(x):
        if not is_target(x):
            return x
        cls = _quiet_class(type(x)) if make_quiet else type(x)._loud
        return cls(**{f.name: getattr(x, f.name) for f in dataclasses.fields(x)})

    if not any(is_target(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_target)):
        return tree
    return jax.tree_util.tree_map(swap, tree, is_leaf=is_target)


def quiet_linen_boxes(tree: Any) -> Any:
    """Linen boxes in ``tree`` swapped for ones whose ``unbox`` adds no constraint.

    Example:
        >>> import flax.linen as nn, jax.numpy as jnp
        >>> box = quiet_linen_boxes(nn.Partitioned(jnp.ones(2), ("model",)))
        >>> type(box).__name__, type(restore_linen_boxes(box)).__name__
        ('_QuietPartitioned', 'Partitioned')
    """
    return _swap(tree, True)


def restore_linen_boxes(tree: Any) -> Any:
    """The inverse of `quiet_linen_boxes` (see there)."""
    return _swap(tree, False)
