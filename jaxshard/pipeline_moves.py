"""How a pipeline's values move: microbatches split from the batch and joined again,
slots shifted one stage on, and a circular schedule's layer chunks moved into ring order.

`jaxshard.pipeline` builds its loops from these.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr
from jax.extend.core import primitives as prims
from jax.sharding import PartitionSpec as P

from jaxshard.annotate import PinKind

# a circular stage's weights for the current pass are a slice of its chunks, taken per
# layer inside a checkpoint that recomputes it for the backward pass: saved, the loop
# would keep a copy of the chunk's weights per iteration; recomputed, it keeps the
# stored chunks once, as GPipe keeps its stage's layers
CHUNK = "jaxshard_pipeline_chunk"


def pin_origins(line: str) -> tuple:
    """The origins of a pipelined loop's pins (`hint_p` ``origin=``): the stacked layers
    on the stage axis, a buffer of one slot per stage, every microbatch's buffer.

    Example:
        >>> pin_origins("model.py:40")[1][1]
        "the pipeline's microbatch slots (scan at model.py:40)"
    """
    return (
        (PinKind.PIPELINE, f"the pipeline's stages (scan at {line})"),
        (PinKind.MICROBATCHES, f"the pipeline's microbatch slots (scan at {line})"),
        (PinKind.MICROBATCHES, f"the pipeline's microbatches (scan at {line})"),
    )


def chunk_policy(body: ClosedJaxpr):
    """The checkpoint policy of a circular stage's layer: the body's own where the body
    is one `jax.checkpoint` (an outer policy overrides an inner one, so the outer one
    is the body's), else save everything as the plain body does; never the chunk's
    weights (`CHUNK`).

    Example:
        >>> body = jax.make_jaxpr(jax.checkpoint(lambda x: x * 2))(1.0)
        >>> chunk_policy(body)(prims.mul_p)  # the body saves nothing: neither do we
        False
    """
    eqns = body.jaxpr.eqns
    if len(eqns) == 1 and eqns[0].primitive is prims.remat_p:
        base = eqns[0].params["policy"] or jax.checkpoint_policies.nothing_saveable
    else:
        base = jax.checkpoint_policies.everything_saveable

    def policy(prim, *args, **params):
        return params.get("name") != CHUNK and base(prim, *args, **params)

    return policy


def interleave(stacked: list, axis: str, stages: int, laps: int) -> list:
    """(S, V, per, ...) stacks stored in layer order (stage d holds chunks d·V ... d·V+V−1,
    the layout of the user's (L, ...) array split over ``axis``) -> the circular layout
    (stage e holds chunks e, e+S, e+2S, ...).

    Forward, a reshape and a transpose, which the planner sees through (a layout the
    uses give the chunks reaches the stored stack) and XLA moves with an all-to-all.
    Backward, the gradients go back by `_move_chunks`: every stage sends V chunks and
    receives V, in V rounds of one collective-permute of a chunk each (the reshape's own
    transpose would gather the whole stack on every stage).

    Example:
        >>> stacked = interleave(stacked, "stage", 4, 2)  # doctest: +SKIP
    """
    move = jax.custom_vjp(functools.partial(_chunks_in_ring_order, stages, laps))
    back = functools.partial(_move_chunks, axis=axis, rounds=chunk_rounds(stages, laps, True))
    move.defvjp(lambda x: (move(x), None), lambda _, g: (back(g),))
    return [move(x) for x in stacked]


def _chunks_in_ring_order(stages: int, laps: int, x):
    flat = x.reshape(stages * laps, *x.shape[2:])  # chunk c = d·V + i
    return jnp.swapaxes(flat.reshape(laps, stages, *x.shape[2:]), 0, 1)  # [e, j]: c = j·S + e


def _move_chunks(x, axis: str, rounds: list):
    """``x`` (S, V, ...) split over ``axis`` with each stage's V chunks moved by
    ``rounds`` (`chunk_rounds`): one collective-permute per round."""

    def body(block):
        me = jax.lax.axis_index(axis)
        local, got = block[0], jnp.zeros_like(block[0])
        for pairs, send, recv in rounds:
            chunk = jax.lax.dynamic_index_in_dim(local, jnp.asarray(send)[me], 0, False)
            moving = [(d, e) for d, e in pairs if d != e]  # a chunk that stays is not sent
            if moving:
                stays = jnp.asarray([(d, d) in pairs for d in range(len(pairs))])[me]
                chunk = jnp.where(stays, chunk, jax.lax.ppermute(chunk, axis, moving))
            got = jax.lax.dynamic_update_index_in_dim(got, chunk, jnp.asarray(recv)[me], 0)
        return got[None]

    return jax.shard_map(body, in_specs=P(axis), out_specs=P(axis), axis_names={axis})(x)


def chunk_rounds(
    stages: int, laps: int, back: bool = False
) -> list[tuple[list, list[int], list[int]]]:
    """The moves from layer order to ring order (``back``: the other way) in rounds: per
    round the (source, destination) stage pairs, the local chunk each stage sends and
    the local slot each stage receives into. Chunk c is at stage c // V, slot c % V in
    layer order and at stage c % S, slot c // S in ring order; the transfers form a
    V-regular bipartite multigraph, which splits into V perfect matchings (König),
    found one at a time by augmenting paths.

    Example:
        >>> [pairs for pairs, _, _ in chunk_rounds(2, 2)]
        [[(0, 1), (1, 0)], [(0, 0), (1, 1)]]
    """
    if back:
        return [
            ([(e, d) for d, e in pairs], recv, send)
            for pairs, send, recv in chunk_rounds(stages, laps)
        ]
    left = {d: [(c % stages, c) for c in range(d * laps, (d + 1) * laps)] for d in range(stages)}
    rounds = []

    def augment(match: dict[int, tuple[int, int]], d: int, seen: set) -> bool:
        for e, c in left[d]:  # match: destination -> (source, chunk)
            if e in seen:
                continue
            seen.add(e)
            if e not in match or augment(match, match[e][0], seen):
                match[e] = (d, c)
                return True
        return False

    for _ in range(laps):
        match: dict[int, tuple[int, int]] = {}
        for d in range(stages):
            if not augment(match, d, set()):  # a regular bipartite multigraph has one
                raise AssertionError("no perfect matching of the pipeline's chunks")
        send, recv, pairs = [0] * stages, [0] * stages, []
        for e, (d, c) in sorted(match.items(), key=lambda kv: kv[1][0]):
            left[d].remove((e, c))
            pairs.append((d, e))
            send[d], recv[e] = c % laps, c // stages
        rounds.append((pairs, send, recv))
    return rounds


def split(v, d: int, m: int):
    """(..., B at d, ...) -> (M, ...) with microbatch k holding rows k, M+k, 2M+k, ...
    (strided, so a batch dim sharded over a mesh axis stays sharded in each
    microbatch); the rows stay at d + 1.

    Example:
        >>> split(jnp.arange(6), 0, 2).tolist()
        [[0, 2, 4], [1, 3, 5]]
    """
    v = jnp.moveaxis(v, d, 0)
    v = jnp.swapaxes(v.reshape(v.shape[0] // m, m, *v.shape[1:]), 0, 1)
    return jnp.moveaxis(v, 1, d + 1)


def replicate(v, d: int, r: int):
    """(M, ..., rows at d, ...) -> (M, R, ..., rows/R at d + 1, ...): replica k holds the
    k-th block of rows, as a mesh axis sharding the rows holds them.

    Example:
        >>> replicate(jnp.zeros((2, 4, 3)), 1, 2).shape
        (2, 2, 2, 3)
    """
    v = jnp.moveaxis(v, d, 1)
    v = v.reshape(v.shape[0], r, v.shape[1] // r, *v.shape[2:])
    return jnp.moveaxis(v, 2, d + 1)


def join(v):
    """The inverse of `split` for rows at dim 1 (the carry's batch).

    Example:
        >>> join(split(jnp.arange(6)[:, None], 0, 2))[:, 0].tolist()
        [0, 1, 2, 3, 4, 5]
    """
    v = jnp.swapaxes(v, 0, 1)
    return v.reshape(v.shape[0] * v.shape[1], *v.shape[2:])


def unsplit(v, d: int):
    """The inverse of `split` for rows at ``d`` + 1: (M, ..., rows, ...) -> (..., B at d, ...).

    Example:
        >>> unsplit(split(jnp.arange(12).reshape(2, 6), 1, 3), 1).tolist() == jnp.arange(12).reshape(2, 6).tolist()
        True
    """
    v = jnp.moveaxis(v, d + 1, 1)
    v = jnp.swapaxes(v, 0, 1)
    v = v.reshape(v.shape[0] * v.shape[1], *v.shape[2:])
    return jnp.moveaxis(v, 0, d)


def shift(buf: list, axis: str, stages: int, back: bool = False) -> list:
    """Each stage's slot to the next stage (the last one's to the first; ``back``: to
    the previous stage, the first one's to the last): a collective-permute over
    ``axis``, every other mesh axis left automatic.

    Example:
        >>> buf = shift(buf, "stage", 4)  # doctest: +SKIP
    """
    step = -1 if back else 1
    perm = [(i, (i + step) % stages) for i in range(stages)]
    specs = tuple(P(axis) for _ in buf)
    moved = jax.shard_map(
        lambda *b: [jax.lax.ppermute(x, axis, perm) for x in b],
        in_specs=specs,
        out_specs=list(specs),
        axis_names={axis},
    )(*buf)
    return list(moved)
