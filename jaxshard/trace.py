"""Tracing: the user's function to a jaxpr, with every argument and result leaf named.

Arguments may be arrays, NumPy arrays, Python scalars or `jax.ShapeDtypeStruct`s; they
are traced as plain shapes and dtypes (any sharding on them is the planner's business,
not the tracer's), but the explicit sharding in an argument's type (an array on a mesh
with Explicit axes) is kept aside as an annotation. Leaves are named by key path,
starting with the parameter's name from the function's signature: ``params/l0/w1``,
``opt_state/0/mu/l0/w1``, ``batch/tok``; results start with ``out``.

`trace_on_mesh` traces on an Auto-typed view of the mesh (code written for
`with_sharding_constraint`), and when that fails on a mesh with Explicit axes, traces
again on the mesh itself, as `jax.jit` would: code in explicit-sharding style
(``out_sharding=`` with axis names, `jax.sharding.reshard`) then traces, and its
annotations are left in the jaxpr for the graph to read as pins. The jaxpr is then
rewritten where one equation computes what two do and stays sharded where they could not
(`jaxshard.rewrite`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from jaxshard.errors import ShardingError
from jaxshard.jax_compat import low_level, lowering_platform, mesh_context
from jaxshard.rewrite import rewrite_closed


@dataclass(frozen=True)
class Traced:
    """A traced function: its jaxpr, the flat leaves' names and the pytree structures."""

    jaxpr: ClosedJaxpr
    in_names: tuple[str, ...]
    out_names: tuple[str, ...]
    in_tree: Any  # treedef of (args, kwargs)
    out_tree: Any
    in_avals: tuple[jax.ShapeDtypeStruct, ...]
    # per argument leaf, the explicit sharding its type carries (None: none), and
    # whether the jaxpr was traced on the mesh's Explicit axes (its avals carry shardings)
    in_types: tuple[PartitionSpec | None, ...] = ()
    explicit: bool = False


def key_name(key: Any) -> str:
    """One path component as text.

    Example:
        >>> from jax.tree_util import DictKey, SequenceKey
        >>> key_name(DictKey("w1")), key_name(SequenceKey(0))
        ('w1', '0')
    """
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key).strip(".[]'\"")


def path_name(prefix: str, path: Sequence[Any]) -> str:
    """A leaf's name: the prefix then each key, joined by ``/``.

    Example:
        >>> from jax.tree_util import DictKey, SequenceKey
        >>> path_name("params", (DictKey("l0"), DictKey("w1")))
        'params/l0/w1'
    """
    return "/".join([prefix, *(key_name(k) for k in path)])


def abstractify(leaf: Any, name: str) -> jax.ShapeDtypeStruct:
    """A leaf as a plain ShapeDtypeStruct (no sharding), or a ShardingError naming it.

    Example:
        >>> abstractify(np.zeros((2, 3), np.float32), "x")
        ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    """
    if isinstance(leaf, (bool, int, float, complex)) and not isinstance(leaf, np.generic):
        aval = jax.typeof(leaf)
        return jax.ShapeDtypeStruct((), aval.dtype, weak_type=True)
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise ShardingError(
            f"argument leaf {name} is a {type(leaf).__name__}, not an array: jaxshard plans "
            "arrays only. Pass it as an array, close over it (functools.partial) if it is "
            "configuration, or pass static_leaves=True to auto_shard to keep every non-array "
            "leaf static (an Equinox module's activation, ints, callables) like eqx.filter_jit."
        )
    return jax.ShapeDtypeStruct(
        tuple(shape), dtype, weak_type=bool(getattr(leaf, "weak_type", False))
    )


def arg_names(fn: Callable, args: tuple, kwargs: dict) -> tuple[list[str], Any]:
    """Names of the flat argument leaves and the treedef of ``(args, kwargs)``.

    Positional arguments are named by the signature's parameter names where it has
    them (``*args`` become ``args/0``...), keyword arguments by their keyword.

    Example:
        >>> def step(params, batch): ...
        >>> arg_names(step, ({"w": 1.0}, {"x": 2.0}), {})[0]
        ['params/w', 'batch/x']
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_args = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), "args")
    leaves, tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    names = []
    for path, _ in leaves:
        group, index, rest = path[0], path[1], path[2:]
        if group.idx == 0:  # positional
            i = index.idx
            prefix = positional[i] if i < len(positional) else f"{var_args}/{i - len(positional)}"
        else:
            prefix = key_name(index)
        names.append(path_name(prefix, rest))
    return names, tree


def trace(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    shardings: Sequence[Any] | None = None,
    platform: str | None = None,
) -> Traced:
    """Trace ``fn(*args, **kwargs)`` to a jaxpr with named leaves; ``shardings`` (one per
    leaf, None for none) type the leaves when tracing on Explicit axes; ``platform``
    (`jax_compat.lowering_platform`) keeps of platform-dependent code the branch that
    runs there.

    Example:
        >>> import jax.numpy as jnp
        >>> args = ({"w": jnp.ones((4, 2))}, jnp.ones((3, 4)))
        >>> t = trace(lambda params, x: x @ params["w"], args, {})
        >>> t.in_names, t.out_names
        (('params/w', 'x'), ('out',))
    """
    names, in_tree = arg_names(fn, args, kwargs)
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    avals = tuple(abstractify(leaf, name) for leaf, name in zip(leaves, names))
    if shardings is not None:
        avals = tuple(a if s is None else a.update(sharding=s) for a, s in zip(avals, shardings))

    def flat_fn(*flat):
        a, k = jax.tree_util.tree_unflatten(in_tree, flat)
        return _check_results(fn(*a, **k))

    _name_for_jax(flat_fn, fn, names)
    jaxpr, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
    jaxpr = rewrite_closed(low_level(jaxpr), platform)  # equivalent equations that stay sharded
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    out_names = tuple(path_name("out", path) for path, _ in out_leaves)
    return Traced(jaxpr, tuple(names), out_names, in_tree, out_tree, avals)


def auto_view(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis Auto (jaxshard decides shardings).

    Example:
        >>> import jax
        >>> auto_view(jax.make_mesh((1,), ("data",))).axis_types
        (Auto,)
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    if isinstance(mesh, AbstractMesh):  # planning for devices this process does not have
        return AbstractMesh(
            mesh.axis_sizes, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
        )
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def explicit_type(leaf: Any, mesh: Mesh) -> PartitionSpec | None:
    """The explicit sharding an argument's type carries on ``mesh``: its spec with only
    the axes that are Explicit in the array's own mesh, or None when it names none (an
    array on an Auto mesh, on one device, or a NumPy array carries no type).

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import PartitionSpec as P, NamedSharding
        >>> mesh = jax.make_mesh((1, 1), ("data", "model"))
        >>> explicit_type(jax.device_put(np.ones((2, 2)), NamedSharding(mesh, P("data"))), mesh)
        P('data', None)
    """
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.axis_names != mesh.axis_names:
        return None
    kinds = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    entries = []
    for entry in sharding.spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        axes = tuple(a for a in axes if kinds.get(a) == AxisType.Explicit)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    if all(e is None for e in entries):
        return None
    rank = len(getattr(leaf, "shape", ()))
    return PartitionSpec(*entries, *[None] * (rank - len(entries)))


def trace_on_mesh(fn: Callable, args: tuple, kwargs: dict, mesh: Mesh) -> Traced:
    """`trace` under ``mesh``: first on its Auto view; on a mesh with Explicit axes, if
    that fails, again on the mesh itself (code in explicit-sharding style). Either way
    the explicit shardings of the arguments' types are recorded in ``in_types``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1, 1), ("data", "model"))
        >>> f = lambda x: jnp.einsum("ij,jk->ik", x, x, out_sharding=P("data"))
        >>> trace_on_mesh(f, (jnp.ones((2, 2)),), {}, mesh).explicit
        True
    """
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    types = tuple(explicit_type(leaf, mesh) for leaf in leaves)
    auto = auto_view(mesh)
    attempts: list[tuple[Mesh, Any]] = [(auto, None)]
    if auto is not mesh:
        # as jax.jit does: the arguments typed with their explicit shardings; then, since
        # jaxshard replans those anyway, typed unsharded (code that cannot take the types
        # a previous plan gave its arguments still traces)
        typed = [None if t is None else NamedSharding(mesh, t) for t in types]
        attempts.append((mesh, typed))
        if any(t is not None for t in types):
            attempts.append((mesh, None))
    errors: list[Exception] = []
    for on, shardings in attempts:
        try:
            with mesh_context(on):
                traced = trace(fn, args, kwargs, shardings, lowering_platform(mesh))
        except Exception as e:  # noqa: BLE001 (the next attempt decides; all failing re-raises)
            errors.append(e)
            continue
        return dataclasses.replace(traced, in_types=types, explicit=on is not auto)
    if len(errors) == 1:
        raise errors[0]
    auto_error, explicit_error = errors[0], errors[1]
    first = str(auto_error).splitlines()[0] if str(auto_error) else repr(auto_error)
    explicit_error.add_note(
        "jaxshard traced the function on the mesh's Explicit axes (as jax.jit does) after "
        "tracing it on an Auto view of the mesh (for code that uses with_sharding_constraint) "
        f"failed with: {type(auto_error).__name__}: {first}"
    )
    raise explicit_error from None


def _check_results(out: Any) -> Any:
    """``out`` unchanged, or a ShardingError naming the first result leaf that is not an
    array (JAX's own error names only its flat index)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, (jax.Array, jax.core.Tracer, np.ndarray, np.generic)) and (
            not isinstance(leaf, (bool, int, float, complex))
        ):
            raise ShardingError(
                f"result leaf {path_name('out', path)} is a {type(leaf).__name__}, not an "
                "array: jaxshard returns arrays only. Pass static_leaves=True to auto_shard to "
                "return non-array leaves as they were made (an Equinox module with its "
                "activation function), like eqx.filter_jit, or return arrays only."
            )
    return out


def _name_for_jax(flat_fn: Callable, fn: Callable, names: Sequence[str]) -> None:
    """Give the flat wrapper JAX's debug info for ``fn`` with the leaves' paths as argument
    names, so JAX's own tracing errors (Python control flow on a traced value, ...) keep
    their type and say "while tracing the function step at model.py:12 ... depends on
    the value of the argument batch/x", not the wrapper's name and ``flat[0]``."""
    from jaxshard.jax_compat import set_debug_info

    set_debug_info(flat_fn, fn, names, "jaxshard planning")
