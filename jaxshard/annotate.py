"""Annotation: the user's partial specs, from a hints dict or from `hint()` in the function.

A hints dict maps regexes, fully matched against leaf key paths, to partial
PartitionSpecs: an entry naming axes pins that dim, ``None`` pins it replicated,
``P.UNCONSTRAINED`` and every dim past the end of the spec are left to the planner.
`hint(x, spec)` marks a value inside the traced function with the same semantics; it is
an identity primitive, so the function still runs unchanged without jaxshard. Every
hint is validated here against the mesh and the array, with errors that name it.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec

from jaxshard.errors import JaxshardWarning, ShardingError, warn
from jaxshard.jax_compat import exclude_from_tracebacks
from jaxshard.lattice import DimSharding, check_dims, from_spec, merge_dim, spec_entry

# jaxshard's own frames are not the user's source line in error messages and tracebacks
exclude_from_tracebacks(os.path.dirname(os.path.abspath(__file__)))

# ``origin`` is "" for a user's `hint`; jaxshard's own pins give (PinKind, text) there
# (the pipeline's stage layout, which widens the user's hints on the layers it splits)
hint_p = Primitive("jaxshard_hint")
hint_p.def_impl(lambda x, *, spec, origin: x)
hint_p.def_abstract_eval(lambda aval, *, spec, origin: aval)
ad.deflinear2(hint_p, lambda ct, x, *, spec, origin: [hint_p.bind(ct, spec=spec, origin=origin)])
mlir.register_lowering(hint_p, lambda ctx, x, *, spec, origin: [x])


def _hint_batcher(args, dims, *, spec, origin):
    (x,), (d,) = args, dims
    if d is batching.not_mapped:
        return hint_p.bind(x, spec=spec, origin=origin), d
    entries = list(spec) + [PartitionSpec.UNCONSTRAINED] * (x.ndim - 1 - len(spec))
    entries.insert(d, PartitionSpec.UNCONSTRAINED)
    return hint_p.bind(x, spec=PartitionSpec(*entries), origin=origin), d


batching.primitive_batchers[hint_p] = _hint_batcher


def hint(x: Any, spec: PartitionSpec | Any) -> Any:
    """Pin the sharding of a value inside a function planned by `auto_shard`.

    ``spec`` is a partial PartitionSpec (see the module doc), or a pytree of them
    matching ``x``. Outside jaxshard this is the identity.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> y = hint(jnp.ones((8, 4)), P("data", P.UNCONSTRAINED))
        >>> y.shape
        (8, 4)
    """
    if isinstance(spec, PartitionSpec):
        return jax.tree_util.tree_map(lambda leaf: hint_p.bind(leaf, spec=spec, origin=""), x)
    return jax.tree_util.tree_map(
        lambda leaf, s: hint_p.bind(leaf, spec=s, origin=""),
        x,
        spec,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


class PinKind(enum.Enum):
    """Where a pin comes from, which decides how to fix two pins that disagree."""

    HINTS = "an entry of the hints dict"  # a regex, or Flax metadata as an exact path
    IN_FUNCTION = "a jaxshard.hint call"
    PROGRAM = "a layout the program fixes"  # shard_map specs, with_sharding_constraint
    # explicit-sharding style: out_sharding=, reshard, an argument's explicit type
    EXPLICIT = "an explicit-sharding annotation"
    PIPELINE = "the pipeline's stage layout"  # auto_shard(pipeline=...) on the layer stack
    MICROBATCHES = "the pipeline's microbatch buffer"  # one slot per stage


@dataclass(frozen=True)
class Pin:
    """What the user pinned on one value: per-dim states and where it came from; a
    merged pin keeps the pins it was merged from, so a later disagreement names the one
    that pinned the dim."""

    dims: tuple[DimSharding, ...]
    source: str  # e.g. "hint 'params/.*/w1': P(None, 'model')"
    kind: PinKind = PinKind.HINTS
    parts: tuple[Pin, ...] = ()
    # the hint that made it, the same for every leaf one hint pins (Flax metadata names
    # each leaf's path in ``source``, but one spec is one hint); "" where ``source`` is
    hint: str = ""

    def pinned_by(self, dim: int) -> Pin:
        """The unmerged pin that pinned ``dim``.

        Example:
            >>> a, b = Pin((("data",), None), "h1"), Pin((None, ()), "h2")
            >>> merge_pins(a, b, "x").pinned_by(1).source
            'h2'
        """
        return next((p for p in self.parts if p.dims[dim] is not None), self)


def open_unnamed(spec: PartitionSpec, rank: int) -> PartitionSpec:
    """An explicit-sharding spec as a partial spec: the axes it names pin their dims and
    the dims it types unsharded are left to the planner (an explicit type cannot say
    "unconstrained", so ``None`` there means "not sharded here", not "must replicate").

    Example:
        >>> open_unnamed(PartitionSpec("data", None), 3)
        P('data', UNCONSTRAINED, UNCONSTRAINED)
    """
    entries = list(spec) + [None] * (rank - len(spec))
    return PartitionSpec(*(PartitionSpec.UNCONSTRAINED if e is None else e for e in entries))


# parameters by which explicit-sharding code fixes an equation's result type
# (dot_general, reshape, broadcast_in_dim, iota, reductions, convert_element_type, ...)
_RESULT_SHARDING_PARAMS = ("out_sharding", "sharding")


def written_shardings(eqn: Any) -> list[tuple[int, PartitionSpec, str]]:
    """``(result index, spec, parameter)`` for each result whose sharding an equation's parameters
    fix and that names mesh axes: ``out_sharding=``/``sharding=`` (the one result) and
    the per-operand shardings of a `jax.device_put` inside the function (JAX fills
    these in only from explicit types, so axis names there come from annotations).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1, 1), ("data", "model"))
        >>> f = lambda x: jnp.einsum("ij,jk->ik", x, x, out_sharding=P("data"))
        >>> with jax.set_mesh(mesh):
        ...     eqn = jax.make_jaxpr(f)(jnp.ones((2, 2))).eqns[0]
        >>> written_shardings(eqn)
        [(0, P('data',), 'out_sharding')]
    """
    params = eqn.params
    found = []
    for key in _RESULT_SHARDING_PARAMS:
        spec = getattr(params.get(key), "spec", None)
        if _names_axes(spec):
            found.append((0, spec, key))
            break
    devices = params.get("devices")
    if isinstance(devices, tuple):
        for i, sharding in enumerate(devices[: len(eqn.outvars)]):
            spec = getattr(sharding, "spec", None)
            if _names_axes(spec):
                found.append((i, spec, "devices"))
    return found


def _names_axes(spec: Any) -> bool:
    return isinstance(spec, PartitionSpec) and any(
        e is not None and e is not PartitionSpec.UNCONSTRAINED for e in spec
    )


def spec_text(spec: Any) -> str:
    """A partial spec as the user would write it.

    Example:
        >>> spec_text(PartitionSpec("data", PartitionSpec.UNCONSTRAINED, None))
        "P('data', P.UNCONSTRAINED, None)"
    """
    if not isinstance(spec, PartitionSpec):
        return repr(spec)
    entries = (repr(e) if e is not PartitionSpec.UNCONSTRAINED else "P.UNCONSTRAINED" for e in spec)
    return "P(" + ", ".join(entries) + ")"


def pin_from_spec(
    spec: PartitionSpec,
    shape: Sequence[int],
    axis_sizes: Mapping[str, int],
    where: str,
    source: str,
    kind: PinKind = PinKind.HINTS,
) -> Pin:
    """Validate a partial spec for one array and turn it into a Pin.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> pin_from_spec(P("data"), (8, 4), {"data": 2}, "batch/x", "hint").dims
        (('data',), None)
        >>> pin_from_spec(P(("data", "stage"), "fsdp"), (8, 4), {"data": 2, "stage": 1, "fsdp": 1}, "x", "").dims
        (('data',), ())
    """
    if not isinstance(spec, PartitionSpec):
        raise ShardingError(
            f"{where}: {source} is a {type(spec).__name__}; give a jax.sharding.PartitionSpec"
        )
    if len(spec) > len(shape):
        raise ShardingError(
            f"{where}: {source} has {len(spec)} entries but the array has rank {len(shape)} "
            f"(shape {tuple(shape)}). Shorten the spec: dims past its end are left to the planner."
        )
    dims = from_spec(spec, len(shape))
    check_dims(dims, shape, axis_sizes, f"{where} ({source})")
    # a mesh axis of size 1 splits nothing: P(('fsdp', 'expert'), 'stage') on a mesh whose
    # 'expert' and 'stage' have size 1 is the layout P('fsdp', None), and one layout
    # has one form (MaxText's rules name every axis of its many-axis mesh)
    dims = tuple(d if not d else tuple(a for a in d if axis_sizes[a] > 1) for d in dims)
    return Pin(dims, source, kind)


def match_hints(
    hints: Mapping[str, PartitionSpec],
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    axis_sizes: Mapping[str, int],
) -> dict[int, Pin]:
    """Pins for named leaves from a hints dict: ``{leaf index: Pin}``.

    Several hints on one leaf merge dim by dim; a dim two hints pin differently is an
    error naming both. A hint that matches nothing warns and lists the paths.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> names, shapes = ["params/w", "batch/x"], [(4, 4), (8, 4)]
        >>> pins = match_hints({r"batch/.*": P("data")}, names, shapes, {"data": 2})
        >>> pins[1].dims
        (('data',), None)
    """
    if not isinstance(hints, Mapping):
        raise ShardingError(
            f"hints must map path regexes to PartitionSpecs, e.g. {{r'batch/.*': P('data')}}; "
            f"got a {type(hints).__name__}: {hints!r}"
        )
    compiled = []
    for key, spec in hints.items():
        if isinstance(key, re.Pattern):
            key = key.pattern
        if not isinstance(key, str):
            raise ShardingError(f"hint key {key!r} is a {type(key).__name__}; give a regex string")
        if not isinstance(spec, PartitionSpec):
            raise ShardingError(
                f"{key}: hint {key!r} is {spec!r} (a {type(spec).__name__}); give a "
                "jax.sharding.PartitionSpec"
            )
        try:
            compiled.append((key, re.compile(key), spec))
        except re.error as e:
            raise ShardingError(f"hint key {key!r} is not a valid regex: {e}") from None
    pins: dict[int, Pin] = {}
    by_name: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        by_name.setdefault(n, []).append(i)
    for key, pattern, spec in compiled:
        literal = key.path if isinstance(key, ExactPath) else _literal(key)
        if literal is not None:  # an exact path (e.g. from Flax metadata): a dict lookup
            hits = by_name.get(literal, [])
        else:
            hits = [i for i, n in enumerate(names) if pattern.fullmatch(n)]
        if not hits:
            shown = ", ".join(names[:60]) + (
                f", ... ({len(names) - 60} more)" if len(names) > 60 else ""
            )
            warn(
                f"hint {key!r} matched no argument or result path. Keys are regexes fully "
                f"matched against paths; the available paths are: {shown}",
                JaxshardWarning,
            )
        for i in hits:
            if isinstance(key, ExactPath):
                pin = exact_pin(spec, shapes[i], axis_sizes, names[i], key.origin)
            else:
                source = f"hint {key!r}: {spec_text(spec)}"
                pin = pin_from_spec(spec, shapes[i], axis_sizes, names[i], source)
            pins[i] = merge_pins(pins[i], pin, names[i]) if i in pins else pin
    return pins


def exact_pin(
    spec: PartitionSpec, shape: Sequence[int], axis_sizes: Mapping[str, int], name: str, origin: str
) -> Pin:
    """The pin of a layout given for one path by ``origin`` (Flax metadata, the search):
    named by its origin in explanations and conflicts.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> pin = exact_pin(P("data"), (8, 4), {"data": 2}, "batch/x", "jaxshard search")
        >>> pin.dims, pin.source
        ((('data',), None), "jaxshard search on batch/x: P('data')")
    """
    pin = pin_from_spec(spec, shape, axis_sizes, name, f"{origin} on {name}: {spec_text(spec)}")
    return Pin(pin.dims, pin.source, pin.kind, pin.parts, f"{origin}: {spec_text(spec)}")


class ExactPath(str):
    """A hints-dict key naming one path exactly, and what made the hint (Flax metadata,
    the search). As a string it is the escaped path, a regex matching just that path, so
    a dict of them still works as ``hints`` anywhere; planning looks the path up directly
    and names the hint by its origin.

    Example:
        >>> key = ExactPath("params/l0/w.1", "Flax metadata")
        >>> print(key, key.path, key.origin)
        params/l0/w\\.1 params/l0/w.1 Flax metadata
    """

    path: str
    origin: str

    def __new__(cls, path: str, origin: str) -> ExactPath:
        key = super().__new__(cls, re.escape(path))
        key.path, key.origin = path, origin
        return key


def _literal(key: str) -> str | None:
    """The path a hint key matches exactly when it is an escaped literal, else None.

    Example:
        >>> _literal(re.escape("params/l0/w.1")), _literal("params/.*")
        ('params/l0/w.1', None)
    """
    plain = re.sub(r"\\(.)", r"\1", key)
    return plain if re.escape(plain) == key else None


def merge_pins(a: Pin, b: Pin, where: str) -> Pin:
    """Merge two pins on one value; if they disagree on a dim, an error names the two
    pins that pinned it and says how to fix that kind of disagreement.

    Example:
        >>> merge_pins(Pin((("data",), None), "h1"), Pin((None, ()), "h2"), "x").dims
        (('data',), ())
        >>> merge_pins(Pin((("data",),), "h1"), Pin((("model",),), "h2"), "x")
        Traceback (most recent call last):
        ...
        jaxshard.errors.ShardingError: x: h1 and h2 disagree on dim 0 ('data' vs 'model'). ...
    """
    dims = []
    for i, (da, db) in enumerate(zip(a.dims, b.dims)):
        merged, conflict = merge_dim(da, db)
        if conflict:
            pa, pb = a.pinned_by(i), b.pinned_by(i)
            raise ShardingError(
                f"{where}: {pa.source} and {pb.source} disagree on dim {i} "
                f"({spec_entry(da)!r} vs {spec_entry(db)!r}). {_disagreement_fix(pa, pb, i)}"
            )
        dims.append(merged)
    parts = (*(a.parts or (a,)), *(b.parts or (b,)))
    return Pin(
        tuple(dims),
        f"{a.source} + {b.source}",
        a.kind,
        parts,
        f"{a.hint or a.source} + {b.hint or b.source}",
    )


_FIX_NAME = {
    PinKind.HINTS: "the hints entry",
    PinKind.IN_FUNCTION: "the jaxshard.hint",
    PinKind.PROGRAM: "the sharding constraint",
    PinKind.EXPLICIT: "the explicit annotation",
    PinKind.PIPELINE: "the pipeline",
    PinKind.MICROBATCHES: "the pipeline",
}


def _disagreement_fix(a: Pin, b: Pin, dim: int) -> str:
    """How to fix two pins that disagree on ``dim``, by what kind of pins they are."""
    kinds = {a.kind, b.kind}
    if kinds == {PinKind.HINTS}:
        return "Make the regexes not overlap, or make the specs agree."
    if kinds == {PinKind.IN_FUNCTION}:
        return "Keep one jaxshard.hint per value, or make the specs agree."
    if kinds == {PinKind.PROGRAM}:
        return "One value cannot have two fixed layouts; make the specs agree."
    if PinKind.EXPLICIT in kinds:
        fixed, other = (a, b) if a.kind is PinKind.EXPLICIT else (b, a)
        where = (
            "pass the argument with a sharding that agrees (or unsharded on that dim)"
            if fixed.source.startswith("the explicit sharding of argument")
            else "change the annotation at that line"
        )
        return (
            f"{fixed.source} is an explicit-sharding annotation in the program. Change "
            f"{_FIX_NAME[other.kind]} ({other.source}) to agree or leave dim {dim} to the "
            f"planner (P.UNCONSTRAINED), or {where}."
        )
    if PinKind.PROGRAM in kinds:
        fixed, other = (a, b) if a.kind is PinKind.PROGRAM else (b, a)
        return (
            f"{fixed.source} fixes this layout; change {_FIX_NAME[other.kind]} to agree, or "
            f"leave dim {dim} to the planner (P.UNCONSTRAINED)."
        )
    return f"Drop {_FIX_NAME[a.kind]} or {_FIX_NAME[b.kind]}, or make their specs agree."
