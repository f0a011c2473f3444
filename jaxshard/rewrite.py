"""Rewrites of the traced jaxpr into equivalent equations that stay sharded.

Some pairs of equations that JAX emits compute what one equation computes, but only the
single equation can be partitioned without gathering (the catalogue's example: the
gradient of an average pooling is a zero pad spreading the pooled gradient to 2x + 1
rows, which no mesh axis divides, then a window sum; one window sum over a base-dilated
input splits with no communication). The catalogue registers such *folds* per
primitive (`register_fold`): given an equation and the equation producing its first
operand, read by it alone, a fold returns the one equation computing both, or None.
Rewrites run on the whole jaxpr, nested ones included, once, before the graph is built;
the lowered program runs the rewritten equations, which give the same numbers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from jaxshard.errors import JaxshardBug
from jaxshard.jax_compat import platform_branch

Fold = Callable[[JaxprEqn, JaxprEqn], "JaxprEqn | None"]
_FOLDS: dict[Any, Fold] = {}


def register_fold(primitive: Any) -> Callable[[Fold], Fold]:
    """Register ``fold(producer, eqn)`` for equations of ``primitive``: the one
    equation computing ``eqn`` from the operands of ``producer`` (the equation producing
    ``eqn``'s first operand, which nothing else reads), or None to keep both. Each
    primitive has one fold: a second raises `JaxshardBug`.

    Example:
        >>> @register_fold(my_primitive)  # doctest: +SKIP
        ... def fold(producer, eqn):
        ...     return None
    """

    def add(fold: Fold) -> Fold:
        old = _FOLDS.get(primitive)
        name = lambda f: f"{f.__module__}.{f.__qualname__}"  # noqa: E731
        if old is not None and name(old) != name(fold):  # the same one again: a reload
            raise JaxshardBug(
                f"primitive {primitive.name!r} already has the fold {name(old)}; extend "
                f"it rather than registering {name(fold)} too"
            )
        _FOLDS[primitive] = fold
        return fold

    return add


def rewrite_closed(closed: ClosedJaxpr, platform: str | None = None) -> ClosedJaxpr:
    """``closed`` with every registered fold applied (`register_fold`), nested jaxprs
    included; with ``platform``, each platform-dependent `cond` replaced by a call of
    the branch JAX's lowering keeps for it (`jax_compat.platform_branch`).

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
    return _rewrite_value(closed, {}, platform)


def _rewrite(jaxpr: Jaxpr, memo: dict, platform: str | None) -> Jaxpr:
    eqns = [_rewrite_params(_for_platform(e, platform), memo, platform) for e in jaxpr.eqns]
    out = eqns
    if any(e.primitive in _FOLDS for e in eqns):  # most jaxprs have nothing to fold
        readers = Counter(v for e in eqns for v in e.invars if not isinstance(v, Literal))
        readers.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
        producer = {v: e for e in eqns for v in e.outvars}
        out, dropped = [], set()
        for e in eqns:
            fold = _FOLDS.get(e.primitive)
            first = e.invars[0] if fold is not None and e.invars else None
            made = None if first is None or isinstance(first, Literal) else producer.get(first)
            if made is not None and readers[first] == 1 and len(made.outvars) == 1:
                folded = fold(made, e)
                if folded is not None:
                    e = folded
                    dropped.add(id(made))
            out.append(e)
        out = [e for e in out if id(e) not in dropped]
    changed = len(out) != len(jaxpr.eqns) or any(a is not b for a, b in zip(out, jaxpr.eqns))
    return jaxpr.replace(eqns=out) if changed else jaxpr


def _for_platform(eqn: JaxprEqn, platform: str | None) -> JaxprEqn:
    if platform is None or eqn.primitive.name != "cond":
        return eqn
    return platform_branch(eqn, platform) or eqn


def _rewrite_params(eqn: JaxprEqn, memo: dict, platform: str | None) -> JaxprEqn:
    params, changed = {}, False
    for name, value in eqn.params.items():
        new = _rewrite_value(value, memo, platform)
        changed |= new is not value
        params[name] = new
    return eqn.replace(params=params) if changed else eqn


def _rewrite_value(value: Any, memo: dict, platform: str | None) -> Any:
    """``value`` rewritten where it is a jaxpr or holds some; a jaxpr several equations
    share (a function called twice) stays one object, rewritten once."""
    if isinstance(value, ClosedJaxpr | Jaxpr):
        done = memo.get(id(value))
        if done is None:
            # JAX 0.12 merged ClosedJaxpr into Jaxpr: a jaxpr is its own ``.jaxpr``
            if isinstance(value, ClosedJaxpr) and value.jaxpr is not value:
                inner = _rewrite_value(value.jaxpr, memo, platform)
                done = value if inner is value.jaxpr else value.replace(jaxpr=inner)
            else:
                done = _rewrite(value, memo, platform)
            memo[id(value)] = (value, done)  # the original kept alive: its id stays its own
            return done
        return done[1]
    if isinstance(value, tuple) and any(isinstance(v, ClosedJaxpr | Jaxpr) for v in value):
        new = tuple(_rewrite_value(v, memo, platform) for v in value)
        return value if all(a is b for a, b in zip(new, value)) else new
    return value
