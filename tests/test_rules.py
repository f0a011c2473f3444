"""Rule strings of the catalogue, one case per primitive pattern (Shardy-style printing)."""

import jax
import jax.numpy as jnp
import jaxshard.rules  # noqa: F401 - registers the catalogue
import pytest

from jaxshard.rule import rule_fn_for

x8x4 = jnp.ones((8, 4))


def _eqn(fn, *args, prim=None):
    eqns = jax.make_jaxpr(fn)(*args).eqns
    return next(e for e in reversed(eqns) if prim is None or e.primitive.name == prim)


CASES = [
    (
        "matmul",
        lambda a, b: a @ b,
        (x8x4, jnp.ones((4, 16))),
        "dot_general",
        "([a, c], [c, b])->([a, b]) reduction={c} {a=8, b=16, c=4}",
    ),
    (
        "batched-einsum",
        lambda a, b: jnp.einsum("bsd,bde->bse", a, b),
        (jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))),
        "dot_general",
        "([a, b, d], [a, d, c])->([a, b, c]) reduction={d} {a=2, b=3, c=5, d=4}",
    ),
    ("scalar-mul", lambda a: a * 2.0, (x8x4,), "mul", "([a, b], [])->([a, b]) {a=8, b=4}"),
    (
        "broadcast-size1",
        lambda a, b: a + b,
        (x8x4, jnp.ones((1, 4))),
        "add",
        "([a, b], [1, b])->([a, b]) {a=8, b=4}",
    ),
    (
        "reduce-sum",
        lambda a: a.sum(0),
        (x8x4,),
        "reduce_sum",
        "([a, b])->([b]) reduction={a} {a=8, b=4}",
    ),
    (
        "reduce-max",
        lambda a: a.max(1),
        (x8x4,),
        "reduce_max",
        "([a, b])->([a]) reduction={b:max} {a=8, b=4}",
    ),
    (
        "argmax",
        lambda a: a.argmax(1),
        (x8x4,),
        "argmax",
        "([a, b])->([a]) need_replication={b} {a=8, b=4}",
    ),
    ("transpose", lambda a: a.T, (x8x4,), "transpose", "([a, b])->([b, a]) {a=8, b=4}"),
    (
        "broadcast-in-dim",
        lambda a: jnp.broadcast_to(a, (3, 8, 4)),
        (x8x4,),
        "broadcast_in_dim",
        "([b, c])->([a, b, c]) {a=3, b=8, c=4}",
    ),
    ("reshape-merge", lambda a: a.reshape(32), (x8x4,), "reshape", "([a, b])->([ab]) {a=8, b=4}"),
    (
        "reshape-split",
        lambda a: a.reshape(2, 4, 4),
        (x8x4,),
        "reshape",
        "([ab, c])->([a, b, c]) {a=2, b=4, c=4}",
    ),
    (
        "reshape-general",
        lambda a: a.reshape(72, 24, 6, 8),
        (jnp.ones((6, 12, 24, 48)),),
        "reshape",
        "([a, b, c, de])->([ab, c, d, e]) {a=6, b=12, c=24, d=6, e=8}",
    ),
    (
        "reshape-singleton-insert",
        lambda a: a.reshape(8, 1, 4),
        (x8x4,),
        "reshape",
        "([a, b])->([a, 1, b]) {a=8, b=4}",
    ),
    (
        "reshape-singleton-remove",
        lambda a: a.reshape(8, 4),
        (jnp.ones((8, 1, 4)),),
        "reshape",
        "([a, 1, b])->([a, b]) {a=8, b=4}",
    ),
    (
        "reshape-entangled",
        lambda a: a.reshape(4, 6),
        (jnp.ones((6, 4)),),
        "reshape",
        "([ab, e])->([ac, d]) need_replication={b, c, d, e} {a=2, b=3, c=2, d=6, e=4}",
    ),
    (
        "squeeze",
        lambda a: a.squeeze(1),
        (jnp.ones((8, 1, 4)),),
        "squeeze",
        "([a, 1, b])->([a, b]) {a=8, b=4}",
    ),
    ("iota", lambda: jnp.arange(8), (), "iota", "()->([a]) {a=8}"),
    (
        "select",
        lambda c, a: jax.lax.select(c, a, a),
        (x8x4 > 0, x8x4),
        "select_n",
        "([a, b], [a, b], [a, b])->([a, b]) {a=8, b=4}",
    ),
    (
        "embedding-gather",
        lambda t, i: t[i],
        (jnp.ones((16, 4)), jnp.zeros((2, 3), int)),
        "gather",
        "([a, b], [c, d, e])->([c, d, b]) reduction={a} need_replication={e} {a=16, b=4, c=2, d=3, e=1}",
    ),
    (
        "slice",
        lambda a: a[:, 1:3],
        (x8x4,),
        "slice",
        "([a, b])->([a, b]) window={b} {a=8, b=2}",
    ),
    (
        "convert",
        lambda a: a.astype(jnp.bfloat16),
        (x8x4,),
        "convert_element_type",
        "([a, b])->([a, b]) {a=8, b=4}",
    ),
    ("integer-pow", lambda a: a**3, (x8x4,), "integer_pow", "([a, b])->([a, b]) {a=8, b=4}"),
]


@pytest.mark.parametrize(
    "fn, args, prim, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rule_string(fn, args, prim, expected):
    eqn = _eqn(fn, *args, prim=prim)
    rule = rule_fn_for(eqn.primitive)(eqn)
    assert str(rule) == expected
    rule.check(
        [getattr(v.aval, "shape", ()) for v in eqn.invars],
        [v.aval.shape for v in eqn.outvars],
        prim,
    )
