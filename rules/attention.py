"""cuDNN fused attention (`jax.nn.dot_product_attention(..., implementation="cudnn")`).

The forward takes ``query (B, T, N, H), key (B, S, K, H), value (B, S, K, Hv)`` (or the
``BNTH`` layout), an optional bias ``(B|1, N|1, T, S)``, sequence lengths and offsets
``(B[, M])`` and page tables; it returns the output ``(B, T, N, Hv)`` and, when
training, the softmax statistics ``(B*M, N, T)``. With grouped-query attention the
``N`` query heads are ``K`` groups of ``G``: the head dim is the compound ``[k, g]``.

Derived from the math ``out[b,t,n,:] = softmax_s(q[b,t,n,:] . k[b,s,k(n),:] + bias) @
v[b,s,k(n),:]``: batch and heads pass through (each (b, n) is its own attention); the
query length passes through in the forward when nothing ties a query row to its
absolute position (no mask, no sliding window, no packed segments, no paging); the key
length and the qk head dim are need-replication (the softmax normalizes over all keys,
and it is not a sum of per-shard parts); the value head dim passes through in the
forward (each output column is its own weighted sum). In the backward, ``dk`` and
``dv`` sum over queries and the ``G`` query heads of a group, and ``dq`` sums over the
value head dim, so those are need-replication there. A broadcast bias whose gradient
is taken would need a sum across batch or heads: those factors are then
need-replication.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn

from jaxshard.jax_compat import cudnn_attention as cudnn
from jaxshard.jax_compat import cudnn_attention_params
from jaxshard.rule import FactorKind, Rule, RuleBuilder, register_rule, shapes_of

NEED = FactorKind.NEED_REPLICATION
PASS = FactorKind.PASS

FORWARD = (cudnn._dot_product_attention_fwd_p, cudnn._dot_product_attention_fwd_p_wrapper)
BACKWARD = (cudnn._dot_product_attention_bwd_p, cudnn._dot_product_attention_bwd_p_wrapper)


@register_rule(*FORWARD, *BACKWARD)
def attention_rule(eqn: JaxprEqn) -> Rule:
    """See the module docstring; operands and results in the primitive's order.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxshard.rules.attention import bind_forward
        >>> q, kv = jnp.ones((2, 8, 4, 16)), jnp.ones((2, 8, 2, 16))
        >>> eqn = jax.make_jaxpr(lambda q, k, v: bind_forward(q, k, v))(q, kv, kv).eqns[-1]
        >>> print(attention_rule(eqn))  # doctest: +ELLIPSIS
        ([a, b, cd, e], [a, f, c, e], [a, f, c, g], [h], [i], ...)->([a, b, cd, g])
        need_replication={e, f, h, i, j, k, l, m, n} {a=2, b=8, c=2, d=2, e=16, f=8, g=16, h=0, ...}
    """
    params = eqn.params
    backward = eqn.primitive in BACKWARD
    ins, outs = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    bnth = params["layout"] == cudnn.AttentionLayout.BNTH.value
    seq_dim, head_dim = (2, 1) if bnth else (1, 2)
    q, k, v = ins[:3]
    batch, q_len, heads, qk_head = q[0], q[seq_dim], q[head_dim], q[3]
    kv_len, kv_heads, v_head = k[seq_dim], k[head_dim], v[3]
    groups = heads // kv_heads
    bias = ins[3]
    segments = cudnn.get_max_seg_per_batch(eqn.invars[6].aval)
    has_dbias = backward and params["variadic_args"][1]
    if params.get("score_mod") is not None or params.get("score_mod_jaxpr") is not None:
        # flex attention: a user function of the whole score tensor and extra operands
        # may mix any of its dims, so nothing is split
        return _Covering(ins, outs).build()
    positional = (
        params["mask_type"] is not cudnn.MaskType.NO_MASK
        or params["sliding_window_length"] is not None
        or segments > 1
        or cudnn.check_is_paged_attention(eqn.invars[8].aval)
    )
    # a bias gradient is summed over the dims the bias is broadcast along
    bias_b = len(bias) == 4 and bias[0] == batch
    bias_n = len(bias) == 4 and bias[1] == heads
    b_kind = NEED if has_dbias and not bias_b else PASS
    n_kind = NEED if has_dbias and not bias_n else PASS

    b = _Covering(ins, outs)
    q_like = [0] + ([11, 12] if backward else [])  # query, fwd output, grad output
    stat_in = [10] if backward else []
    stat_out = [1] if not backward and len(outs) > 1 else []
    aux = [i for i in (4, 5, 6, 7) if len(ins[i]) >= 1 and ins[i][0] == batch]
    full_bias = [3] if len(bias) == 4 else []
    dbias = [3] if has_dbias else []

    def at(tensors: list[int], dim: int) -> dict[int, int]:
        return dict.fromkeys(tensors, dim)

    # batch: every tensor's dim 0 (the statistics fold segments in: [b, m])
    b.add(
        at(q_like + [1, 2] + stat_in + aux + ([3] if bias_b else []), 0),
        at([0] + stat_out + ([1, 2] if backward else []) + (dbias if bias_b else []), 0),
        batch,
        b_kind,
    )
    if (stat_in or stat_out) and segments > 1:
        b.add(at(stat_in, 0), at(stat_out, 0), segments, NEED)
    t_kind = NEED if backward or positional else PASS
    b.add(
        at(q_like, seq_dim) | at(stat_in, 2) | at(full_bias, 2),
        at([0], seq_dim) | at(stat_out, 2) | at(dbias, 2),
        q_len,
        t_kind,
    )
    # heads: [kv heads, group]; the statistics and a full bias carry the query heads
    n_in = at(q_like, head_dim) | at(stat_in, 1) | at([3] if bias_n else [], 1)
    n_out = at([0], head_dim) | at(stat_out, 1) | at(dbias if bias_n else [], 1)
    b.add(
        n_in | at([1, 2], head_dim),
        n_out | at([1, 2] if backward else [], head_dim),
        kv_heads,
        n_kind,
    )
    if groups > 1:
        b.add(n_in, n_out, groups, NEED if backward else n_kind)
    # qk head dim and key length live inside the softmax
    b.add(at([0, 1], 3), at([0, 1] if backward else [], 3), qk_head, NEED)
    b.add(
        at([1, 2], seq_dim) | at(full_bias, 3),
        at([1, 2] if backward else [], seq_dim) | at(dbias, 3),
        kv_len,
        NEED,
    )
    # value head dim: the output's minor dim
    v_in = at([2] + ([11, 12] if backward else []), 3)
    b.add(v_in, at([2] if backward else [0], 3), v_head, NEED if backward else PASS)
    return b.build()


class _Covering:
    """A RuleBuilder that gives every dim left without a factor (a broadcast bias's
    size-1 dims excepted) its own need-replication factor: placeholder operands, page
    tables, segment dims."""

    def __init__(self, ins, outs):
        self.ins, self.outs = ins, outs
        self.b = RuleBuilder(len(ins), len(outs), ([len(s) for s in ins], [len(s) for s in outs]))
        self.covered: set[tuple[bool, int, int]] = set()

    def add(self, operand_dims: dict, result_dims: dict, size: int, kind: FactorKind) -> None:
        self.b.add_factor(operand_dims, result_dims, size, kind)
        self.covered |= {(True, i, d) for i, d in operand_dims.items()}
        self.covered |= {(False, i, d) for i, d in result_dims.items()}

    def build(self) -> Rule:
        for is_operand, shapes in ((True, self.ins), (False, self.outs)):
            for i, shape in enumerate(shapes):
                for d, size in enumerate(shape):
                    if (is_operand, i, d) not in self.covered and size != 1:
                        where = {i: d}
                        self.b.add_factor(
                            where if is_operand else {}, {} if is_operand else where, size, NEED
                        )
        return self.b.build()


def bind_forward(query, key, value, *, causal: bool = False, training: bool = False):
    """Bind the forward primitive as `jax.nn.dot_product_attention` does on a GPU (BTNH,
    no bias, no dropout); tracing it works on any backend, running needs cuDNN.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.ones((2, 8, 4, 16))
        >>> [str(o.aval) for o in jax.make_jaxpr(bind_forward)(x, x, x).eqns[-1].outvars]
        ['float32[2,8,4,16]']
    """
    import jax.numpy as jnp

    unused = jnp.zeros(0, query.dtype)
    mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
    return cudnn._dot_product_attention_fwd_p_wrapper.bind(
        query, key, value, unused, unused, unused, unused, unused, unused, unused,
        **cudnn_attention_params(
            scale=1.0 / query.shape[-1] ** 0.5, seed=42, dropout_rate=0.0,
            variadic_args=(False, False), mask_type=mask,
            layout=cudnn.AttentionLayout.BTNH.value, sliding_window_length=None,
            is_training=training,
        ),
    )  # fmt: skip
