"""Collectives and their bytes, read from a compiled program's HLO text.

Method (what the quality tables report):

- The text of ``compiled.as_text()`` is split into computations (``%name (...) -> ... {``
  up to ``}``, ``ENTRY`` marks the entry). Every instruction whose opcode is a collective
  (``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``,
  ``collective-permute``, or their async ``-start`` forms; ``-done`` is not counted again)
  is one collective.
- Its *result bytes* are the bytes of its result shape, which in an SPMD program is the
  per-device shape (a combined all-reduce has a tuple result: all elements count; an
  async ``all-gather-start`` returns ``(operand, result)``: the result half counts).
- Its *ring bytes* estimate what one device sends, from the group size ``n`` read from
  ``replica_groups`` (explicit ``{{..}}``, iota ``[g,n]<=[..]`` and
  ``mesh[...] {axes}`` forms): all-reduce ``2(n-1)/n·S``, all-gather and all-to-all
  ``(n-1)/n·S``, reduce-scatter ``(n-1)·S`` (``S`` = result bytes), collective-permute
  ``S``. These are the ring volumes jaxshard's cost model predicts with.
- Executions per step: each computation's multiplier is the sum over its call sites of
  the caller's multiplier, times the trip count for a ``while`` body. The trip count is
  the ``known_trip_count`` XLA records in the while's backend config; failing that, the
  constant the loop condition compares its counter against; failing that, 1, and the
  result says the count is a lower bound (``unknown_trip_counts``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from jaxshard.cost import ring_bytes
from jaxshard.hlo import (  # one parser of computations, loops and HLO types
    computations,
    shape_bytes,
    trip_count,
)

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_CALLS = re.compile(
    r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclass
class Collective:
    kind: str
    computation: str
    result_bytes: int
    group_size: int | None
    executions: int = 1

    @property
    def ring_bytes(self) -> float:
        n, s = self.group_size, self.result_bytes
        if not n:  # an unreadable group: count the whole buffer
            return float(s)
        return ring_bytes(self.kind, n, n * s if self.kind == "reduce-scatter" else s)


@dataclass
class CollectiveStats:
    """Collectives of one compiled program, per device, per call of the program."""

    collectives: list[Collective] = field(default_factory=list)
    unknown_trip_counts: int = 0

    @property
    def static_count(self) -> int:
        return len(self.collectives)

    @property
    def count(self) -> int:
        """Collectives executed per step (loop bodies times their trip counts)."""
        return sum(c.executions for c in self.collectives)

    @property
    def result_bytes(self) -> int:
        return sum(c.result_bytes * c.executions for c in self.collectives)

    @property
    def ring_bytes(self) -> float:
        return sum(c.ring_bytes * c.executions for c in self.collectives)

    def by_kind(self) -> dict[str, int]:
        kinds: dict[str, int] = defaultdict(int)
        for c in self.collectives:
            kinds[c.kind] += c.executions
        return dict(sorted(kinds.items()))

    def kinds_text(self) -> str:
        short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
                 "all-to-all": "A2A", "collective-permute": "CP"}  # fmt: skip
        return " ".join(f"{n}{short[k]}" for k, n in self.by_kind().items()) or "-"


def group_size(line: str, num_devices: int) -> int | None:
    """The size of each replica group of a collective instruction, or None if unreadable.

    Example:
        >>> group_size("all-reduce(x), replica_groups=[2,4]<=[8], to_apply=%add", 8)
        4
        >>> group_size("all-gather(x), replica_groups={{0,4},{1,5},{2,6},{3,7}}", 8)
        2
        >>> group_size("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, x", 8)
        2
        >>> group_size("replica_groups=mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}, x", 8)
        4
    """
    i = line.find("replica_groups=")
    if i < 0:
        return None
    text = line[i + len("replica_groups=") :]
    if text.startswith("{}"):
        return num_devices
    if text.startswith("{{"):
        first = text[2 : text.index("}")]
        return len([x for x in first.split(",") if x.strip()])
    m = re.match(r"\[(\d+),(\d+)\]<=", text)
    if m:
        return int(m.group(2))
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\S+)?\s*\{([^}]*)\}", text)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        n = 1
        for axis in re.findall(r"'(\w+)'", m.group(2)):
            if axis not in sizes:
                return None
            n *= int(sizes[axis])
        return n
    return None


def collective_stats(hlo_text: str, num_devices: int) -> CollectiveStats:
    """Collectives of ``compiled.as_text()``, with executions per step; see the module doc."""
    comps, entry = computations(hlo_text)
    stats = CollectiveStats()
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)  # caller -> (callee, factor)
    for name, lines in comps.items():
        for line in lines:
            calls = dict((k, v) for k, v in _CALLS.findall(line))
            for key, callee in _CALLS.findall(line):
                factor = 1
                if key == "body":
                    trips = trip_count(line, comps, calls.get("condition"))
                    if trips is None:
                        stats.unknown_trip_counts += 1
                        trips = 1
                    factor = trips
                edges[name].append((callee, factor))
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    edges[name].append((callee, 1))
    multiplier: dict[str, int] = defaultdict(int)
    if entry is None:  # pragma: no cover - every compiled module has an ENTRY
        raise ValueError("no ENTRY computation in the HLO text")
    order = _topological(entry, edges)
    multiplier[entry] = 1
    for name in order:
        for callee, factor in edges.get(name, ()):
            multiplier[callee] += multiplier[name] * factor
    for name, lines in comps.items():
        for line in lines:
            parsed = _instruction(line)
            if parsed is None:
                continue
            type_text, opcode = parsed
            kind = opcode.removesuffix("-start")
            if kind not in KINDS or opcode.endswith("-done"):
                continue
            sizes = shape_bytes(type_text)
            if opcode.endswith("-start") and kind == "all-gather":
                sizes = sizes[len(sizes) // 2 :]  # (operands..., results...)
            elif opcode.endswith("-start") and kind == "collective-permute":
                sizes = sizes[:1]
            stats.collectives.append(
                Collective(kind, name, sum(sizes), group_size(line, num_devices),
                           multiplier.get(name, 0) or 1)
            )  # fmt: skip
    return stats


def _instruction(line: str) -> tuple[str, str] | None:
    """``(result type, opcode)`` of an HLO instruction line, or None for other lines.

    Example:
        >>> _instruction("  %ar.1 = (f32[2]{0}, f32[]) all-reduce(%a, %b), to_apply=%add")
        ('(f32[2]{0}, f32[])', 'all-reduce')
    """
    i = line.find(" = ")
    if i < 0:
        return None
    rest = line[i + 3 :]
    if rest.startswith("("):  # a tuple type: up to the matching parenthesis
        depth, end = 0, len(rest)
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                end = i + 1
                break
        type_text, rest = rest[:end], rest[end:]
    else:
        type_text, _, rest = rest.partition(" ")
    m = re.match(r"\s*([\w\-]+)\(", rest)
    return (type_text, m.group(1)) if m else None


def _topological(entry: str, edges: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Computations reachable from the entry, every caller before its callees."""
    seen, order = set(), []

    def visit(name: str) -> None:
        stack = [(name, iter(edges.get(name, ())))]
        seen.add(name)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                order.append(node)
            elif nxt[0] not in seen:
                seen.add(nxt[0])
                stack.append((nxt[0], iter(edges.get(nxt[0], ()))))

    visit(entry)
    return order[::-1]
