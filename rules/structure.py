"""Higher-order primitives as graph structure: their inner jaxprs, linked to the outer values.

`jit` (pjit), `closed_call`, `remat`/`checkpoint`, `custom_jvp_call` and
`custom_vjp_call`, `composite` (a named decomposition), `linear_call` (its callee) and
`remat_opt` (a custom-vjp forward under remat) and `custom_vmap_call` call one inner jaxpr on the equation's
operands: each operand is the
inner input of the same position and each result the inner output; `custom_linear_solve`
calls its ``solve`` jaxpr on that jaxpr's constants and the right-hand side. The links are
identities, so the engine inlines them; lowering rewrites each body in place, so nested
jits, custom derivatives and rematerialization boundaries survive. `shard_map` is a boundary: its
in/out specs are fixed layouts of its operands and results, and its manual body is not
planned.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p
from jax.sharding import PartitionSpec

from jaxshard.annotate import open_unnamed
from jaxshard.jax_compat import custom_vmap_p, linear_call_p, optional_primitives, remat_opt_p
from jaxshard.rule import (
    Link,
    Port,
    Region,
    Side,
    primitive,
    register_annotation,
    register_boundary,
    register_region,
)


def call_region(eqn: JaxprEqn) -> list[Region]:
    """One region: operand i is inner input i, result i is inner output i.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(jax.jit(jnp.sin))(jnp.ones(3)).eqns[0]
        >>> [str(link.outer) for link in call_region(eqn)[0].links]
        ['in[0]', 'out[0]']
    """
    params = eqn.params
    inner = params.get("jaxpr", params.get("call_jaxpr"))
    jaxpr, consts = (inner.jaxpr, tuple(inner.consts)) if hasattr(inner, "consts") else (inner, ())
    links = [Link(Port(Side.IN, i), Port(Side.IN, i)) for i in range(len(eqn.invars))]
    links += [Link(Port(Side.OUT, i), Port(Side.OUT, i)) for i in range(len(eqn.outvars))]
    return [
        Region(jaxpr, consts, tuple(links), param="jaxpr" if "jaxpr" in params else "call_jaxpr")
    ]


register_region(
    p.jit_p,
    p.closed_call_p,
    p.remat_p,
    p.custom_jvp_call_p,
    p.custom_vjp_call_p,
    primitive("composite"),
    # calls newer releases add: jax.experimental.overlap.program_order and
    # jax.experimental.xla_metadata's calls (constants first, then the arguments)
    *optional_primitives("program_order", "xla_metadata_call"),
)(call_region)


@register_region(linear_call_p)
def linear_call_region(eqn: JaxprEqn) -> list[Region]:
    """`linear_call` runs ``callee`` on its operands (constants, residuals, linear
    inputs, positionally); the transpose is only traced when differentiating, so the
    forward program is the callee.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.custom_derivatives import linear_call
        >>> f = lambda x: linear_call(lambda r, x: x * r, lambda r, t: t * r, 2.0, x)
        >>> eqn = jax.make_jaxpr(f)(jnp.ones(3)).eqns[0]
        >>> region, = linear_call_region(eqn)
        >>> region.param, [str(link.outer) for link in region.links]
        ('callee', ['in[0]', 'in[1]', 'out[0]'])
    """
    return _positional_region(eqn, "callee")


@register_region(remat_opt_p)
def remat_opt_region(eqn: JaxprEqn) -> list[Region]:
    """A `custom_vjp` forward under remat with ``optimize_remat=True``: ``fwd_jaxpr``
    maps the operands (constants, then arguments) to the results (residuals, then
    outputs) positionally; the primal-only thunk is not traced.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.custom_vjp(jnp.sin)
        >>> f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,),
        ...          optimize_remat=True)
        >>> jaxpr = jax.make_jaxpr(lambda x: jax.jvp(f, (x,), (x,)))(jnp.ones(3))
        >>> eqn = next(e for e in jaxpr.eqns if e.primitive.name == "remat_opt")
        >>> remat_opt_region(eqn)[0].param
        'fwd_jaxpr'
    """
    return _positional_region(eqn, "fwd_jaxpr")


@register_region(custom_vmap_p)
def custom_vmap_region(eqn: JaxprEqn) -> list[Region]:
    """`jax.custom_batching.custom_vmap` outside a vmap runs ``call`` (constants, then
    arguments) positionally; its batching rule only matters under `vmap`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.custom_batching.custom_vmap(jnp.sin)
        >>> f.def_vmap(lambda n, batched, x: (jnp.sin(x), batched[0]))  # doctest: +ELLIPSIS
        <function ...>
        >>> eqn = jax.make_jaxpr(f)(jnp.ones(3)).eqns[0]
        >>> custom_vmap_region(eqn)[0].param
        'call'
    """
    return _positional_region(eqn, "call")


def _positional_region(eqn: JaxprEqn, param: str) -> list[Region]:
    inner = eqn.params[param]
    links = [Link(Port(Side.IN, i), Port(Side.IN, i)) for i in range(len(eqn.invars))]
    links += [Link(Port(Side.OUT, i), Port(Side.OUT, i)) for i in range(len(eqn.outvars))]
    return [Region(inner.jaxpr, tuple(inner.consts), tuple(links), param=param)]


@register_region(p.linear_solve_p)
def linear_solve_region(eqn: JaxprEqn) -> list[Region]:
    """`jax.lax.custom_linear_solve` computes ``solve`` on its constants and the right-hand
    side (the operands: each of its four jaxprs' constants, in the order matvec, vecmat,
    solve, transpose_solve, then the right-hand side); the other jaxprs only serve its
    derivatives, which JAX traces as equations of their own.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda a, b: jnp.linalg.solve(a, b)
        >>> jaxpr = jax.make_jaxpr(f)(jnp.eye(3)[None], jnp.ones((1, 3, 1)))
        >>> solve = lambda j: next(e for e in j.eqns if e.primitive.name == "custom_linear_solve")
        >>> eqn = solve(jaxpr.eqns[0].params["jaxpr"].jaxpr)
        >>> region, = linear_solve_region(eqn)
        >>> region.param, region.index, [str(link.outer) for link in region.links]
        ('jaxprs', 2, ['in[2]', 'in[3]', 'in[6]', 'out[0]'])
    """
    lengths = eqn.params["const_lengths"]
    first = lengths.matvec + lengths.vecmat
    n_rhs = len(eqn.invars) - sum(lengths)
    outer = [*range(first, first + lengths.solve), *range(sum(lengths), sum(lengths) + n_rhs)]
    links = [Link(Port(Side.IN, o), Port(Side.IN, i)) for i, o in enumerate(outer)]
    links += [Link(Port(Side.OUT, i), Port(Side.OUT, i)) for i in range(len(eqn.outvars))]
    solve = eqn.params["jaxprs"].solve
    index = eqn.params["jaxprs"]._fields.index("solve")
    return [Region(solve.jaxpr, tuple(solve.consts), tuple(links), param="jaxprs", index=index)]


@register_boundary(primitive("shard_map"))
def shard_map_boundary(eqn: JaxprEqn) -> tuple[list[PartitionSpec], list[PartitionSpec]]:
    """The specs `shard_map` was given; dims they leave out are replicated. A shard_map
    manual over some mesh axes only (``axis_names=``) pins just those: its other axes stay
    automatic, so dims its specs leave out are left to the planner (``P.UNCONSTRAINED``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P, AxisType
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        >>> f = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((8, 4))).eqns[0]
        >>> shard_map_boundary(eqn)
        ([P('data', None)], [P('data', None)])
    """

    manual = eqn.params.get("newly_manual_axes")
    mesh_axes = set(getattr(eqn.params.get("mesh"), "axis_names", ()))
    partial = bool(manual) and set(manual) != mesh_axes
    rest = PartitionSpec.UNCONSTRAINED if partial else None

    def full(spec, var):
        entries = [rest if e is None and partial else e for e in spec]
        entries += [rest] * (len(var.aval.shape) - len(spec))
        return PartitionSpec(*entries)

    ins = [full(s, v) for s, v in zip(eqn.params["in_specs"], eqn.invars)]
    outs = [full(s, v) for s, v in zip(eqn.params["out_specs"], eqn.outvars)]
    return ins, outs


@register_annotation(p.sharding_constraint_p)
def sharding_constraint_annotation(eqn: JaxprEqn) -> tuple[list, list]:
    """A user's `with_sharding_constraint` pins its result like a hint: every dim its spec
    names or leaves out is pinned, `P.UNCONSTRAINED` dims are left to the planner.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P, AxisType
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        >>> f = lambda x: jax.lax.with_sharding_constraint(x, P("data"))
        >>> with jax.set_mesh(mesh):
        ...     eqn = jax.make_jaxpr(f)(jnp.ones((8, 4))).eqns[0]
        >>> sharding_constraint_annotation(eqn)
        ([None], [P('data', None)])
    """
    spec = getattr(eqn.params["sharding"], "spec", None)
    if spec is None:  # not a NamedSharding: nothing jaxshard can read
        return [None], [None]
    rank = len(eqn.outvars[0].aval.shape)
    open_dims = eqn.params.get("unconstrained_dims", frozenset())
    entries = list(spec) + [None] * (rank - len(spec))
    entries = [PartitionSpec.UNCONSTRAINED if d in open_dims else e for d, e in enumerate(entries)]
    return [None], [PartitionSpec(*entries)]


@register_annotation(primitive("reshard"))
def reshard_annotation(eqn: JaxprEqn) -> tuple[list, list]:
    """`jax.sharding.reshard` pins the mesh axes its target names on its result; the dims
    it leaves unsharded are left to the planner. JAX also inserts reshards on its own
    (to replicated, entering `auto_axes` regions, on literals): those name no axis and pin
    nothing.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> with jax.set_mesh(mesh):
        ...     eqn = jax.make_jaxpr(lambda x: jax.sharding.reshard(x, P("data")))(
        ...         jnp.ones((8, 4))).eqns[0]
        >>> reshard_annotation(eqn)
        ([None], [P('data', UNCONSTRAINED)])
    """
    target = eqn.params.get("dst_sharding")
    spec = getattr(target, "spec", target)
    if not isinstance(spec, PartitionSpec) or all(e is None for e in spec):
        return [None] * len(eqn.invars), [None] * len(eqn.outvars)
    return [None], [open_unnamed(spec, len(eqn.outvars[0].aval.shape))]


@register_boundary(primitive("debug_print"), primitive("debug_callback"))
def debug_boundary(eqn: JaxprEqn) -> tuple[list, list]:
    """`jax.debug.print`/`callback` read values and pin nothing; nothing propagates across.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: jax.debug.print("{}", x))(jnp.ones(2)).eqns[0]
        >>> debug_boundary(eqn)
        ([None], [])
    """
    return [None] * len(eqn.invars), [None] * len(eqn.outvars)
