"""The sharding graph: every value of a traced program, and the rules that connect them.

A jaxpr is flattened into values (one per variable per call site, nested jaxprs
inlined) and *applications* (a rule over operand and result values). Higher-order
equations contribute their inner jaxprs through the regions the catalogue registers:
identity links alias inner values to outer ones, other links become rule applications.
`hint()` equations and boundaries (`shard_map`) become pins. An equation whose primitive has no rule is kept as a
boundary: nothing propagates across it, and one warning names it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

import jax
from jax.extend.core import Jaxpr, JaxprEqn, Literal

from jaxshard.annotate import (
    Pin,
    PinKind,
    hint_p,
    merge_pins,
    open_unnamed,
    pin_from_spec,
    spec_text,
    written_shardings,
)
from jaxshard.errors import JaxshardBug, JaxshardWarning, warn
from jaxshard.jax_compat import source_summary
from jaxshard.lattice import merge_dim
from jaxshard.rule import (
    FactorKind,
    Rule,
    Side,
    annotation_fn_for,
    boundary_fn_for,
    identity_rule,
    primitive,
    region_fn_for,
    rule_fn_for,
    shapes_of,
)
from jaxshard.trace import Traced

_RESHARD = primitive("reshard")  # explicit-sharding style: its target is the user's annotation

Path = tuple[int, ...]  # equation indices from the top jaxpr down to a nested jaxpr


Where = tuple | None  # (enclosing equation, its Where): resolved to a line only on demand


def source_line(eqn: JaxprEqn, enclosing: Where = None) -> str:
    """The user source line an equation came from, e.g. ``model.py:42 (attention)``; for
    an equation JAX made inside its own functions, the line of the enclosing call."""
    line = source_summary(eqn.source_info)
    while not line and enclosing is not None:
        eqn, enclosing = enclosing
        line = source_summary(eqn.source_info)
    return line or "<inside JAX>"


class AppKind(StrEnum):
    """What an application is: an equation's rule, a link between an outer value and a
    nested jaxpr's, or a tie of a result to the argument it is the new value of."""

    EQN = "eqn"
    LINK = "link"
    TIE = "tie"


class App(NamedTuple):
    """One rule applied to values: an equation, a region link, or a result-argument tie.
    (A named tuple: one is made per equation, so it must be cheap to create.)"""

    rule: Rule
    operands: tuple[int, ...]
    results: tuple[int, ...]
    kind: AppKind
    eqn: JaxprEqn | None = None
    where: Where = None

    def describe(self) -> str:
        """Primitive and source line (or the link kind), for explanations."""
        if self.eqn is None:
            return self.kind
        return f"{self.eqn.primitive.name} at {source_line(self.eqn, self.where)}"


class Boundary(NamedTuple):
    """An equation propagation does not cross (`shard_map`), where it is in the program
    (``where``: its enclosing equations, as `App.where`), its values and source line."""

    eqn: JaxprEqn
    where: Where
    operands: tuple[int, ...]
    results: tuple[int, ...]
    line: str


@dataclass
class Graph:
    """Values (shape, dtype, optional name) and the applications between them."""

    shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtypes: list[Any] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    apps: list[App] = field(default_factory=list)
    in_vids: list[int] = field(default_factory=list)
    out_vids: list[int] = field(default_factory=list)
    pins: dict[int, Pin] = field(default_factory=dict)
    # per jaxpr call site (the path of equation indices to it): its variables' values
    var_vids: dict[Path, dict[Any, int]] = field(default_factory=dict)
    ties: list[tuple[int, int]] = field(default_factory=list)  # (arg leaf, result leaf)
    # a link application -> the first application of the nested jaxpr it links (its
    # loop or call body, which the graph lists before the links)
    link_body: dict[int, int] = field(default_factory=dict, repr=False)
    # the link applications whose operand is the outer result a nested jaxpr's result
    # flows into (the value moves from the link's result to its operand)
    out_links: set[int] = field(default_factory=set, repr=False)
    # the link applications tying a loop carry's body input (its operand) to its body
    # output (its result): they run once per iteration, where the output is handed to the
    # next iteration's input
    carry_links: set[int] = field(default_factory=set, repr=False)
    # values a higher-order equation reads outside all of its regions (a cond's branch
    # index) or that a region computes for the equation itself (a while loop's
    # predicate): no application reads them, yet they are computed, reductions and all
    read_outside: set[int] = field(default_factory=set, repr=False)
    # equations propagation does not cross (shard_map): their collectives are the program's
    boundaries: list[Boundary] = field(default_factory=list)
    unknown: dict[str, str] = field(default_factory=dict)  # primitive -> first source line
    # primitive -> the values its equations cut off: (operands, results)
    cut: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict, repr=False)
    rule_cache: dict[Any, Rule] = field(default_factory=dict, repr=False)
    # while building: per primitive its registry entries; per equation object its rule
    dispatch: dict[Any, tuple] = field(default_factory=dict, repr=False)
    eqn_rules: dict[int, Rule] = field(default_factory=dict, repr=False)
    # the values literal operands make, by value: a literal passed into a call is the
    # call's inner input too (XLA's common-subexpression pass sees the constant)
    literals: dict[int, Literal] = field(default_factory=dict, repr=False)
    # results computed from the finished graph, kept for the next asker (`dead_apps`)
    memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def new_value(self, aval: Any) -> int:
        shapes = self.shapes
        shapes.append(getattr(aval, "shape", ()))
        self.dtypes.append(getattr(aval, "dtype", None))
        return len(shapes) - 1

    def value_name(self, vid: int) -> str:
        """A value's path if it has one, else its type, e.g. ``a float32[8, 12] value``."""
        if vid in self.names:
            return self.names[vid]
        dtype = getattr(self.dtypes[vid], "name", self.dtypes[vid])
        return f"a {dtype}[{', '.join(map(str, self.shapes[vid]))}] value"

    def producers(self) -> dict[int, int]:
        """For each value an equation makes, that equation (arguments, and the values a
        loop or call passes in, have none). Shared between callers: read it, never
        change it.

        Example:
            >>> g = Graph(); g.producers()
            {}
        """
        cached = self.memo.get("producers")
        if cached is not None and cached[0] == len(self.apps):  # planning asks often
            return cached[1]
        made = {
            v: a for a, app in enumerate(self.apps) if app.kind is AppKind.EQN for v in app.results
        }
        self.memo["producers"] = (len(self.apps), made)
        return made

    def uses(self) -> list[list[int]]:
        """For each value, the applications it takes part in."""
        uses: list[list[int]] = [[] for _ in self.shapes]
        for i, app in enumerate(self.apps):
            for v in (*app.operands, *app.results):
                if not uses[v] or uses[v][-1] != i:
                    uses[v].append(i)
        return uses


def updates(graph: Graph, i: int, o: int, uses: list[list[int]] | None = None) -> bool:
    """Whether result leaf ``o`` is computed from argument leaf ``i`` through equations
    that keep its shape and treat each element alone (an optimizer's update, ``p - lr *
    g``), links into nested calls included: what makes ``o`` the *new value* of ``i``,
    which ``donate_state`` may donate. A gradient of ``i`` (reached through a matmul's
    transpose) has its shape too, but is not.

    Example:
        >>> updates(plan.graph, 0, 0)  # doctest: +SKIP
        True
    """
    return graph.out_vids[o] in elementwise_reach(graph, graph.in_vids[i], True, uses)


def stack_results(graph: Graph, v: int) -> tuple[int, ...]:
    """The results (output positions) whose buffer XLA may fill with loop stack ``v``:
    those of its shape that equations treating each element alone compute from it (a
    scanned gradient's new weights and moments), and the new value of the argument ``v``
    is a transposed copy of (a weight stack stored with its layers on dim 1, MaxText's,
    moved layers-first for the scan: XLA holds the copy in the buffer of the new weight,
    written at the end of the step).

    Example:
        >>> stack_results(plan.graph, v)  # doctest: +SKIP
        (4, 16)
    """
    size, found, uses = graph.memo.get("stack_results", (None, None, None))
    if size != len(graph.apps):  # asked per layout the search prices; the graph may grow
        found, uses = {}, graph.uses()
        graph.memo["stack_results"] = (len(graph.apps), found, uses)
    hit = found.get(v)
    if hit is None:
        shape = graph.shapes[v]
        outs = [o for o, r in enumerate(graph.out_vids) if graph.shapes[r] == shape]
        reach = elementwise_reach(graph, v, links=False, uses=uses) if outs else set()
        source = _transposed_from(graph, v)
        made = [o for o in outs if graph.out_vids[o] in reach]
        copied = [o for i, o in graph.ties if graph.in_vids[i] == source]
        hit = found[v] = tuple(dict.fromkeys(made + copied))
    return hit


def _transposed_from(graph: Graph, v: int) -> int | None:
    """The argument ``v`` is a copy of with its dims reordered (through equations that
    only move an array, `view_dims`, each reordering or keeping its dims and its dtype),
    or None (an argument itself is no copy)."""
    producer, args = graph.producers(), set(graph.in_vids)
    if v in args:
        return None
    while v not in args:
        a = producer.get(v)
        moved = None if a is None else view_dims(graph.apps[a])
        if moved is None or moved == tuple(range(len(moved))):
            return None  # not a move, or one that copies nothing (a layout constraint)
        u = graph.apps[a].operands[0]
        if graph.dtypes[u] != graph.dtypes[v]:
            return None
        v = u
    return v


def elementwise_reach(
    graph: Graph, v: int, links: bool, uses: list[list[int]] | None = None
) -> set[int]:
    """The values computed from ``v`` by equations that keep its shape and treat each
    element alone (every factor passes through), and with ``links`` through links into
    and out of nested calls: the values an update of ``v`` flows into.

    Example:
        >>> elementwise_reach(plan.graph, plan.graph.in_vids[0], links=True)  # doctest: +SKIP
        {0, 7, 9}
    """
    shape = graph.shapes[v]
    uses = graph.uses() if uses is None else uses
    seen, frontier = {v}, [v]
    while frontier:
        u = frontier.pop()
        for a in uses[u]:
            app = graph.apps[a]
            if u not in app.operands or app.kind is AppKind.TIE:
                continue
            if app.kind is AppKind.LINK and not links:
                continue
            if app.kind is AppKind.EQN and not app.rule.plain:
                continue
            for r in app.results:
                if r not in seen and graph.shapes[r] == shape:
                    seen.add(r)
                    frontier.append(r)
    return seen


def find_root(parent: list[int], x: int) -> int:
    """The representative of ``x`` in a union-find forest (``parent[i] == i`` at a root),
    halving the path on the way.

    Example:
        >>> parent = [0, 0, 1, 3]  # 2 -> 1 -> 0; 3 alone
        >>> find_root(parent, 2), find_root(parent, 3), parent
        (0, 3, [0, 0, 0, 3])
    """
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def build_graph(traced: Traced, axis_sizes: Mapping[str, int]) -> Graph:
    """Flatten a traced program into a Graph.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxshard.trace import trace
        >>> import jaxshard.rules  # registers the catalogue
        >>> g = build_graph(trace(lambda x: jnp.sin(x) * 2, (jnp.ones(4),), {}), {})
        >>> [a.eqn.primitive.name for a in g.apps]
        ['sin', 'mul']
    """
    g = Graph()
    closed = traced.jaxpr
    g.in_vids = [g.new_value(v.aval) for v in closed.jaxpr.invars]
    for vid, name in zip(g.in_vids, traced.in_names):
        g.names[vid] = name
    for vid, name, spec in zip(g.in_vids, traced.in_names, traced.in_types):
        if spec is not None:  # an argument's explicit type pins the axes it names
            source = f"the explicit sharding of argument {name}: {spec_text(spec)}"
            _pin_explicit(g, vid, spec, name, source, axis_sizes)
    g.out_vids = _build(g, closed.jaxpr, g.in_vids, (), axis_sizes)
    g.eqn_rules.clear()  # keyed by object ids: valid only while building
    for vid, name in zip(g.out_vids, traced.out_names):
        g.names.setdefault(vid, name)
    for i, o in tied_results(traced):
        vi, vo = g.in_vids[i], g.out_vids[o]
        g.ties.append((i, o))
        if vi != vo:
            g.apps.append(App(identity_rule(g.shapes[vi]), (vi,), (vo,), AppKind.TIE))
    if g.unknown:
        listed = "; ".join(
            f"{p} (first at {line}){_cost(g, *g.cut[p])}" for p, line in g.unknown.items()
        )
        warn(
            f"no sharding rule for: {listed}. Values keep what they have and nothing "
            "propagates across these equations; `python -m jaxshard rules` lists covered "
            "primitives.",
            JaxshardWarning,
        )
    return g


def _cost(g: Graph, operands: list[int], results: list[int], shown: int = 3) -> str:
    """What a rule-less boundary costs: its results get no sharding from its operands
    (they stay replicated unless a later use shards them), its operands none from the
    results' uses.

    Example:
        >>> g = Graph()
        >>> a, b = g.new_value(jax.ShapeDtypeStruct((4, 8), "float32")), g.new_value(
        ...     jax.ShapeDtypeStruct((4, 8), "float32"))
        >>> g.names[a] = "params/w"
        >>> print(_cost(g, [a], [b]))
        : its results (a float32[4, 8] value; 128 bytes) get no sharding from its operands
        (params/w) and stay replicated unless a later use shards them
    """

    def names(vids: list[int]) -> str:
        unique = list(dict.fromkeys(v for v in vids if g.shapes[v]))
        text = ", ".join(g.value_name(v) for v in unique[:shown])
        return text + (f" and {len(unique) - shown} more" if len(unique) > shown else "")

    arrays = [v for v in dict.fromkeys(results) if g.shapes[v]]
    if not arrays:
        return ""
    size = sum(math.prod(g.shapes[v]) * getattr(g.dtypes[v], "itemsize", 4) for v in arrays)
    text = f": its results ({names(results)}; {size} bytes) get no sharding"
    if any(g.shapes[v] for v in operands):
        text += f" from its operands ({names(operands)})"
    return text + " and stay replicated unless a later use shards them"


def _build(
    g: Graph,
    jaxpr: Jaxpr,
    in_vids: Sequence[int],
    path: Path,
    axis_sizes,
    enclosing: Where = None,
) -> list[int]:
    env: dict[Any, int] = {}
    g.var_vids[path] = env

    def bind(var: Any, vid: int) -> None:
        env[var] = vid

    def read(var: Any) -> int:
        if isinstance(var, Literal):
            vid = g.new_value(var.aval)
            g.literals[vid] = var
            return vid
        return env[var]

    for var in jaxpr.constvars:
        bind(var, g.new_value(var.aval))
    for var, vid in zip(jaxpr.invars, in_vids):
        bind(var, vid)
    dispatch = g.dispatch
    for index, eqn in enumerate(jaxpr.eqns):
        operands = [read(v) for v in eqn.invars]
        primitive = eqn.primitive
        if primitive is hint_p:
            vid, spec, origin = operands[0], eqn.params["spec"], eqn.params["origin"]
            kind, where = origin or (
                PinKind.IN_FUNCTION,
                f"jaxshard.hint at {source_line(eqn, enclosing)}",
            )
            pin = pin_from_spec(spec, g.shapes[vid], axis_sizes, where, spec_text(spec))
            pin = Pin(pin.dims, f"{where}: {spec_text(spec)}", kind)
            g.pins[vid] = merge_pins(g.pins[vid], pin, g.value_name(vid)) if vid in g.pins else pin
            bind(eqn.outvars[0], vid)
            continue
        fns = dispatch.get(primitive)
        if fns is None:  # looked up once per primitive
            fns = dispatch[primitive] = (
                region_fn_for(primitive),
                annotation_fn_for(primitive),
                boundary_fn_for(primitive),
                rule_fn_for(primitive),
            )
        region_fn, annotation_fn, boundary_fn, rule_fn = fns
        if region_fn is not None:
            _build_regions(
                g,
                eqn,
                region_fn(eqn),
                operands,
                path + (index,),
                axis_sizes,
                bind,
                (eqn, enclosing),
            )
            continue
        results = [g.new_value(v.aval) for v in eqn.outvars]
        for var, vid in zip(eqn.outvars, results):
            bind(var, vid)
        if annotation_fn is not None:
            g.apps.append(
                App(
                    identity_rule(g.shapes[operands[0]]),
                    (operands[0],),
                    (results[0],),
                    AppKind.EQN,
                    eqn,
                    enclosing,
                )
            )
            _pin_boundary(
                g,
                eqn,
                annotation_fn(eqn),
                operands,
                results,
                source_line(eqn, enclosing),
                axis_sizes,
                PinKind.EXPLICIT if primitive is _RESHARD else PinKind.PROGRAM,
            )
            continue
        if boundary_fn is not None:
            line = source_line(eqn, enclosing)
            _pin_boundary(g, eqn, boundary_fn(eqn), operands, results, line, axis_sizes)
            g.boundaries.append(Boundary(eqn, enclosing, tuple(operands), tuple(results), line))
            # no application reads a boundary's operands, yet it reads them, whole: a
            # value only `jax.debug.print` reads is computed, its partial sums summed
            g.read_outside.update(operands)
            continue
        rule = None
        if rule_fn is not None:
            rule = g.eqn_rules.get(id(eqn))  # an equation of a body called again: its rule
            if rule is None:
                rule = g.eqn_rules[id(eqn)] = _rule(g, rule_fn, eqn, enclosing)
        if rule is None:  # no rule function, or it found nothing to read (a kernel)
            g.unknown.setdefault(primitive.name, source_line(eqn, enclosing))
            ins, outs = g.cut.setdefault(primitive.name, ([], []))
            ins.extend(operands)
            outs.extend(results)
            continue
        g.apps.append(App(rule, tuple(operands), tuple(results), AppKind.EQN, eqn, enclosing))
        for i, written, param in written_shardings(eqn) if eqn.params else ():
            where = f"{primitive.name} at {source_line(eqn, enclosing)}"
            name = "out_sharding" if param != "devices" else "target"
            source = f"{name}={spec_text(written)} of {where}"
            _pin_explicit(g, results[i], written, where, source, axis_sizes)
    return [read(v) for v in jaxpr.outvars]


def _pin_explicit(g: Graph, vid: int, spec, where: str, source: str, axis_sizes) -> None:
    """Pin the axes an explicit sharding names on a value (its unsharded dims stay open),
    as a layout the program fixes."""
    partial = open_unnamed(spec, len(g.shapes[vid]))
    pin = pin_from_spec(partial, g.shapes[vid], axis_sizes, where, source)
    pin = Pin(pin.dims, source, PinKind.EXPLICIT)
    g.pins[vid] = merge_pins(g.pins[vid], pin, g.value_name(vid)) if vid in g.pins else pin


def _rule(g: Graph, rule_fn, eqn: JaxprEqn, enclosing: Where) -> Rule | None:
    """The equation's rule, built and checked once per distinct (primitive, shapes,
    dtypes, params): repeated layers share one Rule object."""
    try:
        key = (
            eqn.primitive,
            tuple(
                [(getattr(v.aval, "shape", ()), getattr(v.aval, "dtype", None)) for v in eqn.invars]
            ),
            tuple([(v.aval.shape, v.aval.dtype) for v in eqn.outvars]),
            tuple(sorted(eqn.params.items())),
        )
        hash(key)
    except TypeError:
        key = None
    rule = g.rule_cache.get(key) if key is not None else None
    if rule is None:
        rule = rule_fn(eqn)
        if rule is None:
            return None
        shapes = shapes_of(eqn.invars), shapes_of(eqn.outvars)
        try:
            rule.check(*shapes, eqn.primitive.name)
        except JaxshardBug:  # again, naming the source line (found only when needed)
            rule.check(*shapes, f"{eqn.primitive.name} at {source_line(eqn, enclosing)}")
            raise
        if key is not None:
            g.rule_cache[key] = rule
    return rule


def _pin_boundary(
    g: Graph, eqn, specs, operands, results, line: str, axis_sizes, pin_kind=PinKind.PROGRAM
) -> None:
    source = f"{eqn.primitive.name} at {line}"
    for kind, vids, spec_list in (("operand", operands, specs[0]), ("result", results, specs[1])):
        for i, (vid, spec) in enumerate(zip(vids, spec_list)):
            if spec is None:
                continue
            pin = pin_from_spec(
                spec, g.shapes[vid], axis_sizes, f"{source}, {kind} {i}", "its spec"
            )
            pin = Pin(pin.dims, source, pin_kind)
            if kind == "operand" and _program_layouts_differ(g.pins.get(vid), pin):
                # a valid program: XLA reshards between the layouts two equations fix for
                # one value, so this equation reads a copy, linked by a reshard
                view = g.new_value(eqn.invars[i].aval)
                g.apps.append(App(identity_rule(g.shapes[vid]), (vid,), (view,), AppKind.LINK, eqn))
                vid = view
            g.pins[vid] = (
                merge_pins(g.pins[vid], pin, f"{source}, {kind} {i}") if vid in g.pins else pin
            )


_FIXED = (PinKind.PROGRAM, PinKind.EXPLICIT)  # layouts the program itself fixes


def _program_layouts_differ(old: Pin | None, new: Pin) -> bool:
    """True when ``old`` comes from layouts the program fixes only (not from the user)
    and disagrees with ``new`` on some dim."""
    return (
        old is not None
        and all(p.kind in _FIXED for p in old.parts or (old,))
        and any(merge_dim(a, b)[1] for a, b in zip(old.dims, new.dims))
    )


def _build_regions(
    g: Graph, eqn: JaxprEqn, regions, operands, path: Path, axis_sizes, bind, where: Where
) -> None:
    results: list[int | None] = [None] * len(eqn.outvars)
    pending: list[tuple[int, int, Rule | None]] = []  # (outer result, inner vid, rule)
    linked = {link.outer.index for r in regions for link in r.links if link.outer.side is Side.IN}
    g.read_outside.update(v for i, v in enumerate(operands) if i not in linked)
    body = len(g.apps)  # the first application of the equation's regions
    for r, region in enumerate(regions):
        inner_in: list[int | None] = [None] * len(region.jaxpr.invars)
        for link in region.links:
            if link.outer.side is Side.IN and link.inner.side is Side.IN and link.rule is None:
                inner_in[link.inner.index] = operands[link.outer.index]
        inner_in_vids = [
            vid if vid is not None else g.new_value(var.aval)
            for vid, var in zip(inner_in, region.jaxpr.invars)
        ]
        inner_out = _build(g, region.jaxpr, inner_in_vids, path + (r,), axis_sizes, where)
        # a region's result no link hands out (a while loop's predicate) is read there
        out_linked = {link.inner.index for link in region.links if link.inner.side is Side.OUT}
        g.read_outside.update(
            v for j, v in enumerate(inner_out) if j not in out_linked and v is not None
        )
        inner = {Side.IN: inner_in_vids, Side.OUT: inner_out}
        for link in region.links:
            kind, i = link.outer
            vid = inner[link.inner.side][link.inner.index]
            if kind is Side.IN:
                if link.rule is not None or link.inner.side is not Side.IN:
                    rule = link.rule or identity_rule(g.shapes[operands[i]])
                    g.apps.append(App(rule, (operands[i],), (vid,), AppKind.LINK, eqn, where[1]))
            elif link.rule is None and results[i] is None:
                results[i] = vid
            else:
                pending.append((i, vid, link.rule))
        for group in region.ties:
            vids = [inner[k][j] for k, j in group]
            for other in vids[1:]:
                if other != vids[0]:
                    g.carry_links.add(len(g.apps))
                    g.apps.append(
                        App(
                            identity_rule(g.shapes[vids[0]]),
                            (vids[0],),
                            (other,),
                            AppKind.LINK,
                            eqn,
                            where,  # inside the body: once per iteration
                        )
                    )
    for i, var in enumerate(eqn.outvars):
        if results[i] is None:
            results[i] = g.new_value(var.aval)
        bind(var, results[i])
    for i, vid, rule in pending:
        if vid != results[i]:
            rule = rule or identity_rule(g.shapes[results[i]])
            g.out_links.add(len(g.apps))
            g.apps.append(App(rule, (results[i],), (vid,), AppKind.LINK, eqn, where[1]))
    for a in range(body, len(g.apps)):
        if g.apps[a].kind is AppKind.LINK and g.apps[a].eqn is eqn:
            g.link_body.setdefault(a, body)


def tied_results(traced: Traced) -> list[tuple[int, int]]:
    """Pairs (argument leaf, result leaf) where a result is the new value of an argument.

    A top-level result element (or the whole result) that is a container (not a bare
    array) ties to the first top-level argument with the same tree structure, shapes
    and dtypes: new params keep the params' layout, so a training loop never reshards
    between steps.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxshard.trace import trace
        >>> step = lambda p, x: ({"w": p["w"] * 2}, x * 2)
        >>> t = trace(step, ({"w": jnp.ones(3)}, jnp.ones(2)), {})
        >>> tied_results(t)
        [(0, 0)]
    """
    (args, kwargs) = jax.tree_util.tree_unflatten(traced.in_tree, list(range(len(traced.in_avals))))
    groups = [*args, *kwargs.values()]
    out_indexed = jax.tree_util.tree_unflatten(traced.out_tree, list(range(len(traced.out_names))))
    out_avals = [(tuple(v.aval.shape), v.aval.dtype) for v in traced.jaxpr.jaxpr.outvars]
    in_avals = [(tuple(a.shape), a.dtype) for a in traced.in_avals]
    elements = list(out_indexed) if isinstance(out_indexed, (tuple, list)) else [out_indexed]
    ties: list[tuple[int, int]] = []
    used: set[int] = set()
    for element in elements:
        out_leaves, out_def = jax.tree_util.tree_flatten(element)
        if jax.tree_util.treedef_is_leaf(out_def):
            continue
        for g_index, group in enumerate(groups):
            in_leaves, in_def = jax.tree_util.tree_flatten(group)
            if g_index in used or in_def != out_def or not in_leaves:
                continue
            if all(in_avals[i] == out_avals[o] for i, o in zip(in_leaves, out_leaves)):
                used.add(g_index)
                ties.extend(zip(in_leaves, out_leaves))
                break
    return ties


def contracts(app) -> bool:
    """Whether an equation sums over a dim of its operands (a matmul, a convolution); an
    indexed reduction is a lookup (a gather's table dim), not a contraction.

    Example:
        >>> contracts(plan.graph.apps[0])  # doctest: +SKIP
        True
    """
    return app.kind is AppKind.EQN and any(
        f.kind is FactorKind.REDUCTION and not f.indexed for f in app.rule.factors
    )


def readers(graph: Graph, uses: Sequence[Sequence[int]], v: int) -> int:
    """How many applications read value ``v`` (``uses``: `Graph.uses`, which also lists
    the application that makes it).

    Example:
        >>> readers(g, g.uses(), 3)  # doctest: +SKIP
        2
    """
    return sum(1 for b in uses[v] if v in graph.apps[b].operands)


def slices_stack(graph: Graph, a: int) -> bool:
    """Whether application ``a`` hands a loop's body one slice of a stacked input per
    iteration (a scan's ``xs``): a link into the body whose result has one dim fewer than
    its operand (an out-link carries a body's result out instead).

    Example:
        >>> [a for a in range(len(g.apps)) if slices_stack(g, a)]  # doctest: +SKIP
        [41, 42]
    """
    app = graph.apps[a]
    return (
        app.kind is AppKind.LINK
        and a not in graph.out_links
        and len(graph.shapes[app.operands[0]]) == len(graph.shapes[app.results[0]]) + 1
    )


def moved_back(moved: Sequence[int], layout: Sequence) -> tuple:
    """The layout of a move's operand (``moved``: its `view_dims`) that puts its result
    in ``layout``.

    Example:
        >>> moved_back((1, 0, 2), (("data",), (), ("model",)))
        ((), ('data',), ('model',))
    """
    operand: list = [None] * len(moved)
    for d, src in enumerate(moved):
        operand[src] = layout[d]
    return tuple(operand)


def view_dims(app) -> tuple[int, ...] | None:
    """For an equation that only moves or converts one array (a transpose, a dtype cast,
    a layout constraint): per result dim, the operand dim it holds; None for any other.

    Read from the rule alone: one operand, one result, nothing summed, every dim of the
    result one whole dim of the operand (size-1 dims, which carry no factor, in order).

    Example (``app`` an equation ``jnp.transpose(w, (1, 0, 2))``):
        >>> view_dims(app)  # doctest: +SKIP
        (1, 0, 2)
    """
    rule = app.rule
    if app.kind is not AppKind.EQN or len(rule.operands) != 1 or len(rule.results) != 1:
        return None
    if any(f.kind is FactorKind.REDUCTION for f in rule.factors):
        return None
    (src,), (dst,) = rule.operands, rule.results
    if len(src) != len(dst):
        return None
    whole = {fl: d for d, fl in enumerate(src) if fl}
    empty = iter([d for d, fl in enumerate(src) if not fl])
    dims = [whole.get(fl) if fl else next(empty, None) for fl in dst]
    if None in dims or len(set(dims)) != len(dims):
        return None
    return tuple(dims)
