"""Fully automatic search: the shardings hints leave free, chosen by an integer program.

The search decides on a coarsened problem and lets propagation fill in the rest.
Propagation moves a sharding along the factors of every rule, so the (value, dim) pairs
one factor connects form a *dim class* (the residual stream's model dim across all
layers, one layer's attention heads, one layer's MLP hidden dim, the batch): whatever
axes one member of a class carries, propagation gives to all. A class is pinned by a
hint, decided if it contains a dim of an undecided argument, and otherwise replicated.
Repeated layers share decisions: arguments are grouped by their path with layer indices
replaced by ``*`` (``params/layers/*/attn/wq``) and shape, optimizer state joins the
parameter whose path ends its own, and classes holding the same group dims are one
decision. With a memory budget, each group may also store an extra mesh axis on a free
dim (FSDP/ZeRO-3), gathered where it is used.

Every decision picks one candidate (unsharded, or one mesh axis that divides all its
sizes). Costs come from the rules: an equation whose reduction factor is sharded leaves
its results partial (an all-reduce), a sharded need-replication factor gathers its
operands, and a tensor may not carry one axis on two dims. Equations with the same rule
and the same decisions are counted once with their multiplicity, so a 48-layer model
costs little more than a 12-layer one. The integer program (HiGHS, via ``highspy``) has a
one-hot variable per decision candidate and one per joint choice of the decisions an
equation or tensor touches; it minimizes the estimated communication time of one step
(`jaxshard.cost.CostModel`) subject to per-device memory (arguments, results and the live
activations at the peak equations, added lazily until the layout's own peak fits) at
most the budget. The chosen hints then go through ordinary propagation, whose plan gives
the reported bytes and memory.
"""

from __future__ import annotations

import itertools
import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxshard.cost import (
    CostModel,
    Liveness,
    MemoryEstimate,
    executions,
    human_bytes,
    liveness,
    memory_estimate,
    nbytes,
    reshard_collectives,
    ring_bytes,
    step_bytes,
)
from jaxshard.errors import JaxshardBug, ShardingError, warn
from jaxshard.graph import find_root
from jaxshard.lattice import Axes, spec_entry, to_spec
from jaxshard.plan import (
    Plan,
    dead_apps,
    duplicate_app,
    gc_paused,
    hint_pins,
    mesh_axis_sizes,
    plan_from_graph,
    trace_graph,
)
from jaxshard.rule import FactorKind

# Chosen hints carry this regex comment into the plan, so an origin reads
# hint 'params/layers/0/attn/wq(?#jaxshard search)': P(None, 'model')
SEARCH_TAG = "(?#jaxshard search)"
_LAYER_INDEX = re.compile(r"(?<=/)\d+(?=/|$)")
_US = 1e6  # the objective is in microseconds
_MEMORY_TIEBREAK = 1e-9  # objective units per byte: 1 GB of memory weighs 1 µs
_EXTRA_TIEBREAK = 1e-2  # µs per leaf stored with an extra axis
# Storing a parameter itself on an extra axis (FSDP) is modeled, but off. Propagation now
# keeps such a stored axis out of the activations (`jaxshard.plan.split_storage`), but
# the model still misjudges what XLA compiles from it: on a 2-layer GPT (d 256, 2x4,
# batch hint) with the Megatron layout's memory as the budget, turning it on gives 1.45x
# Megatron's compiled bytes at 0.84x its memory (the Megatron layout itself fits), and
# at 0.85x the budget the plan compiles to 1.04x Megatron's memory (XLA keeps gathered
# parameters live through the backward pass). The optimizer state alone (ZeRO-1)
# propagates and compiles as modeled.
_SHARD_PARAMETERS = False


@dataclass
class SearchResult:
    """What `search_hints` chose and what it costs.

    ``hints`` maps exact argument paths (``re.escape``\\d) to full PartitionSpecs for the
    leaves the search decided; together with the user's hints they give ``plan``.
    ``predicted_bytes`` and ``memory_bytes`` are read from that plan: collective bytes per
    device per step (``plan.predicted_bytes``: a scan body's reshards count once per
    iteration) and `jaxshard.cost.memory_estimate`'s
    per-device total;
    ``estimated_bytes``/``estimated_seconds`` are the integer program's own estimate (the
    seconds of communication, plus compute when the cost model has ``flops``).
    ``optimal`` is False when the time limit stopped the solver (the best layout found
    is returned). ``seconds`` is the wall time of the whole search.
    """

    hints: dict[str, PartitionSpec]
    predicted_bytes: float
    memory_bytes: int
    seconds: float
    optimal: bool
    explanation: str
    estimated_bytes: float = 0.0
    estimated_seconds: float = 0.0
    memory: MemoryEstimate | None = None
    plan: Plan | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return self.explanation


@dataclass
class _Decision:
    """One choice of the integer program: a dim class's axes, or a group's extra axis."""

    name: str
    candidates: list[Any]  # Axes for a class; None or (dim, axis, scope) for an extra


@dataclass
class _Group:
    key: str  # the owner's path with layer indices as '*'
    owners: list[int]  # argument leaf indices with that path pattern and shape
    followers: list[int] = field(default_factory=list)  # optimizer state following them
    extra: int | None = None  # decision index of the extra (FSDP) axis


@dataclass
class _Term:
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
    def empty(decisions: tuple[int, ...], sizes: tuple[int, ...]) -> _Term:
        n = math.prod(sizes)
        z = np.zeros(n)
        return _Term(decisions, sizes, z, z.copy(), z.copy(), np.ones(n, dtype=bool), z.copy())


def search_hints(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    mesh: Mesh,
    hints: Mapping[str, PartitionSpec] | None = None,
    *,
    memory_budget: float | None = None,
    time_limit: float = 30.0,
    cost_model: CostModel | None = None,
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """Choose PartitionSpecs for every argument leaf ``hints`` leave free.

    Minimizes the estimated communication time of one call of ``fn`` under
    ``cost_model`` (default `CostModel()`), keeping the estimated per-device memory at
    most ``memory_budget`` bytes when given (else memory only breaks ties). Stops the
    solver after ``time_limit`` seconds of the whole search, returning the best layout
    found (``optimal=False``) with a `JaxshardWarning` that says so. ``progress``
    receives one line per stage and per improved solution; by default the lines go to
    stderr once the search has run for 5 s, so only long searches show them. A budget
    no layout meets raises `ShardingError` naming the smallest footprint found.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> def mlp(params, x):
        ...     return jnp.sum(jax.nn.relu(x @ params["w1"]) @ params["w2"])
        >>> params = {"w1": jnp.ones((16, 64)), "w2": jnp.ones((64, 16))}
        >>> result = search_hints(jax.grad(mlp), (params, jnp.ones((8, 16))), {}, mesh,
        ...                       {"x": P("data")})
        >>> result.hints["params/w1"], result.hints["params/w2"]
        (P(None, 'model'), P('model', None))
        >>> result.optimal
        True
    """
    t0 = time.perf_counter()
    say = progress or _LateProgress(t0)
    hints = dict(hints or {})
    traced, graph = trace_graph(fn, args, kwargs, mesh)
    with gc_paused():
        say(f"traced {len(graph.apps)} equations, {len(graph.shapes)} values "
            f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
        problem = _Problem(traced, graph, mesh, hints, cost_model or CostModel(), memory_budget)
        say(
            f"coarsened: {len(problem.groups)} argument groups, {len(problem.decisions)} "
            f"decisions, {len(problem.terms)} joint terms ({time.perf_counter() - t0:.1f} s)"
        )
        tried: list[tuple[MemoryEstimate, Plan, dict[int, int]]] = []

        def propagated(choice):
            chosen = {k + SEARCH_TAG: v for k, v in problem.hints_for(choice).items()}
            searched = {**hints, **chosen}
            plan = plan_from_graph(traced, graph, mesh, searched, problem.cost_model)
            memory = memory_estimate(graph, plan.dims, plan.axis_sizes, plan.out_dims, problem.live)
            tried.append((memory, plan, choice))
            return plan, memory

        for _ in range(3):  # propagation may need more memory than the model said: retry
            try:
                choice, optimal, status = problem.solve(t0, time_limit, say)
            except _Infeasible as e:
                for smallest in e.choices:
                    propagated(smallest)
                memory, plan, choice = min(tried, key=lambda t: t[0].total)
                if memory.total > memory_budget:
                    _raise_over_budget(problem, memory_budget, memory, plan)
                optimal = False
                status = "the smallest-memory layout: the model put every layout over budget"
                break
            plan, memory = propagated(choice)
            say(f"propagated: {human_bytes(step_bytes(plan))} of collectives, "
                f"{human_bytes(memory.total)} of memory per device "
                f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
            if memory_budget is None or memory.total <= memory_budget or not optimal:
                break
            modeled = problem.memory(choice).total
            problem.budget *= min(modeled / memory.total, 0.999)
            say(f"propagation needs {human_bytes(memory.total)}, the model said "
                f"{human_bytes(modeled)}: searching again within "
                f"{human_bytes(problem.budget)}")  # fmt: skip
        else:
            memory, plan, choice = min(tried, key=lambda t: t[0].total)
            _raise_over_budget(problem, memory_budget, memory, plan)
    seconds = time.perf_counter() - t0
    if not optimal:
        warn(
            f"jaxshard search did not prove its layout optimal ({status}) after {seconds:.1f} s; "
            "the plan is the best layout found. Raise the time limit for a better one."
        )
    est_time, est_bytes = problem.comm(choice)
    text = problem.explain(choice, plan, memory, optimal, status, seconds)
    result = SearchResult(
        problem.hints_for(choice), step_bytes(plan), memory.total, seconds, optimal, text,
        est_bytes, est_time / _US, memory, plan,
    )  # fmt: skip
    plan.search_result = result
    return result


class _LateProgress:
    """Progress lines on stderr, but only once the search has run ``after`` seconds
    (the lines held until then come first): short searches stay quiet."""

    def __init__(self, t0: float, after: float = 5.0):
        self.t0, self.after, self.held = t0, after, []

    def __call__(self, message: str) -> None:
        seconds = time.perf_counter() - self.t0
        self.held.append(f"jaxshard search [{seconds:5.1f} s] {message}")
        if seconds >= self.after:
            print("\n".join(self.held), file=sys.stderr, flush=True)
            self.held.clear()


class _Infeasible(Exception):
    """No layout meets the budget in the model; ``choices`` are its smallest-memory ones
    (without and with extra storage axes)."""

    def __init__(self, choices: list[dict[int, int]]):
        super().__init__()
        self.choices = choices


def _raise_over_budget(problem, budget, memory: MemoryEstimate, plan: Plan) -> None:
    """Raise a ShardingError naming the smallest per-device footprint found (measured
    after propagation) and its layout."""
    specs = jax.tree.leaves(plan.in_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    shown = [f"{n}: {s}" for n, s in zip(problem.traced.in_names, specs) if tuple(s)]
    size = lambda n: human_bytes(n, 2)  # noqa: E731
    raise ShardingError(
        f"no layout fits the memory budget of {size(budget)} per device: the smallest "
        f"footprint jaxshard finds on this mesh is {size(memory.total)} ({memory.total} bytes) "
        f"per device (arguments {size(memory.arguments)}, results {size(memory.results)}, "
        f"peak activations {size(memory.activations)}; estimated "
        "by jaxshard.cost.memory_estimate), with "
        + ", ".join(shown[:6])
        + (", ..." if len(shown) > 6 else "")
        + ". Raise the budget to at least that, use a larger mesh, or shrink the batch."
    ) from None


def group_key(path: str) -> str:
    """A path with its layer indices replaced by ``*``: one decision covers all layers.

    Example:
        >>> group_key("params/layers/11/attn/wq"), group_key("opt_state/0/mu/head")
        ('params/layers/*/attn/wq', 'opt_state/*/mu/head')
    """
    return _LAYER_INDEX.sub("*", path)


def _followers(names, shapes, dtypes, candidates) -> dict[int, int]:
    """Leaves that follow another leaf (optimizer state): same shape and dtype, and the
    other's path below its argument ends this one's path. ``{follower: owner}``."""
    by_tail: dict[tuple, list[int]] = {}
    for i in candidates:
        parts = tuple(names[i].split("/"))
        if len(parts) > 1:
            by_tail.setdefault(parts[1:], []).append(i)
    out = {}
    for i in candidates:
        parts = tuple(names[i].split("/"))
        for k in range(1, len(parts)):
            hits = [
                j for j in by_tail.get(parts[k:], [])
                if j != i and shapes[j] == shapes[i] and dtypes[j] == dtypes[i]
                and len(names[j]) < len(names[i])
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


class _Problem:
    """The coarsened problem of one traced function: dim classes, groups, decisions and
    joint terms, and the integer program over them."""

    def __init__(self, traced, graph, mesh, hints, cost_model, memory_budget):
        self.traced, self.graph, self.mesh = traced, graph, mesh
        self.sizes = mesh_axis_sizes(mesh)
        self.cost_model, self.budget = cost_model, memory_budget
        self.dead = dead_apps(graph)
        self.live: Liveness = liveness(graph, self.dead)
        self.user_budget = memory_budget
        self._pins(hints)
        self._classes()
        self._groups()
        self._decide()
        self.value_refs = [self._refs(v) for v in range(len(graph.shapes))]
        self.terms: dict[tuple[int, ...], _Term] = {}
        self.constant_time = self.constant_bytes = 0.0  # collectives no decision changes
        self._value_terms()
        self._app_terms()
        self._group_terms()
        self.static = self._static_memory()

    # --- dim classes -------------------------------------------------------------------

    def _pins(self, hints) -> None:
        pins = hint_pins(self.traced, self.graph, hints, self.sizes)
        self.pins: dict[int, tuple] = {v: p.dims for v, p in pins.items()}

    def _classes(self) -> None:
        """Union-find over (value, dim): every dim joins the class of its major factor."""
        g = self.graph
        offset = np.zeros(len(g.shapes) + 1, dtype=np.int64)
        offset[1:] = np.cumsum([len(s) for s in g.shapes])
        self.offset = offset
        n = int(offset[-1])
        parent = list(range(n))
        size = [0] * n  # gcd of the factor sizes a class's dims carry
        for v, shape in enumerate(g.shapes):
            for d, s in enumerate(shape):
                size[offset[v] + d] = s

        majors: dict[int, list[tuple[int, int]]] = {}  # per rule: (tensor, dim, factor)
        for app in g.apps:
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
            for t, d, f in entries:
                k = find_root(parent, int(offset[vids[t]]) + d)
                fs = rule.factors[f].size
                if size[k] % fs:
                    size[k] = math.gcd(size[k], fs)
                other = first.get(f)
                if other is None:
                    first[f] = k
                    continue
                other = find_root(parent, other)
                if other != k:
                    parent[k] = other
                    size[other] = math.gcd(size[other], size[k])
                first[f] = other
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
        follows = _followers(names, shapes, dtypes, open_leaves)
        by_key: dict[tuple, _Group] = {}
        group_of: dict[int, _Group] = {}
        for i in open_leaves:
            if i in follows:
                continue
            key = (group_key(names[i]), shapes[i], str(dtypes[i]))
            grp = by_key.get(key)
            if grp is None:
                grp = by_key[key] = _Group(key[0], [])
            grp.owners.append(i)
            group_of[i] = grp
        for i, owner in follows.items():
            grp = group_of.get(owner)
            if grp is None:  # its owner is fully pinned: a group of its own
                key = (group_key(names[i]), shapes[i], str(dtypes[i]))
                grp = by_key.setdefault(key, _Group(key[0], []))
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
        twice = set()  # classes two dims of one tensor share: never sharded
        for v, shape in enumerate(g.shapes):
            if len(shape) > 1:
                keys = [self._key(v, d) for d, s in enumerate(shape) if s > 1]
                if len(set(keys)) < len(keys):
                    twice.update(k for k in keys if keys.count(k) > 1)
        self.decisions: list[_Decision] = []
        self.fixed: list[Axes] = [()]
        fixed_index = {(): 0}
        by_members: dict[frozenset, int] = {}
        divides: dict[int, int] = {}  # per decision: gcd of its classes' sizes
        self.ref: dict[int, int] = {}  # class -> decision (>= 0) or -1 - fixed index
        for k in sorted(set(self.root)):
            if k in pinned:
                axes = pinned[k]
                j = fixed_index.setdefault(axes, len(self.fixed))
                if j == len(self.fixed):
                    self.fixed.append(axes)
                self.ref[k] = -1 - j
            elif k in members and k not in twice:
                key = frozenset(members[k])
                dec = by_members.get(key)
                if dec is None:
                    dec = by_members[key] = len(self.decisions)
                    self.decisions.append(_Decision(self._class_name(key), [()]))
                divides[dec] = math.gcd(divides.get(dec, 0), self.class_size[k])
                self.ref[k] = dec
            else:
                self.ref[k] = -1
        for dec, size in divides.items():
            self.decisions[dec].candidates += [
                (a,) for a, n in self.sizes.items() if n > 1 and size % n == 0
            ]
        self.n_class_decisions = len(self.decisions)
        if self.budget is not None:  # an extra storage axis per group, for memory
            total = sum(self._leaf_bytes(i) for i in self.leaf_group)
            scopes = ("state", "all") if _SHARD_PARAMETERS else ("state",)
            for grp in self.groups:
                leaves = (*grp.owners, *grp.followers)
                if sum(self._leaf_bytes(i) for i in leaves) < 1e-3 * total:
                    continue
                shape = g.shapes[g.in_vids[grp.owners[0]]]
                pins = [self.pins.get(g.in_vids[i]) for i in leaves]
                cands: list[Any] = [None]
                for d, s in enumerate(shape):
                    if not any(p is not None and p[d] is not None for p in pins):
                        cands += [
                            (d, a, scope) for scope in scopes
                            if grp.followers or scope == "all"
                            for a, n in self.sizes.items() if n > 1 and s % n == 0
                        ]  # fmt: skip
                if len(cands) > 1:
                    grp.extra = len(self.decisions)
                    self.decisions.append(_Decision(f"{grp.key} extra axis", cands))
        self.followers = {i for grp in self.groups for i in grp.followers}

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
        lay = [self.axes(r, choice) for r in self.refs(v)]
        k = self.leaf_group.get(i)
        extra_dec = None if k is None else self.groups[k].extra
        if extra_dec is not None:
            extra = self.decisions[extra_dec].candidates[choice[extra_dec]]
            if extra is not None and (extra[2] == "all" or i in self.followers):
                d, axis, _ = extra
                if lay[d] or any(axis in x for x in lay):
                    return None
                lay[d] = (axis,)
        pin = self.pins.get(v)
        if pin is not None:
            lay = [p if p is not None else x for p, x in zip(pin, lay)]
        return lay

    def refs(self, v: int) -> tuple[int, ...]:
        """Per dim of value ``v``: its decision (>= 0) or fixed axes (-1 - index)."""
        return self.value_refs[v]

    def _refs(self, v: int) -> tuple[int, ...]:
        return tuple(
            self.ref[self._key(v, d)] if s > 1 else -1 for d, s in enumerate(self.graph.shapes[v])
        )

    def axes(self, ref: int, choice: Mapping[int, int]) -> Axes:
        """The axes of a class reference under a choice of candidate per decision."""
        if ref < 0:
            return self.fixed[-1 - ref]
        return self.decisions[ref].candidates[choice[ref]]

    # --- joint terms -------------------------------------------------------------------

    def _term(self, decisions) -> _Term:
        decisions = tuple(sorted(set(decisions)))
        term = self.terms.get(decisions)
        if term is None:
            sizes = tuple(len(self.decisions[d].candidates) for d in decisions)
            term = self.terms[decisions] = _Term.empty(decisions, sizes)
        return term

    def _combos(self, term: _Term):
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
            free = {r for r in refs if r >= 0}
            if not free or refs in seen:
                continue
            seen.add(refs)
            fixed_axes = [a for r in refs if r < 0 for a in self.fixed[-1 - r]]
            if sum(r >= 0 for r in refs) < 2 and not fixed_axes:
                continue  # one decided dim and nothing else sharded: no clash possible
            term = self._term(free)
            for n, choice in self._combos(term):
                dims = [self.axes(r, choice) for r in refs]
                used = [a for d, r in zip(dims, refs) for a in d if r >= 0]
                if len(used) != len(set(used)) or set(used) & set(fixed_axes):
                    term.allowed[n] = False

    def _app_terms(self) -> None:
        """Collectives each equation needs under each joint choice of its decisions:
        all-reduces of partial results, gathers for need-replication factors."""
        g = self.graph
        sigs: dict[tuple, list] = {}
        seen: set = set()
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
                    if factor.kind is not FactorKind.PASS and factor.size > 1
                )  # fmt: skip
            if not kinds:
                continue
            vids = (*app.operands, *app.results)
            key = (id(rule), tuple(self.refs(v) for v in vids))
            entry = sigs.get(key)
            if entry is None:
                sigs[key] = [app, runs[a]]
            else:
                entry[1] += runs[a]
        for (_, refs), (app, count) in sigs.items():
            free = {r for rs in refs for r in rs if r >= 0}
            if not free:
                t, b = self._app_cost(app, refs, {})
                self.constant_time += count * t
                self.constant_bytes += count * b
                continue
            term = self._term(free)
            for n, choice in self._combos(term):
                cost = self._app_cost(app, refs, choice)
                if cost is None:
                    term.allowed[n] = False
                    continue
                term.time[n] += count * cost[0]
                term.bytes[n] += count * cost[1]

    def _app_cost(self, app, refs, choice) -> tuple[float, float] | None:
        """(µs, bytes) of the collectives an application needs under a choice; None when
        the choice shards a need-replication factor on an axis another factor of the
        equation uses (a sharded table row gathered by indices sharded the same way:
        XLA exchanges the whole result for it, which the rules do not predict)."""
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
        for t, dims in enumerate(tensors):
            for d, fl in enumerate(dims):
                big = [f for f in fl if rule.factors[f].size > 1]
                if big and layouts[t][d]:
                    factor_axes.setdefault(big[0], layouts[t][d])
        for f, axes in factor_axes.items():
            if rule.factors[f].kind is FactorKind.NEED_REPLICATION and any(
                a in other for h, other in factor_axes.items() if h != f for a in axes
            ):
                decided = any(r >= 0 for rs in refs for r in rs)
                if decided:
                    return None
        partial = frozenset(
            a for f, axes in factor_axes.items()
            if rule.factors[f].kind is FactorKind.REDUCTION for a in axes
        )  # fmt: skip
        need = {f for f, axes in factor_axes.items()
                if rule.factors[f].kind is FactorKind.NEED_REPLICATION}  # fmt: skip
        steps = []
        n_ops = len(rule.operands)
        for t, dims in enumerate(tensors):
            v = vids[t]
            if t >= n_ops and partial:
                steps += reshard_collectives(
                    g.shapes[v], g.dtypes[v], layouts[t], layouts[t], self.sizes, partial
                )
            if t < n_ops and need:
                dst = list(layouts[t])
                for d, fl in enumerate(dims):
                    if any(f in need for f in fl):
                        dst[d] = ()
                if tuple(dst) != layouts[t]:
                    steps += reshard_collectives(
                        g.shapes[v], g.dtypes[v], layouts[t], dst, self.sizes
                    )
        seconds = sum(self.cost_model.collective_time(s.axes, s.bytes) for s in steps)
        if self.cost_model.flops:
            work = 2 * math.prod(f.size for f in rule.factors)
            split = math.prod(self.sizes[a] for axes in factor_axes.values() for a in axes)
            seconds += work / split / self.cost_model.flops
        return seconds * _US, sum(b for _, _, b in steps)

    def _uses(self, v: int) -> int:
        """Equations that read argument ``v`` in its compute layout (not the optimizer's
        elementwise update, which works in the stored layout)."""
        g = self.graph
        shape = g.shapes[v]
        n = 0
        for a in self._readers.get(v, ()):
            app = g.apps[a]
            others = [g.shapes[u] for u in (*app.operands, *app.results)]
            if not all(s == shape or s == () for s in others):
                n += 1
        return n

    def _group_terms(self) -> None:
        """Per group: the memory of its arguments (and tied results) under each joint
        choice, and the gathers an extra storage axis costs at each use."""
        g = self.graph
        self._readers: dict[int, list[int]] = {}
        for a, app in enumerate(g.apps):
            if a not in self.dead and app.kind == "eqn":
                for u in app.operands:
                    self._readers.setdefault(u, []).append(a)
        for grp in self.groups:
            leaves = (*grp.owners, *grp.followers)
            refs = {i: self.refs(g.in_vids[i]) for i in leaves}
            free = {r for rs in refs.values() for r in rs if r >= 0}
            if grp.extra is not None:
                free.add(grp.extra)
            uses = {i: self._uses(g.in_vids[i]) for i in grp.owners}
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
                    gathers = uses[i] if extra[2] == "all" else 1
                    n_axis = self.sizes[extra[1]]
                    local = self._leaf_bytes(i) / (2 if i in self.tied else 1) / shards
                    if extra[2] == "all":
                        local *= n_axis
                    b = ring_bytes("all-gather", n_axis, local)
                    term.bytes[n] += gathers * b
                    term.time[n] += gathers * _US * self.cost_model.collective_time((extra[1],), b)

    # --- memory at an equation ---------------------------------------------------------

    def _activation_row(self, t: int) -> tuple[float, dict[tuple, np.ndarray]]:
        """Live intermediates at application ``t``: constant bytes, and per term the
        bytes under each joint choice."""
        g, live = self.graph, self.live
        mask = (live.start[live.intermediates] <= t) & (live.end[live.intermediates] >= t)
        const = 0.0
        rows: dict[tuple, np.ndarray] = {}
        by_sig: dict[tuple, float] = {}
        for v in live.intermediates[mask]:
            v = int(v)
            key = (self.refs(v), g.shapes[v], g.dtypes[v])
            by_sig[key] = by_sig.get(key, 0) + 1
        for (refs, shape, dtype), count in by_sig.items():
            size = nbytes(shape, dtype) * count
            free = tuple(sorted({r for r in refs if r >= 0}))
            if not free:
                const += size / math.prod(self.sizes[a] for r in refs for a in self.axes(r, {}))
                continue
            term = self._term(free)
            row = rows.setdefault(term.decisions, np.zeros(len(term.time)))
            for n, choice in self._combos(term):
                shards = math.prod(self.sizes[a] for r in refs for a in self.axes(r, choice))
                row[n] += size / shards
        return const, rows

    def _static_memory(self) -> float:
        """Bytes of arguments and results that no decision touches."""
        g = self.graph
        total = 0.0
        for i, v in enumerate(g.in_vids):
            if i not in self.leaf_group:
                lay = [self.axes(r, {}) if r < 0 else () for r in self.refs(v)]
                shards = math.prod(self.sizes[a] for x in lay for a in x)
                total += self._leaf_bytes(i) / shards
        tied_out = {o for _, o in g.ties}
        for o, v in enumerate(g.out_vids):
            if o not in tied_out:
                lay = [self.axes(r, {}) if r < 0 else () for r in self.refs(v)]
                total += nbytes(g.shapes[v], g.dtypes[v]) / math.prod(
                    self.sizes[a] for x in lay for a in x
                )
        return total

    # --- the integer program -----------------------------------------------------------

    def solve(self, t0: float, time_limit: float, say) -> tuple[dict[int, int], bool, str]:
        """The best choice per decision: (choice, optimal, solver status text)."""
        import highspy

        if not self.decisions:
            return {}, True, "nothing to decide"
        if time.perf_counter() - t0 >= time_limit:
            return self._baseline(), False, "the time limit ran out before the solver started"
        model = _Model(self)
        rows_added: set[int] = set()
        live = self.live
        peak0 = self._peak(self._baseline())
        points = [peak0] if self.budget is not None and peak0 >= 0 else []
        for t in points:
            model.add_memory_row(*self._activation_row(t), self.static, self.budget)
            rows_added.add(t)
        optimal, status = True, ""
        for _ in range(16):
            left = time_limit - (time.perf_counter() - t0)
            result = model.run(max(left, 1e-3), say)
            if result is None:
                if model.status == highspy.HighsModelStatus.kInfeasible:
                    points = sorted(rows_added)
                    deadline = t0 + time_limit
                    raise _Infeasible(
                        [_smallest_memory(self, points, e, deadline) for e in (False, True)]
                    )
                return self._baseline(), False, f"no layout found in time ({model.status_text})"
            choice, is_optimal = result
            optimal &= is_optimal
            status = model.status_text
            if model.status == highspy.HighsModelStatus.kTimeLimit:
                status = "the time limit stopped the solver: the best layout it found"
            if self.budget is None or not len(live.intermediates):
                break
            memory = self.memory(choice)
            if memory.total <= self.budget * (1 + 1e-9) or memory.peak_app in rows_added:
                break
            say(f"layout needs {human_bytes(memory.total)} at equation {memory.peak_app}: "
                "adding that memory constraint")  # fmt: skip
            model.add_memory_row(*self._activation_row(memory.peak_app), self.static, self.budget)
            rows_added.add(memory.peak_app)
            if not is_optimal:
                break
        return choice, optimal, status

    def _baseline(self) -> dict[int, int]:
        return {d: 0 for d in range(len(self.decisions))}

    def _peak(self, choice) -> int:
        return self.memory(choice).peak_app

    def memory(self, choice) -> MemoryEstimate:
        """The class model's memory estimate of a choice (every value at its class's axes,
        each group's arguments with their extra axis)."""
        g = self.graph
        dims = [tuple(self.axes(r, choice) for r in self.refs(v)) for v in range(len(g.shapes))]
        for i in self.leaf_group:
            lay = self.leaf_layout(i, choice)
            if lay is not None:
                dims[g.in_vids[i]] = tuple(lay)
        out_dims = [dims[v] for v in g.out_vids]
        for i, o in g.ties:
            out_dims[o] = dims[g.in_vids[i]]
        return memory_estimate(g, dims, self.sizes, out_dims, self.live)

    def comm(self, choice) -> tuple[float, float]:
        """Estimated (µs, bytes) of communication per step under a choice."""
        t, b = self.constant_time, self.constant_bytes
        for term in self.terms.values():
            n = _index(term, choice)
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
            out[re.escape(self.traced.in_names[i])] = PartitionSpec(*map(spec_entry, lay))
        return out

    def explain(self, choice, plan, memory, optimal, status, seconds) -> str:
        est_time, est_bytes = self.comm(choice)
        base_time, base_bytes = self.comm(self._baseline())
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


def _index(term: _Term, choice) -> int:
    n = 0
    for d, s in zip(term.decisions, term.sizes):
        n = n * s + choice[d]
    return n


class _Model:
    """The HiGHS model: a one-hot binary per decision candidate, a binary per allowed
    joint choice of each multi-decision term (its marginals equal the one-hots)."""

    def __init__(self, problem: _Problem):
        import highspy

        self.highspy = highspy
        self.problem = problem
        decisions = problem.decisions
        self.x: list[list[int]] = []
        n = 0
        for dec in decisions:
            self.x.append(list(range(n, n + len(dec.candidates))))
            n += len(dec.candidates)
        cost = [0.0] * n
        upper = [1.0] * n
        rows: list[tuple[dict[int, float], float, float]] = []
        for cols in self.x:
            rows.append(({c: 1.0 for c in cols}, 1.0, 1.0))
        self.col_of: dict[tuple[int, ...], np.ndarray] = {}
        for key, term in problem.terms.items():
            weight = term.time + _MEMORY_TIEBREAK * term.memory + term.bias
            if len(key) == 1:
                cols = np.array(self.x[key[0]])
                for c, w, ok in zip(cols, weight, term.allowed):
                    cost[c] += w
                    if not ok:
                        upper[c] = 0.0
                self.col_of[key] = cols
                continue
            cols = np.full(len(weight), -1)
            combos = list(itertools.product(*(range(s) for s in term.sizes)))
            for j in range(len(combos)):
                if term.allowed[j]:
                    cols[j] = n
                    cost.append(float(weight[j]))
                    upper.append(1.0)
                    n += 1
            self.col_of[key] = cols
            for pos, d in enumerate(key):
                for cand, xc in enumerate(self.x[d]):
                    row = {int(cols[j]): 1.0 for j, combo in enumerate(combos)
                           if combo[pos] == cand and cols[j] >= 0}  # fmt: skip
                    row[xc] = row.get(xc, 0.0) - 1.0
                    rows.append((row, 0.0, 0.0))
        self.n = n
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 1e-6)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, len(rows)
        lp.col_cost_ = np.array(cost)
        lp.col_lower_ = np.zeros(n)
        lp.col_upper_ = np.array(upper)
        lp.row_lower_ = np.array([r[1] for r in rows])
        lp.row_upper_ = np.array([r[2] for r in rows])
        starts, index, value = [0], [], []
        for row, _, _ in rows:
            index += list(row)
            value += list(row.values())
            starts.append(len(index))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, len(rows)
        lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(value, dtype=np.float64)
        lp.integrality_ = [highspy.HighsVarType.kInteger] * n
        h.passModel(lp)
        self.h = h
        self.status = None
        self.status_text = ""
        self._say = None
        h.cbMipImprovingSolution.subscribe(self._improved)

    def _improved(self, event) -> None:
        if self._say is not None:
            value = event.data_out.objective_function_value
            self._say(f"solver: better layout found, estimated {value / 1e3:.3f} ms per step")

    def columns(self, key: tuple[int, ...]) -> np.ndarray:
        """The model's column per joint choice of ``key`` (-1: not allowed)."""
        cols = self.col_of.get(key)
        if cols is None:
            if len(key) != 1:
                raise JaxshardBug(f"search: no joint variables for decisions {key}")
            cols = self.col_of[key] = np.array(self.x[key[0]])
        return cols

    def memory_expression(self, const, rows, static) -> tuple[dict[int, float], float]:
        """Per-device memory as ``(coefficients, constant)`` over the model's columns."""
        coef: dict[int, float] = {}
        total = const + static
        for key, term in self.problem.terms.items():
            if term.memory.any():
                for c, m in zip(self.columns(key), term.memory):
                    if c >= 0:
                        coef[int(c)] = coef.get(int(c), 0.0) + float(m)
        for key, row in rows.items():
            for c, m in zip(self.columns(key), row):
                if c >= 0:
                    coef[int(c)] = coef.get(int(c), 0.0) + float(m)
        return coef, total

    def add_memory_row(self, const, rows, static, budget) -> None:
        """Memory at one equation (arguments, results, live activations) ≤ budget."""
        coef, total = self.memory_expression(const, rows, static)
        idx = np.array(list(coef), dtype=np.int32)
        val = np.array(list(coef.values()))
        self.h.addRow(-self.highspy.kHighsInf, float(budget - total), len(idx), idx, val)

    def allow_extras(self, decisions, allowed: bool) -> None:
        """Allow or forbid every non-None candidate of the extra-axis ``decisions``."""
        cols = np.array([c for d in decisions for c in self.x[d][1:]], dtype=np.int32)
        if len(cols):
            upper = np.ones(len(cols)) if allowed else np.zeros(len(cols))
            self.h.changeColsBounds(len(cols), cols, np.zeros(len(cols)), upper)

    def run(self, time_limit: float, say) -> tuple[dict[int, int], bool] | None:
        hs = self.highspy
        self.h.setOptionValue("time_limit", float(time_limit))
        self._say = say
        self.h.run()
        self._say = None
        self.status = self.h.getModelStatus()
        self.status_text = self.h.modelStatusToString(self.status)
        info = self.h.getInfo()
        if info.primal_solution_status != hs.SolutionStatus.kSolutionStatusFeasible:
            return None
        values = self.h.getSolution().col_value
        choice = {d: int(np.argmax([values[c] for c in cols])) for d, cols in enumerate(self.x)}
        return choice, self.status == hs.HighsModelStatus.kOptimal


def _smallest_memory(
    problem: _Problem, points: list[int], extras: bool, deadline: float
) -> dict[int, int]:
    """The layout of least estimated per-device memory, ignoring communication: the
    largest memory over the equations in ``points`` (and each layout's own peak, added
    as found) is minimized. ``extras``: whether groups may store extra axes. The solver
    stops at ``deadline`` (a `time.perf_counter` time) with the best layout found so far."""
    model = _Model(problem)
    model.allow_extras(range(problem.n_class_decisions, len(problem.decisions)), extras)
    hs, h = model.highspy, model.h
    m = h.getNumCol()  # a column bounding every memory row from above: minimized
    h.changeColsCost(m, np.arange(m, dtype=np.int32), np.zeros(m))
    h.addCol(1.0, 0.0, hs.kHighsInf, 0, np.array([], dtype=np.int32), np.array([]))

    def bound(t: int) -> None:
        coef, total = model.memory_expression(*problem._activation_row(t), problem.static)
        idx = np.array([*coef, m], dtype=np.int32)
        h.addRow(-hs.kHighsInf, -total, len(idx), idx, np.array([*coef.values(), -1.0]))

    points = list(points) or [problem.memory(problem._baseline()).peak_app]
    for t in points:
        bound(t)
    choice = problem._baseline()
    for _ in range(8):
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        found = model.run(left, None)
        if found is None:
            break
        choice = found[0]
        peak = problem.memory(choice).peak_app
        if peak in points:
            break
        points.append(peak)
        bound(peak)
    return choice
