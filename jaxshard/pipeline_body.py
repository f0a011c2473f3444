"""What a pipelined layer body must be, and its form at microbatch size.

`independence` proves that a scan's body treats the batch rows independently: a pseudo
mesh axis (`MICROBATCH`) of size M pinned on the carry's batch dim must reach the new
carry on the same dim, never be summed over, never need resharding and never reach the
per-layer ``xs``; values the body closes over that carry the batch are found on the way.
`microbatched` re-traces the body on microbatch-sized values, rewriting shape parameters
(a reshape to (B, T, H, Dh) becomes (B/M, T, H, Dh)) and inlining custom derivative rules.
`jaxshard.pipeline` uses both to decide which scans qualify and to run them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal
from jax.extend.core import primitives as prims

from jaxshard.annotate import Pin
from jaxshard.errors import ShardingError
from jaxshard.graph import Graph, build_graph
from jaxshard.jax_compat import bind_with_source, consts_as_inputs, scan_counts, user_context
from jaxshard.propagate import Propagator
from jaxshard.rule import region_fn_for
from jaxshard.trace import Traced

MICROBATCH = "__microbatch__"  # the pseudo mesh axis that proves batch independence
ORIGINAL_SCAN = jax.lax.scan  # the body's own scans run unpipelined


class Rejected(Exception):
    """A scan that does not qualify, with the reason."""


# the `jaxshard.pipeline.Interception` of the planning tracing on this thread, if any:
# read by the interceptors of `jax.lax.scan` and of `jax.value_and_grad`/`jax.grad`
_ACTIVE = threading.local()


def active_interception():
    """The `Interception` of the planning tracing on this thread, if any.

    Example:
        >>> active_interception() is None  # outside `jaxshard.pipeline.intercepting`
        True
    """
    return getattr(_ACTIVE, "value", None)


def activate(seen):
    """Make ``seen`` (an `Interception`, or None) this thread's; returns the one it
    replaces, to restore afterwards.

    Example:
        >>> outer = activate(seen)  # doctest: +SKIP
        >>> activate(outer)  # doctest: +SKIP
    """
    outer = active_interception()
    _ACTIVE.value = seen
    return outer


# --- proving the body treats the batch independently ------------------------------------


@dataclass
class _Analysis:
    graph: Graph
    dims: list
    batch_consts: list[tuple[int, int]]  # (const index, its batch dim)
    n_consts: int


def _propagated(closed: ClosedJaxpr, names: list[str], pinned: range, m: int):
    """The graph of ``closed`` (consts first as inputs, named ``names``) and its
    propagation of a pseudo axis of size ``m`` pinned on the leading dim of the inputs
    at positions ``pinned``."""
    jaxpr = consts_as_inputs(closed.jaxpr)
    n_in = len(jaxpr.invars)
    traced = Traced(
        ClosedJaxpr(jaxpr, []),
        tuple(names),
        tuple(f"out/{i}" for i in range(len(jaxpr.outvars))),
        jax.tree_util.tree_structure((tuple(range(n_in)), {})),
        jax.tree_util.tree_structure(tuple(range(len(jaxpr.outvars)))),
        tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars),
    )
    sizes = {MICROBATCH: m}
    graph = build_graph(traced, sizes)
    prop = Propagator(graph, sizes)
    for vid in (graph.in_vids[i] for i in pinned):
        rank = len(graph.shapes[vid])
        prop.pin(vid, Pin(((MICROBATCH,),) + (None,) * (rank - 1), "the pipeline's microbatches"))
    prop.run()
    return graph, prop


def _batch_dims(dims, vid: int) -> list[int]:
    return [d for d, ax in enumerate(dims[vid]) if ax and MICROBATCH in ax]


def _rows_kept_apart(graph: Graph, prop: Propagator, a: int, what: str) -> None:
    """`Rejected` unless application ``a`` works in the layouts its values hold as far as
    the pseudo axis goes (no row mixed with another)."""
    layouts = prop.state.layouts
    for vid, d, want in prop.working(a)[0]:
        held, wanted = layouts[vid][d].axes or (), want or ()
        if (MICROBATCH in held) != (MICROBATCH in wanted):
            raise Rejected(f"{what} mixes batch rows at {graph.apps[a].describe()}")


def _found_batch(graph: Graph, dims, vids, what: str) -> list[tuple[int, int]]:
    """(position, batch dim) of each of ``vids`` the pseudo axis reached."""
    out = []
    for i, vid in enumerate(vids):
        found = _batch_dims(dims, vid)
        if len(found) > 1:
            raise Rejected(f"{what} has the batch on dims {found}")
        if found:
            out.append((i, found[0]))
    return out


def independence(closed: ClosedJaxpr, n_carry: int, n_xs: int, m: int) -> _Analysis:
    """Propagate a pseudo axis of size ``m`` from the carry's batch dim through the body
    (consts first as inputs); `Rejected` naming the equation that mixes rows.

    Example:
        >>> body = jax.make_jaxpr(lambda h, w: [h.sum(0) * w])(np.ones((8, 4)), np.ones(4))
        >>> independence(body, 1, 1, 4)
        Traceback (most recent call last):
        jaxshard.pipeline_body.Rejected: its body sums over the batch at reduce_sum...
    """
    n_consts = len(closed.consts)
    names = [f"const/{i}" for i in range(n_consts)]
    names += [f"carry/{i}" for i in range(n_carry)] + [f"xs/{i}" for i in range(n_xs)]
    graph, prop = _propagated(closed, names, range(n_consts, n_consts + n_carry), m)
    dims = prop.state.dims
    for a, app in enumerate(graph.apps):
        if MICROBATCH in prop.working(a)[1]:
            raise Rejected(f"its body sums over the batch at {app.describe()}")
        _rows_kept_apart(graph, prop, a, "its body")
    for i, vid in enumerate(graph.out_vids):
        if _batch_dims(dims, vid) != [0]:
            raise Rejected(
                f"its body's new carry leaf {i} does not keep the batch on its leading dim "
                f"(batch found on dims {_batch_dims(dims, vid)})"
            )
    for i, vid in enumerate(graph.in_vids[n_consts + n_carry :]):
        if _batch_dims(dims, vid):
            raise Rejected(f"its xs leaf {i} has a batch dim; xs must be per-layer parameters")
    batch_consts = _found_batch(
        graph, dims, graph.in_vids[:n_consts], "a value its body closes over"
    )
    return _Analysis(graph, dims, batch_consts, n_consts)


# --- the loss head: a sum over rows ---------------------------------------------------------

# primitives through which a value that is a sum over microbatches stays one, given which
# operands may be such sums: "all" (every operand: add), "first" (a scale or divisor
# that does not depend on the rows: div), "one" (exactly one operand: mul, dot_general);
# calls (jit) are inlined in the graph, region links pass their values on unchanged
_LINEAR = {
    "add": "all", "add_any": "all", "sub": "all", "neg": "all", "reduce_sum": "all",
    "reshape": "all", "squeeze": "all", "expand_dims": "all", "broadcast_in_dim": "all",
    "transpose": "all", "convert_element_type": "all", "copy": "all",
    "sharding_constraint": "all", "jaxshard_hint": "all",
    "div": "first", "mul": "one", "dot_general": "one",
}  # fmt: skip


@dataclass
class _Head:
    analysis: _Analysis  # batch_consts: (position among the head's other inputs, dim)
    summed: list[int]  # the head's outputs that are sums over the rows (the loss first)


def head_sums(closed: ClosedJaxpr, n_carry: int, m: int) -> _Head:
    """Prove that the loss head (the step after the layer scan: final norm, output
    projection, per-example loss and its mean) is a sum of per-microbatch terms: its
    inputs are the scan's carry (first ``n_carry``, batch leading) and other values;
    rows are never mixed, every reduction over the batch is a sum, and what follows a
    sum is linear in it (scaled or divided by values that do not depend on the rows,
    added only to other such sums), up to every output. Run on a microbatch, the head
    then gives that microbatch's share of the loss (a mean divides by the whole batch's
    size, a constant of the program). `Rejected` with the equation that breaks it.

    Example:
        >>> head = jax.make_jaxpr(lambda h: [(h ** 2).mean()])(np.ones((8, 4)))
        >>> head_sums(head, 1, 4).summed
        [0]
        >>> head_sums(jax.make_jaxpr(lambda h: [h.max()])(np.ones((8, 4))), 1, 4)
        Traceback (most recent call last):
        jaxshard.pipeline_body.Rejected: the loss reduces over the batch at reduce_max...
    """
    n_consts = len(closed.consts)
    n_in = len(closed.jaxpr.invars)
    names = [f"const/{i}" for i in range(n_consts)]
    names += [f"carry/{i}" for i in range(n_carry)]
    names += [f"in/{i}" for i in range(n_in - n_carry)]
    graph, prop = _propagated(closed, names, range(n_consts, n_consts + n_carry), m)
    dims = prop.state.dims
    rows = set(graph.in_vids[n_consts : n_consts + n_carry])  # depend on the rows
    sums: set[int] = set()  # sums over the rows: linear in them
    for a, app in enumerate(graph.apps):
        where = app.describe()
        inputs = [v for v in app.operands if v in rows or v in sums]
        if not inputs:
            continue
        _rows_kept_apart(graph, prop, a, "the loss")
        summing = MICROBATCH in prop.working(a)[1]
        if any(v in sums for v in app.operands):
            name = app.eqn.primitive.name if app.eqn is not None else "link"
            how = "all" if app.eqn is None else _LINEAR.get(name)
            summed = [v in sums for v in app.operands]
            ok = (
                not summing
                and not any(v in rows and v not in sums for v in app.operands)
                and (
                    (how == "all" and all(summed))
                    or (how == "first" and summed[0] and not any(summed[1:]))
                    or (how == "one" and sum(summed) == 1 and len(inputs) == 1)
                )
            )
            if not ok:
                raise Rejected(
                    f"the loss is not a sum of per-example terms: {where} takes a sum over the "
                    "batch and is not linear in it (a mean of per-example losses is, also "
                    "divided by a count the layers do not change; a sum plus a term the layers "
                    "do not change, or a nonlinear function of the mean, is not)"
                )
            sums.update(app.results)
        elif summing:
            if app.eqn is None or app.eqn.primitive.name not in ("reduce_sum", "dot_general"):
                raise Rejected(
                    f"the loss reduces over the batch at {where} with something other than "
                    "a sum (a mean of per-example losses is a sum)"
                )
            sums.update(app.results)
        else:
            rows.update(app.results)
    summed = []
    for i, vid in enumerate(graph.out_vids):
        if vid in sums:
            summed.append(i)
        elif vid in rows:
            raise Rejected(
                f"the loss function returns a value per example (output {i}) after the "
                "layer scan; 1F1B needs every output of the loss that depends on the layers "
                "to be a sum or mean over the batch"
            )
    if _found_batch(graph, dims, graph.in_vids[:n_consts], "a constant of the loss"):
        raise Rejected("the loss after the layer scan holds a constant with the batch's rows")
    batch_ins = _found_batch(
        graph, dims, graph.in_vids[n_consts + n_carry :], "a value the loss reads"
    )
    return _Head(_Analysis(graph, dims, batch_ins, n_consts), summed)


# --- the body at microbatch size ----------------------------------------------------------


def microbatched(analysis: _Analysis, closed: ClosedJaxpr, m: int) -> ClosedJaxpr:
    """The body (consts first as inputs) re-traced on microbatch-sized values.

    Example:
        >>> micro = microbatched(independence(body, 1, 1, 4), body, 4)  # doctest: +SKIP
    """
    jaxpr = consts_as_inputs(closed.jaxpr)
    shrink = _Shrink(analysis.graph, analysis.dims, m)
    avals = [jax.ShapeDtypeStruct(shrink.shape((), v), v.aval.dtype) for v in jaxpr.invars]
    return jax.make_jaxpr(lambda *a: shrink.run(jaxpr, (), (), a))(*avals)


_SHAPE_PARAMS = {
    "reshape": "new_sizes",
    "broadcast_in_dim": "shape",
    "dynamic_slice": "slice_sizes",
    "rng_bit_generator": "shape",
    "random_bits": "shape",
}


class _Shrink:
    """Evaluates a jaxpr on microbatch-sized values: every value whose dim the pseudo
    axis reached is 1/M the size there, and shape parameters follow."""

    def __init__(self, graph: Graph, dims, m: int):
        self.graph, self.dims, self.m = graph, dims, m

    def shape(self, path, var) -> tuple[int, ...]:
        vid = self.graph.var_vids[path][var]
        dims = self.dims[vid]
        return tuple(
            n // self.m if dims[d] and MICROBATCH in dims[d] else n
            for d, n in enumerate(self.graph.shapes[vid])
        )

    def run(self, jaxpr, consts, path, args) -> list:
        env: dict = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, a in zip(jaxpr.invars, args):
            env[v] = a

        def read(v):
            return v.val if isinstance(v, Literal) else env[v]

        for k, eqn in enumerate(jaxpr.eqns):
            outs = self.eqn(eqn, path, k, [read(v) for v in eqn.invars])
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, path, k, ins) -> list:
        want = [self.shape(path, v) for v in eqn.outvars]
        same_in = all(np.shape(x) == tuple(v.aval.shape) for x, v in zip(ins, eqn.invars))
        if same_in and want == [tuple(v.aval.shape) for v in eqn.outvars]:
            return _bind(eqn, ins, eqn.params)
        from jaxshard.graph import source_line

        line = source_line(eqn)
        if region_fn_for(eqn.primitive) is not None:
            with user_context(eqn):
                outs = self.nested(eqn, path + (k,), ins)
        else:
            name = eqn.primitive.name
            params = dict(eqn.params)
            if name == "iota" and any(a != b for a, b in zip(want[0], eqn.outvars[0].aval.shape)):
                raise ShardingError(
                    f"pipeline: the layer body numbers the batch rows (iota at {line}); each "
                    "microbatch would number its own rows. Pass row indices in as a value "
                    "that carries the batch instead."
                )
            if name in _SHAPE_PARAMS:
                params[_SHAPE_PARAMS[name]] = want[0]
            elif name == "gather":
                old = eqn.invars[0].aval.shape
                sizes = list(params["slice_sizes"])
                for d, (n_old, n_new) in enumerate(zip(old, np.shape(ins[0]))):
                    if n_old != n_new and sizes[d] == n_old:
                        sizes[d] = n_new
                params["slice_sizes"] = tuple(sizes)
            elif name == "slice":  # whole along the batch: the microbatch whole too
                old = eqn.invars[0].aval.shape
                limits = list(params["limit_indices"])
                for d, (n_old, n_new) in enumerate(zip(old, np.shape(ins[0]))):
                    if n_old != n_new and params["start_indices"][d] == 0 and limits[d] == n_old:
                        limits[d] = n_new
                params["limit_indices"] = tuple(limits)
            outs = _bind(eqn, ins, params)
        got = [tuple(np.shape(o)) for o in outs]
        if got != want:
            raise ShardingError(
                f"pipeline: cannot run {eqn.primitive.name} at {line} on microbatches (its "
                f"result would be {got}, the batch analysis expects {want}). Write the layer "
                "body without fixed batch-size shapes there, or drop pipeline=."
            )
        return outs

    def nested(self, eqn, path, ins) -> list:
        """A higher-order equation on microbatch-sized operands, re-expressed with the
        public API around the shrunk bodies (calls and custom derivatives inlined)."""
        prim, name, params = eqn.primitive, eqn.primitive.name, eqn.params
        regions = region_fn_for(prim)(eqn)

        def body(r):
            region = regions[r]
            return lambda *a: self.run(region.jaxpr, region.consts, path + (r,), a)

        if prim is prims.remat_p:
            fn = jax.checkpoint(
                lambda *a: body(0)(*a), prevent_cse=params["prevent_cse"], policy=params["policy"]
            )
            return list(fn(*ins))
        if prim is prims.scan_p:
            nc, ncar = scan_counts(params)
            consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
            inner = body(0)

            def step(c, x):
                out = inner(*consts, *c, *x)
                return tuple(out[:ncar]), tuple(out[ncar:])

            c, ys = ORIGINAL_SCAN(
                step, tuple(init), tuple(xs), length=params["length"],
                reverse=params["reverse"], unroll=params["unroll"],
            )  # fmt: skip
            return [*c, *ys]
        if prim is prims.while_p:
            cn, bn = params["cond_nconsts"], params["body_nconsts"]
            cc, bc, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
            cond, step = body(0), body(1)
            out = jax.lax.while_loop(
                lambda c: cond(*cc, *c)[0], lambda c: tuple(step(*bc, *c)), tuple(init)
            )
            return list(out)
        if prim is prims.cond_p:
            branches = [_tupled(body(r)) for r in range(len(regions))]
            return list(jax.lax.switch(ins[0], branches, *ins[1:]))
        if len(regions) == 1 and all(
            link.outer == link.inner and link.rule is None for link in regions[0].links
        ):  # jit, closed_call, custom_jvp/vjp calls, composites: inline
            return body(0)(*ins)
        raise ShardingError(
            f"pipeline: cannot run {name} inside the layer body on microbatches; move it "
            "out of the scanned layer or drop pipeline="
        )


def _tupled(fn):
    """``fn`` returning a tuple (what `lax.switch` branches must agree on)."""
    return lambda *a: tuple(fn(*a))


def _bind(eqn, ins, params) -> list:
    """``eqn`` applied to ``ins`` with ``params``, keeping its source line (as
    `jax.core.eval_jaxpr` does)."""
    return bind_with_source(eqn, ins, params)
