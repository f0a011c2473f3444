"""User kernels: sharding rules written in `custom_partitioning`'s notation.

A Pallas kernel, an `ffi_call` or any block of ops is opaque to the rule catalogue.
`with_rule(rule)(fn)` wraps it so planning sees one equation (the `with_rule` primitive)
whose rule is the one given, in the notation `jax.experimental.custom_partitioning` uses
for Shardy (``"b q h d, b k h d -> b q h d"``, ``...`` for leading batch dims, ``(a b)`` a
compound dim, ``reduction_factors=``, ``need_replication_factors=``). The same
conversion reads the ``sharding_rule`` a `custom_partitioning` op carries
(`rules/custom.py`). Outside jaxshard the wrapped call runs its body unchanged; under
autodiff a `custom_vjp` keeps the body's own derivative (its custom VJP, if any) and the
rule covers the forward call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import (
    BATCHING,
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.extend.core import ClosedJaxpr, Var, jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

from jaxshard.errors import ShardingError
from jaxshard.jax_compat import (
    MultipleResultsPrimitive,
    batching,
    mlir,
    require_devices_while_lowering,
    shardy_enabled,
    str_to_sdy_sharding_rule,
)
from jaxshard.rule import Factor, FactorKind, Rule

RuleSpec = str | SdyShardingRule


def sdy_rule(
    rule: RuleSpec,
    *,
    reduction_factors: Sequence[str] = (),
    need_replication_factors: Sequence[str] = (),
    **factor_sizes: int,
) -> SdyShardingRule:
    """A `SdyShardingRule` from custom_partitioning's einsum-like string (or the rule itself).

    Example:
        >>> r = sdy_rule("i j, j k -> i k", reduction_factors=("j",))
        >>> r.reduction_factors
        ('j',)
    """
    if isinstance(rule, SdyShardingRule):
        if reduction_factors or need_replication_factors or factor_sizes:
            raise ShardingError(
                "factor kinds and sizes go into the SdyShardingRule itself when one is given"
            )
        return rule
    if not isinstance(rule, str):
        raise ShardingError(
            f"a sharding rule is a string like 'i j, j k -> i k' or an SdyShardingRule, "
            f"got {type(rule).__name__}"
        )
    try:
        return str_to_sdy_sharding_rule(
            rule,
            reduction_factors=tuple(reduction_factors),
            need_replication_factors=tuple(need_replication_factors),
            **factor_sizes,
        )
    except (ValueError, TypeError) as e:
        raise ShardingError(f"sharding rule {rule!r}: {e}") from None


def to_rule(
    sdy: SdyShardingRule,
    in_shapes: Sequence[Sequence[int]],
    out_shapes: Sequence[Sequence[int]],
    what: str,
    unresulted: FactorKind = FactorKind.NEED_REPLICATION,
) -> Rule:
    """The jaxshard `Rule` a `SdyShardingRule` means for these operand and result shapes.

    ``...`` expands to one factor per leading dim (shared by every value of its group);
    a dim of size 1 gets no factor (a broadcast dim, never sharded); a reduction factor
    combines by sum; a factor Shardy would permute needs replication (jaxshard never
    shards it). A factor that appears in no result without being declared a reduction
    is ``unresulted``: need-replication for `with_rule` (whose lowering sums only the
    declared reductions); a `custom_partitioning` op's own partition callback reduces it,
    as Shardy lets it, so there it is a reduction (an all-reduce of the results). A rule
    that does not fit the shapes raises `ShardingError` naming ``what``.

    Example:
        >>> r = sdy_rule("... i j, j k -> ... i k", reduction_factors=("j",))
        >>> print(to_rule(r, [(2, 4, 6), (6, 8)], [(2, 4, 8)], "matmul"))
        ([b0, i, j], [j, k])->([b0, i, k]) reduction={j} {b0=2, i=4, j=6, k=8}
    """
    mappings = tuple(sdy.operand_mappings) + tuple(sdy.result_mappings)
    shapes = [tuple(s) for s in in_shapes] + [tuple(s) for s in out_shapes]
    where = f"{what}: sharding rule {_rule_text(sdy)}"
    if len(sdy.operand_mappings) != len(in_shapes) or len(sdy.result_mappings) != len(out_shapes):
        raise ShardingError(
            f"{where} has {len(sdy.operand_mappings)} operands and {len(sdy.result_mappings)} "
            f"results; the call has {len(in_shapes)} and {len(out_shapes)} "
            f"(shapes {shapes[: len(in_shapes)]} -> {shapes[len(in_shapes) :]})"
        )
    sizes: dict[str, int] = dict(sdy.factor_sizes)
    expanded: list[list[tuple[str, ...]]] = []  # per value, per dim: factor names
    batch_rank: dict[str, int] = {}
    for i, (mapping, shape) in enumerate(zip(mappings, shapes)):
        value = list(mapping)
        group = None
        if value and isinstance(value[0], str) and value[0].startswith(BATCHING):
            group = value.pop(0)[1:] or "0"
        lead = len(shape) - len(value) if group is not None else 0
        if lead < 0 or (group is None and len(value) != len(shape)):
            raise ShardingError(
                f"{where}: {_value_name(i, len(in_shapes))} has rank {len(shape)} "
                f"(shape {shape}), the rule gives it {len(value)} dims"
            )
        if group is not None and batch_rank.setdefault(group, lead) != lead:
            raise ShardingError(
                f"{where}: '...' stands for {batch_rank[group]} and {lead} leading dims"
            )
        dims = [(f"b{group if group != '0' else ''}{j}",) for j in range(lead)]
        dims += [(d,) if isinstance(d, str) else tuple(d) for d in value]
        expanded.append(dims)
        for names, size in zip(dims, shape):
            if len(names) == 1 and size != 1:
                known = sizes.setdefault(names[0], size)
                if known != size:
                    raise ShardingError(
                        f"{where}: factor {names[0]!r} is {known} in one place and {size} in "
                        f"{_value_name(i, len(in_shapes))} (shape {shape})"
                    )
    order: list[str] = []
    for dims in expanded:
        for names in dims:
            order.extend(n for n in names if n not in order)
    missing = [n for n in order if n not in sizes]
    for n in missing:
        sizes[n] = 1  # only ever in size-1 dims
    in_results = {n for dims in expanded[len(in_shapes) :] for names in dims for n in names}
    factors = []
    for n in order:
        kind = FactorKind.PASS
        if n in sdy.reduction_factors:
            kind = FactorKind.REDUCTION
        elif n in sdy.need_replication_factors or n in sdy.permutation_factors:
            kind = FactorKind.NEED_REPLICATION
        elif n not in in_results:
            kind = unresulted
        factors.append(Factor(n, sizes[n], kind))
    index = {n: k for k, n in enumerate(order)}

    def convert(dims: list[tuple[str, ...]], shape: tuple[int, ...]):
        out = []
        for names, size in zip(dims, shape):
            if size == 1 and len(names) == 1:
                out.append(())
            else:
                out.append(tuple(index[n] for n in names))
        return tuple(out)

    values = [convert(d, s) for d, s in zip(expanded, shapes)]
    rule = Rule(tuple(factors), tuple(values[: len(in_shapes)]), tuple(values[len(in_shapes) :]))
    try:
        rule.check(in_shapes, out_shapes, what)
    except Exception as e:  # noqa: BLE001 - a user's rule: their error, with the fix
        raise ShardingError(
            f"{where} does not fit the call's shapes {shapes[: len(in_shapes)]} -> "
            f"{shapes[len(in_shapes) :]} ({e}); give the sizes of compound-dim factors "
            "as keyword arguments (a=2)"
        ) from None
    return rule


def _value_name(i: int, n_in: int) -> str:
    return f"operand {i}" if i < n_in else f"result {i - n_in}"


def _rule_text(sdy: SdyShardingRule) -> str:
    def value(m) -> str:
        parts = []
        for d in m:
            if isinstance(d, str):
                parts.append("..." + (d[1:] if d[1:] != "0" else "") if d[0] == BATCHING else d)
            else:
                parts.append("(" + " ".join(d) + ")")
        return " ".join(parts)

    text = ", ".join(map(value, sdy.operand_mappings)) + " -> "
    text += ", ".join(map(value, sdy.result_mappings))
    extra = [f"reduction_factors={sdy.reduction_factors}"] if sdy.reduction_factors else []
    if sdy.need_replication_factors:
        extra.append(f"need_replication_factors={sdy.need_replication_factors}")
    return repr(text) + (f" ({', '.join(extra)})" if extra else "")


# --- the with_rule primitive ----------------------------------------------------------

with_rule_p = MultipleResultsPrimitive("with_rule")
with_rule_p.multiple_results = True


def _impl(*args, jaxpr: ClosedJaxpr, rule: SdyShardingRule, n_ruled: int, name: str, fn):
    return jaxpr_as_fun(jaxpr)(*args)


def _abstract_eval(*avals, jaxpr: ClosedJaxpr, rule, n_ruled, name, fn):
    return jaxpr.out_avals, jaxpr.effects


def _batch(args, dims, *, jaxpr, rule, n_ruled, name, fn):
    # under vmap the rule no longer fits the batched shapes: run the body, unwrapped
    outs = jax.vmap(jaxpr_as_fun(jaxpr), in_axes=dims)(*args)
    return outs, [0] * len(outs)


def call_rule(params: dict, in_shapes, out_shapes) -> Rule:
    """The rule of a `with_rule` equation: the user's rule over its first operands and
    results, extended over the constants the body captured (trailing operands) and the
    values it saves for the backward pass (trailing results). One of those that is a
    ruled operand or result of the body keeps its factors. The dims of any other saved
    value are found by tracing the body (shapes only) with each pass-through factor's
    dims halved: a dim that halves with exactly one factor carries it, a dim that never
    changes is replicated; a factor that changes a saved value any other way, and every
    reduction factor (a shard's saved values would be partial), need replication here.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(with_rule("b d -> b d")(jnp.tanh))(jnp.ones((4, 2)))
        >>> inner = eqn.eqns[0].params["call_jaxpr"].eqns[0]
        >>> print(call_rule(inner.params, [(4, 2)], [(4, 2)]))
        ([b, d])->([b, d]) {b=4, d=2}
    """
    sdy, n_ruled = params["rule"], params["n_ruled"]
    n_ops = len(sdy.operand_mappings)
    base = to_rule(sdy, in_shapes[:n_ops], out_shapes[:n_ruled], f"with_rule({params['name']})")
    if n_ops == len(in_shapes) and n_ruled == len(out_shapes):
        return base
    inner = params["jaxpr"].jaxpr
    known = dict(zip(inner.invars, base.operands))
    known.update((v, d) for v, d in zip(inner.outvars, base.results) if isinstance(v, Var))
    saved = [
        j
        for j, v in enumerate(inner.outvars[n_ruled:], n_ruled)
        if not (isinstance(v, Var) and v in known)
    ]
    carried, demoted = ({}, set()) if not saved else _probe(params, base, n_ops, saved)
    factors = [
        Factor(f.name, f.size, FactorKind.NEED_REPLICATION) if i in demoted else f
        for i, f in enumerate(base.factors)
    ]

    def dims_for(var, shape, carries=None) -> tuple:
        if isinstance(var, Var) and var in known:
            return known[var]
        dims = []
        for d, size in enumerate(shape):
            if carries is not None and carries[d] is not None:
                dims.append((carries[d],))
            elif size == 1:
                dims.append(())
            else:
                factors.append(Factor(f"r{len(factors)}", size, FactorKind.NEED_REPLICATION))
                dims.append((len(factors) - 1,))
        return tuple(dims)

    operands = base.operands + tuple(
        dims_for(v, s) for v, s in zip(inner.invars[n_ops:], in_shapes[n_ops:])
    )
    results = base.results + tuple(
        dims_for(v, out_shapes[j], carried.get(j))
        for j, v in enumerate(inner.outvars[n_ruled:], n_ruled)
    )
    return Rule(tuple(factors), operands, results)


def _probe(params: dict, base: Rule, n_ops: int, saved: list[int]):
    """Which factor each dim of the saved values carries: ``({result: [factor or None per
    dim]}, factors that must not be sharded)``. A body that captured values cannot be
    traced again; it is lowered in place, and its saved values are planned replicated."""
    avals = params["jaxpr"].in_avals
    outs = params["jaxpr"].out_avals
    if len(avals) != n_ops:  # such a call is lowered in place, where any layout is right
        return {}, set()
    carried = {j: [None] * len(outs[j].shape) for j in saved}
    demoted = {i for i, f in enumerate(base.factors) if f.kind is FactorKind.REDUCTION}
    for f, factor in enumerate(base.factors):
        in_compound = any(
            f in d and sum(base.factors[g].size > 1 for g in d) > 1
            for t in base.operands + base.results
            for d in t
        )
        if factor.kind is not FactorKind.PASS or factor.size == 1 or in_compound:
            continue  # a factor sharing a dim is never split by the lowering
        if factor.size % 2:
            demoted.add(f)
            continue
        shapes = []
        for dims, aval in zip(base.operands, avals):
            shape = list(aval.shape)
            for d, names in enumerate(dims):
                if f in names:
                    shape[d] //= 2  # f is the whole dim or leads it: splitting halves the dim
            shapes.append(jax.ShapeDtypeStruct(tuple(shape), aval.dtype))
        try:
            probed = jax.tree_util.tree_leaves(jax.eval_shape(params["fn"], *shapes))
        except Exception:  # noqa: BLE001 - the body cannot run on halves: never split f
            demoted.add(f)
            continue
        for j in saved:
            for d, (full, half) in enumerate(zip(outs[j].shape, probed[j].shape)):
                if full == half:
                    continue
                if half * 2 == full and carried[j][d] is None:
                    carried[j][d] = f
                else:
                    demoted.add(f)
    return carried, demoted


def to_sdy(rule: Rule) -> SdyShardingRule:
    """The `SdyShardingRule` of a jaxshard rule, for Shardy (factor names ``f0, f1, ...``).

    Example:
        >>> rule = to_rule(sdy_rule("m k, k n -> m n", reduction_factors=("k",)),
        ...                [(2, 4), (4, 6)], [(2, 6)], "matmul")
        >>> print(to_sdy(rule))
        SdyShardingRule((('f0', 'f1'), ('f1', 'f2')), (('f0', 'f2'),), {} reduction_factors=('f1',))
    """
    whole = {d[0] for t in rule.operands + rule.results for d in t if len(d) == 1}
    fresh = iter(range(len(rule.factors), 10**9))

    def mapping(dims) -> ArrayMapping:
        out = []
        for d in dims:
            if not d:
                out.append(f"f{next(fresh)}")  # a size-1 dim: a factor of its own
            elif len(d) == 1:
                out.append(f"f{d[0]}")
            else:
                out.append(CompoundFactor(*(f"f{f}" for f in d)))
        return ArrayMapping(*out)

    kinds = {
        k: tuple(f"f{i}" for i, f in enumerate(rule.factors) if f.kind is k) for k in FactorKind
    }
    return SdyShardingRule(
        tuple(mapping(t) for t in rule.operands),
        tuple(mapping(t) for t in rule.results),
        reduction_factors=kinds[FactorKind.REDUCTION],
        need_replication_factors=kinds[FactorKind.NEED_REPLICATION],
        **{f"f{i}": f.size for i, f in enumerate(rule.factors) if i not in whole},
    )


def partition_by_rule(rule: Rule, body: Callable) -> Callable:
    """A `custom_partitioning` partition callback that runs ``body`` on each device's
    shards as ``rule`` says: every factor keeps the mesh axes an operand gives it, a
    factor that needs replication (or shares a dim with another factor) is gathered, and
    results are summed over the axes of sharded reduction factors.
    """

    # a factor that shares a dim with another is never split: no spec splits a minor one
    shared = {
        f
        for t in rule.operands + rule.results
        for d in t
        if sum(rule.factors[g].size > 1 for g in d) > 1
        for f in d
    }

    def partition(mesh, arg_shapes, result_shape):
        specs = [getattr(a.sharding, "spec", None) for a in arg_shapes]
        axes_of: dict[int, tuple[str, ...]] = {}
        used: set[str] = set()
        for dims, spec in zip(rule.operands, specs):
            for d, factors in enumerate(dims if spec is not None else ()):
                entry = spec[d] if d < len(spec) else None
                axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
                lead = [f for f in factors if rule.factors[f].size > 1]
                if not axes or len(lead) != 1 or lead[0] in axes_of or lead[0] in shared:
                    continue
                if used & set(axes):
                    continue
                factor = rule.factors[lead[0]]
                n = math.prod(mesh.shape[a] for a in axes)
                if factor.kind is not FactorKind.NEED_REPLICATION and factor.size % n == 0:
                    axes_of[lead[0]] = axes
                    used.update(axes)

        def sharding(dims) -> NamedSharding:
            entries = []
            for factors in dims:
                lead = [f for f in factors if rule.factors[f].size > 1]
                axes = axes_of.get(lead[0]) if len(lead) == 1 else None
                entries.append(axes if axes is None or len(axes) > 1 else axes[0])
            return NamedSharding(mesh, PartitionSpec(*entries))

        reduced = tuple(
            a for f, axes in axes_of.items() if rule.factors[f].kind is FactorKind.REDUCTION
            for a in axes
        )  # fmt: skip

        def lower_fn(*args):
            outs = body(*args)
            return [jax.lax.psum(o, reduced) for o in outs] if reduced else list(outs)

        return (
            mesh,
            lower_fn,
            [sharding(d) for d in rule.results],
            tuple(sharding(d) for d in rule.operands),
        )

    return partition


def _lower(ctx, *args, jaxpr: ClosedJaxpr, rule, n_ruled, name, fn):
    """Lower as a `custom_partitioning` op with the rule, so XLA partitions the call the
    way the plan assumes: the function is traced again at each device's shard shapes
    and runs there, a kernel included. With Shardy off, or when the body captured
    traced values (which cannot be traced again), the body is lowered in place."""
    params = dict(jaxpr=jaxpr, rule=rule, n_ruled=n_ruled, name=name, fn=fn)
    if not shardy_enabled() or len(args) != len(rule.operand_mappings):
        return mlir.lower_fun(_impl, multiple_results=True)(ctx, *args, **params)
    shapes = [tuple(a.shape) for a in ctx.avals_in], [tuple(a.shape) for a in ctx.avals_out]
    full = call_rule(params, *shapes)

    def local(*a):
        return jax.tree_util.tree_leaves(fn(*a))

    call = custom_partitioning(local)
    call.def_partition(partition=partition_by_rule(full, local), sharding_rule=to_sdy(full))
    return mlir.lower_fun(lambda *a: call(*a), multiple_results=True)(ctx, *args)


with_rule_p.def_impl(_impl)
with_rule_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(with_rule_p, _lower)
batching.primitive_batchers[with_rule_p] = _batch
# its lowering is a custom_partitioning op, which needs the devices while lowering
require_devices_while_lowering(with_rule_p)


def _bind(fn: Callable, rule: SdyShardingRule, name: str, n_ruled_of: Callable, args):
    """Trace ``fn`` on ``args`` (flat arrays) and bind one `with_rule` equation."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    # captured constants become trailing operands, so the equation is self-contained
    inner = closed.jaxpr
    if closed.consts:
        inner = inner.replace(invars=[*inner.invars, *inner.constvars], constvars=[])
    flat = with_rule_p.bind(
        *args,
        *closed.consts,
        jaxpr=ClosedJaxpr(inner, ()),
        rule=rule,
        n_ruled=n_ruled_of(out_shape),
        name=name,
        fn=fn,
    )
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flat)


def with_rule(
    rule: RuleSpec,
    *,
    reduction_factors: Sequence[str] = (),
    need_replication_factors: Sequence[str] = (),
    **factor_sizes: int,
) -> Callable[[Callable], Callable]:
    """Let planning treat every call of a function as one equation with ``rule``.

    The rule is written as for `jax.experimental.custom_partitioning`'s
    ``sharding_rule``: one space-separated list of factor names per operand (the
    function's array arguments, flattened in order), ``->``, one per result. A factor
    in an operand and a result passes through (sharding it needs no communication); a
    factor in ``reduction_factors`` is contracted (sharding it leaves the results a
    partial sum); a factor in ``need_replication_factors`` is never sharded. ``...``
    stands for leading batch dims, ``(a b)`` for a dim that is two factors (give the
    minor ones' sizes as keyword arguments). Outside jaxshard the function runs
    unchanged. Under `jax.grad` the function's own derivative is used (its custom VJP,
    if it has one); the rule covers the forward call, and the backward ops are planned
    by their own rules: wrap a backward kernel with `with_rule` too. Values saved for
    the backward pass get their factors as `call_rule` says.
    Check a rule by execution with `check_rule`.

    Example:
        >>> import jax.numpy as jnp
        >>> matmul = with_rule("i j, j k -> i k", reduction_factors=("j",))(jnp.matmul)
        >>> matmul(jnp.ones((2, 3)), jnp.ones((3, 4))).shape
        (2, 4)
    """
    sdy = sdy_rule(
        rule,
        reduction_factors=reduction_factors,
        need_replication_factors=need_replication_factors,
        **factor_sizes,
    )

    def wrap(fn: Callable) -> Callable:
        name = getattr(fn, "__name__", type(fn).__name__)
        n_outs = lambda out_shape: len(jax.tree_util.tree_leaves(out_shape))  # noqa: E731

        def primal(*flat):
            return _bind(lambda *a: fn(*a), sdy, name, n_outs, flat)

        call = jax.custom_vjp(primal)

        def fwd(*flat):
            tree: list[Any] = []  # this call's pullback structure, found while tracing

            def with_residuals(*a):
                out, vjp_fn = jax.vjp(fn, *a)
                residuals, treedef = jax.tree_util.tree_flatten(vjp_fn)
                tree[:] = [treedef]
                return out, residuals

            out, residuals = _bind(with_residuals, sdy, name, lambda s: n_outs(s[0]), flat)
            # the pullback itself is the residual: a pytree of the saved arrays
            return out, jax.tree_util.tree_unflatten(tree[0], residuals)

        def bwd(vjp_fn, cotangent):
            return tuple(vjp_fn(cotangent))

        call.defvjp(fwd, bwd)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            flat, tree = jax.tree_util.tree_flatten(args)
            if kwargs or tree != jax.tree_util.tree_structure(tuple(flat)):
                raise ShardingError(
                    f"with_rule({name}): pass the array arguments positionally, one array "
                    f"each (got {tree}{' and keywords' if kwargs else ''}): the rule names "
                    "one operand per array; bind other arguments with functools.partial"
                )
            return call(*flat)

        return wrapped

    return wrap
