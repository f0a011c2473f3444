"""Random numbers: typed-key primitives (`random_seed`, `random_bits`, `random_split`,
`random_fold_in`, `random_gamma`, `random_wrap`, `random_unwrap`, `random_clone`),
`threefry2x32`, and the stateless XLA generators `rng_bit_generator` and `rng_uniform`.

A batch of keys is a batch of independent generators, so the key array's dims pass
through to the leading dims of what they produce. The dims a key generates (the
``shape`` of `random_bits` and `random_split`) are need-replication: only with
``jax_threefry_partitionable`` can a device make its slice alone, and a rule must not
depend on a flag. A key-typed value's shape leaves out the implementation's trailing
dims (``key<fry>[3]`` holds ``uint32[3, 2]``); `random_wrap` and `random_unwrap` give
those dims need-replication factors of their own. `random_seed`, `random_fold_in`,
`random_clone` and the counter-based hashes (`threefry2x32`, `threefry4x32`,
`philox2x32`, `philox4x32`) are elementwise; `iota_2x32_shape` (their counters) is an
iota. `random_gamma` and the XLA generators are
need-replication throughout.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn, Primitive
from jax.extend.core import primitives as p
from jaxshard.rules.elementwise import elementwise_rule

from jaxshard.jax_compat import prng, random_core, random_primitives
from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule, shapes_of

NEED = FactorKind.NEED_REPLICATION


def _prng_primitive(name: str) -> Primitive:
    return getattr(prng, f"{name}_p", None) or getattr(random_core, f"{name}_p")


def leading_rule(eqn: JaxprEqn, leading: int) -> Rule:
    """Dims below ``leading`` pass through from operand 0 to every result; the rest of
    each tensor's dims (other operands included) are need-replication, one factor each.

    Example:
        >>> import jax
        >>> key = jax.random.split(jax.random.key(0), 4)
        >>> f = jax.vmap(lambda k: jax.random.bits(k, (3, 5)))
        >>> eqn = jax.make_jaxpr(f)(key).eqns[-1]
        >>> print(eqn.primitive, leading_rule(eqn, 1))
        random_bits ([a])->([a, b, c]) need_replication={b, c} {a=4, b=3, c=5}
    """
    ins, outs = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    b = RuleBuilder(len(ins), len(outs), ([len(s) for s in ins], [len(s) for s in outs]))
    for d in range(leading):
        b.add_factor({0: d}, dict.fromkeys(range(len(outs)), d), ins[0][d])
    for i, shape in enumerate(ins):
        for d in range(leading if i == 0 else 0, len(shape)):
            b.add_factor({i: d}, {}, shape[d], NEED)
    for i, shape in enumerate(outs):
        for d in range(leading, len(shape)):
            b.add_factor({}, {i: d}, shape[d], NEED)
    return b.build()


@register_rule(p.random_bits_p, p.random_split_p, _prng_primitive("random_unwrap"))
def key_batch_rule(eqn: JaxprEqn) -> Rule:
    """The key array's dims pass through to the leading result dims; the dims it
    generates (or the key data's trailing dims) are need-replication.

    Example:
        >>> import jax
        >>> key = jax.random.split(jax.random.key(0), 4)
        >>> eqn = jax.make_jaxpr(jax.vmap(lambda k: jax.random.split(k, 3)))(key).eqns[-1]
        >>> print(eqn.primitive, key_batch_rule(eqn))
        random_split ([a])->([a, b]) need_replication={b} {a=4, b=3}
    """
    return leading_rule(eqn, len(shapes_of(eqn.invars[:1])[0]))


@register_rule(_prng_primitive("random_wrap"))
def random_wrap_rule(eqn: JaxprEqn) -> Rule:
    """Key data ``uint32[..., 2]`` to keys ``key<fry>[...]``: the trailing dim replicates.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> data = jnp.zeros((4, 2), jnp.uint32)
        >>> eqn = jax.make_jaxpr(jax.random.wrap_key_data)(data).eqns[-1]
        >>> print(random_wrap_rule(eqn))
        ([a, b])->([a]) need_replication={b} {a=4, b=2}
    """
    return leading_rule(eqn, len(shapes_of(eqn.outvars)[0]))


@register_rule(p.random_gamma_p)
def random_gamma_rule(eqn: JaxprEqn) -> Rule:
    """Keys ``(k...)`` and shapes ``(k..., d...)`` to draws ``(k..., d...)``: every dim is
    need-replication, shared by the tensors that have it. The lowering runs one
    rejection-sampling loop over all draws, whose exit test reduces across every draw,
    so even a sharded key dim would all-reduce on each iteration.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda k, a: jax.random.gamma(k, a)
        >>> closed = jax.make_jaxpr(f)(jax.random.key(0), jnp.ones((4, 3)))
        >>> eqn = closed.eqns[-1].params["jaxpr"].eqns[-1]
        >>> print(eqn.primitive, random_gamma_rule(eqn))
        random_gamma ([], [a, b])->([a, b]) need_replication={a, b} {a=4, b=3}
    """
    (key, a), (out,) = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    b = RuleBuilder(2, 1, ([len(key), len(a)], [len(out)]))
    for d, size in enumerate(out):
        b.add_factor({0: d, 1: d} if d < len(key) else {1: d}, {0: d}, size, NEED)
    return b.build()


@register_rule(p.rng_bit_generator_p, p.rng_uniform_p)
def xla_generator_rule(eqn: JaxprEqn) -> Rule:
    """Every dim of the state and the generated values is need-replication.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda s: jax.lax.rng_bit_generator(s, (4, 8))
        >>> eqn = jax.make_jaxpr(f)(jnp.zeros(4, jnp.uint32)).eqns[0]
        >>> print(xla_generator_rule(eqn))
        ([a])->([b], [c, d]) need_replication={a, b, c, d} {a=4, b=4, c=4, d=8}
    """
    return leading_rule(eqn, 0)


register_rule(
    p.random_seed_p,
    p.random_fold_in_p,
    p.threefry2x32_p,
    *random_primitives,
    _prng_primitive("random_clone"),
)(elementwise_rule)


@register_rule(_prng_primitive("iota_2x32_shape"))
def iota_2x32_rule(eqn: JaxprEqn) -> Rule:
    """The high and low words of a 64-bit iota: no operands, each dim a factor shared by
    both results (a slice of an iota is computed locally from its offset).

    Example:
        >>> from jaxshard.jax_compat import prng
        >>> import jax
        >>> eqn = jax.make_jaxpr(lambda: prng.iota_2x32_shape((4, 8)))().eqns[0]
        >>> print(iota_2x32_rule(eqn))
        ()->([a, b], [a, b]) {a=4, b=8}
    """
    outs = shapes_of(eqn.outvars)
    b = RuleBuilder(0, len(outs), ([], [len(s) for s in outs]))
    for d, size in enumerate(outs[0]):
        b.add_factor({}, dict.fromkeys(range(len(outs)), d), size)
    return b.build()
