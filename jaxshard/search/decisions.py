"""The search's decisions: dim classes (the (value, dim) pairs one rule factor ties
together), argument groups (repeated layers share one decision), each decision's
candidates, and which leaves follow another's layout (`followers`).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

import numpy as np

from jaxshard.graph import find_root
from jaxshard.lattice import Axes
from jaxshard.plan import (
    contracts,
    hint_pins,
    split_storage,
)
from jaxshard.search.refs import UNSPLIT, Fixed, Follow, Ref, decision_of

_LAYER_INDEX = re.compile(r"(?<=/)\d+(?=/|$)")


US = 1e6  # the objective is in microseconds


MEMORY_TIEBREAK = 1e-9  # objective units per byte: 1 GB of memory weighs 1 µs


_EXTRA_TIEBREAK = 1e-2  # µs per leaf stored with an extra axis


# the most joint choices an equation's term may reach by a class following a decision
# (`Problem._follow`): past it the integer program grows slow to solve
FOLLOW_COMBOS = 64

# what a (value, dim) is at one equation, in the order `_classes` keeps a dim in its
# factor's class where a class the program pins meets one of state: the lower is cut and
# moved. `_OWN_MADE` is a result made from state without passing a pin (a weight's
# gradient, a projection's output)
_OWN_OTHER, _OWN_PINNED, _OWN_MADE, _OWN_STATE = 0, 1, 2, 3


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


class DimClasses:
    """`Problem`'s decisions (a mixin: the graph, mesh and tables are the
    problem's)."""

    def _pins(self, hints) -> None:
        """The pins' dims: the computation's part of each (`split_storage`: an FSDP hint's
        axes the batch spends are storage) fixes the classes, and a leaf is stored as its
        whole pin says (``stored``)."""
        pins = hint_pins(self.traced, self.graph, hints, self.sizes)
        compute, storage = split_storage(pins, self.graph)
        self.pins: dict[int, tuple] = {v: p.dims for v, p in compute.items()}
        self.stored: dict[int, tuple] = {v: p.dims for v, p in pins.items()}
        # a storage pin splitting one dim the computation leaves whole is that leaf's
        # extra axis, fixed (its gathers and gathered copies priced as the search's own)
        self.user_extra: dict[int, Extra] = {}
        for v, pin in storage.items():
            kept = self.pins.get(v, (None,) * len(pin.dims))
            apart = [d for d, (axes, rest) in enumerate(zip(pin.dims, kept)) if axes != rest]
            if len(apart) == 1 and not kept[apart[0]]:
                self.user_extra[v] = Extra(apart[0], tuple(pin.dims[apart[0]]), Scope.ALL)

    def _classes(self) -> None:
        """Union-find over (value, dim): every dim joins the class of its major factor,
        unless that would give one tensor two dims of one class or one equation one class
        on two factors (attention's query and key positions, ``x.T @ x``): that dim is
        *cut* from the factor (`cuts`), and the equation moves it between its class's
        layout and the factor's (`_app_cost`), so the sequence stays a decision. Where a
        class a constraint in the step pins would meet one holding an open dim of state,
        the dim with the weakest claim to its own layout is cut instead (`_OWN_*`)."""
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
        # what a dim is on its own (`_OWN_*`), and per root whether its class holds a dim
        # the program pins (a sharding constraint: a layout at that point) and one of
        # state the search lays out
        own = self._own_kinds(n)
        made = self._made_from_state(own, offset)
        pinned_cls = [k == _OWN_PINNED for k in own]
        state_cls = [k == _OWN_STATE or m for k, m in zip(own, made)]

        def rank(vids: tuple[int, ...], t: int, d: int, n_operands: int) -> int:
            k = int(offset[vids[t]]) + d
            return _OWN_MADE if own[k] == _OWN_OTHER and t >= n_operands and made[k] else own[k]

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
            pinned_cls[other] |= pinned_cls[k]
            state_cls[other] |= state_cls[k]
            return other

        def clash(k: int, other: int) -> bool:
            """A class the program pins meeting a class of state the search lays out."""
            return (pinned_cls[k] and state_cls[other]) or (state_cls[k] and pinned_cls[other])

        # the mesh axes a size splits over: a class joining a factor of a size fewer of
        # them divide would lose those layouts for every member (64 query heads behind a
        # repeat of 8 key heads, on a 32-way tensor axis), so the dim is cut from that
        # factor instead, and the equation prices the move
        splits = [n for n in self.sizes.values() if n > 1]

        def narrows(a: int, b: int) -> bool:
            both = math.gcd(a, b)
            return any((a % n == 0 or b % n == 0) and both % n for n in splits)

        self.cuts: dict[int, frozenset[tuple[int, int]]] = {}
        # per equation, the dims cut where a pinned class met one of state: their moved
        # copies are priced in memory (`MemoryModel._moved_terms`)
        self.pin_cuts: dict[int, list[tuple[int, int]]] = {}
        # (value, dim) cut for its size from the class of (value, dim) of its factor
        self.narrowed: list[tuple[int, int, int, int]] = []
        for a, app in enumerate(g.apps):
            rule = app.rule
            entries = self._majors(rule)
            vids = (*app.operands, *app.results)
            first: dict[int, int] = {}
            joined: dict[int, list[tuple[int, int]]] = {}  # per factor: the dims it holds
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
                    joined[f] = [(t, d)]
                    continue
                other = find_root(parent, other)
                if other == k:
                    joined[f].append((t, d))
                    continue
                if clash(k, other) and claims.get(k, f) == f:
                    # a layout the program pins is no reason to lay state out so: the
                    # weight of a projection whose input a constraint splits over
                    # "tensor" may be stored otherwise (MaxText: activations' embedding
                    # dim on "tensor", the weights' on "fsdp"). The dim that is least
                    # its own layout moves: state before a pinned value before the rest
                    n_ops = len(rule.operands)
                    mine = rank(vids, t, d, n_ops)
                    theirs = max(rank(vids, t2, d2, n_ops) for t2, d2 in joined[f])
                    moved = joined[f] if mine > theirs else [(t, d)]
                    if mine > theirs:
                        first[f], joined[f] = k, [(t, d)]
                    cut += moved
                    self.pin_cuts.setdefault(a, []).extend(moved)
                    continue
                root = None if claims.get(k, f) != f else union(k, other)
                if root is None:
                    cut.append((t, d))
                    continue
                first[f] = root
                joined[f].append((t, d))
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

    def _majors(self, rule) -> list[tuple[int, int, int]]:
        """Per dim of ``rule``'s tensors that a factor of size > 1 spans: ``(tensor, dim,
        its major factor)``, tensors numbered operands first (cached per rule)."""
        cache = self.__dict__.setdefault("_majors_cache", {})
        entries = cache.get(id(rule))
        if entries is None:
            entries = cache[id(rule)] = [
                (t, d, big[0])
                for t, dims in enumerate((*rule.operands, *rule.results))
                for d, fl in enumerate(dims)
                if (big := [f for f in fl if rule.factors[f].size > 1])
            ]
        return entries

    def _own_kinds(self, n: int) -> list[int]:
        """Per (value, dim), flat: `_OWN_STATE` for an open dim of state (an argument the
        step returns, that no hint pins there), `_OWN_PINNED` for a dim a pin inside the
        program lays out (a sharding constraint, `jaxshard.hint`), else `_OWN_OTHER`."""
        g, offset = self.graph, self.offset
        own = [_OWN_OTHER] * n
        arguments = set(g.in_vids)
        for v, dims in self.pins.items():
            if v not in arguments:
                for d, axes in enumerate(dims):
                    if axes is not None:
                        own[int(offset[v]) + d] = _OWN_PINNED
        for i, _ in g.ties:
            v = g.in_vids[i]
            pin = self.pins.get(v)
            for d, s in enumerate(g.shapes[v]):
                if s > 1 and (pin is None or pin[d] is None):
                    own[int(offset[v]) + d] = _OWN_STATE
        return own

    def _made_from_state(self, own: list[int], offset) -> list[bool]:
        """Per (value, dim), flat: whether rule factors tie it to an open dim of state
        without passing a dim the program pins (a weight's gradient, through the optimizer's
        update, to the weight): at the equation that makes it, such a dim keeps its
        factor's layout against a pinned operand (`_classes`)."""
        g = self.graph
        parent = list(range(len(own)))
        for app in g.apps:
            vids = (*app.operands, *app.results)
            first: dict[int, int] = {}
            for t, d, f in self._majors(app.rule):
                k = int(offset[vids[t]]) + d
                if own[k] == _OWN_PINNED:
                    continue
                a, b = find_root(parent, k), find_root(parent, first.setdefault(f, k))
                if a != b:
                    parent[a] = b
        state = {find_root(parent, k) for k, kind in enumerate(own) if kind == _OWN_STATE}
        return [kind != _OWN_PINNED and find_root(parent, k) in state for k, kind in enumerate(own)]

    def _key(self, v: int, d: int) -> int:
        return self.root[int(self.offset[v]) + d]

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
            pin = self.stored.get(g.in_vids[owner])
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
        for grp in self.groups:  # the user's storage pins
            fixed = {self.user_extra.get(g.in_vids[i]) for i in grp.owners}
            if len(fixed) == 1 and None not in fixed:
                grp.extra = len(self.decisions)
                self.decisions.append(Decision(f"{grp.key} storage (hint)", [fixed.pop()]))
        if self.budget is not None:  # an extra storage axis per group, for memory
            total = sum(self._leaf_bytes(i) for i in self.leaf_group)
            # one mesh axis, or several (ZeRO-3 over the axes the batch takes)
            storage_axes = [(a,) for a, n in self.sizes.items() if n > 1] + combos
            for grp in self.groups:
                leaves = (*grp.owners, *grp.followers)
                if grp.extra is not None or sum(self._leaf_bytes(i) for i in leaves) < 1e-3 * total:
                    continue
                shape = g.shapes[g.in_vids[grp.owners[0]]]
                pins = [self.stored.get(g.in_vids[i]) for i in leaves]
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
