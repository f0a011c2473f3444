"""The search problem built from the traced graph: dim classes (the (value, dim) pairs
one rule factor ties together), argument groups (repeated layers share one decision),
the decisions and their candidates, and the joint terms whose costs the integer program
weighs (memory: `jaxshard.search.memory`). See the package docstring for the outline."""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import PartitionSpec

from jaxshard.annotate import ExactPath
from jaxshard.cost import (
    Liveness,
    executions,
    halo_collectives,
    liveness,
    nbytes,
    pending_sums,
    reshard_collectives,
    ring_bytes,
    step_bytes,
    unhaloed,
    xla_scope,
)
from jaxshard.graph import AppKind, find_root, view_dims
from jaxshard.lattice import Axes, spec_entry, to_spec
from jaxshard.plan import (
    contracts,
    dead_apps,
    duplicate_app,
    hint_pins,
    mesh_axis_sizes,
)
from jaxshard.rule import FactorKind
from jaxshard.search.memory import MemoryModel, fused_liveness
from jaxshard.search.refs import UNSPLIT, Fixed, Follow, Ref, decision_of

_LAYER_INDEX = re.compile(r"(?<=/)\d+(?=/|$)")
US = 1e6  # the objective is in microseconds
MEMORY_TIEBREAK = 1e-9  # objective units per byte: 1 GB of memory weighs 1 µs
_EXTRA_TIEBREAK = 1e-2  # µs per leaf stored with an extra axis
# the most joint choices an equation's term may reach by a class following a decision
# (`Problem._follow`): past it the integer program grows slow to solve
FOLLOW_COMBOS = 64


class Scope(StrEnum):
    """What an extra storage axis holds: the optimizer state alone (ZeRO-1), or the
    parameter with its state (FSDP). An FSDP parameter's gathered copy is counted alive
    from its first use to its last (XLA keeps it through the backward pass), and planning
    takes the search's storage decision as it is (`jaxshard.plan.plan_from_graph`'s
    ``storage``)."""

    STATE = "state"
    ALL = "all"


class Extra(NamedTuple):
    """A group's extra storage axes: on dim ``dim`` of its leaves, holding ``scope``."""

    dim: int
    axes: Axes
    scope: Scope


@dataclass
class Decision:
    """One choice of the integer program: a dim class's axes, or a group's extra axis."""

    name: str
    candidates: list[Any]  # Axes for a class; None or an `Extra` for an extra axis


@dataclass
class Group:
    key: str  # the owner's path with layer indices as '*'
    owners: list[int]  # argument leaf indices with that path pattern and shape
    followers: list[int] = field(default_factory=list)  # optimizer state following them
    extra: int | None = None  # decision index of the extra (FSDP) axis


@dataclass
class Term:
    """A function of the joint choice of ``decisions``: per combination (product order)
    communication time (µs), bytes, memory bytes, whether it is allowed, and a tie-break
    added to the objective only."""

    decisions: tuple[int, ...]
    sizes: tuple[int, ...]
    time: np.ndarray
    bytes: np.ndarray
    memory: np.ndarray
    allowed: np.ndarray
    bias: np.ndarray

    @staticmethod
    def empty(decisions: tuple[int, ...], sizes: tuple[int, ...]) -> Term:
        n = math.prod(sizes)
        z = np.zeros(n)
        return Term(decisions, sizes, z, z.copy(), z.copy(), np.ones(n, dtype=bool), z.copy())


def group_key(path: str) -> str:
    """A path with its layer indices replaced by ``*``: one decision covers all layers.

    Example:
        >>> group_key("params/layers/11/attn/wq"), group_key("opt_state/0/mu/head")
        ('params/layers/*/attn/wq', 'opt_state/*/mu/head')
    """
    return _LAYER_INDEX.sub("*", path)


def followers(names, shapes, dtypes, candidates) -> dict[int, int]:
    """Leaves that follow another leaf (optimizer state): same shape and dtype, and the
    other's path below its argument ends this one's path; or, within one argument, the
    other's path below its first two parts, this one sitting deeper (Flax NNX's train
    state: ``state/model/...`` and ``state/optimizer/opt_state/0/mu/...``, whose tree
    has no ``model``). ``{follower: owner}``.

    Example:
        >>> names = ["state/model/w", "state/optimizer/opt_state/0/mu/w"]
        >>> followers(names, [(4, 4)] * 2, ["float32"] * 2, range(2))
        {1: 0}
    """
    by_tail: dict[tuple, list[tuple[int, int]]] = {}
    for i in candidates:
        parts = tuple(names[i].split("/"))
        for drop in (1, 2):
            if len(parts) > drop:
                by_tail.setdefault(parts[drop:], []).append((i, drop))
    out = {}
    for i in candidates:
        parts = tuple(names[i].split("/"))
        for k in range(1, len(parts)):
            hits = [
                j for j, drop in by_tail.get(parts[k:], [])
                if j != i and shapes[j] == shapes[i] and dtypes[j] == dtypes[i]
                and len(names[j]) < len(names[i])
                and (drop == 1 or (k > drop and names[j].split("/")[0] == parts[0]))
            ]  # fmt: skip
            if hits:
                out[i] = hits[0]
                break
    for i in list(out):  # follow chains to the first owner
        seen = {i}
        while out[i] in out and out[i] not in seen:
            seen.add(out[i])
            out[i] = out[out[i]]
    return out


class Problem(MemoryModel):
    """The coarsened problem of one traced function: dim classes, groups, decisions and
    joint terms, and the integer program over them."""

    def __init__(self, traced, graph, mesh, hints, cost_model, memory_budget):
        self.traced, self.graph, self.mesh = traced, graph, mesh
        self.sizes = mesh_axis_sizes(mesh)
        self.cost_model, self.budget = cost_model, memory_budget
        self.dead = dead_apps(graph)
        # buffers as XLA's fusion leaves them: the budget is compared with what the
        # compiled program allocates
        self.live: Liveness = fused_liveness(graph, liveness(graph, self.dead))
        self.user_budget = memory_budget
        self._pins(hints)
        # whole choices the integer program may not take (`jaxshard.search._repriced`)
        self.excluded: list[dict[int, int]] = []
        # equations whose memory rows a solve needed: every later solve starts with them
        # (a row bounds the model's memory at one equation, true at any budget)
        self.memory_points: list[int] = []
        self._activation_rows: dict[int, tuple] = {}  # `activation_row`, per equation
        self._readers: dict[int, list[int]] = {}
        # a value -> the values that are it moved or converted (a transpose, a cast), each
        # with, per its dim, the value's dim: MaxText moves a stack's layer dim to the
        # front before its scan; the uses of such a view are the value's uses
        self._views: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        self._alias_memo: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # `_aliases`
        # a stacked argument -> the per-layer values scans slice it into (their uses are
        # its uses, once per iteration)
        self._layers: dict[int, list[int]] = {}
        for a, app in enumerate(graph.apps):
            if a in self.dead:
                continue
            if app.kind is AppKind.EQN:
                dims = view_dims(app)
                if dims is not None:
                    self._views.setdefault(app.operands[0], []).append((app.results[0], dims))
                    continue
                for u in app.operands:
                    self._readers.setdefault(u, []).append(a)
            elif app.kind is AppKind.LINK and len(app.operands) == 1:
                (o,), (r,) = app.operands, app.results
                if len(graph.shapes[o]) == len(graph.shapes[r]) + 1:
                    self._layers.setdefault(o, []).append(r)
        self._classes()
        self._groups()
        self._decide()
        self.value_refs = [self._refs(v) for v in range(len(graph.shapes))]
        self.terms: dict[tuple[int, ...], Term] = {}
        self.constant_time = self.constant_bytes = 0.0  # collectives no decision changes
        self._value_terms()
        self._app_terms()
        self._group_terms()
        self._stack_terms()
        self.static = self._static_memory()

    # --- dim classes -------------------------------------------------------------------

    def _pins(self, hints) -> None:
        pins = hint_pins(self.traced, self.graph, hints, self.sizes)
        self.pins: dict[int, tuple] = {v: p.dims for v, p in pins.items()}

    def _classes(self) -> None:
        """Union-find over (value, dim): every dim joins the class of its major factor,
        unless that would give one tensor two dims of one class or one equation one class
        on two factors (attention's query and key positions, ``x.T @ x``): that dim is
        *cut* from the factor (`cuts`), and the equation moves it between its class's
        layout and the factor's (`_app_cost`), so the sequence stays a decision."""
        g = self.graph
        offset = np.zeros(len(g.shapes) + 1, dtype=np.int64)
        offset[1:] = np.cumsum([len(s) for s in g.shapes])
        self.offset = offset
        n = int(offset[-1])
        parent = list(range(n))
        size = [0] * n  # gcd of the factor sizes a class's dims carry
        owner = np.repeat(np.arange(len(g.shapes)), np.diff(offset))
        values: dict[int, set[int]] = {}  # per root of a merged class: its values
        for v, shape in enumerate(g.shapes):
            for d, s in enumerate(shape):
                size[offset[v] + d] = s

        def held(k: int) -> set[int]:
            v = int(owner[k])
            return values.get(k) or ({v} if len(g.shapes[v]) > 1 else set())

        def union(k: int, other: int) -> int | None:
            """Merge two roots; None when a value would hold two dims of the result."""
            small, big = held(k), held(other)
            if len(small) > len(big):
                k, other, small, big = other, k, big, small
            if not small.isdisjoint(big):
                return None
            merged = values.get(other)
            if merged is None:  # a class of one dim so far: its set is made here
                merged = values[other] = set(big)
            merged.update(small)
            values.pop(k, None)
            parent[k] = other
            size[other] = math.gcd(size[other], size[k])
            return other

        # the mesh axes a size splits over: a class joining a factor of a size fewer of
        # them divide would lose those layouts for every member (64 query heads behind a
        # repeat of 8 key heads, on a 32-way tensor axis), so the dim is cut from that
        # factor instead, and the equation prices the move
        splits = [n for n in self.sizes.values() if n > 1]

        def narrows(a: int, b: int) -> bool:
            both = math.gcd(a, b)
            return any((a % n == 0 or b % n == 0) and both % n for n in splits)

        self.cuts: dict[int, frozenset[tuple[int, int]]] = {}
        # (value, dim) cut for its size from the class of (value, dim) of its factor
        self.narrowed: list[tuple[int, int, int, int]] = []
        majors: dict[int, list[tuple[int, int]]] = {}  # per rule: (tensor, dim, factor)
        for a, app in enumerate(g.apps):
            rule = app.rule
            entries = majors.get(id(rule))
            if entries is None:
                entries = []
                for t, dims in enumerate((*rule.operands, *rule.results)):
                    for d, fl in enumerate(dims):
                        big = [f for f in fl if rule.factors[f].size > 1]
                        if big:
                            entries.append((t, d, big[0]))
                majors[id(rule)] = entries
            vids = (*app.operands, *app.results)
            first: dict[int, int] = {}
            cut = []
            narrowed: list[tuple[int, int, int]] = []
            for t, d, f in entries:
                k = find_root(parent, int(offset[vids[t]]) + d)
                fs = rule.factors[f].size
                if size[k] % fs:
                    if narrows(size[k], fs):
                        cut.append((t, d))
                        narrowed.append((t, d, f))
                        continue
                    size[k] = math.gcd(size[k], fs)
                claims = {find_root(parent, r): h for h, r in first.items()}
                other = first.get(f)
                if other is not None and narrows(size[k], size[find_root(parent, other)]):
                    cut.append((t, d))
                    narrowed.append((t, d, f))
                    continue
                if other is None:
                    if claims.get(k, f) != f:
                        cut.append((t, d))
                        continue
                    first[f] = k
                    continue
                other = find_root(parent, other)
                if other == k:
                    continue
                root = None if claims.get(k, f) != f else union(k, other)
                if root is None:
                    cut.append((t, d))
                    continue
                first[f] = root
            if cut:
                self.cuts[a] = frozenset(cut)
            # a dim cut for its size, with a dim of this equation its factor's class holds
            for t, d, f in narrowed:
                kept = next(((t2, d2) for t2, d2, f2 in entries
                             if f2 == f and (t2, d2) not in cut), None)  # fmt: skip
                if kept is not None:
                    self.narrowed.append((vids[t], d, vids[kept[0]], kept[1]))
        self.root = [find_root(parent, k) for k in range(n)]
        self.class_size = size

    def _key(self, v: int, d: int) -> int:
        return self.root[int(self.offset[v]) + d]

    # --- groups of arguments -----------------------------------------------------------

    def _groups(self) -> None:
        g, t = self.graph, self.traced
        names = t.in_names
        shapes = [g.shapes[v] for v in g.in_vids]
        dtypes = [g.dtypes[v] for v in g.in_vids]
        open_leaves = []
        for i, v in enumerate(g.in_vids):
            pin = self.pins.get(v)
            if any(s > 1 and (pin is None or pin[d] is None) for d, s in enumerate(shapes[i])):
                open_leaves.append(i)
        # owners may be pinned leaves: the optimizer state of a parameter the user laid
        # out is stored as the parameter is (`leaf_layout`)
        is_open = set(open_leaves)
        follows = {
            i: o for i, o in followers(names, shapes, dtypes, range(len(names))).items()
            if i in is_open
        }  # fmt: skip
        self.owner_pin: dict[int, tuple] = {}
        by_key: dict[tuple, Group] = {}
        group_of: dict[int, Group] = {}
        for i in open_leaves:
            if i in follows:
                continue
            key = (group_key(names[i]), shapes[i], str(dtypes[i]))
            grp = by_key.get(key)
            if grp is None:
                grp = by_key[key] = Group(key[0], [])
            grp.owners.append(i)
            group_of[i] = grp
        for i, owner in follows.items():
            grp = group_of.get(owner)
            pin = self.pins.get(g.in_vids[owner])
            if pin is not None:
                self.owner_pin[i] = pin
            if grp is None:  # its owner is fully pinned: a group of its own
                key = (group_key(names[i]), shapes[i], str(dtypes[i]))
                grp = by_key.setdefault(key, Group(key[0], []))
                grp.owners.append(i)
            else:
                grp.followers.append(i)
            group_of[i] = grp
        self.groups = list(by_key.values())
        index = {id(grp): k for k, grp in enumerate(self.groups)}
        self.leaf_group = {i: index[id(grp)] for i, grp in group_of.items()}
        self.tied = {i for i, _ in g.ties}

    # --- decisions ---------------------------------------------------------------------

    def _decide(self) -> None:
        """Each class becomes fixed axes (pinned, or replicated when nothing decides it)
        or a decision shared by every class holding the same group dims."""
        g = self.graph
        members: dict[int, set] = {}
        for i, k in self.leaf_group.items():
            v = g.in_vids[i]
            for d, s in enumerate(g.shapes[v]):
                if s > 1:
                    members.setdefault(self._key(v, d), set()).add((k, d))
        pinned: dict[int, Axes] = {}
        for v, dims in self.pins.items():
            for d, axes in enumerate(dims):
                if axes is not None and g.shapes[v][d] > 1:
                    pinned.setdefault(self._key(v, d), axes)
        self.decisions: list[Decision] = []
        by_members: dict[frozenset, int] = {}
        divides: dict[int, int] = {}  # per decision: gcd of its classes' sizes
        self.ref: dict[int, Ref] = {}  # class -> its decision, or the axes pins fix
        for k in sorted(set(self.root)):
            if k in pinned:
                self.ref[k] = Fixed(pinned[k])
            elif k in members:
                key = frozenset(members[k])
                dec = by_members.get(key)
                if dec is None:
                    dec = by_members[key] = len(self.decisions)
                    self.decisions.append(Decision(self._class_name(key), [()]))
                divides[dec] = math.gcd(divides.get(dec, 0), self.class_size[k])
                self.ref[k] = dec
            else:
                self.ref[k] = UNSPLIT
        # a class holding a dim of a data argument (not state the step returns: the
        # batch) may also take several mesh axes at once, major to minor (data parallel
        # over part or all of the mesh); for state, one axis per dim keeps the program
        # small
        data_classes = {
            k for k, ms in members.items() if any(i not in self.tied for i in self._leaves_of(ms))
        }
        multi = tuple(a for a, n in self.sizes.items() if n > 1)
        # several axes at once, major to minor: every set of two or more whose sizes'
        # product divides the dim (a batch of 256 on a 16x8x8 mesh: data and fsdp)
        combos = [c for r in range(2, len(multi) + 1) for c in itertools.combinations(multi, r)]
        # the layer dim of a stack scans slice stays whole: each iteration reads one
        # layer, so a stack split over layers is gathered whole before the loop (an
        # extra storage axis on another dim gathers one layer at a time instead)
        layer_decisions = {self.ref.get(self._key(v, 0)) for v in self._layers}
        for dec, size in divides.items():
            if dec in layer_decisions:
                continue
            self.decisions[dec].candidates += [
                (a,) for a, n in self.sizes.items() if n > 1 and size % n == 0
            ]
            if any(self.ref.get(k) == dec for k in data_classes):
                self.decisions[dec].candidates += [
                    c for c in combos if size % math.prod(self.sizes[a] for a in c) == 0
                ]
        self._follow()
        self.n_class_decisions = len(self.decisions)
        if self.budget is not None:  # an extra storage axis per group, for memory
            total = sum(self._leaf_bytes(i) for i in self.leaf_group)
            # one mesh axis, or several (ZeRO-3 over the axes the batch takes)
            storage_axes = [(a,) for a, n in self.sizes.items() if n > 1] + combos
            for grp in self.groups:
                leaves = (*grp.owners, *grp.followers)
                if sum(self._leaf_bytes(i) for i in leaves) < 1e-3 * total:
                    continue
                shape = g.shapes[g.in_vids[grp.owners[0]]]
                pins = [self.pins.get(g.in_vids[i]) for i in leaves]
                gatherable = all(self._gathered_at_uses(i) for i in grp.owners)
                cands: list[Any] = [None]
                for d, s in enumerate(shape):
                    if not any(p is not None and p[d] is not None for p in pins):
                        cands += [
                            Extra(d, axes, scope) for scope in Scope
                            if (scope is Scope.STATE and grp.followers)
                            or (scope is Scope.ALL and gatherable)
                            for axes in storage_axes
                            if s % math.prod(self.sizes[a] for a in axes) == 0
                        ]  # fmt: skip
                if len(cands) > 1:
                    grp.extra = len(self.decisions)
                    self.decisions.append(Decision(f"{grp.key} extra axis", cands))
        self.followers = {i for grp in self.groups for i in grp.followers}

    def _follow(self) -> None:
        """A class cut from its factor for its size (`narrowed`) that nothing lays out
        would be priced replicated, though propagation carries the factor's axes there
        wherever they divide it (8 key heads behind a 1024-wide projection split 4 ways):
        it follows the factor's decision (`Follow`), unless that makes some equation's
        joint choices more than `FOLLOW_COMBOS` (the program would grow slow to solve;
        it is then priced replicated, as before)."""
        g = self.graph
        proposed: dict[int, Follow] = {}
        for v, d, w, e in self.narrowed:
            k, factor = self._key(v, d), self.ref[self._key(w, e)]
            if self.ref[k] is UNSPLIT and type(factor) is int:
                proposed.setdefault(k, Follow(factor, self.class_size[k]))
        if not proposed:
            return
        refused: set[int] = set()
        for a, app in enumerate(g.apps):
            if a in self.dead:
                continue
            keys = {
                self._key(v, d)
                for v in (*app.operands, *app.results)
                for d, size in enumerate(g.shapes[v])
                if size > 1
            }
            touched = keys & proposed.keys()
            if not touched:
                continue
            decisions = {decision_of(self.ref[k]) for k in keys} - {None}
            decisions |= {proposed[k].dec for k in touched}
            if math.prod(len(self.decisions[x].candidates) for x in decisions) > FOLLOW_COMBOS:
                refused |= touched
        for k, follow in proposed.items():
            if k not in refused:
                self.ref[k] = follow

    def _gathered_at_uses(self, i: int) -> bool:
        """Whether argument leaf ``i`` can be stored apart (FSDP) as the model prices it:
        state the step returns whose every compute use contracts it (a matmul gathers
        its weight; a lookup table's gradient would scatter into the storage layout)."""
        if i not in self.tied:
            return False
        uses = self._compute_uses(self.graph.in_vids[i])
        return bool(uses) and all(contracts(self.graph.apps[a]) for a in uses)

    def _compute_uses(self, v: int) -> list[int]:
        """`_uses` of argument ``v`` and of its views (`_aliases`), and for a stacked one
        those of the per-layer values its scans read: a weight stored apart on a dim other
        than its layer dim is gathered one layer at a time, at each use in the body
        (`gathered_bytes`)."""
        return sorted(
            a
            for w, _ in self._aliases(v)
            for a in (*self._uses(w), *(a for r in self._layers.get(w, ()) for a in self._uses(r)))
        )

    def _aliases(self, v: int) -> list[tuple[int, tuple[int, ...]]]:
        """``v`` and every value that is ``v`` moved or converted, each with, per its dim,
        the dim of ``v`` it holds (memoized: the memory rows ask per joint choice)."""
        out = self._alias_memo.get(v)
        if out is None:
            out = self._alias_memo[v] = [(v, tuple(range(len(self.graph.shapes[v]))))]
            for w, dims in out:  # grows while read: views of views
                out += [(r, tuple(dims[p] for p in perm)) for r, perm in self._views.get(w, ())]
        return out

    def _stack_dim(self, v: int) -> int | None:
        """The dim of argument ``v`` a scan slices it on (through its views), if any."""
        return next((dims[0] for w, dims in self._aliases(v) if w in self._layers), None)

    def _leaves_of(self, members) -> list[int]:
        """The argument leaves of the groups in ``members`` ((group, dim) pairs)."""
        return [i for k, _ in members for grp in (self.groups[k],)
                for i in (*grp.owners, *grp.followers)]  # fmt: skip

    def _class_name(self, members: frozenset) -> str:
        k, d = min(members, key=lambda m: (self.groups[m[0]].key, m[1]))
        more = f" (+{len(members) - 1} more)" if len(members) > 1 else ""
        return f"dim {d} of {self.groups[k].key}{more}"

    def _leaf_bytes(self, i: int) -> int:
        v = self.graph.in_vids[i]
        return nbytes(self.graph.shapes[v], self.graph.dtypes[v]) * (2 if i in self.tied else 1)

    def leaf_layout(self, i: int, choice: Mapping[int, int]) -> list[Axes] | None:
        """The stored layout of argument leaf ``i`` under a choice: its classes' axes, its
        group's extra axis, the user's pins; None if the extra axis clashes."""
        v = self.graph.in_vids[i]
        lay = self._once([self.axes(r, choice) for r in self.refs(v)], v)
        k = self.leaf_group.get(i)
        extra_dec = None if k is None else self.groups[k].extra
        if extra_dec is not None:
            extra = self.decisions[extra_dec].candidates[choice[extra_dec]]
            if extra is not None and (extra.scope is Scope.ALL or i in self.followers):
                d, axes = extra.dim, extra.axes
                if lay[d] or any(a in x for x in lay for a in axes):
                    return None
                lay[d] = axes
        pin = self.pins.get(v, self.owner_pin.get(i))
        if pin is not None:
            lay = [p if p is not None else x for p, x in zip(pin, lay)]
        return lay

    def _once(self, lay: list[Axes], v: int) -> list[Axes]:
        """A layout with every mesh axis on one dim only. Pins inside the program can
        give an argument's dims one axis twice (MaxText's activation constraints put
        "tensor" on both the embed and the MLP dims a weight joins); the dim of the
        smaller class keeps it (the weight's own dim, not the residual stream's, which
        spans every layer), as the search hints it."""
        used = [a for x in lay for a in x]
        if len(used) == len(set(used)):
            return lay
        members = self.__dict__.get("_members")
        if members is None:
            members = self.__dict__["_members"] = Counter(self.root)
        seen: set[str] = set()
        out = list(lay)
        for d in sorted(range(len(lay)), key=lambda d: members[self._key(v, d)]):
            out[d] = tuple(a for a in lay[d] if a not in seen)
            seen.update(lay[d])
        return out

    def gathered_bytes(self, i: int, choice: Mapping[int, int]) -> float:
        """Per-device bytes of parameter ``i`` gathered to its compute layout when the
        choice stores it apart (FSDP), else 0."""
        if not self.stored_apart(i, choice):
            return 0.0
        v = self.graph.in_vids[i]
        lay = self._once([self.axes(r, choice) for r in self.refs(v)], v)
        pin = self.pins.get(v)
        if pin is not None:
            lay = [p if p is not None else x for p, x in zip(pin, lay)]
        shards = math.prod(self.sizes[a] for x in lay for a in x)
        whole = nbytes(self.graph.shapes[v], self.graph.dtypes[v]) / shards
        k = self.leaf_group[i]
        extra = self.decisions[self.groups[k].extra].candidates[choice[self.groups[k].extra]]
        layer = self._stack_dim(v)
        if layer is not None and extra.dim != layer:  # one layer gathered at a time
            return whole / self.graph.shapes[v][0]
        return whole

    def stored_apart(self, i: int, choice: Mapping[int, int]) -> bool:
        """Whether argument leaf ``i`` is stored on an extra axis its computation does not
        use (a parameter under FSDP, gathered at its uses, and its optimizer state);
        optimizer state alone on an extra axis (ZeRO-1) is the update's layout."""
        k = self.leaf_group.get(i)
        dec = None if k is None else self.groups[k].extra
        if dec is None:
            return False
        extra = self.decisions[dec].candidates[choice[dec]]
        # under FSDP the optimizer state lives and is updated like its parameter
        return extra is not None and extra.scope is Scope.ALL

    def storage_axes(self, i: int, choice: Mapping[int, int]) -> tuple[Axes, ...] | None:
        """Per dim of argument leaf ``i``, the mesh axes the choice stores it on apart
        from its computation (gathered at its uses); None when it is not stored apart."""
        if not self.stored_apart(i, choice):
            return None
        dec = self.groups[self.leaf_group[i]].extra
        extra = self.decisions[dec].candidates[choice[dec]]
        dims = range(len(self.graph.shapes[self.graph.in_vids[i]]))
        return tuple(extra.axes if d == extra.dim else () for d in dims)

    def refs(self, v: int) -> tuple[Ref, ...]:
        """Per dim of value ``v``: its decision (an index) or the axes pins fix (`Fixed`)."""
        return self.value_refs[v]

    def _refs(self, v: int) -> tuple[Ref, ...]:
        return tuple(
            self.ref[self._key(v, d)] if s > 1 else UNSPLIT
            for d, s in enumerate(self.graph.shapes[v])
        )

    def axes(self, ref: Ref, choice: Mapping[int, int]) -> Axes:
        """The axes of a class reference under a choice of candidate per decision."""
        if type(ref) is Fixed:
            return ref.axes
        if type(ref) is Follow:
            if ref.dec not in choice:  # the memory model prices it unsplit
                return ()
            axes = self.decisions[ref.dec].candidates[choice[ref.dec]]
            return axes if ref.size % math.prod(self.sizes[a] for a in axes) == 0 else ()
        return self.decisions[ref].candidates[choice[ref]]

    # --- joint terms -------------------------------------------------------------------

    def _term(self, decisions) -> Term:
        decisions = tuple(sorted(set(decisions)))
        term = self.terms.get(decisions)
        if term is None:
            sizes = tuple(len(self.decisions[d].candidates) for d in decisions)
            term = self.terms[decisions] = Term.empty(decisions, sizes)
        return term

    def _combos(self, term: Term):
        for n, combo in enumerate(itertools.product(*(range(s) for s in term.sizes))):
            yield n, dict(zip(term.decisions, combo))

    def _layout(self, refs, choice) -> tuple[Axes, ...] | None:
        """A tensor's layout under a choice, or None if one axis lands on two dims."""
        dims = tuple(self.axes(r, choice) for r in refs)
        used = [a for d in dims for a in d]
        return dims if len(used) == len(set(used)) else None

    def _value_terms(self) -> None:
        """No tensor carries one axis on two dims (beyond what hints already force)."""
        g = self.graph
        seen = set()
        for v in range(len(g.shapes)):
            refs = self.refs(v)
            free = {decision_of(r) for r in refs} - {None}
            if not free or refs in seen:
                continue
            seen.add(refs)
            fixed_axes = [a for r in refs if type(r) is Fixed for a in r.axes]
            if sum(decision_of(r) is not None for r in refs) < 2 and not fixed_axes:
                continue  # one decided dim and nothing else sharded: no clash possible
            term = self._term(free)
            for n, choice in self._combos(term):
                dims = [self.axes(r, choice) for r in refs]
                used = [a for d, r in zip(dims, refs) for a in d if decision_of(r) is not None]
                if len(used) != len(set(used)) or set(used) & set(fixed_axes):
                    term.allowed[n] = False

    def _app_terms(self) -> None:
        """Collectives each equation needs under each joint choice of its decisions:
        all-reduces of partial results, gathers for need-replication factors."""
        g = self.graph
        sigs: dict[tuple, list] = {}
        seen: dict = {}
        runs = executions(g)
        special: dict[int, tuple] = {}
        for a, app in enumerate(g.apps):
            if a in self.dead or duplicate_app(app, seen):
                continue
            rule = app.rule
            kinds = special.get(id(rule))
            if kinds is None:
                kinds = special[id(rule)] = tuple(
                    f for f, factor in enumerate(rule.factors)
                    if not factor.plain and factor.size > 1
                )  # fmt: skip
            cut = self.cuts.get(a, frozenset())
            if not kinds and not cut:
                continue
            vids = (*app.operands, *app.results)
            key = (id(rule), tuple(self.refs(v) for v in vids), cut)
            entry = sigs.get(key)
            if entry is None:
                sigs[key] = [app, runs[a]]
            else:
                entry[1] += runs[a]
        for (_, refs, cut), (app, count) in sigs.items():
            free = {decision_of(r) for rs in refs for r in rs} - {None}
            if not free:
                t, b = self._app_cost(app, refs, {}, cut)
                self.constant_time += count * t
                self.constant_bytes += count * b
                continue
            term = self._term(free)
            for n, choice in self._combos(term):
                cost = self._app_cost(app, refs, choice, cut)
                if cost is None:
                    term.allowed[n] = False
                    continue
                term.time[n] += count * cost[0]
                term.bytes[n] += count * cost[1]

    def _app_cost(self, app, refs, choice, cut=frozenset()) -> tuple[float, float] | None:
        """(µs, bytes) of the collectives an application needs under a choice; None when
        the choice shards a need-replication factor on an axis another factor of the
        equation uses (a sharded table row
        gathered by indices sharded the same way: XLA exchanges the whole result for it,
        which the rules do not predict). A dim ``cut`` from its factor (`_classes`) is
        moved: an operand to the factor's layout before, a result from it after."""
        g, rule = self.graph, app.rule
        vids = (*app.operands, *app.results)
        layouts = []
        for rs in refs:
            lay = self._layout(rs, choice)
            if lay is None:
                return 0.0, 0.0  # not allowed anyway (a value term says so)
            layouts.append(lay)
        tensors = (*rule.operands, *rule.results)
        factor_axes: dict[int, Axes] = {}
        majors: dict[tuple[int, int], int] = {}
        moved = set(cut)
        for t, dims in enumerate(tensors):
            for d, fl in enumerate(dims):
                # a windowed factor of size 1 (no axis splits both its dims) still
                # makes a split operand dim whole here
                big = [f for f in fl if rule.factors[f].size > 1 or rule.factors[f].window]
                if not big:
                    continue
                f = majors[t, d] = big[0]
                axes = layouts[t][d]
                if not axes or (t, d) in cut or factor_axes.get(f) == axes:
                    continue
                taken = {a for h, other in factor_axes.items() if h != f for a in other}
                if cut and (f in factor_axes or taken.intersection(axes)):
                    # two factors in one class (classes merged after this equation
                    # was cut): the later dims move to the earlier factors' layout
                    moved.add((t, d))
                else:
                    factor_axes.setdefault(f, axes)
        for f, axes in factor_axes.items():
            if rule.factors[f].kind is FactorKind.NEED_REPLICATION and any(
                a in other for h, other in factor_axes.items() if h != f for a in axes
            ):
                decided = any(decision_of(r) is not None for rs in refs for r in rs)
                if decided:
                    return None
        partial = pending_sums(rule, factor_axes)
        need = {f for f, axes in factor_axes.items()
                if rule.factors[f].kind is FactorKind.NEED_REPLICATION}  # fmt: skip
        # a windowed factor split: a halo exchange, or worked whole where the shards
        # would need more than their neighbours' rows
        steps = []
        need |= unhaloed(rule, factor_axes, self.sizes)
        if any(rule.factors[f].window is not None for f in factor_axes):
            windowed = {f: axes for f, axes in factor_axes.items() if f not in need}
            layout_of = dict(zip(vids, layouts))
            steps += [
                s for _, s in halo_collectives(rule, windowed, g, vids, layout_of, self.sizes)
            ]
        n_ops = len(rule.operands)
        for t, dims in enumerate(tensors):
            v = vids[t]
            work = list(layouts[t])  # the layout the equation works in
            for d in range(len(dims)):
                if (t, d) in moved:
                    work[d] = factor_axes.get(majors[t, d], ())
                if t < n_ops and need and any(f in need for f in dims[d]):
                    work[d] = ()
            if t >= n_ops and (partial or work != list(layouts[t])):
                steps += reshard_collectives(
                    g.shapes[v], g.dtypes[v], work, layouts[t], self.sizes, partial
                )
            elif t < n_ops and work != list(layouts[t]):
                steps += reshard_collectives(g.shapes[v], g.dtypes[v], layouts[t], work, self.sizes)
        seconds = sum(self.cost_model.collective_time(s.axes, s.ring_bytes) for s in steps)
        if self.cost_model.flops:
            flops = 2 * math.prod(f.size for f in rule.factors)
            split = math.prod(self.sizes[a] for axes in factor_axes.values() for a in axes)
            seconds += flops / split / self.cost_model.flops
        return seconds * US, sum(b for _, _, b in steps)

    def _uses(self, v: int) -> list[int]:
        """Equations that read argument ``v`` in its compute layout (not the optimizer's
        elementwise update, which works in the stored layout), in program order."""
        g = self.graph
        shape = g.shapes[v]
        uses = []
        for a in self._readers.get(v, ()):
            app = g.apps[a]
            others = [g.shapes[u] for u in (*app.operands, *app.results)]
            if not all(s == shape or s == () for s in others):
                uses.append(a)
        return uses

    def _group_terms(self) -> None:
        """Per group: the memory of its arguments (and tied results) under each joint
        choice, and the gathers an extra storage axis costs at each use."""
        g = self.graph
        # per parameter that may be stored apart: its first and last use, between which
        # XLA keeps the gathered copy (the forward's uses to the backward's)
        self.gathered_span: dict[int, tuple[int, int]] = {}
        for grp in self.groups:
            leaves = (*grp.owners, *grp.followers)
            refs = {i: self.refs(g.in_vids[i]) for i in leaves}
            free = {decision_of(r) for rs in refs.values() for r in rs} - {None}
            if grp.extra is not None:
                free.add(grp.extra)
            # a parameter stored apart is gathered once per XLA computation that uses it:
            # the copy gathered for the first use serves the later ones there (the
            # backward's uses and a remat body's recomputation read the same copy, as
            # `jaxshard.plan.Plan.moved_copies` counts it)
            uses = {
                i: len({xla_scope(g.apps[a].where) for a in self._compute_uses(g.in_vids[i])})
                for i in grp.owners
            }
            for i in grp.owners if grp.extra is not None else ():
                spots = self._compute_uses(g.in_vids[i])
                if spots:
                    self.gathered_span[i] = (min(spots), max(spots))
            if not free:
                continue
            term = self._term(free)
            for n, choice in self._combos(term):
                for i in leaves:
                    lay = self.leaf_layout(i, choice)
                    if lay is None:
                        term.allowed[n] = False
                        break
                    shards = math.prod(self.sizes[a] for x in lay for a in x)
                    term.memory[n] += self._leaf_bytes(i) / shards
                    extra = grp.extra is not None and self.decisions[grp.extra].candidates[
                        choice[grp.extra]
                    ]  # fmt: skip
                    if not extra or i not in uses:
                        continue
                    term.bias[n] += _EXTRA_TIEBREAK  # on ties, prefer layouts without
                    # the parameter is all-gathered over the extra axis: at each use when
                    # it is stored sharded, once after the update when only its state is
                    gathers = uses[i] if extra.scope is Scope.ALL else 1
                    n_axis = math.prod(self.sizes[a] for a in extra.axes)
                    local = self._leaf_bytes(i) / (2 if i in self.tied else 1) / shards
                    if extra.scope is Scope.ALL:
                        local *= n_axis
                    b = ring_bytes("all-gather", n_axis, local)
                    term.bytes[n] += gathers * b
                    term.time[n] += gathers * US * self.cost_model.collective_time(extra.axes, b)

    def baseline(self) -> dict[int, int]:
        return {d: 0 for d in range(len(self.decisions))}

    def comm(self, choice) -> tuple[float, float]:
        """Estimated (µs, bytes) of communication per step under a choice."""
        t, b = self.constant_time, self.constant_bytes
        for term in self.terms.values():
            n = term_index(term, choice)
            t += term.time[n]
            b += term.bytes[n]
        return t, b

    # --- results -----------------------------------------------------------------------

    def hints_for(self, choice) -> dict[str, PartitionSpec]:
        """Exact-path hints for every grouped argument leaf."""
        out = {}
        for i in sorted(self.leaf_group):
            lay = self.leaf_layout(i, choice) or []
            # a full spec: a shorter one would leave its trailing dims to propagation
            entries: list = list(map(spec_entry, lay))
            refs = self.refs(self.graph.in_vids[i])
            used = [a for x in lay for a in x]
            if len(used) != len(set(used)):
                # the leaf's own pin gives an axis a dim fixed by pins elsewhere also has
                # (`_once` settles the dims pins elsewhere fix alone): those dims are left
                # to propagation, whose conflict policy decides them
                for d, r in enumerate(refs):
                    if type(r) is Fixed and lay[d]:
                        entries[d] = PartitionSpec.UNCONSTRAINED
            key = ExactPath(self.traced.in_names[i], "jaxshard search")
            out[key] = PartitionSpec(*entries)
        return out

    def explain(self, choice, plan, memory, optimal, status, seconds) -> str:
        est_time, est_bytes = self.comm(choice)
        base_time, base_bytes = self.comm(self.baseline())
        g = self.graph
        what = "communication + compute" if self.cost_model.flops else "communication"
        lines = [
            f"search: {len(self.groups)} argument groups, {len(self.decisions)} decisions, "
            f"{len(self.terms)} joint terms over {len(g.apps)} equations; "
            + ("optimal" if optimal else "NOT proven optimal")
            + f" ({status}); {seconds:.1f} s",
            f"estimated {what} per step: {est_time / 1e3:.3f} ms, collectives "
            f"{est_bytes / 2**20:.2f} MiB per device (everything replicated: "
            f"{base_time / 1e3:.3f} ms, {base_bytes / 2**20:.2f} MiB)",
            f"after propagation: {step_bytes(plan) / 2**20:.2f} MiB of collectives per "
            f"device; memory {memory.total / 2**20:.2f} MiB per device (arguments "
            f"{memory.arguments / 2**20:.2f}, results {memory.results / 2**20:.2f}, peak "
            f"activations {memory.activations / 2**20:.2f})"
            + (f", budget {self.user_budget / 2**20:.2f} MiB" if self.user_budget else ""),
            "",
            f"{'group (layers share one row)':<40} {'leaves':>6} {'spec':<22} "
            f"{'optimizer state':<22} per device",
        ]
        for grp in self.groups:
            leaves = (*grp.owners, *grp.followers)
            layouts = [self.leaf_layout(j, choice) or [] for j in leaves]
            dev = sum(
                self._leaf_bytes(j) / math.prod(self.sizes[a] for x in lay for a in x)
                for j, lay in zip(leaves, layouts)
            )
            state = str(to_spec(layouts[len(grp.owners)])) if grp.followers else "-"
            lines.append(
                f"{grp.key:<40} {len(leaves):>6} {str(to_spec(layouts[0])):<22} {state:<22} "
                f"{dev / 2**20:.2f} MiB"
            )
        lines.append("(per device: the group's arguments, their results and optimizer state)")
        return "\n".join(lines)


def term_index(term: Term, choice) -> int:
    n = 0
    for d, s in zip(term.decisions, term.sizes):
        n = n * s + choice[d]
    return n
