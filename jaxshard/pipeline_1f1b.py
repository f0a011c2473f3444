"""The one-forward-one-backward (1F1B) pipeline schedule, from the unchanged train step.

GPipe runs every microbatch forward, then every one backward: each stage keeps the
activations of all M microbatches until the backward pass starts. 1F1B starts a
microbatch's backward pass as soon as its forward pass leaves the last stage, so each
stage keeps a bounded number of microbatches whatever M. That needs the loss head (what
follows the layer scan: final norm, output projection, per-example loss) to run per
microbatch inside the loop, which the user's ``jax.value_and_grad(loss)`` cannot do by
itself: jaxshard intercepts ``jax.value_and_grad`` and ``jax.grad`` while tracing a step
planned with ``Pipeline(schedule="1f1b")`` and, when the loss qualifies, computes the
value and gradients itself:

1. the loss is traced with its layer scan as one marker equation (the scan must qualify
   for pipelining as for GPipe, `jaxshard.pipeline`); what depends on the marker is the
   *head*, the rest the *prefix* (embedding lookup, masks, anything else);
2. `jaxshard.pipeline_body.head_sums` proves the head is a sum of per-microbatch terms
   (rows never mixed, reductions over the batch are sums, linear after them: a mean of
   per-example losses qualifies) and the head is re-traced at microbatch size;
3. the prefix runs as the user wrote it and is differentiated by JAX; the scan and the
   head run as one loop whose gradients are computed inside it (a `jax.custom_vjp`):
   S−1 warm-up iterations (forward only), M iterations in which every stage runs one
   microbatch forward and another backward (the last stage runs the head of the
   microbatch it just finished, then its backward), S−1 cool-down iterations (backward
   only). Stage s runs microbatch t−s forward and t−(2S−2−s) backward at iteration t.
   Each stage saves only its inputs (a ring of 2S−1 slots) and recomputes its layers for
   the backward pass under the body's own remat policy. Activations move one stage on,
   cotangents one stage back, by collective-permute. The bubble is GPipe's,
   (S−1)/(M+S−1).

A loss that does not qualify runs on the GPipe schedule; `Plan.explain` says why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, jaxpr_as_fun
from jax.sharding import PartitionSpec as P

from jaxshard.annotate import hint_p
from jaxshard.jax_compat import MultipleResultsPrimitive, bind_with_source, without_dead_code
from jaxshard.pipeline_body import (
    ORIGINAL_SCAN,
    Rejected,
    active_interception,
    head_sums,
    microbatched,
)
from jaxshard.pipeline_moves import join, pin_origins, shift, split, unsplit

ORIGINAL_VALUE_AND_GRAD = jax.value_and_grad
ORIGINAL_GRAD = jax.grad

# the layer scan inside a traced loss: operands (carry, stacked xs, the body's consts),
# results the new carry; never lowered, only split out of the loss's jaxpr
scan_marker_p = MultipleResultsPrimitive("jaxshard_pipelined_scan")
scan_marker_p.multiple_results = True
scan_marker_p.def_abstract_eval(lambda *avals, n_carry, index: list(avals[:n_carry]))


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _pick(values: list, idx: list[int]) -> list:
    return [values[i] for i in idx]


def _merge(values: list, idx: list[int], new: list) -> list:
    out = list(values)
    for i, v in zip(idx, new):
        out[i] = v
    return out


def value_and_grad(fun: Callable, argnums=0, has_aux: bool = False, *more, **kw) -> Callable:
    """`jax.value_and_grad` while a 1F1B pipeline is planned: the loss runs as one loop
    of forward and backward microbatches when it qualifies (module doc), else as JAX
    differentiates it (the layer scan then runs on the GPipe schedule).

    Example:
        >>> with intercepting(Pipeline("stage", 8, schedule="1f1b"), mesh):  # doctest: +SKIP
        ...     loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    """
    plain = ORIGINAL_VALUE_AND_GRAD(fun, argnums, has_aux, *more, **kw)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        seen = active_interception()
        if (
            seen is None
            or seen.pipeline.schedule != "1f1b"
            or seen.busy
            or seen.capturing
            or kwargs
            or more
            or kw.get("holomorphic")
        ):
            return plain(*args, **kwargs)
        try:
            loss = _SplitLoss.of(fun, args, seen)
        except Rejected as why:
            seen.fallback = str(why)
            return plain(*args)
        return ORIGINAL_VALUE_AND_GRAD(loss.composite, argnums, has_aux, **kw)(*args)

    return wrapped


def grad(fun: Callable, argnums=0, has_aux: bool = False, *more, **kw) -> Callable:
    """`jax.grad` while a 1F1B pipeline is planned (`value_and_grad`).

    Example:
        >>> grads = jax.grad(loss_fn)(params, batch)  # doctest: +SKIP
    """
    both = value_and_grad(fun, argnums, has_aux, *more, **kw)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        if has_aux:
            (_, aux), g = both(*args, **kwargs)
            return g, aux
        return both(*args, **kwargs)[1]

    return wrapped


def capture(loop, init, xs, seen) -> Any:
    """The marker equation standing for a qualifying layer scan while a loss is traced
    for 1F1B (`_SplitLoss.of`); returns ``(new_carry, None)`` as the scan would.

    Example:
        >>> x, _ = capture(loop, x, params["layers"], seen)  # doctest: +SKIP
    """
    carry = jax.tree_util.tree_leaves(init)
    stacked = jax.tree_util.tree_leaves(xs)
    consts = [jnp.asarray(c) for c in loop.consts]
    out = scan_marker_p.bind(
        *carry, *stacked, *consts, n_carry=len(carry), index=len(seen.captured)
    )
    seen.captured.append(loop)
    return jax.tree_util.tree_unflatten(loop.carry_tree, list(out)), None


class _SplitLoss:
    """A loss traced with its layer scan as a marker, split into prefix and head."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    @classmethod
    def of(cls, fun: Callable, args: tuple, seen) -> _SplitLoss:
        flat, in_tree = jax.tree_util.tree_flatten(args)
        # arrays are traced; Python values (a flag the loss branches on) stay as given
        dynamic = [k for k, x in enumerate(flat) if isinstance(x, jax.Array)]
        avals = [jax.ShapeDtypeStruct(np.shape(flat[k]), jnp.result_type(flat[k])) for k in dynamic]

        def flat_fun(*leaves):
            return fun(*jax.tree_util.tree_unflatten(in_tree, _merge(flat, dynamic, leaves)))

        seen.capturing, seen.captured = True, []
        try:
            closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*avals)
        finally:
            seen.capturing = False
        captured, seen.captured = seen.captured, []
        if not captured:
            raise Rejected("no layer scan of the loss qualifies for pipelining")
        if len(captured) > 1:
            raise Rejected(
                f"the loss runs {len(captured)} layer scans; 1F1B pipelines a loss with one"
            )
        jaxpr = closed.jaxpr
        at = [k for k, e in enumerate(jaxpr.eqns) if e.primitive is scan_marker_p]
        if not at:
            raise Rejected(
                "the layer scan runs inside a nested call of the loss (jax.jit, "
                "jax.checkpoint or a custom derivative around it); 1F1B needs it at the "
                "loss's top level"
            )
        marker = jaxpr.eqns[at[0]]
        dep = set(marker.outvars)
        head, prefix = [], []
        for e in jaxpr.eqns:
            if e is marker:
                continue
            if any(not isinstance(v, Literal) and v in dep for v in e.invars):
                head.append(e)
                dep.update(e.outvars)
            else:
                prefix.append(e)
        outs = jaxpr.outvars
        if isinstance(outs[0], Literal) or outs[0] not in dep:
            raise Rejected("the loss does not depend on the layer scan")
        made = set(marker.outvars) | {v for e in head for v in e.outvars}
        ext = list(
            dict.fromkeys(
                v for e in head for v in e.invars if not isinstance(v, Literal) and v not in made
            )
        )
        head_outs = [v for v in outs if not isinstance(v, Literal) and v in dep]
        loop = captured[0]
        n_carry = loop.n_carry

        def run_head(*vals):
            env = dict(zip(marker.outvars, vals[:n_carry]))
            env.update(zip(ext, vals[n_carry:]))
            return _evaluate(head, env, head_outs)

        head_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in marker.outvars]
        head_avals += [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ext]
        head_closed = jax.make_jaxpr(run_head)(*head_avals)
        sums = head_sums(head_closed, n_carry, loop.m)
        return cls(
            jaxpr=jaxpr, consts=list(closed.consts), in_tree=in_tree, dynamic=dynamic,
            out_tree=jax.tree_util.tree_structure(out_shape), marker=marker, prefix=prefix,
            ext=ext, head_outs=head_outs, loop=loop, seen=seen,
            head=sums, head_micro=microbatched(sums.analysis, head_closed, loop.m),
            head_whole=head_closed,
        )  # fmt: skip

    def composite(self, *args):
        """The loss: the prefix as traced, the scan and head as the 1F1B loop."""
        flat = _pick(jax.tree_util.tree_leaves(args), self.dynamic)
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, flat))
        marker = self.marker
        wanted = [*marker.invars, *self.ext] + [
            v for v in self.jaxpr.outvars if not isinstance(v, Literal) and v not in self.head_outs
        ]
        got = dict(zip(wanted, _evaluate(self.prefix, env, wanted)))
        read = lambda v: v.val if isinstance(v, Literal) else got[v]  # noqa: E731
        n_carry, n_xs = self.loop.n_carry, len(marker.invars) - self.loop.n_carry
        n_xs -= len(self.loop.consts)
        ins = [read(v) for v in marker.invars]
        carry, stacked, consts = ins[:n_carry], ins[n_carry : n_carry + n_xs], ins[n_carry + n_xs :]
        outs = _pipelined(self)(carry, stacked, consts, [read(v) for v in self.ext])
        got.update(zip(self.head_outs, outs))
        leaves = [read(v) for v in self.jaxpr.outvars]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)


def _evaluate(eqns: list, env: dict, wanted: list) -> list:
    """The values of ``wanted`` after binding ``eqns`` (in order) on ``env``."""
    env = dict(env)

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for e in eqns:
        for v, o in zip(e.outvars, bind_with_source(e, [read(v) for v in e.invars], e.params)):
            env[v] = o
    return [read(v) for v in wanted]


def _pipelined(split_loss: _SplitLoss) -> Callable:
    """The scan and head as one function whose gradient the 1F1B loop computes with its
    value (returned as residuals, scaled by the loss's cotangent)."""

    @jax.custom_vjp
    def run(carry, stacked, consts, ext):
        return _one_f_one_b(split_loss, carry, stacked, consts, ext)[0]

    def forward(carry, stacked, consts, ext):
        return _one_f_one_b(split_loss, carry, stacked, consts, ext)

    def backward(grads, cts):
        scale = cts[0]
        return jax.tree_util.tree_map(
            lambda g: None if g is None else g * scale.astype(g.dtype),
            grads,
            is_leaf=lambda g: g is None,
        )

    run.defvjp(forward, backward)
    return run


def _cotangents(f: Callable, primals: tuple, ct) -> tuple:
    """``jax.vjp(f, *primals)[1](ct)`` without computing ``f``'s result: the backward
    pass of a layer whose inputs were saved, its forward pass recomputed inside it as
    the body's own remat policy says (JAX's vjp computes the result anyway; XLA would
    drop it, but the plan would count its work)."""

    def backward(primals, ct):
        return jax.vjp(f, *primals)[1](ct)

    closed, shape = jax.make_jaxpr(backward, return_shape=True)(primals, ct)
    flat = jax.tree_util.tree_leaves((primals, ct))
    out = jaxpr_as_fun(without_dead_code(closed))(*flat)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)


def _segments(stages: int, microbatches: int) -> list[tuple[int, int, dict]]:
    """The 1F1B loop's three phases, ``(first, stop, flags)``: S−1 iterations forward
    only, M forward and backward, S−1 backward only; the flags say whether the stages
    run forward and backward and send the activations on and the cotangents back. A
    phase of one iteration, which XLA runs unrolled, sends nothing no later iteration
    reads (the same send inside a longer loop runs on every iteration).

    Example:
        >>> [(a, b, sorted(k for k, v in f.items() if v)) for a, b, f in _segments(2, 3)]
        [(0, 1, ['forward', 'send']), (1, 4, ['backward', 'forward', 'send', 'send_back']), (4, 5, ['backward'])]
    """
    s, m = stages, microbatches
    phases = [
        (0, s - 1, {"forward": True, "backward": False, "send": True, "send_back": False}),
        (s - 1, m + s - 1,
         {"forward": True, "backward": True, "send": m > 1 and s > 1, "send_back": s > 1}),
        (m + s - 1, m + 2 * s - 2,
         {"forward": False, "backward": True, "send": False, "send_back": s > 2}),
    ]  # fmt: skip
    return [(a, b, f) for a, b, f in phases if b > a]


def _put2(ring, x, k, i):
    """``ring`` with ``x`` at [k, i]."""
    return jax.lax.dynamic_update_slice(ring, x[None, None], (k, i) + (0,) * x.ndim)


def _at2(ring, k, i):
    """``ring[k, i]``."""
    return jax.lax.dynamic_slice(ring, (k, i) + (0,) * (ring.ndim - 2), (1, 1, *ring.shape[2:]))[
        0, 0
    ]


def _head_weight_grads(split_loss, y, ext, fixed_ids, diff) -> list:
    """The loss's gradient with respect to the head's inputs that do not carry the batch
    (its weights), from the whole batch's final activations ``y``: one backward pass of
    the head, its sums over the batch done once."""
    head_fn = jaxpr_as_fun(split_loss.head_whole)
    fixed = _pick(ext, fixed_ids)

    def loss(fd):
        vals = list(ext)
        for i, v in zip(fixed_ids, _merge(fixed, diff, fd)):
            vals[i] = v
        return head_fn(*split_loss.head_whole.consts, *y, *vals)[0]

    out, vjp = jax.vjp(loss, _pick(fixed, diff))
    return vjp(jnp.ones_like(out))[0]


def _one_f_one_b(split_loss: _SplitLoss, carry, stacked, consts, ext):
    """The 1F1B loop (module doc): the head's outputs summed over microbatches, and the
    loss's gradients with respect to every operand (None where not differentiable)."""
    loop, head = split_loss.loop, split_loss.head
    seen = split_loss.seen
    s, m, axis, n_carry = loop.stages, loop.m, loop.axis, loop.n_carry
    per, ring = loop.layers // s, 2 * s - 1
    layers_pin, slots, whole = pin_origins(loop.line)

    def pin(x, spec, origin=slots):
        return hint_p.bind(x, spec=spec, origin=origin)

    seen.busy += 1
    try:
        if loop.reverse:
            stacked = [jnp.flip(x, 0) for x in stacked]
        stacked = [pin(x.reshape(s, per, *x.shape[1:]), P(axis), layers_pin) for x in stacked]
        batch_of = dict(loop.batch_consts)
        fixed_ids = [i for i in range(len(consts)) if i not in batch_of]
        moving = [(c, 0) for c in carry] + [(consts[i], d) for i, d in loop.batch_consts]
        micro = [pin(split(v, d, m), P(None), whole) for v, d in moving]
        fixed = _pick(consts, fixed_ids)
        body = jaxpr_as_fun(loop.micro)

        w_idx = [k for k, x in enumerate(stacked) if _inexact(x)]
        s_idx = [k for k, x in enumerate(micro) if _inexact(x)]
        f_idx = [k for k, x in enumerate(fixed) if _inexact(x)]
        c_idx = [k for k in s_idx if k < n_carry]  # the carry's differentiable leaves
        b_idx = [k - n_carry for k in s_idx if k >= n_carry]  # ... and the batch consts'

        def layer_fn(bc, fixed_vals, c, w):
            cs = list(consts)
            for i, v in zip(fixed_ids, fixed_vals):
                cs[i] = v
            for (i, _), v in zip(loop.batch_consts, bc):
                cs[i] = v
            return list(body(*cs, *c, *w))

        def stage(weights, slot, fixed_vals, ring, k):
            """The slot after the stage's layers, each layer's input carry written into
            slot ``k`` of the stage's ``ring`` (for the backward pass, which recomputes
            inside a layer as its body says)."""
            bc = slot[n_carry:]

            def layer(state, w):
                c, ring, i = state
                ring = [_put2(r, x, k, i) for r, x in zip(ring, c)]
                return (layer_fn(bc, fixed_vals, c, w), ring, i + 1), None

            (c, ring, _), _ = ORIGINAL_SCAN(
                layer, (list(slot[:n_carry]), list(ring), jnp.int32(0)), list(weights)
            )
            return [*c, *bc], ring

        def stage_back(weights, ring, k, bc, fixed_vals, ct):
            """The stage's backward pass from its layers' saved inputs: a reverse scan of
            one layer's vjp each; ``ct`` is the cotangent of the slot's differentiable
            entries. Returns (weight gradients, the slot's, the fixed consts')."""
            ct_c, ct_b = ct[: len(c_idx)], ct[len(c_idx) :]

            def step(acc, w):
                dc, db, df, i = acc
                x = [_at2(r, k, i) for r in ring]

                def f(wd, xd, bd, fd):
                    out = layer_fn(_merge(bc, b_idx, bd), _merge(fixed_vals, f_idx, fd),
                                   _merge(x, c_idx, xd), _merge(w, w_idx, wd))  # fmt: skip
                    return _pick(out, c_idx)

                primals = (
                    _pick(w, w_idx),
                    _pick(x, c_idx),
                    _pick(bc, b_idx),
                    _pick(fixed_vals, f_idx),
                )
                gw, gx, gb, gf = _cotangents(f, primals, dc)
                db = [a + g for a, g in zip(db, gb)]
                df = [a + g for a, g in zip(df, gf)]
                return (gx, db, df, i - 1), gw

            zeros_b = [jnp.zeros_like(bc[k]) for k in b_idx]
            zeros_f = [jnp.zeros_like(fixed_vals[k]) for k in f_idx]
            (dx, db, df, _), dws = ORIGINAL_SCAN(
                step,
                (list(ct_c), zeros_b, zeros_f, jnp.int32(per - 1)),
                list(weights),
                reverse=True,
            )
            return list(dws), [*dx, *(a + g for a, g in zip(ct_b, db))], list(df)

        run_f = jax.vmap(stage, in_axes=(0, 0, None, 0, 0))
        run_b = jax.vmap(stage_back, in_axes=(0, 0, 0, 0, None, 0))

        # the head: its inputs that carry the batch travel per microbatch
        hbatch = dict(head.analysis.batch_consts)
        hfixed_ids = [i for i in range(len(ext)) if i not in hbatch]
        hrows = [pin(split(ext[i], d, m), P(None), whole) for i, d in head.analysis.batch_consts]
        hfixed = _pick(ext, hfixed_ids)
        hrow_idx = [k for k, x in enumerate(hrows) if _inexact(x)]
        hfix_idx = [k for k, x in enumerate(hfixed) if _inexact(x)]
        y_idx = [k for k in range(n_carry) if k in s_idx]
        head_fn = jaxpr_as_fun(split_loss.head_micro)

        def run_head(y, rows):
            vals = list(ext)
            for j, (i, _) in enumerate(head.analysis.batch_consts):
                vals[i] = rows[j]
            return head_fn(*split_loss.head_whole.consts, *y, *vals)

        def head_step(y, rows):
            # the gradient of the head's own weights is taken once after the loop, on the
            # whole batch: accumulated here, it would be summed over the data-parallel
            # axes at every iteration
            def f(yd, rd):
                return run_head(_merge(y, y_idx, yd), _merge(rows, hrow_idx, rd))

            outs, vjp = jax.vjp(f, _pick(y, y_idx), _pick(rows, hrow_idx))
            ct = [jnp.ones_like(outs[0])] + [jnp.zeros_like(o) for o in outs[1:]]
            return outs, vjp(ct)

        ids = jnp.arange(s)

        def on_stage(mask, v):
            return mask.reshape((s,) + (1,) * (v.ndim - 1))

        def at(v, i):
            return jax.lax.dynamic_index_in_dim(v, i, 0, False)

        def put(v, x, i):
            return jax.lax.dynamic_update_index_in_dim(v, x, i, 0)

        per_stage_at = jax.vmap(at)
        per_stage_put = jax.vmap(put)

        def tick(state, t, forward, backward, send, send_back):
            fbuf, saved, saved_bc, bbuf, dw, dfix, dmicro, sums, drows, ys = state
            fout = None
            if forward:
                j = jnp.clip(t, 0, m - 1)
                first = (ids == 0) & (t < m)
                fbuf = [
                    jnp.where(on_stage(first, b), at(v, j)[None], b) for v, b in zip(micro, fbuf)
                ]
                fbuf = [pin(b, P(axis)) for b in fbuf]
                slot = jnp.mod(t - ids, ring)
                fout, saved = run_f(stacked, fbuf, fixed, saved, slot)
                fout = [pin(b, P(axis)) for b in fout]
                saved = [pin(v, P(axis)) for v in saved]
                saved_bc = [pin(per_stage_put(v, b, slot), P(axis))
                            for v, b in zip(saved_bc, fbuf[n_carry:])]  # fmt: skip
            if forward and backward:  # the head of the microbatch the last stage finished
                last = ids == s - 1
                y = [jnp.sum(jnp.where(on_stage(last, o), o, jnp.zeros_like(o)), axis=0)
                     for o in fout[:n_carry]]  # fmt: skip
                mh = t - (s - 1)
                rows = [at(v, mh) for v in hrows]
                outs, (dy, drow) = head_step(y, rows)
                sums = [a + o for a, o in zip(sums, outs)]
                drows = [pin(put(a, g, mh), P(None), whole) for a, g in zip(drows, drow)]
                ys = [pin(put(a, v, mh), P(None), whole) for a, v in zip(ys, y)]
                ct_last = list(dy) + [jnp.zeros_like(micro[k][0]) for k in s_idx if k >= n_carry]
                bbuf = [jnp.where(on_stage(last, b), c[None], b) for c, b in zip(ct_last, bbuf)]
                bbuf = [pin(b, P(axis)) for b in bbuf]
            if backward:
                mb = t - (2 * s - 2 - ids)
                valid = (mb >= 0) & (mb < m)
                bc = [per_stage_at(v, jnp.mod(mb, ring)) for v in saved_bc]
                gw, gslot, gfix = run_b(stacked, saved, jnp.mod(mb, ring), bc, fixed, bbuf)
                dw = [pin(a + jnp.where(on_stage(valid, g), g, 0), P(axis), layers_pin)
                      for a, g in zip(dw, gw)]  # fmt: skip
                dfix = [pin(a + jnp.where(on_stage(valid, g), g, 0), P(axis))
                        for a, g in zip(dfix, gfix)]  # fmt: skip
                m0 = t - (2 * s - 2)
                k0 = jnp.clip(m0, 0, m - 1)
                ok0 = (m0 >= 0) & (m0 < m)
                new = []
                for a, g in zip(dmicro, gslot):
                    g0 = jnp.sum(jnp.where(on_stage(ids == 0, g), g, jnp.zeros_like(g)), axis=0)
                    new.append(pin(put(a, jnp.where(ok0, g0, at(a, k0)), k0), P(None), whole))
                dmicro = new
                if send_back:
                    bbuf = [pin(b, P(axis)) for b in shift(list(gslot), axis, s, back=True)]
            if send:
                fbuf = [pin(b, P(axis)) for b in shift(fout, axis, s)]
            return (fbuf, saved, saved_bc, bbuf, dw, dfix, dmicro, sums, drows, ys), None

        fbuf = [pin(jnp.broadcast_to(v[0], (s, *v.shape[1:])), P(axis)) for v in micro]
        saved = [pin(jnp.broadcast_to(v[0], (s, ring, per, *v.shape[1:])), P(axis))
                 for v in micro[:n_carry]]  # fmt: skip
        saved_bc = [pin(jnp.broadcast_to(v[0], (s, ring, *v.shape[1:])), P(axis))
                    for v in micro[n_carry:]]  # fmt: skip
        bbuf = [pin(jnp.zeros((s, *micro[k].shape[1:]), micro[k].dtype), P(axis)) for k in s_idx]
        dw = [pin(jnp.zeros_like(stacked[k]), P(axis), layers_pin) for k in w_idx]
        dfix = [pin(jnp.zeros((s, *np.shape(fixed[k])), jnp.result_type(fixed[k])), P(axis))
                for k in f_idx]  # fmt: skip
        dmicro = [pin(jnp.zeros_like(micro[k]), P(None), whole) for k in s_idx]
        out_avals = split_loss.head_micro.out_avals
        sums = [jnp.zeros(a.shape, a.dtype) for a in out_avals]
        drows = [pin(jnp.zeros_like(hrows[k]), P(None), whole) for k in hrow_idx]
        ys = [pin(jnp.zeros_like(micro[k]), P(None), whole) for k in range(n_carry)]
        state = (fbuf, saved, saved_bc, bbuf, dw, dfix, dmicro, sums, drows, ys)
        for first, stop, flags in _segments(s, m):
            step = functools.partial(tick, **flags)
            state, _ = ORIGINAL_SCAN(step, state, jnp.arange(first, stop))
        _, _, _, _, dw, dfix, dmicro, sums, drows, ys = state
        dhfix = _head_weight_grads(split_loss, [join(y) for y in ys], ext, hfixed_ids, hfix_idx)
    finally:
        seen.busy -= 1

    # gradients back in the operands' shapes
    g_stacked: list = [None] * len(stacked)
    for k, g in zip(w_idx, dw):
        g = g.reshape(loop.layers, *g.shape[2:])
        g_stacked[k] = jnp.flip(g, 0) if loop.reverse else g
    g_moving: list = [None] * len(moving)
    for k, g in zip(s_idx, dmicro):
        g_moving[k] = join(g) if k < n_carry else unsplit(g, moving[k][1])
    g_consts: list = [None] * len(consts)
    for k, g in zip(f_idx, dfix):
        g_consts[fixed_ids[k]] = jnp.sum(g, axis=0)
    for j, (i, _) in enumerate(loop.batch_consts):
        g_consts[i] = g_moving[n_carry + j]
    g_ext: list = [None] * len(ext)
    for k, g in zip(hrow_idx, drows):
        i, d = head.analysis.batch_consts[k]
        g_ext[i] = unsplit(g, d)
    for k, g in zip(hfix_idx, dhfix):
        g_ext[hfixed_ids[k]] = g
    seen.record_1f1b(loop)
    grads = (g_moving[:n_carry], g_stacked, g_consts, g_ext)
    return list(sums), grads
