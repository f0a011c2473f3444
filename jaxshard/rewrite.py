"""Rewrites of the traced jaxpr into equivalent equations that stay sharded.

Some pairs of equations that JAX emits compute what one equation computes, but only the
single equation can be partitioned without gathering: the gradient of an average
pooling is a zero pad with interior padding (the pooled gradient spread out, 2x + 1
rows) followed by a window sum. The padded intermediate has a size no mesh axis divides
(65 rows), so splitting it would need uneven shards, while the same sum read through a
base-dilated window (`lax.reduce_window` with ``base_dilation``) maps each shard of the
pooled gradient onto a shard of the result with no communication at all. Rewrites run
on the whole jaxpr, nested ones included, once, before the graph is built; the lowered
program runs the rewritten equations, which give the same numbers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, new_jaxpr_eqn
from jax.extend.core import primitives as p


def rewrite_closed(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with every zero pad that only feeds a window sum folded into it.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> pool = lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (2,), (2,), "VALID")
        >>> _, vjp = jax.vjp(pool, jnp.ones(8))
        >>> closed = jax.make_jaxpr(vjp)(jnp.ones(4))
        >>> [e.primitive.name for e in closed.eqns]
        ['pad', 'reduce_window_sum']
        >>> [(e.primitive.name, e.params["base_dilation"]) for e in rewrite_closed(closed).eqns]
        [('reduce_window_sum', (2,))]
    """
    return _rewrite_value(closed, {})


def _rewrite(jaxpr: Jaxpr, memo: dict) -> Jaxpr:
    eqns = [_rewrite_params(e, memo) for e in jaxpr.eqns]
    readers = Counter(v for e in eqns for v in e.invars if not isinstance(v, Literal))
    readers.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
    padded = {e.outvars[0]: e for e in eqns if _zero_pad(e)}
    out, dropped = [], set()
    for e in eqns:
        pad = padded.get(e.invars[0]) if e.primitive is p.reduce_window_sum_p else None
        if pad is not None and readers[e.invars[0]] == 1 and _unpadded_sum(e):
            e = _folded(pad, e)
            dropped.add(id(pad))
        out.append(e)
    out = [e for e in out if id(e) not in dropped]
    changed = len(out) != len(jaxpr.eqns) or any(a is not b for a, b in zip(out, jaxpr.eqns))
    return jaxpr.replace(eqns=out) if changed else jaxpr


def _rewrite_params(eqn: JaxprEqn, memo: dict) -> JaxprEqn:
    params, changed = {}, False
    for name, value in eqn.params.items():
        new = _rewrite_value(value, memo)
        changed |= new is not value
        params[name] = new
    return eqn.replace(params=params) if changed else eqn


def _rewrite_value(value: Any, memo: dict) -> Any:
    """``value`` rewritten where it is a jaxpr or holds some; a jaxpr several equations
    share (a function called twice) stays one object, rewritten once."""
    if isinstance(value, ClosedJaxpr | Jaxpr):
        done = memo.get(id(value))
        if done is None:
            # JAX 0.12 merged ClosedJaxpr into Jaxpr: a jaxpr is its own ``.jaxpr``
            if isinstance(value, ClosedJaxpr) and value.jaxpr is not value:
                inner = _rewrite_value(value.jaxpr, memo)
                done = value if inner is value.jaxpr else value.replace(jaxpr=inner)
            else:
                done = _rewrite(value, memo)
            memo[id(value)] = (value, done)  # the original kept alive: its id stays its own
            return done
        return done[1]
    if isinstance(value, tuple) and any(isinstance(v, ClosedJaxpr | Jaxpr) for v in value):
        new = tuple(_rewrite_value(v, memo) for v in value)
        return value if all(a is b for a, b in zip(new, value)) else new
    return value


def _zero_pad(eqn: JaxprEqn) -> bool:
    """A pad with a literal zero, adding rows (none cropped)."""
    if eqn.primitive is not p.pad_p or not isinstance(eqn.invars[1], Literal):
        return False
    value = eqn.invars[1].val
    return value == 0 and all(lo >= 0 and hi >= 0 for lo, hi, _ in eqn.params["padding_config"])


def _unpadded_sum(eqn: JaxprEqn) -> bool:
    params = eqn.params
    return all(tuple(pad) == (0, 0) for pad in params["padding"]) and all(
        d == 1 for d in params["base_dilation"]
    )


def _folded(pad: JaxprEqn, window: JaxprEqn) -> JaxprEqn:
    """One window sum reading the pad's operand through the pad's padding (its interior
    padding as base dilation)."""
    config = pad.params["padding_config"]
    params = dict(window.params)
    params["padding"] = tuple((int(lo), int(hi)) for lo, hi, _ in config)
    params["base_dilation"] = tuple(int(interior) + 1 for _, _, interior in config)
    return new_jaxpr_eqn(
        [pad.invars[0]], window.outvars, window.primitive, params, window.effects,
        window.source_info, window.ctx,
    )  # fmt: skip
