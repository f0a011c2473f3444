"""Loops and branches as graph structure: `scan`, `while` and `cond`.

A loop carry's outer input, body input, body output and outer result share one sharding
(tied). `scan`'s stacked inputs and outputs (``xs``/``ys``) link to the per-iteration
slices of the body by a rule whose leading scanned dim is need-replication, so stacked
layer parameters are never sharded along the layer dim. `cond`'s branches all see the
operands and all produce the results. The regions name the parameter holding each body
so that lowering can rewrite it with sharding constraints inside.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p

from jaxshard.jax_compat import scan_counts
from jaxshard.rule import (
    FactorKind,
    Link,
    Port,
    Region,
    Rule,
    RuleBuilder,
    Side,
    register_region,
)


def stacked_rule(stacked_shape: tuple[int, ...]) -> Rule:
    """``([t, a, b])->([a, b]) need_replication={t}``: a stacked value and one slice of it.

    Example:
        >>> print(stacked_rule((12, 4, 8)))
        ([a, b, c])->([b, c]) need_replication={a} {a=12, b=4, c=8}
    """
    b = RuleBuilder(1, 1, ([len(stacked_shape)], [len(stacked_shape) - 1]))
    b.add_factor({0: 0}, {}, stacked_shape[0], FactorKind.NEED_REPLICATION)
    for d, size in enumerate(stacked_shape[1:]):
        b.add_factor({0: d + 1}, {0: d}, size)
    return b.build()


def _closed(closed):
    return closed.jaxpr, tuple(closed.consts)


@register_region(p.scan_p)
def scan_region(eqn: JaxprEqn) -> list[Region]:
    """Consts link to the body's consts; carries are tied; xs/ys link through `stacked_rule`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda c, xs: jax.lax.scan(lambda c, x: (c + x, c * x), c, xs)
        >>> eqn = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((5, 3))).eqns[0]
        >>> region, = scan_region(eqn)
        >>> [[str(port) for port in group] for group in region.ties]
        [['in[0]', 'out[0]']]
    """
    nc, ncar = scan_counts(eqn.params)
    jaxpr, consts = _closed(eqn.params["jaxpr"])
    links = [Link(Port(Side.IN, i), Port(Side.IN, i)) for i in range(nc + ncar)]
    links += [Link(Port(Side.OUT, j), Port(Side.OUT, j)) for j in range(ncar)]
    for i in range(nc + ncar, len(eqn.invars)):
        links.append(
            Link(Port(Side.IN, i), Port(Side.IN, i), stacked_rule(tuple(eqn.invars[i].aval.shape)))
        )
    for j in range(ncar, len(eqn.outvars)):
        links.append(
            Link(
                Port(Side.OUT, j), Port(Side.OUT, j), stacked_rule(tuple(eqn.outvars[j].aval.shape))
            )
        )
    ties = tuple((Port(Side.IN, nc + j), Port(Side.OUT, j)) for j in range(ncar))
    return [Region(jaxpr, consts, tuple(links), ties, param="jaxpr")]


@register_region(p.while_p)
def while_region(eqn: JaxprEqn) -> list[Region]:
    """The cond and the body both see the carry; the body's carry in and out are tied.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 2), (0, x))
        >>> eqn = jax.make_jaxpr(f)(jnp.ones(3)).eqns[0]
        >>> [r.param for r in while_region(eqn)]
        ['cond_jaxpr', 'body_jaxpr']
    """
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    ncar = len(eqn.invars) - cn - bn
    cond_jaxpr, cond_consts = _closed(eqn.params["cond_jaxpr"])
    body_jaxpr, body_consts = _closed(eqn.params["body_jaxpr"])
    cond_links = [Link(Port(Side.IN, i), Port(Side.IN, i)) for i in range(cn)]
    cond_links += [Link(Port(Side.IN, cn + bn + j), Port(Side.IN, cn + j)) for j in range(ncar)]
    body_links = [Link(Port(Side.IN, cn + i), Port(Side.IN, i)) for i in range(bn)]
    body_links += [Link(Port(Side.IN, cn + bn + j), Port(Side.IN, bn + j)) for j in range(ncar)]
    body_links += [Link(Port(Side.OUT, j), Port(Side.OUT, j)) for j in range(ncar)]
    ties = tuple((Port(Side.IN, bn + j), Port(Side.OUT, j)) for j in range(ncar))
    return [
        Region(cond_jaxpr, cond_consts, tuple(cond_links), param="cond_jaxpr"),
        Region(body_jaxpr, body_consts, tuple(body_links), ties, param="body_jaxpr"),
    ]


@register_region(p.cond_p)
def cond_region(eqn: JaxprEqn) -> list[Region]:
    """Every branch takes the operands after the index and produces the results.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x)
        >>> eqn = [e for e in jax.make_jaxpr(f)(True, jnp.ones(3)).eqns if e.primitive.name == "cond"][0]
        >>> len(cond_region(eqn))
        2
    """
    regions = []
    for index, branch in enumerate(eqn.params["branches"]):
        jaxpr, consts = _closed(branch)
        links = [Link(Port(Side.IN, i + 1), Port(Side.IN, i)) for i in range(len(eqn.invars) - 1)]
        links += [Link(Port(Side.OUT, j), Port(Side.OUT, j)) for j in range(len(eqn.outvars))]
        regions.append(Region(jaxpr, consts, tuple(links), param="branches", index=index))
    return regions
