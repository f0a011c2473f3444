"""Lowering: a plan becomes a program XLA partitions.

The traced jaxpr is rewritten, not replayed: after every value the plan pins, a
`sharding_constraint` equation is inserted and later uses read the constrained value;
the bodies of nested jits, loops, branches, custom derivatives and rematerialized
blocks are rewritten in place the same way, so their structure survives. The result is
bound as one `jit` equation inside `jax.jit` with in/out shardings for every argument
and result leaf, which costs a single bind instead of re-tracing thousands of
equations. Shardings live on an Auto-typed view of the plan's mesh, so meshes with
Explicit axes (the default of `jax.make_mesh`) work too.

A program traced on Explicit axes (code in explicit-sharding style) carries shardings in
its types and in parameters (``out_sharding=`` of dot_general, reshape, ...; `reshard`
equations). Its types are erased first (`Eraser`): every aval is retyped on the Auto
view, explicit sharding parameters are dropped and `reshard` becomes a copy. Nothing is
lost: those annotations are pins of the plan, so the rewrite constrains them like hints
(with the layout the plan chose for the dims they leave unsharded), and the results
are handed back on the caller's mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.extend.core import primitives as prims
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxshard.cost import CollectiveKind, reshard_steps, without_unit_axes
from jaxshard.graph import AppKind, contracts
from jaxshard.jax_compat import (
    UNSPECIFIED,
    context_on_mesh,
    drop_var,
    is_drop_var,
    jit_equation_params,
    jit_p,
    new_eqn,
    new_var,
)
from jaxshard.lattice import to_spec
from jaxshard.plan import Plan, auto_view, gc_paused, read_values
from jaxshard.rule import primitive, region_fn_for


class Eraser:
    """Retypes a jaxpr traced on Explicit axes for the Auto view of its mesh: avals lose
    their explicit shardings, meshes in parameters turn their Explicit axes Auto,
    explicit sharding parameters are dropped, and `reshard` becomes a copy. The
    structure is kept equation for equation (nested jaxprs too, each shared body erased
    once), so the plan's per-call-site variables map through ``vars``.

    Example:
        >>> erased = Eraser(auto_view(mesh)).closed(traced.jaxpr)  # doctest: +SKIP
    """

    def __init__(self, auto_mesh: Mesh):
        self.auto = auto_mesh.abstract_mesh
        self.vars: dict[Any, Any] = {}  # original Var -> erased Var
        self._memo: dict[int, Any] = {}  # id(original jaxpr) -> erased jaxpr
        self._keep: list = []  # the originals, so their ids stay unique while erasing
        self._contexts: dict[int, Any] = {}  # id(equation context) -> erased context
        self._reshard = primitive("reshard")

    def closed(self, closed: ClosedJaxpr) -> ClosedJaxpr:
        """The erased ClosedJaxpr (its consts unchanged)."""
        found = self._memo.get(id(closed))
        if found is None:
            self._keep.append(closed)
            found = self._memo[id(closed)] = ClosedJaxpr(self.jaxpr(closed.jaxpr), closed.consts)
        return found

    def jaxpr(self, jaxpr: Jaxpr) -> Jaxpr:
        """The erased Jaxpr, its variables recorded in ``vars``."""
        found = self._memo.get(id(jaxpr))
        if found is not None:
            return found
        self._keep.append(jaxpr)
        constvars = [self._var(v) for v in jaxpr.constvars]
        invars = [self._var(v) for v in jaxpr.invars]
        eqns = [self._eqn(e) for e in jaxpr.eqns]
        outvars = [self._atom(v) for v in jaxpr.outvars]
        found = self._memo[id(jaxpr)] = jaxpr.replace(
            constvars=constvars, invars=invars, outvars=outvars, eqns=eqns
        )
        return found

    def aval(self, aval: Any) -> Any:
        """``aval`` typed on the Auto view (unchanged when it carries no explicit axis)."""
        sharding = getattr(aval, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or AxisType.Explicit not in getattr(mesh, "axis_types", ()):
            return aval
        explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
        spec = [_without(e, explicit) for e in sharding.spec]
        mesh = self.auto if mesh.axis_types.count(AxisType.Manual) == 0 else _auto_axes(mesh)
        return aval.update(sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    def _var(self, var: Any) -> Any:
        new = self.vars.get(var)
        if new is None:
            aval = self.aval(var.aval)
            if is_drop_var(var):
                return drop_var(aval)
            new = self.vars[var] = var if aval is var.aval else new_var(aval)
        return new

    def _atom(self, atom: Any) -> Any:
        if isinstance(atom, Literal):
            aval = self.aval(atom.aval)
            return atom if aval is atom.aval else Literal(atom.val, aval)
        return self._var(atom)

    def _eqn(self, eqn: Any) -> Any:
        invars = [self._atom(v) for v in eqn.invars]
        outvars = [self._var(v) for v in eqn.outvars]
        if eqn.primitive is self._reshard and _explicit(eqn.params.get("dst_sharding")):
            # the plan pins the result with the axes the reshard named
            return eqn.replace(
                primitive=prims.copy_p,
                invars=invars,
                outvars=outvars,
                params={},
                ctx=self._ctx(eqn.ctx),
            )
        params = {k: self._param(v) for k, v in eqn.params.items()}
        return eqn.replace(invars=invars, outvars=outvars, params=params, ctx=self._ctx(eqn.ctx))

    def _ctx(self, ctx: Any) -> Any:
        """The equation's context with its current mesh on the Auto view: lowering rules
        that trace helper functions (integer_pow, ...) run under this mesh."""
        mesh = getattr(ctx, "cur_abstract_mesh", None)
        if mesh is None or AxisType.Explicit not in getattr(mesh, "axis_types", ()):
            return ctx
        found = self._contexts.get(id(ctx))
        if found is None:
            found = self._contexts[id(ctx)] = context_on_mesh(ctx, _auto_axes(mesh))
            self._keep.append(ctx)
        return found

    def _param(self, value: Any) -> Any:
        if isinstance(value, NamedSharding):
            return None if _explicit(value) else value
        if isinstance(value, Mesh):
            return _auto_axes(value)
        if isinstance(value, type(self.auto)):
            return _auto_axes(value)
        if isinstance(value, ClosedJaxpr):
            return self.closed(value)
        if isinstance(value, Jaxpr):
            return self.jaxpr(value)
        if isinstance(value, tuple) and any(
            isinstance(v, (ClosedJaxpr, Jaxpr, NamedSharding)) for v in value
        ):
            return tuple(
                UNSPECIFIED if isinstance(v, NamedSharding) and _explicit(v) else self._param(v)
                for v in value
            )
        return value


def _explicit(sharding: Any) -> bool:
    mesh = getattr(sharding, "mesh", None)
    return mesh is not None and AxisType.Explicit in getattr(mesh, "axis_types", ())


def _auto_axes(mesh: Any) -> Any:
    """``mesh`` (concrete or abstract) with its Explicit axes Auto, Manual ones kept."""
    types = getattr(mesh, "axis_types", ())
    if AxisType.Explicit not in types:
        return mesh
    new = tuple(AxisType.Auto if t == AxisType.Explicit else t for t in types)
    if isinstance(mesh, Mesh):
        return Mesh(mesh.devices, mesh.axis_names, axis_types=new)
    return mesh.update_axis_types(
        {n: AxisType.Auto for n, t in zip(mesh.axis_names, types) if t == AxisType.Explicit}
    )


def _without(entry: Any, axes: set) -> Any:
    """A spec entry without the given axes (``None`` when none is left)."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return entry
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(n for n in names if n not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def pinned_values(plan: Plan) -> set[int]:
    """Values the lowered program constrains: hinted values, results of equations with a
    reduction or need-replication factor, and both sides of every predicted reshard and
    local slice: the value that moves and the results of the equation it moves for (and,
    where that equation is elementwise and its result is what moves, its operands).

    Pinning the results too makes XLA move an operand where the plan says. Left free,
    XLA may carry the operand's layout through the equation and move it later instead:
    a reshape that splits a dim sharded over "model" (4) into (2, 2) keeps both halves
    sharded on sub-axes of "model", which the plan cannot express (Llama's grouped-query
    ``jnp.repeat`` in the backward pass). Elementwise values in between are left to XLA,
    whose propagation agrees with the pinned neighbours.
    """
    g = plan.graph
    pinned = set(g.pins)
    for app in g.apps:
        if app.kind is AppKind.EQN and not app.rule.plain:
            pinned.update(app.results)
    for r in plan.reshards:
        pinned.add(r.vid)
        pinned.update(g.apps[r.app].results)
    # a value the plan computes whole and slices for one use: left free, XLA may compute
    # it sliced for that use and all-gather it for the others (AdamW's second moment
    # next to a parameter stored sharded)
    for a, vid in plan.slices:
        pinned.add(vid)
        pinned.update(g.apps[a].results)
    # an elementwise equation whose result the plan moves or slices: its operands stay
    # where they lie. JAX lowers some equations to their operand itself (``x ** 1`` in
    # optax's first moment, a cast to the type it has): the result's constraint then lands
    # on the operand, and Shardy gives the operand, and every other reader of it, the
    # moved layout. A result pinned only in its sliced layout is computed sliced, and
    # Shardy pulls the finer layout back onto the operands. Either way a gradient norm's
    # squares were split over one more axis than planned, and summed over it once more
    moved = [(r.app, r.vid) for r in plan.reshards if not r.partial]
    for a, vid in (*moved, *plan.sliced_results):
        app = g.apps[a]
        if app.kind is AppKind.EQN and app.rule.plain and vid in app.results:
            pinned.update(o for o in app.operands if g.shapes[o] != ())
    # a pinned value JAX lowers to its operand itself (``x ** 1``, a cast to its own type,
    # a copy): its constraint lands on the operand's value, which the operand's other
    # readers still read unconstrained. Where the pinned value's one reader is a copy
    # moved for its use (`operands_at_use`), Shardy's apply-sharding-constraints sees a
    # chain operand -> pin -> moved copy and hands every later reader of the operand the
    # moved copy (optax's second moment squared the gradient its first moment moved,
    # moving it back and the square again: one all-to-all more). The operand is pinned
    # too, so its readers read a constrained value and no chain forms
    producers = g.producers()
    todo = list(pinned)
    while todo:
        a = producers.get(todo.pop())
        if a is None or g.apps[a].kind is not AppKind.EQN or not lowers_to_operand(g.apps[a].eqn):
            continue
        for o in g.apps[a].operands:
            if o not in pinned and g.shapes[o] == g.shapes[g.apps[a].results[0]]:
                pinned.add(o)
                todo.append(o)
    return pinned


def lowers_to_operand(eqn) -> bool:
    """Whether JAX lowers ``eqn`` to its operand itself, no operation of its own:
    ``integer_pow`` with ``y=1``, a copy, a cast to the type the operand has.

    Example (``eqn`` an equation ``x ** 1``):
        >>> lowers_to_operand(eqn)  # doctest: +SKIP
        True
    """
    name = eqn.primitive.name
    if name == "integer_pow":
        return eqn.params.get("y") == 1
    if name == "convert_element_type":
        return eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype
    return name == "copy"


def operands_at_use(plan: Plan) -> dict[int, dict[int, tuple]]:
    """The layouts operands are moved to at their use: per equation (named by the value
    of its first result), ``{operand value: the layout the equation works in}``, for
    every predicted reshard of an operand and every repeat of one (`Plan.repeats`): the
    repeat's copy is constrained alike, so that XLA merges its collective into the first
    one's as the plan predicts. Left free, XLA moved a repeated weight its own way on a
    2x4 mesh (a collective-permute plus an all-gather over "model": twice the bytes).

    The lowered program constrains a copy of the operand to this layout right before the
    equation, so the collective the plan priced is the one XLA runs. Left to itself, XLA's
    partitioner may move an operand some other way: a weight stored split over "data"
    and wanted whole by a matmul whose batch is on "data" was measured moving as a
    collective-permute plus an all-gather over "model", twice the bytes of the all-gather
    over "data" the plan asks for.

    Example:
        >>> operands_at_use(plan)  # doctest: +SKIP
        {412: {17: ((), ())}}
    """
    g = plan.graph
    found: dict[int, dict[int, tuple]] = {}
    again = {(a, vid) for a, vid, _ in plan.moved_again}
    moves = [(r.app, r.vid, r.dst) for r in plan.reshards if (r.app, r.vid) not in again]
    for a, vid, dst in (*moves, *plan.repeats):
        app = g.apps[a]
        if app.kind is not AppKind.EQN or vid in app.results or not app.results:
            continue
        found.setdefault(app.results[0], {})[vid] = dst
    return found


def _computed_whole(plan: Plan, a: int) -> bool:
    """Whether the lowered program pins result(s) of application ``a`` that the plan
    computes whole and slices to that working layout first (`Plan.sliced_results`).
    Pinned only sliced, Shardy picks the layout to compute in by itself: an elementwise
    result sliced pulls the finer layout back onto its operands and their other readers,
    moving them there instead (a clipped gradient's select, read by a norm's squares,
    collective-permuted and all-to-all'd over "fsdp"); a concatenation along the sliced
    dim is computed split along another dim and all-to-all'd (``jnp.roll``), or
    miscompiled where its pieces do not divide. One operation with several results (a
    top-k) gets one layout for all of them from XLA: some sliced and others read whole,
    the others were computed sliced too and gathered back (a router's top-k, its indices
    split with the batch, its values wanted whole); all sliced, or the others read by
    nothing, XLA computes it as the plan says and a pin only adds a gather. A loop's or a
    call's results are values of their own."""
    g = plan.graph
    app = g.apps[a]
    if app.rule.plain:
        return True
    if app.kind is not AppKind.EQN or app.eqn is None:
        return False
    if any(isinstance(v, (ClosedJaxpr, Jaxpr)) for v in jax.tree.leaves(app.eqn.params)):
        return False
    if len(app.results) < 2:
        return True
    read = read_values(g)
    return any((a, vid) not in plan.sliced_results and vid in read for vid in app.results)


def program_name(traced) -> str:
    """The name of the traced user function, for the lowered program (XLA dumps and
    profiles name modules by it); "jaxshard_step" when JAX recorded none.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxshard.trace import trace
        >>> def train_step(x):
        ...     return x * 2
        >>> program_name(trace(train_step, (jnp.ones(2),), {}))
        'train_step'
    """
    info = traced.jaxpr.jaxpr.debug_info
    name = info.func_name if info is not None else ""
    return name if name.isidentifier() else "jaxshard_step"


class Via(NamedTuple):
    """A result's pin: computed in ``working``, then moved to ``dims`` (`Lowered`)."""

    working: tuple
    dims: tuple


class Lowered:
    """The jitted, sharded program of a plan and the shardings it takes and returns.

    Example:
        >>> lowered = Lowered(plan)  # doctest: +SKIP
        >>> outs = lowered(flat_args)  # doctest: +SKIP
    """

    def __init__(self, plan: Plan):
        self.plan = plan
        self.mesh = auto_view(plan.mesh)
        self._named: dict[tuple, NamedSharding] = {}
        # the layout each constrained variable was given (`_constrain`), and the mesh's
        # axis sizes (`without_unit_axes`: size-1 axes move nothing)
        self._layout_of: dict[Any, tuple] = {}
        self._sizes = dict(self.mesh.shape)
        self.in_shardings = tuple(self._sharding(d) for d in plan.flat_in_dims())
        self.out_shardings = tuple(self._sharding(d) for d in plan.out_dims)
        with gc_paused():
            self.jaxpr = self._rewrite_program(plan)
        n_in, n_out = len(self.in_shardings), len(self.out_shardings)
        name = program_name(plan.traced)
        # the enclosing jax.jit carries the argument and result shardings; repeating
        # them in the equation only adds an identity sharding op per leaf to compile
        params = jit_equation_params(self.jaxpr, n_in, n_out, self.mesh, name)

        def program(*flat):
            return tuple(jit_p.bind(*flat, **params))

        program.__name__ = program.__qualname__ = name  # names the module: jit_<name>
        self.jitted = jax.jit(
            program,
            in_shardings=self.in_shardings,
            out_shardings=self.out_shardings,
        )

    def _sharding(self, dims) -> NamedSharding:
        named = self._named.get(dims)
        if named is None:
            named = self._named[dims] = NamedSharding(self.mesh, to_spec(dims))
        return named

    def _rewrite_program(self, plan: Plan) -> ClosedJaxpr:
        pinned = pinned_values(plan)
        closed = plan.traced.jaxpr
        rename: Any = None
        if getattr(plan.traced, "explicit", False):
            eraser = Eraser(self.mesh)
            closed, rename = eraser.closed(closed), eraser.vars
        # a result the plan computes in one layout and moves to its own by a reshard XLA
        # has no collective for: constrained to the working layout first (`Via`), then
        # moved step by step (`_constrain`)
        via: dict[int, Via] = {}
        for r in plan.reshards:
            app = plan.graph.apps[r.app]
            if r.vid not in app.results:
                continue
            if contracts(app) and any(step.kind == CollectiveKind.ALL_TO_ALL for step in r.steps):
                # a contraction's result the plan moves by an all-to-all: left to itself,
                # XLA computes it in the final layout, gathering an operand the plan
                # keeps split (measured: a weight gradient whose inputs are split on one
                # axis along different dims gathered the larger input)
                via[r.vid] = Via(r.src, plan.dims[r.vid])
            elif r.partial:
                kinds = {step.kind for step in r.steps}
                if CollectiveKind.ALL_GATHER in kinds or (
                    CollectiveKind.REDUCE_SCATTER in kinds
                    and app.eqn.primitive is prims.scatter_add_p
                ):
                    # a partial sum reduced, then gathered: left to itself, XLA computes
                    # the contraction in the gathered layout, gathering its operand
                    # instead (measured: a head's backward matmul under a pipeline gathered
                    # the logits' gradient over "stage", 8x the bytes of its result). A
                    # scatter-add's partial sum reduce-scattered: XLA scatters into the
                    # split layout, moving the updates by an all-to-all (an embedding's
                    # gradient, for its optimizer state stored split over the batch's
                    # axis: 16x the bytes of the reduce-scatter)
                    via[r.vid] = Via(r.src, plan.dims[r.vid])
                continue
            elif len(reshard_steps(*self._without_unit_axes(r.src, r.dst), self._sizes)) > 1:
                via[r.vid] = Via(r.src, plan.dims[r.vid])
        for (a, vid), working in plan.sliced_results.items():
            if _computed_whole(plan, a):
                via.setdefault(vid, Via(working, plan.dims[vid]))
        # per path (a call site of a nested jaxpr): {var: layout} and a hashable key
        self._levels = {}
        for path, env in plan.graph.var_vids.items():
            items = [
                (var if rename is None else rename.get(var, var), via.get(vid, plan.dims[vid]))
                for var, vid in env.items()
                if vid in pinned
            ]
            if items:
                self._levels[path] = (dict(items), tuple(items))
        # per path: {first result var of an equation: {operand var: its layout at this use}}
        self._uses: dict[tuple, dict[Any, dict[Any, tuple]]] = {}
        at_use = operands_at_use(plan)
        for path, env in plan.graph.var_vids.items() if at_use else ():
            firsts = [(var, at_use[vid]) for var, vid in env.items() if vid in at_use]
            if not firsts:
                continue
            moved = {v for _, moves in firsts for v in moves}
            vars_of: dict[int, list] = {}  # a value may have several names in one jaxpr
            for var, vid in env.items():
                if vid in moved:
                    vars_of.setdefault(vid, []).append(var)
            named = (lambda v: v) if rename is None else (lambda v: rename.get(v, v))
            self._uses[path] = {
                named(var): {
                    named(name): dims for v, dims in moves.items() for name in vars_of.get(v, ())
                }
                for var, moves in firsts
            }
        self._regions: dict[int, list] = {}  # id(jaxpr) -> its higher-order equations
        self._bodies: dict[tuple, Any] = {}  # rewritten nested jaxprs, shared by call sites
        # the arguments arrive in their planned layouts (the jit's in_shardings)
        self._layout_of.update(zip(closed.jaxpr.invars, plan.flat_in_dims()))
        return ClosedJaxpr(self._rewrite(closed.jaxpr, ()), closed.consts)

    def _without_unit_axes(self, *layouts) -> list[tuple]:
        return [without_unit_axes(d, self._sizes) for d in layouts]

    def _constrain(self, var, dims: tuple, eqns: list, like) -> Any:
        """``var`` constrained to ``dims`` (appended to ``eqns``). A value this rewrite
        constrained before moves through the layouts `reshard_steps` gives: a move XLA
        has no collective for would replicate the whole array on every device."""
        if isinstance(dims, Via):
            if not self._passes_on(like, var, dims.dims):
                var = self._constrain(var, dims.working, eqns, like)
            dims = dims.dims
        src = self._layout_of.get(var)
        steps = [dims]
        if src is not None and None not in src and None not in dims:
            moving = self._without_unit_axes(src, dims)
            steps = [*reshard_steps(*moving, self._sizes)[:-1], dims]
        for step in steps:
            new = new_var(var.aval)
            params = dict(
                sharding=self._sharding(step),
                layout=None,
                context_mesh=self.mesh,
                unconstrained_dims=frozenset(),
            )
            eqns.append(new_eqn([var], [new], prims.sharding_constraint_p, params, like))
            var = new
        self._layout_of[var] = dims
        return var

    def _passes_on(self, eqn, var, dims: tuple) -> bool:
        """Whether ``eqn`` makes ``var`` from one value of its shape already constrained to
        ``dims`` (a hint, a type conversion): another name of a moved value, which a
        `Via` must not take back through the working layout."""
        ins = [v for v in eqn.invars if not isinstance(v, Literal)]
        return (
            var in eqn.outvars
            and len(ins) == 1
            and ins[0].aval.shape == var.aval.shape
            and self._layout_of.get(ins[0]) == dims
        )

    def _regions_of(self, jaxpr: Jaxpr) -> list:
        """``(index, eqn, regions)`` of the higher-order equations of a jaxpr, computed
        once per jaxpr object (repeated layers call the same bodies)."""
        found = self._regions.get(id(jaxpr))
        if found is None:
            found = self._regions[id(jaxpr)] = []
            for index, eqn in enumerate(jaxpr.eqns):
                region_fn = region_fn_for(eqn.primitive)
                if region_fn is not None:
                    found.append((index, eqn, region_fn(eqn)))
        return found

    def _rewrite(self, jaxpr: Jaxpr, path: tuple[int, ...]) -> Jaxpr:
        """``jaxpr`` with a constraint after every pinned value, bodies rewritten too.

        A nested jaxpr is rewritten once per distinct set of constraints: call sites
        that constrain the same values to the same layouts (repeated layers) share one
        rewritten object, and a body that needs no constraint stays the original object,
        so JAX lowers each distinct body to one StableHLO function, as for plain `jit`.
        """
        pins, key = self._levels.get(path, ({}, ()))
        uses = self._uses.get(path, {})
        if uses:
            key = (key, tuple((r, tuple(m.items())) for r, m in uses.items()))
        new_params: dict[int, dict] = {}
        children = []
        for index, eqn, regions in self._regions_of(jaxpr):
            params = None
            for r, region in enumerate(regions):
                inner = self._rewrite(region.jaxpr, path + (index, r))
                children.append(inner)
                if inner is region.jaxpr:
                    continue
                params = params or dict(eqn.params)
                old = (
                    params[region.param]
                    if region.index is None
                    else params[region.param][region.index]
                )
                new = self._closed(old, inner) if isinstance(old, ClosedJaxpr) else inner
                if region.index is None:
                    params[region.param] = new
                else:
                    items = list(params[region.param])
                    items[region.index] = new
                    # a named tuple keeps its type (a linear solve's jaxprs, read by name)
                    kind = type(params[region.param])
                    params[region.param] = (
                        kind(*items) if hasattr(kind, "_fields") else tuple(items)
                    )
            if params is not None:
                new_params[index] = params
        if path:
            if not pins and not new_params and not uses:
                return jaxpr  # nothing to constrain in this body or below
            memo = (id(jaxpr), key, tuple(id(c) for c in children))
            shared = self._bodies.get(memo)
            if shared is not None:
                return shared
        subst: dict[Any, Any] = {}
        eqns: list = []
        if path and jaxpr.eqns:  # a body's inputs (loop carries) keep their layout too
            for var in jaxpr.invars:
                dims = pins.get(var)
                if isinstance(dims, Via):
                    # moved where it was computed: it arrives in its layout. Taken back
                    # through the working layout, it was gathered and sliced again in
                    # every call (per-example keys split whole, then sliced with the batch)
                    dims = dims.dims
                if dims is not None:
                    subst[var] = self._constrain(var, dims, eqns, jaxpr.eqns[0])
        # a call's first result is its body's: the move belongs to the equation inside,
        # where the body's input keeps its layout up to it. Moved at the call site too,
        # the body's input was pinned back to the value's own layout and moved again
        # (a moved operand of ``jnp.cumsum``, a nested jit: gathered twice)
        calls = {index for index, _, regions in self._regions_of(jaxpr) if regions}
        for index, eqn in enumerate(jaxpr.eqns):
            params = new_params.get(index)
            read = eqn.invars  # the names the plan's moves are keyed by
            if subst and any(not isinstance(v, Literal) and v in subst for v in eqn.invars):
                invars = [v if isinstance(v, Literal) else subst.get(v, v) for v in eqn.invars]
                eqn = eqn.replace(invars=invars, params=params)
            elif params is not None:
                eqn = eqn.replace(params=params)
            moves = (
                uses.get(eqn.outvars[0]) if uses and eqn.outvars and index not in calls else None
            )
            if moves:
                eqn = self._moved_operands(eqn, read, moves, subst, eqns)
            eqns.append(eqn)
            if pins:
                for var in eqn.outvars:
                    dims = pins.get(var)
                    if isinstance(dims, Via) and index in calls:
                        # a call's result is its body's, moved there through the working
                        # layout: taken back through it here, it was gathered whole and
                        # sliced again after the call (an fft inside jnp.fft's jit)
                        dims = dims.dims
                    if dims is not None and not is_drop_var(var):
                        subst[var] = self._constrain(var, dims, eqns, eqn)
        outvars = [v if isinstance(v, Literal) else subst.get(v, v) for v in jaxpr.outvars]
        new = jaxpr.replace(eqns=eqns, outvars=outvars)
        if path:
            self._bodies[memo] = new
        return new

    def _moved_operands(self, eqn, read: list, moves: dict, subst: dict, eqns: list):
        """``eqn`` reading copies of the operands the plan moves (``read``: its operands'
        names before substitution), each constrained to the layout the equation works in
        (appended to ``eqns``); other readers keep the operand as it is."""
        invars, copies = list(eqn.invars), {}
        for i, var in enumerate(read):
            if isinstance(var, Literal) or var not in moves:
                continue
            if var not in copies:
                copies[var] = self._constrain(subst.get(var, var), moves[var], eqns, eqn)
            invars[i] = copies[var]
        return eqn.replace(invars=invars) if copies else eqn

    def _closed(self, old: ClosedJaxpr, inner: Jaxpr) -> ClosedJaxpr:
        """One ClosedJaxpr per (original, rewritten body): JAX's lowering caches key on it."""
        memo = (id(old), id(inner))
        closed = self._bodies.get(memo)
        if closed is None:
            closed = self._bodies[memo] = ClosedJaxpr(inner, old.consts)
        return closed

    def __call__(self, flat_args):
        with jax.set_mesh(self.mesh):
            return self.jitted(*flat_args)

    def lower(self, flat_args=None):
        """`jax.jit(...).lower` of the program for these arguments (abstract ones work);
        without them, for abstract arguments of the traced shapes in the planned layouts."""
        if flat_args is None:
            flat_args = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(self.plan.traced.in_avals, self.in_shardings)
            ]
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*flat_args)
