"""Shape primitives: broadcasts, reshapes, transposes, squeezes, iota, slicing and joins.

`reshape` is a factorization with compound dims: ``(6,12,24,48)->(72,24,6,8)`` is
``([a, b, c, de]) -> ([ab], [c], [d], [e])``, so "only the major factor of a merged dim
may carry the sharding" falls out of the engine. A sliced, padded or reversed dim (a
dynamic slice's at a constant offset too) is a windowed factor (`jaxshard.rule.Window`):
it stays split where each shard needs at most its neighbours' rows, which XLA sends with
collective-permutes. A concatenated dim, or one sliced or updated at a traced offset, is
need-replication.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from jax.extend.core import JaxprEqn, Literal
from jax.extend.core import primitives as p

from jaxshard.rule import (
    FactorKind,
    Rule,
    RuleBuilder,
    Window,
    primitive,
    register_rule,
    shapes_of,
)

NEED = FactorKind.NEED_REPLICATION


@register_rule(p.broadcast_in_dim_p)
def broadcast_in_dim_rule(eqn: JaxprEqn) -> Rule:
    """Operand dims map to ``broadcast_dimensions``; new and size-1-expanded dims are fresh.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: jnp.broadcast_to(x, (4, 8)))(jnp.ones(8)).eqns[0]
        >>> print(broadcast_in_dim_rule(eqn))
        ([b])->([a, b]) {a=4, b=8}
    """
    (in_shape,), (out_shape,) = shapes_of(eqn.invars[:1]), shapes_of(eqn.outvars)
    source = {d: i for i, d in enumerate(eqn.params["broadcast_dimensions"])}
    b = RuleBuilder(
        len(eqn.invars), 1, ([len(in_shape)] + [0] * (len(eqn.invars) - 1), [len(out_shape)])
    )
    for d, size in enumerate(out_shape):
        i = source.get(d)
        shared = i is not None and in_shape[i] == size and size != 1
        b.add_factor({0: i} if shared else {}, {0: d}, size)
    return b.build()


def reshape_builder(in_shape, out_shape) -> RuleBuilder:
    """Factor a reshape: shared factors where the shapes align, need-replication otherwise.

    Example:
        >>> print(reshape_builder((6, 12, 24, 48), (72, 24, 6, 8)).build())
        ([a, b, c, de])->([ab, c, d, e]) {a=6, b=12, c=24, d=6, e=8}
    """
    b = RuleBuilder(1, 1, ([len(in_shape)], [len(out_shape)]))
    if 0 in in_shape or 0 in out_shape:
        for d, s in enumerate(in_shape):
            b.add_factor({0: d}, {}, s, NEED)
        for d, s in enumerate(out_shape):
            b.add_factor({}, {0: d}, s, NEED)
        return b
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    i = j = 0
    ri = in_shape[ins[0]] if ins else 1
    rj = out_shape[outs[0]] if outs else 1
    while i < len(ins) and j < len(outs):
        g = math.gcd(ri, rj)
        if g > 1:
            b.add_factor({0: ins[i]}, {0: outs[j]}, g)
            ri, rj = ri // g, rj // g
        else:  # entangled dims: no factor is shared until the products meet again
            pi, pj = ri, rj
            b.add_factor({0: ins[i]}, {}, ri, NEED)
            b.add_factor({}, {0: outs[j]}, rj, NEED)
            while pi != pj:
                if pi < pj:
                    i += 1
                    pi *= in_shape[ins[i]]
                    b.add_factor({0: ins[i]}, {}, in_shape[ins[i]], NEED)
                else:
                    j += 1
                    pj *= out_shape[outs[j]]
                    b.add_factor({}, {0: outs[j]}, out_shape[outs[j]], NEED)
            ri = rj = 1
        if ri == 1:
            i += 1
            ri = in_shape[ins[i]] if i < len(ins) else 1
        if rj == 1:
            j += 1
            rj = out_shape[outs[j]] if j < len(outs) else 1
    return b


@register_rule(p.reshape_p)
def reshape_rule(eqn: JaxprEqn) -> Rule:
    """See `reshape_builder`."""
    (in_shape, *_), (out_shape,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    return reshape_builder(in_shape, out_shape).build()


@register_rule(p.transpose_p)
def transpose_rule(eqn: JaxprEqn) -> Rule:
    """Result dim j is operand dim ``permutation[j]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: x.T)(jnp.ones((4, 8))).eqns[0]
        >>> print(transpose_rule(eqn))
        ([a, b])->([b, a]) {a=4, b=8}
    """
    (in_shape,) = shapes_of(eqn.invars)
    perm = eqn.params["permutation"]
    b = RuleBuilder(1, 1, ([len(in_shape)], [len(perm)]))
    out_of = {d: j for j, d in enumerate(perm)}
    for d, size in enumerate(in_shape):
        b.add_factor({0: d}, {0: out_of[d]}, size)
    return b.build()


@register_rule(p.squeeze_p)
def squeeze_rule(eqn: JaxprEqn) -> Rule:
    """Removed dims have size 1 and no factor; the rest pass through in order."""
    (in_shape,), (out_shape,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    removed = {d % len(in_shape) for d in eqn.params["dimensions"]}
    b = RuleBuilder(1, 1, ([len(in_shape)], [len(out_shape)]))
    kept = [d for d in range(len(in_shape)) if d not in removed]
    for j, d in enumerate(kept):
        b.add_factor({0: d}, {0: j}, in_shape[d])
    return b.build()


@register_rule(p.iota_p)
def iota_rule(eqn: JaxprEqn) -> Rule:
    """No operands: each result dim is a fresh factor (any slice of an iota is local)."""
    (out_shape,) = shapes_of(eqn.outvars)
    b = RuleBuilder(len(eqn.invars), 1, ([0] * len(eqn.invars), [len(out_shape)]))
    for d, size in enumerate(out_shape):
        b.add_factor({}, {0: d}, size)
    return b.build()


def aligned_rule(
    eqn: JaxprEqn,
    changed: set[int] = frozenset(),
    windows: Mapping[int, Window] = {},  # noqa: B006 - read only
) -> Rule:
    """Same-rank operands and results: dim d is shared where every tensor has the same size
    and d is not in ``changed``; a dim of ``windows`` is one windowed factor shared by
    every tensor (a halo exchange when split, see `jaxshard.rule.Window`); any other dim
    is need-replication per tensor. Rank-0 operands (start indices, padding values) take
    part in nothing.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: x[:, 1:3])(jnp.ones((4, 8))).eqns[0]
        >>> print(aligned_rule(eqn))
        ([a, b])->([a, c]) need_replication={b, c} {a=4, b=8, c=2}
    """
    ins, outs = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    rank = len(outs[0])
    b = RuleBuilder(len(ins), len(outs), ([len(s) for s in ins], [len(s) for s in outs]))
    for d in range(rank):
        tensors = [("in", i, s) for i, s in enumerate(ins) if len(s) == rank and rank]
        tensors += [("out", i, s) for i, s in enumerate(outs)]
        sizes = {s[d] for _, _, s in tensors}
        if d in windows:
            b.add_factor(
                {i: d for k, i, _ in tensors if k == "in"},
                {i: d for k, i, _ in tensors if k == "out"},
                window=windows[d],
            )
            continue
        if len(sizes) == 1 and d not in changed:
            b.add_factor(
                {i: d for k, i, _ in tensors if k == "in"},
                {i: d for k, i, _ in tensors if k == "out"},
                sizes.pop(),
            )
            continue
        for kind, i, s in tensors:
            where = {i: d}
            b.add_factor(where if kind == "in" else {}, where if kind == "out" else {}, s[d], NEED)
    return b.build()


register_rule(p.concatenate_p, primitive("split"))(aligned_rule)


def _constant_starts(eqn: JaxprEqn, first: int) -> list[int | None]:
    """Each start index operand from ``first`` on: its value when a literal, else None."""
    return [
        int(v.val) if isinstance(v, Literal) and np.ndim(v.val) == 0 else None
        for v in eqn.invars[first:]
    ]


@register_rule(p.dynamic_slice_p)
def dynamic_slice_rule(eqn: JaxprEqn) -> Rule:
    """A dim sliced at a constant start is a slice's window (`slice_rule`); at a traced
    start it is need-replication (which rows is known only at run time).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x: jax.lax.dynamic_slice(x, (2, 0), (2, 8))
        >>> print(dynamic_slice_rule(jax.make_jaxpr(f)(jnp.ones((4, 8))).eqns[0]))
        ([a, b], [], [])->([a, b]) window={a} {a=2, b=8}
    """
    (shape, *_), (out,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    starts = _constant_starts(eqn, 1)
    sliced = {d for d in range(len(shape)) if out[d] != shape[d]}
    windows = {d: Window(shape[d], out[d], low=-starts[d]) for d in sliced if starts[d] is not None}
    return aligned_rule(eqn, sliced - set(windows), windows)


@register_rule(p.dynamic_update_slice_p)
def dynamic_update_slice_rule(eqn: JaxprEqn) -> Rule:
    """A dim the update covers in part: the operand's and the result's rows are one
    factor, the update's its own, need-replication. Written at a constant start, the
    shared factor is a window written there (`Window.written`): split so that the
    update's rows fall in one shard, that shard writes them and the others pass through;
    split across them, XLA gathers the dim. At a traced start it is need-replication too.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x, u: jax.lax.dynamic_update_slice(x, u, (2, 0))
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((2, 8))).eqns[0]
        >>> print(dynamic_update_slice_rule(eqn))
        ([a, c], [b, c], [], [])->([a, c]) need_replication={b} window={a} {a=4, b=2, c=8}
    """
    (shape, update, *_), (out,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    starts = _constant_starts(eqn, 2)
    b = RuleBuilder(len(eqn.invars), 1, ([len(s) for s in shapes_of(eqn.invars)], [len(out)]))
    for d, size in enumerate(shape):
        if update[d] == size:
            b.add_factor({0: d, 1: d}, {0: d}, size)
            continue
        if starts[d] is None:
            b.add_factor({0: d}, {0: d}, size, NEED)
        else:
            start = min(max(starts[d], 0), size - update[d])  # XLA clamps the start
            b.add_factor({0: d}, {0: d}, window=Window(size, size, written=(start, update[d])))
        b.add_factor({1: d}, {}, update[d], NEED)
    return b.build()


@register_rule(p.slice_p)
def slice_rule(eqn: JaxprEqn) -> Rule:
    """A sliced dim is a window of extent 1 read from ``start`` every ``stride`` rows:
    split, each shard's rows come from its own shard and at most its neighbours' (XLA
    sends them with collective-permutes), or else the dim is gathered.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: x[:, 1:7])(jnp.ones((4, 8))).eqns[0]
        >>> print(slice_rule(eqn))
        ([a, b])->([a, b]) window={b} {a=4, b=2}
    """
    (shape,) = shapes_of(eqn.invars)
    (out,) = shapes_of(eqn.outvars)
    strides = eqn.params["strides"] or (1,) * len(shape)
    starts = eqn.params["start_indices"]
    windows = {
        d: Window(shape[d], out[d], stride=strides[d], low=-starts[d])
        for d in range(len(shape))
        if out[d] != shape[d]
    }
    return aligned_rule(eqn, windows=windows)


@register_rule(p.pad_p)
def pad_rule(eqn: JaxprEqn) -> Rule:
    """A padded dim is a window of extent 1 over the operand dilated by its interior
    padding, ``low`` rows before it (negative: cropped): split, a shard's rows come from
    its own shard and its neighbours' (a shift moves one row across each boundary, an
    edge padding moves none on two devices), or else the dim is gathered.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> pad = lambda x: jax.lax.pad(x, 0.0, ((0, 0, 0), (1, 1, 0)))
        >>> eqn = jax.make_jaxpr(pad)(jnp.ones((4, 8))).eqns[0]
        >>> print(pad_rule(eqn))
        ([a, b], [])->([a, b]) window={b} {a=4, b=2}
    """
    (shape, _), (out,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    windows = {
        d: Window(shape[d], out[d], low=low, base_dilation=interior + 1)
        for d, (low, _, interior) in enumerate(eqn.params["padding_config"])
        if (low, interior) != (0, 0) or out[d] != shape[d]
    }
    return aligned_rule(eqn, windows=windows)


@register_rule(p.rev_p)
def rev_rule(eqn: JaxprEqn) -> Rule:
    """A reversed dim is windowed: split, each shard's rows live reversed on the mirror
    device (one collective-permute of the whole shard).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: x[::-1])(jnp.ones((4, 8))).eqns[0]
        >>> print(rev_rule(eqn))
        ([a, b])->([a, b]) window={a} {a=4, b=8}
    """
    (shape,) = shapes_of(eqn.invars)
    windows = {d: Window(shape[d], shape[d], reverse=True) for d in eqn.params["dimensions"]}
    return aligned_rule(eqn, windows=windows)


@register_rule(primitive("stack"))
def stack_rule(eqn: JaxprEqn) -> Rule:
    """Every operand's dims pass through to the result's dims around ``axis``; the new
    ``axis`` dim (one slice per operand) is need-replication: XLA lowers a stack to a
    concatenate, and splitting the concatenated dim compiles to an all-to-all even when
    every operand is replicated (measured by the rule execution test).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda a, b: jnp.stack([a, b], axis=1)
        >>> print(stack_rule(jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((4, 8))).eqns[0]))
        ([a, c], [a, c])->([a, b, c]) need_replication={b} {a=4, b=2, c=8}
    """
    ins, (out,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    axis = eqn.params["axis"]
    b = RuleBuilder(len(ins), 1, ([len(s) for s in ins], [len(out)]))
    for d, size in enumerate(out):
        if d == axis:
            b.add_factor({}, {0: d}, size, NEED)
        else:
            b.add_factor(dict.fromkeys(range(len(ins)), d - (d > axis)), {0: d}, size)
    return b.build()


@register_rule(primitive("unstack"))
def unstack_rule(eqn: JaxprEqn) -> Rule:
    """The operand's other dims pass through to every result; the unstacked ``axis`` is
    need-replication (result i is slice i, which lives on one device if it is split).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x: jnp.unstack(x, axis=0)
        >>> print(unstack_rule(jax.make_jaxpr(f)(jnp.ones((2, 8))).eqns[0]))
        ([a, b])->([b], [b]) need_replication={a} {a=2, b=8}
    """
    (shape,), outs = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    axis = eqn.params["axis"]
    b = RuleBuilder(1, len(outs), ([len(shape)], [len(s) for s in outs]))
    every = range(len(outs))
    for d, size in enumerate(shape):
        if d == axis:
            b.add_factor({0: d}, {}, size, NEED)
        else:
            b.add_factor({0: d}, dict.fromkeys(every, d - (d > axis)), size)
    return b.build()


@register_rule(primitive("tile"))
def tile_rule(eqn: JaxprEqn) -> Rule:
    """Result dim d is ``reps[d]`` copies of operand dim d, copy-major: ``[r, a]`` with
    ``r`` a result-only factor (whole copies are local) and ``a`` the operand's, which
    may carry a sharding only where ``reps[d]`` is 1.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: jnp.tile(x, (2, 1)))(jnp.ones((4, 8))).eqns[0]
        >>> print(tile_rule(eqn))
        ([b, c])->([ab, c]) {a=2, b=4, c=8}
    """
    (shape,), (out,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    b = RuleBuilder(1, 1, ([len(shape)], [len(out)]))
    for d, (size, reps) in enumerate(zip(shape, eqn.params["reps"])):
        if reps != 1:
            b.add_factor({}, {0: d}, reps)
        b.add_factor({0: d}, {0: d}, size)
    return b.build()
