"""Indexing: `gather` and the `scatter` family with general dimension numbers.

Gather: the indices' batch dims pass through to the result's batch dims, operand dims
taken whole pass through to the result's offset dims, batching dims are shared by all
three. An indexed operand dim the gather takes one element of (an embedding's vocabulary,
the class dim of ``take_along_axis``) is a *reduction*: split, each device looks up the
rows it holds, zeros for the others, and the partial results are summed — XLA's
partitioner does exactly this (a masked local gather and an all-reduce of the result,
the vocabulary-parallel embedding of Megatron). Other indexed dims (windows of several
elements) are need-replication: a window may straddle devices.
Scatter-add: the updates' scatter dims, shared with the indices, are *reductions* —
each device adds its local updates into the whole operand and the partial sums are
combined — which is the data-parallel gradient of an embedding lookup. Other scatters
cannot combine duplicates across devices, so those dims are need-replication. An indexed
operand dim the scatter writes one element of passes through to the result: split, each
device applies the updates that land in its rows and drops the rest, with no
communication (the gradient of a vocabulary-parallel embedding).
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn
from jax.extend.core import primitives as p
from jax.lax import GatherScatterMode

from jaxshard.jax_compat import scatter_sub_p
from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule, shapes_of

NEED = FactorKind.NEED_REPLICATION
_CLAMPED = (GatherScatterMode.CLIP, GatherScatterMode.PROMISE_IN_BOUNDS)


@register_rule(p.gather_p)
def gather_rule(eqn: JaxprEqn) -> Rule:
    """Embedding lookup ``table[ids]``: ``([v, d], [b, s, 1])->([b, s, d])``, v a
    reduction (one row per index: a split table gives partial lookups to sum).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda table, ids: table[ids]
        >>> eqn = jax.make_jaxpr(f)(jnp.ones((16, 4)), jnp.zeros((2, 3), int)).eqns[-1]
        >>> print(gather_rule(eqn))
        ([a, b], [c, d, e])->([c, d, b]) reduction={a} need_replication={e}
        {a=16, b=4, c=2, d=3, e=1}
    """
    dn = eqn.params["dimension_numbers"]
    slice_sizes = eqn.params["slice_sizes"]
    operand, indices, out = shapes_of(eqn.invars[:2]) + shapes_of(eqn.outvars)
    b = RuleBuilder(2, 1, ([len(operand), len(indices)], [len(out)]))
    offset_dims = list(dn.offset_dims)
    batch_out = [d for d in range(len(out)) if d not in offset_dims]
    index_batch = list(range(len(indices) - 1))  # the last indices dim is the index vector
    out_of_index_dim = dict(zip(index_batch, batch_out))
    operand_batch = dict(zip(dn.operand_batching_dims, dn.start_indices_batching_dims))
    windowed = [
        d
        for d in range(len(operand))
        if d not in dn.collapsed_slice_dims and d not in operand_batch
    ]
    out_of_operand_dim = dict(zip(windowed, offset_dims))
    # a start index into a dim the slice takes whole is clamped to 0 (a vmapped
    # dynamic_slice indexes every dim): the dim passes through as if not indexed
    clamped = eqn.params["mode"] in _CLAMPED
    factor_of_index_dim = {}
    for d, size in enumerate(operand):
        if d in operand_batch:
            i = operand_batch[d]
            factor_of_index_dim[i] = b.add_factor({0: d, 1: i}, {0: out_of_index_dim[i]}, size)
        elif (
            d in out_of_operand_dim
            and slice_sizes[d] == size
            and (d not in dn.start_index_map or clamped)
        ):
            b.add_factor({0: d}, {0: out_of_operand_dim[d]}, size)
        elif slice_sizes[d] == 1 and size > 1:
            b.add_factor({0: d}, {}, size, FactorKind.REDUCTION, indexed=True)
            if d in out_of_operand_dim:
                b.add_factor({}, {0: out_of_operand_dim[d]}, 1)
        else:
            b.add_factor({0: d}, {}, size, NEED)
            if d in out_of_operand_dim:
                b.add_factor({}, {0: out_of_operand_dim[d]}, slice_sizes[d], NEED)
    for i in index_batch:
        if i not in factor_of_index_dim:
            b.add_factor({1: i}, {0: out_of_index_dim[i]}, indices[i])
    b.add_factor({1: len(indices) - 1}, {}, indices[-1], NEED)
    return b.build()


def scatter_rule(eqn: JaxprEqn, combinable: bool) -> Rule:
    """Operand dims pass to the result (indexed ones written one element at a time too;
    other indexed ones need-replication); update window dims taken whole share the
    operand's factor; update scatter dims share the indices' batch dims and are
    reductions when duplicates combine by addition.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda t, ids, u: t.at[ids].add(u)
        >>> args = jnp.ones((16, 4)), jnp.zeros((2, 3), int), jnp.ones((2, 3, 4))
        >>> eqn = jax.make_jaxpr(f)(*args).eqns[-1]
        >>> print(scatter_rule(eqn, combinable=True))
        ([a, b], [c, d, e], [c, d, b])->([a, b]) reduction={c, d} need_replication={e}
        {a=16, b=4, c=2, d=3, e=1}
    """
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = shapes_of(eqn.invars[:3])
    b = RuleBuilder(3, 1, ([len(operand), len(indices), len(updates)], [len(operand)]))
    window = list(dn.update_window_dims)
    operand_batch = dict(zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims))
    windowed = [
        d
        for d in range(len(operand))
        if d not in dn.inserted_window_dims and d not in operand_batch
    ]
    update_of_operand_dim = dict(zip(windowed, window))
    scatter_update_dims = [d for d in range(len(updates)) if d not in window]
    index_batch = list(range(len(indices) - 1))
    update_of_index_dim = dict(zip(index_batch, scatter_update_dims))
    indexed = set(dn.scatter_dims_to_operand_dims)
    clamped = eqn.params["mode"] in _CLAMPED  # as in `gather_rule`
    batch_index_dims = set(operand_batch.values())
    for d, size in enumerate(operand):
        if d in operand_batch:
            i = operand_batch[d]
            b.add_factor({0: d, 1: i, 2: update_of_index_dim[i]}, {0: d}, size)
        elif (
            d in update_of_operand_dim
            and updates[update_of_operand_dim[d]] == size
            and (d not in indexed or clamped)
        ):
            b.add_factor({0: d, 2: update_of_operand_dim[d]}, {0: d}, size)
        elif d in indexed and (
            d not in update_of_operand_dim or updates[update_of_operand_dim[d]] == 1
        ):
            b.add_factor({0: d}, {0: d}, size)  # one element per index: rows stay put
            if d in update_of_operand_dim:
                b.add_factor({2: update_of_operand_dim[d]}, {}, 1)
        else:
            b.add_factor({0: d}, {0: d}, size, NEED)
            if d in update_of_operand_dim:
                b.add_factor(
                    {2: update_of_operand_dim[d]}, {}, updates[update_of_operand_dim[d]], NEED
                )
    kind = FactorKind.REDUCTION if combinable else NEED
    for i in index_batch:
        if i not in batch_index_dims:
            b.add_factor({1: i, 2: update_of_index_dim[i]}, {}, indices[i], kind)
    b.add_factor({1: len(indices) - 1}, {}, indices[-1], NEED)
    return b.build()


# a subtraction of partial sums is the subtraction of their total: combinable like add
register_rule(p.scatter_add_p, scatter_sub_p)(lambda eqn: scatter_rule(eqn, combinable=True))
register_rule(p.scatter_p, p.scatter_mul_p, p.scatter_min_p, p.scatter_max_p)(
    lambda eqn: scatter_rule(eqn, combinable=False)
)
