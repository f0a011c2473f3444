"""Saved plans: the JSON format `Plan.to_json` writes, read back as untrusted input.

A saved plan is a file: edited by hand, truncated, copied between versions, made by a
script. `read_saved` checks the whole document against the format before anything uses
it, and every violation is a `ShardingError` naming the field by its JSON path
(``values``, ``dims[12][1]``), what it holds and what was expected. `SavedPlan.check`
then checks it against the program it is applied to: the mesh, the program's
fingerprint, and every layout against the shape of its value.

The format (version 2), one JSON object:

``format``
    ``"jaxshard-plan"``.
``version``
    ``2``.
``mesh``
    ``{"axes": [name, ...], "sizes": [size, ...]}``: distinct axis names, sizes >= 1.
``inputs``, ``outputs``
    One object per argument leaf (result leaf): ``{"name": path, "value": index,
    "shape": [size, ...], "dtype": name}``; ``value`` indexes ``dims``.
``values``
    The number of values in the program (an integer >= 0).
``program``
    The program's fingerprint: ``{"sha256": hex, "equations": [primitive name, ...]}``:
    the hash of every equation's primitive and operand and result shapes and dtypes in
    order, and the primitive names, to say where a program differs.
``dims``
    One layout per value (``values`` of them): per dim ``null`` (left open) or a list
    of mesh axis names; an axis at most once per value; no ``null`` in the layout of an
    argument.
``out_dims``
    One layout per result leaf, as in ``dims``, without ``null``.
``pipeline`` (optional)
    One object per pipelined scan: ``{"line": text, "layers": n, "stages": n,
    "microbatches": n, "batch": n, "replicas": [axis, ...]}``, plus ``"schedule":
    "circular", "repeats": n`` for a circular pipeline and ``"schedule": "1f1b", "repeats":
    1`` for a one-forward-one-backward one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.sharding import PartitionSpec

from jaxshard.errors import ShardingError
from jaxshard.lattice import to_spec

PLAN_FORMAT, PLAN_VERSION = "jaxshard-plan", 2
_PIPELINE_INTS = ("layers", "stages", "microbatches", "batch")


def program_fingerprint(graph: Any) -> dict:
    """The ``program`` field of a saved plan for ``graph``: a hash of every application's
    primitive (or link kind) with its operands' and results' shapes and dtypes, in
    order, and the primitive names.

    Example:
        >>> fingerprint = program_fingerprint(plan.graph)  # doctest: +SKIP
        >>> fingerprint["equations"][:2]  # doctest: +SKIP
        ['dot_general', 'tanh']
    """
    digest = hashlib.sha256()
    names = []
    for app in graph.apps:
        name = app.eqn.primitive.name if app.eqn is not None else app.kind
        names.append(name)
        shapes = ";".join(
            f"{graph.dtypes[v]}{tuple(graph.shapes[v])}" for v in (*app.operands, *app.results)
        )
        digest.update(f"{name}|{shapes}\n".encode())
    return {"sha256": digest.hexdigest(), "equations": names}


@dataclass
class SavedPlan:
    """A plan read from JSON (`Plan.from_json`), checked against the format: every
    value's layout, and what it was made for (mesh, program, argument and result shapes
    and dtypes). Give it to ``auto_shard(mesh, plan=...)`` or `make_plan(...,
    saved=...)` to reuse it without planning again."""

    record: dict

    @property
    def in_specs(self) -> dict[str, PartitionSpec]:
        """``{argument path: PartitionSpec}``."""
        dims = self.record["dims"]
        return {a["name"]: to_spec(dims_from_json(dims[a["value"]])) for a in self.record["inputs"]}

    def differences(self, other: dict) -> list[str]:
        """What differs from another record's mesh, program, arguments and results, one
        line each.

        Example:
            >>> saved.differences(record_of(traced, graph, mesh))  # doctest: +SKIP
            ['mesh: saved {...}, now {...}']
        """
        out = []
        for key in ("mesh", "inputs", "outputs", "values"):
            mine, theirs = self.record[key], other[key]
            if key in ("inputs", "outputs") and len(mine) == len(theirs):
                out += [f"{key[:-1]} {m['name']}: saved {_leaf_text(m)}, now {_leaf_text(t)}"
                        for m, t in zip(mine, theirs) if m != t]  # fmt: skip
            elif mine != theirs:
                out.append(f"{key}: saved {mine}, now {theirs}")
        if not out and self.record["program"]["sha256"] != other["program"]["sha256"]:
            out.append(_program_difference(self.record["program"], other["program"]))
        return out

    def check(self, graph: Any) -> None:
        """Every saved layout fits its value in ``graph`` (the same program: see
        `differences`): one entry per dim, axes dividing the dim's size.

        Example:
            >>> saved.check(graph)  # doctest: +SKIP
        """
        sizes = dict(zip(self.record["mesh"]["axes"], self.record["mesh"]["sizes"]))
        for v, dims in enumerate(self.record["dims"]):
            _fit(f"dims[{v}]", dims, graph.shapes[v], sizes)
        for o, dims in enumerate(self.record["out_dims"]):
            _fit(f"out_dims[{o}]", dims, graph.shapes[graph.out_vids[o]], sizes)


def _leaf_text(leaf: dict) -> str:
    return f"{leaf['name']} {leaf['dtype']}{tuple(leaf['shape'])}"


def _program_difference(saved: dict, now: dict) -> str:
    a, b = saved["equations"], now["equations"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return (
                f"program: a different function (equation {i} is {x!r} in the saved plan, "
                f"{y!r} now)"
            )
    if len(a) != len(b):
        return f"program: a different function ({len(a)} equations saved, {len(b)} now)"
    return "program: the same equations on other shapes or dtypes (the fingerprints differ)"


def dims_to_json(dims) -> list:
    """A layout as JSON: per dim ``null`` or a list of axis names."""
    return [None if d is None else list(d) for d in dims]


def dims_from_json(dims) -> tuple:
    """A layout read from JSON (already checked by `read_saved`)."""
    return tuple(None if d is None else tuple(d) for d in dims)


def _fit(path: str, dims: list, shape: Sequence[int], sizes: dict) -> None:
    if len(dims) != len(shape):
        raise ShardingError(
            f"saved plan: {path} has {len(dims)} entries, but the value has rank {len(shape)} "
            f"(shape {tuple(shape)}); the file was edited or made for another program: plan "
            "again (drop plan=...)"
        )
    for d, (axes, size) in enumerate(zip(dims, shape)):
        n = math.prod(sizes[a] for a in axes or ())
        if size % n:
            raise ShardingError(
                f"saved plan: {path}[{d}] is {axes}, whose {n} shards do not divide the dim "
                f"of size {size} (shape {tuple(shape)}); plan again (drop plan=...)"
            )


def read_saved(text: Any) -> SavedPlan:
    """Parse and check a saved plan (the module doc gives the format); every violation
    is a `ShardingError` naming the field, what it holds and what was expected.

    Example:
        >>> read_saved('{"format": "jaxshard-plan", "version": 1}')  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        jaxshard.errors.ShardingError: saved plan: version is 1, this jaxshard reads version 2: ...
    """
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as e:
            raise ShardingError(f"not a jaxshard plan: not UTF-8 text ({e})") from None
    if not isinstance(text, str):
        raise ShardingError(
            f"Plan.from_json takes the JSON text of a saved plan, got a {type(text).__name__}"
        )
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ShardingError(
            f"not a jaxshard plan: the text is not JSON ({e}); was the file truncated?"
        ) from None
    if not isinstance(record, dict) or record.get("format") != PLAN_FORMAT:
        raise ShardingError(f"not a jaxshard plan: the JSON has no 'format': {PLAN_FORMAT!r}")
    version = record.get("version")
    if version != PLAN_VERSION or isinstance(version, bool):
        raise ShardingError(
            f"saved plan: version is {version!r}, this jaxshard reads version {PLAN_VERSION}: "
            "plan again with this version (drop plan=..., then save the new plan)"
        )
    _Check(record).all()
    return SavedPlan(record)


class _Check:
    """The format's rules, one method per field; each error names the JSON path."""

    def __init__(self, record: dict):
        self.record = record

    def all(self) -> None:
        r = self.record
        known = {"format", "version", "mesh", "inputs", "outputs", "values", "program"}
        known |= {"dims", "out_dims", "pipeline"}
        extra = sorted(set(r) - known)
        if extra:
            self.fail(extra[0], r[extra[0]], f"no such field (the fields are {sorted(known)})")
        for key in sorted(known - {"pipeline"}):
            if key not in r:
                raise ShardingError(f"saved plan: field {key!r} is missing; plan again")
        axes = self.mesh(r["mesh"])
        n = self.count("values", r["values"])
        self.program(r["program"])
        self.list_of("dims", r["dims"], n)
        for v, dims in enumerate(r["dims"]):
            self.layout(f"dims[{v}]", dims, axes)
        inputs = self.leaves("inputs", r["inputs"], n, axes)
        outputs = self.leaves("outputs", r["outputs"], n, axes)
        self.list_of("out_dims", r["out_dims"], len(outputs))
        for o, dims in enumerate(r["out_dims"]):
            self.layout(f"out_dims[{o}]", dims, axes)
        for i, leaf in enumerate(inputs):
            self.fits(f"dims[{leaf['value']}]", r["dims"][leaf["value"]], leaf, f"inputs[{i}]")
        for o, leaf in enumerate(outputs):
            self.fits(f"out_dims[{o}]", r["out_dims"][o], leaf, f"outputs[{o}]")
        if "pipeline" in r:
            self.pipeline(r["pipeline"], axes)

    def fail(self, path: str, value: Any, expected: str) -> None:
        shown = json.dumps(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise ShardingError(
            f"saved plan: {path} is {shown}, expected {expected}; the file was edited, "
            "truncated or written by another program: plan again (drop plan=...)"
        )

    def count(self, path: str, value: Any, least: int = 0) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            self.fail(path, value, f"an integer >= {least}")
        return value

    def text(self, path: str, value: Any) -> str:
        if not isinstance(value, str):
            self.fail(path, value, "a string")
        return value

    def list_of(self, path: str, value: Any, length: int | None = None) -> list:
        if not isinstance(value, list):
            self.fail(path, value, "a list")
        if length is not None and len(value) != length:
            self.fail(path, f"<a list of {len(value)}>", f"a list of {length}")
        return value

    def obj(self, path: str, value: Any, keys: Sequence[str]) -> dict:
        if not isinstance(value, dict):
            self.fail(path, value, f"an object with {list(keys)}")
        if sorted(value) != sorted(keys):
            self.fail(path, value, f"an object with exactly the fields {sorted(keys)}")
        return value

    def mesh(self, mesh: Any) -> dict[str, int]:
        self.obj("mesh", mesh, ("axes", "sizes"))
        names = self.list_of("mesh.axes", mesh["axes"])
        sizes = self.list_of("mesh.sizes", mesh["sizes"], len(names))
        for i, name in enumerate(names):
            self.text(f"mesh.axes[{i}]", name)
        if len(set(names)) != len(names):
            self.fail("mesh.axes", names, "distinct axis names")
        for i, size in enumerate(sizes):
            self.count(f"mesh.sizes[{i}]", size, 1)
        return dict(zip(names, sizes))

    def program(self, program: Any) -> None:
        self.obj("program", program, ("equations", "sha256"))
        digest = self.text("program.sha256", program["sha256"])
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            self.fail("program.sha256", digest, "64 hex digits")
        for i, name in enumerate(self.list_of("program.equations", program["equations"])):
            self.text(f"program.equations[{i}]", name)

    def layout(self, path: str, dims: Any, axes: dict[str, int]) -> None:
        seen: set[str] = set()
        for d, entry in enumerate(self.list_of(path, dims)):
            if entry is None:
                continue
            for k, axis in enumerate(self.list_of(f"{path}[{d}]", entry)):
                if not isinstance(axis, str) or axis not in axes:
                    self.fail(f"{path}[{d}][{k}]", axis, f"a mesh axis ({list(axes)})")
                if axis in seen:
                    self.fail(f"{path}[{d}][{k}]", axis, "an axis not used by another dim")
                seen.add(axis)

    def leaves(self, path: str, leaves: Any, n: int, axes: dict[str, int]) -> list:
        for i, leaf in enumerate(self.list_of(path, leaves)):
            where = f"{path}[{i}]"
            self.obj(where, leaf, ("dtype", "name", "shape", "value"))
            self.text(f"{where}.name", leaf["name"])
            self.text(f"{where}.dtype", leaf["dtype"])
            value = self.count(f"{where}.value", leaf["value"])
            if value >= n:
                self.fail(f"{where}.value", value, f"a value index below values ({n})")
            for d, size in enumerate(self.list_of(f"{where}.shape", leaf["shape"])):
                self.count(f"{where}.shape[{d}]", size)
        return leaves

    def fits(self, path: str, dims: list, leaf: dict, leaf_path: str) -> None:
        if len(dims) != len(leaf["shape"]):
            self.fail(path, dims, f"{len(leaf['shape'])} entries, one per dim of {leaf_path}")
        sizes = dict(zip(self.record["mesh"]["axes"], self.record["mesh"]["sizes"]))
        for d, (axes, size) in enumerate(zip(dims, leaf["shape"])):
            if axes is None:  # an argument or result is laid out whole: nothing left open
                self.fail(f"{path}[{d}]", axes, "a list of mesh axes ([] for replicated)")
            n = math.prod(sizes[a] for a in axes)
            if size % n:
                self.fail(f"{path}[{d}]", axes, f"axes whose {n} shards divide {size}")

    def pipeline(self, loops: Any, axes: dict[str, int]) -> None:
        keys = ("batch", "layers", "line", "microbatches", "replicas", "stages")
        for i, loop in enumerate(self.list_of("pipeline", loops)):
            where = f"pipeline[{i}]"
            named = isinstance(loop, dict) and "schedule" in loop
            self.obj(where, loop, keys + (("repeats", "schedule") if named else ()))
            self.text(f"{where}.line", loop["line"])
            for key in _PIPELINE_INTS + (("repeats",) if named else ()):
                self.count(f"{where}.{key}", loop[key], 1)
            if named and loop["schedule"] not in ("circular", "1f1b"):
                self.fail(
                    f"{where}.schedule", loop["schedule"], '"circular" or "1f1b" (GPipe is unnamed)'
                )
            for k, axis in enumerate(self.list_of(f"{where}.replicas", loop["replicas"])):
                if not isinstance(axis, str) or axis not in axes:
                    self.fail(f"{where}.replicas[{k}]", axis, f"a mesh axis ({list(axes)})")
