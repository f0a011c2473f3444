"""Lowering: a plan becomes a program XLA partitions.

The traced jaxpr is replayed, inlining call-like regions and rebinding loops and
branches with rewritten bodies, with
`jax.lax.with_sharding_constraint` at the values the plan pins, and wrapped in
`jax.jit` with in/out shardings for every argument and result leaf. Shardings live on
an Auto-typed view of the plan's mesh, so meshes with Explicit axes (the default of
`jax.make_mesh`) work too.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax._src import source_info_util  # keeps user source lines on replayed equations
from jax.extend.core import Jaxpr, Literal
from jax.sharding import NamedSharding

from jaxshard.annotate import hint_p
from jaxshard.lattice import to_spec
from jaxshard.plan import Plan, auto_view
from jaxshard.rule import FactorKind, region_fn_for


def pinned_values(plan: Plan) -> set[int]:
    """Values the lowered program constrains: hinted values, results of equations with a
    reduction or need-replication factor, and both sides of every predicted reshard.

    Elementwise values in between are left to XLA, whose propagation agrees with the
    pinned neighbours.
    """
    g = plan.graph
    pinned = set(g.pins)
    for app in g.apps:
        if app.kind == "eqn" and any(f.kind is not FactorKind.PASS for f in app.rule.factors):
            pinned.update(app.results)
    for r in plan.reshards:
        pinned.add(r.vid)
    return pinned


class Lowered:
    """The jitted, sharded program of a plan and the shardings it takes and returns."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.mesh = auto_view(plan.mesh)
        named = lambda dims: NamedSharding(self.mesh, to_spec(dims))  # noqa: E731
        self.in_shardings = tuple(named(d) for d in plan.flat_in_dims())
        self.out_shardings = tuple(named(d) for d in plan.out_dims)
        pinned = pinned_values(plan)
        self._pins = {
            key: named(plan.dims[vid]) for key, vid in plan.graph.var_vid.items() if vid in pinned
        }
        closed = plan.traced.jaxpr
        self.jitted = jax.jit(
            lambda *flat: tuple(self._eval(closed.jaxpr, closed.consts, flat, ())),
            in_shardings=self.in_shardings,
            out_shardings=self.out_shardings,
        )

    def _eval(self, jaxpr: Jaxpr, consts, args, path: tuple[int, ...]) -> list[Any]:
        """Replay ``jaxpr`` on ``args``, constraining the values the plan pins."""
        env: dict[Any, Any] = {}
        pins = self._pins

        def write(var, value):
            sharding = pins.get((path, var))
            if sharding is not None:
                value = jax.lax.with_sharding_constraint(value, sharding)
            env[var] = value

        def read(var):
            return var.val if isinstance(var, Literal) else env[var]

        for var, value in zip(jaxpr.constvars, consts):
            env[var] = value
        for var, value in zip(jaxpr.invars, args):
            if path:  # top-level arguments already arrive in their in_shardings
                write(var, value)
            else:
                env[var] = value
        for index, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            region_fn = region_fn_for(eqn.primitive)
            if eqn.primitive is hint_p:
                outs = invals
            elif region_fn is not None:
                regions = region_fn(eqn)
                if regions[0].param is None:
                    outs = self._inline(eqn, regions, invals, path + (index,))
                else:
                    outs = self._rebind(eqn, regions, invals, path + (index,))
            else:
                with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
                    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                outs = outs if eqn.primitive.multiple_results else [outs]
            for var, value in zip(eqn.outvars, outs):
                write(var, value)
        return [read(v) for v in jaxpr.outvars]

    def _inline(self, eqn, regions, invals, path):
        (region,) = regions
        inner_args: list[Any] = [None] * len(region.jaxpr.invars)
        for link in region.links:
            if link.outer[0] == "in":
                inner_args[link.inner[1]] = invals[link.outer[1]]
        inner_outs = self._eval(region.jaxpr, region.consts, inner_args, path + (0,))
        outs: list[Any] = [None] * len(eqn.outvars)
        for link in region.links:
            if link.outer[0] == "out":
                outs[link.outer[1]] = inner_outs[link.inner[1]]
        return outs

    def _rebind(self, eqn, regions, invals, path):
        """Bind a loop or branch again with each body rewritten to carry its constraints."""
        params = dict(eqn.params)
        for r, region in enumerate(regions):
            avals = [
                jax.ShapeDtypeStruct(
                    v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False)
                )
                for v in region.jaxpr.invars
            ]
            body = functools.partial(self._eval, region.jaxpr, region.consts, path=path + (r,))
            closed = jax.make_jaxpr(lambda *xs, body=body: body(xs))(*avals)
            if not hasattr(params[region.param], "consts"):  # an open jaxpr (remat)
                if closed.consts:
                    return self._inline(eqn, regions, invals, path)
                params[region.param] = closed.jaxpr
            elif region.index is None:
                params[region.param] = closed
            else:
                items = list(params[region.param])
                items[region.index] = closed
                params[region.param] = tuple(items)
        with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        return outs if eqn.primitive.multiple_results else [outs]

    def __call__(self, flat_args):
        with jax.set_mesh(self.mesh):
            return self.jitted(*flat_args)

    def lower(self, flat_args):
        """`jax.jit(...).lower` of the program for these arguments (abstract ones work)."""
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*flat_args)
