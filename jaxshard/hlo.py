"""Reading compiled HLO text: its collectives, the mesh axes their replica groups span,
and how many times each runs per call.

`compiled_collectives` turns ``compiled.as_text()`` into one `Collective` per transfer:
its kind, the mesh axes its replica groups span (explicit ``{{0,1},{2,3}}``, iota
``[2,4]<=[8]T(1,0)`` and mesh ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}`` forms; a
group over part of an axis is a sub-axis, named as Shardy does: ``model:(1)2``, the major
half of a "model" axis of 4), the bytes of each operand (XLA's combiners pack several
into one tuple instruction, so each element counts; an async ``-start`` counts its
result once), and its runs per call: a computation runs as often as its callers, times
the trip count for a while body (XLA's ``known_trip_count``, else the bound of a
``counter < N`` condition, else unknown).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

import numpy as np

from jaxshard.cost import Collective, CollectiveKind

KINDS = tuple(CollectiveKind)
_INSTRUCTION = re.compile(r"=\s*[^=]*?\b(" + "|".join(KINDS) + r")(?:-start)?\(")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start)?\((.*)$")
# Bytes per element of each HLO element type. Sub-byte types (s2/s4/u4, fp4) occupy a byte
# each in XLA's buffers (ShapeUtil::ByteSizeOfPrimitiveType), so a byte is what moves.
DTYPE_BYTES = {
    "pred": 1, "s1": 1, "u1": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "f4e2m1fn": 1, "f8e3m4": 1, "f8e4m3": 1, "f8e4m3fn": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLS = re.compile(
    r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def shape_bytes(type_text: str) -> list[int]:
    """Bytes of each array in an HLO type (a tuple type gives one entry per element;
    tokens and other non-array types give none).

    Example:
        >>> shape_bytes("(f32[8,16]{1,0}, bf16[4]{0}, f8e4m3fn[8]{0})")
        [512, 8, 8]
    """
    return [
        math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype]
        for dtype, dims in _ARRAY.findall(type_text)
        if dtype in DTYPE_BYTES
    ]


def hlo_collectives(hlo_text: str) -> Counter:
    """Collective instructions in compiled HLO text, by kind.

    Example:
        >>> hlo_collectives("%ar = f32[8]{0} all-reduce(f32[8]{0} %x), to_apply=%sum")
        Counter({'all-reduce': 1})
    """
    return Counter(CollectiveKind(m.group(1)) for m in _INSTRUCTION.finditer(hlo_text))


def _groups_to_axes(groups: list[list[int]], mesh) -> frozenset[str]:
    """The mesh axes whose device groups (flat mesh positions) are exactly ``groups``.

    A group may span part of an axis: a sub-axis, named as Shardy does, ``model:(1)2``
    (pre-size 1, size 2: the major half of "model") or ``model:(2)2`` (the minor half).
    Groups that no set of (sub-)axes makes give ``{"?"}``.

    Example:
        >>> import jax
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> sorted(_groups_to_axes([[0, 4], [1, 5], [2, 6], [3, 7]], mesh))
        ['data']
        >>> sorted(_groups_to_axes([[0, 2], [1, 3], [4, 6], [5, 7]], mesh))
        ['model:(1)2']
        >>> sorted(_groups_to_axes([[0, 1, 4, 5], [2, 3, 6, 7]], mesh))
        ['data', 'model:(2)2']
    """
    names, shape = list(mesh.axis_names), tuple(mesh.devices.shape)
    first = next((g for g in groups if 0 in g), None)
    if first is None:
        return frozenset({"?"})
    coords = np.array(np.unravel_index(sorted(first), shape)).T.reshape(len(first), len(shape))
    parts = []  # (axis, pre, size, post) per spanned axis
    for i, n in enumerate(shape):
        values = sorted(set(coords[:, i].tolist()))
        size = len(values)
        if size == 1:
            continue
        post = values[1] - values[0]
        if values != [k * post for k in range(size)] or n % (size * post):
            return frozenset({"?"})
        parts.append((i, n // (size * post), size, post))
    if math.prod(p[2] for p in parts) != len(first):
        return frozenset({"?"})
    refined, chosen = [], []
    for i, n in enumerate(shape):
        part = next((p for p in parts if p[0] == i), None)
        if part is None:
            refined.append(n)
        else:
            chosen.append(len(refined) + 1)
            refined += [part[1], part[2], part[3]]
    ids = np.arange(math.prod(shape)).reshape(refined)
    rest = [d for d in range(len(refined)) if d not in chosen]
    made = np.transpose(ids, rest + chosen).reshape(-1, len(first))
    if sorted(sorted(row.tolist()) for row in made) != sorted(sorted(g) for g in groups):
        return frozenset({"?"})
    return frozenset(
        names[i] if size == shape[i] else f"{names[i]}:({pre}){size}" for i, pre, size, _ in parts
    )


def _parse_groups(rest: str, n_devices: int) -> list[list[int]] | None:
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", rest)
    if m:
        return [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        out_shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")]
        )
        if m.group(3):
            ids = np.transpose(ids, [int(x) for x in m.group(3).split(",")])
        return ids.reshape(out_shape).tolist()
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", rest
    )
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    if "replica_groups={}" in rest:
        return [list(range(n_devices))]
    return None


def _mesh_groups(mesh_text: str, ids_text: str | None, axes_text: str) -> list[list[int]]:
    """Replica groups of XLA's mesh form: ``mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0))
    {'b':(1)2}`` (the device ids, when not iota, as an iota ``[dims]T(perm)`` or a list;
    axes whole or sub-axes ``name:(pre-size)size``).

    Example:
        >>> _mesh_groups("'a'=2,'b'=4", None, "'b':(1)2")
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        >>> _mesh_groups("'a'=2,'b'=2", "[2,2]T(1,0)", "'a'")
        [[0, 1], [2, 3]]
    """
    axes = re.findall(r"'([^']+)'=(\d+)", mesh_text)
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    total = math.prod(sizes)
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", (ids_text or "").strip())
    if iota:
        ids = np.arange(total).reshape([int(x) for x in iota.group(1).split(",")])
        if iota.group(2):
            ids = np.transpose(ids, [int(x) for x in iota.group(2).split(",")])
    elif ids_text:
        ids = np.array([int(x) for x in re.findall(r"\d+", ids_text)])
    else:
        ids = np.arange(total)
    refs = [
        (names.index(name), int(pre or 1), int(size) if size else None)
        for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", axes_text)
    ]
    refined, chosen = [], [0] * len(refs)
    for i, n in enumerate(sizes):  # each axis cut into sub-axes as XLA does
        mine = sorted((pre, size or n, k) for k, (axis, pre, size) in enumerate(refs) if axis == i)
        done = 1
        for pre, size, k in mine:
            if pre != done:
                refined.append(pre // done)
            chosen[k] = len(refined)
            refined.append(size)
            done = pre * size
        if done != n:
            refined.append(n // done)
    rest = [d for d in range(len(refined)) if d not in chosen]
    group = math.prod(refined[d] for d in chosen)
    return np.transpose(ids.reshape(refined), rest + chosen).reshape(-1, group).tolist()


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    r"""HLO text split into computations: ``{name: instruction lines}``, and the entry.

    Example:
        >>> computations("ENTRY %main (a: f32[]) -> f32[] {\n  ROOT %n = f32[] negate(%a)\n}")
        ({'main': ['  ROOT %n = f32[] negate(%a)']}, 'main')
    """
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = comps.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
        elif line.strip() == "}":
            current = None
        else:
            current.append(line)
    return comps, entry


def trip_count(line: str, comps: dict[str, list[str]], condition: str | None) -> int | None:
    """A while instruction's trip count: XLA's ``known_trip_count``, else the one constant
    a ``counter < N`` condition compares with, else None.

    Example:
        >>> trip_count('%w = while(%t), backend_config={"known_trip_count":{"n":"12"}}', {}, None)
        12
    """
    m = _TRIP.search(line)
    if m:
        return int(m.group(1))
    cond = comps.get(condition or "", [])
    consts = [int(c) for ln in cond for c in re.findall(r"constant\((\d+)\)", ln)]
    if len(consts) == 1 and any("direction=LT" in ln for ln in cond):
        return consts[0]
    return None


def computation_runs(hlo_text: str) -> dict[str, int | None]:
    """How many times each computation of compiled HLO text runs per call: the sum over
    its call sites of the caller's runs, times the trip count for a while body (None:
    under a loop whose trip count cannot be read).

    Example:
        >>> text = '''
        ... %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
        ...   %ar = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={}, to_apply=%sum
        ... }
        ... ENTRY %main (a: f32[8]) -> f32[8] {
        ...   %w = (s32[], f32[8]) while(%t), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"12"}}
        ... }'''
        >>> sorted(computation_runs(text).items())
        [('body', 12), ('c', 12), ('main', 1), ('sum', 12)]
    """
    comps, entry = computations(hlo_text)
    callers: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            calls = _CALLS.findall(line)
            named = dict(calls)
            for key, callee in calls:
                factor = 1
                if key in ("body", "condition") and " while(" in line:
                    factor = trip_count(line, comps, named.get("condition"))
                callers[callee].append((name, factor))
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    callers[callee].append((name, 1))
    runs: dict[str, int | None] = {}

    def count(name: str) -> int | None:  # HLO's call graph has no cycles
        if name not in runs:
            total: int | None = 1 if name == entry else 0
            for caller, factor in callers.get(name, ()) if name != entry else ():
                n = count(caller)
                if n is None or factor is None or total is None:
                    total = None
                else:
                    total += n * factor
            runs[name] = total
        return runs[name]

    for name in [*comps, *callers]:
        count(name)
    return runs


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _permute_axes(rest: str, mesh) -> tuple[frozenset[str], int]:
    """The mesh axes along which a collective-permute's source/target pairs move (flat
    mesh positions that differ only there), and the size of those axes together.

    Example:
        >>> import jax
        >>> mesh = jax.make_mesh((2, 4), ("stage", "model"))
        >>> _permute_axes("source_target_pairs={{0,4},{4,0},{1,5},{5,1}}", mesh)
        (frozenset({'stage'}), 2)
    """
    found = _PAIRS.search(rest)
    if not found:
        return frozenset({"?"}), 0
    pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", found.group(1))]
    names, shape = list(mesh.axis_names), tuple(mesh.devices.shape)
    moved = set()
    for a, b in pairs:
        ca, cb = np.unravel_index(a, shape), np.unravel_index(b, shape)
        moved.update(i for i in range(len(shape)) if ca[i] != cb[i])
    if not moved:
        return frozenset({"?"}), 0
    return frozenset(names[i] for i in moved), math.prod(shape[i] for i in moved)


def compiled_collectives(hlo_text: str, mesh) -> list[Collective]:
    """Every collective transfer in compiled HLO text: one per (tuple) operand (a tuple
    all-to-all, one operand per device of its group, is one transfer), with the times it
    runs per call (`computation_runs`).

    Example:
        >>> compiled_collectives(compiled.as_text(), mesh)  # doctest: +SKIP
        [Collective(kind='all-reduce', axes=frozenset({'model'}), bytes=16384), ...]
    """
    out = []
    n = mesh.devices.size
    comps, _ = computations(hlo_text)
    runs = computation_runs(hlo_text)
    for name, lines in comps.items() or [("", hlo_text.splitlines())]:
        times = runs.get(name, 1)
        times = 1 if times == 0 else times  # called from nowhere we could read: once
        for line in lines:
            m = _LINE.match(line)
            if not m:
                continue
            result, kind, start, rest = m.groups()
            kind = CollectiveKind(kind)
            groups = _parse_groups(rest, n)
            axes = _groups_to_axes(groups, mesh) if groups else frozenset({"?"})
            size = len(next(iter(groups), [])) if groups else 0
            if kind == CollectiveKind.PERMUTE and not groups:
                axes, size = _permute_axes(rest, mesh)
            sizes = shape_bytes(result)
            if start and kind == CollectiveKind.ALL_GATHER:
                sizes = sizes[len(sizes) // 2 :]  # -start returns (operands, results)
            elif start and kind == CollectiveKind.PERMUTE:
                sizes = sizes[:1]
            elif (
                kind == CollectiveKind.ALL_TO_ALL
                and "dimensions=" not in rest
                and len(sizes) == size > 1
            ):
                # the tuple form: operand i goes to the group's i-th device, one exchange
                sizes = [sum(sizes)]
            out.extend(Collective(kind, axes, local, size, times) for local in sizes)
    return out


_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
_DOT = re.compile(r"\bdot\(%([\w.\-]+), %([\w.\-]+)\).*?lhs_contracting_dims=\{([\d,]*)\}")


def compiled_flops(hlo_text: str) -> float:
    """FLOPs per device per call of the matrix multiplies in compiled HLO text: each
    ``dot`` counts 2 x (its result's elements) x (its contracted size), times the times
    its computation runs (`computation_runs`: a loop body once per iteration, where XLA's
    own ``cost_analysis`` counts it once). A computation under a loop of unknown trip
    count counts once.

    Example:
        >>> text = '''
        ... ENTRY %main (a: f32[8,4], b: f32[4,2]) -> f32[8,2] {
        ...   %a = f32[8,4]{1,0} parameter(0)
        ...   %b = f32[4,2]{1,0} parameter(1)
        ...   ROOT %d = f32[8,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ... }'''
        >>> compiled_flops(text)  # 2 * 16 * 4
        128.0
    """
    comps, _ = computations(hlo_text)
    runs = computation_runs(hlo_text)
    total = 0.0
    for name, lines in comps.items():
        shapes = {}
        for line in lines:
            m = _DEFINED.match(line)
            if m:
                shapes[m.group(1)] = [int(d) for d in m.group(2).split(",") if d]
        for line in lines:
            dot = _DOT.search(line)
            defined = _DEFINED.match(line)
            if dot is None or defined is None or dot.group(1) not in shapes:
                continue
            lhs = shapes[dot.group(1)]
            contracted = math.prod(lhs[int(i)] for i in dot.group(3).split(",") if i)
            result = math.prod(shapes[defined.group(1)])
            total += 2.0 * result * contracted * (runs.get(name) or 1)
    return total
