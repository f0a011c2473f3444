"""Memory per device: the buffers XLA's fusion never makes (`fused_liveness`; on CPU
with the epilogues fused into batched matmuls, `_epilogue_regions`), the plan's
estimate (`memory_estimate`: arguments, results and the largest live set of
intermediates, with work the schedule runs at one time peaking in program order:
`transient_peaks`; `peak_buffers`: what that set holds), the transposed copies XLA's
CPU matmuls read (`transposed_operands`), and the estimate's curve over the schedule
(`MemoryCurve`).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxshard.cost.schedule import Liveness, liveness, xla_scope
from jaxshard.cost.sizes import per_device_bytes, per_device_shape
from jaxshard.graph import AppKind, contracts
from jaxshard.lattice import DimSharding, slices_locally


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of a plan: arguments, results, and the largest live set of
    intermediates (at application ``peak_app``).

    Example:
        >>> MemoryEstimate(100, 100, 50, 3).total
        250
    """

    arguments: int
    results: int
    activations: int
    peak_app: int

    @property
    def total(self) -> int:
        """Arguments + results + peak activations (no buffer donated)."""
        return self.arguments + self.results + self.activations


# elementwise primitives XLA counts as expensive (`HloInstruction::IsExpensive`): its
# fusion does not duplicate them into several readers
EXPENSIVE = frozenset(
    {"exp", "exp2", "log", "log1p", "expm1", "div", "pow", "sqrt", "rsqrt", "cbrt", "tanh",
     "logistic", "erf", "erf_inv", "erfc", "atan2", "sin", "cos", "tan", "asin", "acos",
     "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "digamma", "rem"}
)  # fmt: skip


# reductions XLA fuses their elementwise operands into (an input fusion)
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})


def fused_liveness(
    graph, live: Liveness, extend: bool = True, matmul_epilogues: bool = False
) -> Liveness:
    """``live`` less the buffers XLA's fusion never makes: a value an elementwise
    equation computes (operands broadcast over size-1 dims included, `_row_broadcast`)
    and only elementwise equations or reductions (`REDUCTIONS`) read (a broadcast: or a
    broadcast fused in turn) is recomputed inside its readers' fusions, not stored (the
    backward pass reads such residuals of the forward's elementwise chains, say a layer
    norm's centred input, from their operands), unless an `EXPENSIVE` equation makes it
    for several readers (silu's sigmoid, read by the forward's product and the
    backward's derivative). With
    ``extend`` those operands stay alive until the fused value's last reader, as the
    recomputation needs them. With ``matmul_epilogues`` (XLA's CPU backend), a batched
    matmul's arithmetic epilogue is fused with it too (`_epilogue_regions`).

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.cost import liveness
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sort(jnp.sin(jnp.cos(x)) * 2), (jnp.ones(4),), {}), {})
        >>> len(liveness(g).intermediates), len(fused_liveness(g, liveness(g)).intermediates)
        (3, 1)
    """
    owner = live.owner
    producer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for a, app in enumerate(graph.apps):
        if app.kind is not AppKind.EQN:
            continue
        for v in app.results:
            producer.setdefault(owner[v], a)
        for v in app.operands:
            readers.setdefault(owner[v], []).append(a)
    elementwise: dict[int, bool] = {}

    def is_elementwise(a: int) -> bool:
        hit = elementwise.get(a)
        if hit is None:
            hit = elementwise[a] = _elementwise(graph, graph.apps[a])
        return hit

    loose: dict[int, bool] = {}

    def is_loosely_elementwise(a: int) -> bool:  # size-1 broadcasts allowed
        hit = loose.get(a)
        if hit is None:
            hit = loose[a] = is_elementwise(a) or _row_broadcast(graph, graph.apps[a])
        return hit

    scopes: dict[int, tuple] = {}

    def scope(a: int) -> tuple:
        hit = scopes.get(a)
        if hit is None:
            hit = scopes[a] = xla_scope(graph.apps[a].where, live.inlined)
        return hit

    # a value read inside a loop it is not made in is the loop's operand: XLA fuses only
    # within one computation, so it is stored (a mask broadcast JAX hoisted out of a scan)
    def fusible(a: int) -> bool:  # XLA fuses a broadcast into its readers too
        return is_loosely_elementwise(a) or graph.apps[a].eqn.primitive.name == "broadcast_in_dim"

    # XLA's fusion duplicates a producer into each of several readers only when it is
    # cheap: an expensive one (an exponential, a division) read twice is stored
    def duplicable(v: int) -> bool:
        eqn = graph.apps[producer[v]].eqn
        return len(set(readers.get(v, ()))) < 2 or eqn.primitive.name not in EXPENSIVE

    # a reduction reads its elementwise producers inside its own fusion (XLA's input
    # fusion): the squares of a gradient's norm are summed as they are computed; and a
    # broadcast that is fused itself takes the broadcast it reads along (XLA folds a
    # broadcast of a broadcast into one: vmap broadcasting the -inf of a masked softmax
    # over the pipeline's stages)
    def absorbs(r: int, broadcast: bool) -> bool:
        name = graph.apps[r].eqn.primitive.name
        if is_elementwise(r) or name in REDUCTIONS:
            return True
        return (
            broadcast
            and name == "broadcast_in_dim"
            and owner[graph.apps[r].results[0]] in fused_set
        )

    fused, fused_set = [], set()
    # readers before their operands' producers: whether a broadcast reader is fused is
    # known when its operand is looked at
    for v in sorted(live.intermediates.tolist(), key=lambda v: -producer.get(v, -1)):
        if v not in producer or not fusible(producer[v]):
            continue
        broadcast = graph.apps[producer[v]].eqn.primitive.name == "broadcast_in_dim"
        if (
            all(absorbs(r, broadcast) and scope(r) == scope(producer[v])
                for r in readers.get(v, ()))
            and duplicable(v)
        ):  # fmt: skip
            fused.append(v)
            fused_set.add(v)
    fused.sort()
    if matmul_epilogues:
        inside, outputs = _epilogue_regions(graph, owner, producer, readers, scope)
        fused = [v for v in fused if v not in outputs]
        held = set(live.intermediates.tolist())
        fused += sorted((inside & held).difference(fused))
    end = live.end.copy()
    if extend:  # later fused values first: their operands may be fused values too
        for v in sorted(fused, key=lambda v: -producer[v]):
            for u in graph.apps[producer[v]].operands:
                o = owner[u]
                if end[o] >= 0 and end[v] > end[o]:
                    end[o] = end[v]
    kept = np.setdiff1d(live.intermediates, np.array(fused, dtype=np.int64))
    # an elementwise result written over an operand of its shape that dies there (XLA
    # computes a fusion in place when its operand's buffer is free): the operand's buffer
    # ends as the result's begins. XLA drops a contraction's unit dims from its output,
    # and reads it through a bitcast that it does not overwrite: those wait for a layout
    # (`memory_estimate`)
    at = live.schedule.at if live.schedule is not None else np.arange(len(graph.apps))
    stored = set(kept.tolist())
    fused_set = set(fused)  # with the matmul epilogues
    squeezable: dict[int, int] = {}

    for v in stored:
        a = producer.get(v)
        if a is None or not is_loosely_elementwise(a):
            continue
        for o in _region_inputs(graph, owner, producer, fused_set.__contains__, a):
            if (
                o in stored and o != v and end[o] == at[a] and live.start[o] < at[a]
                and graph.shapes[o] == graph.shapes[v] and graph.dtypes[o] == graph.dtypes[v]
                and o in producer and scope(producer[o]) == scope(a)  # not a loop's operand
            ):  # fmt: skip
                end[o] = at[a] - 1
                if o in producer and contracts(graph.apps[producer[o]]):
                    squeezable[o] = int(at[a])
                break
    return Liveness(
        owner, live.start, end, kept, live.stacked, live.schedule, squeezable, live.span,
        live.results_from, live.inlined,
    )  # fmt: skip


def _row_broadcast(graph, app) -> bool:
    """Whether ``app`` is elementwise with operands broadcast over size-1 dims (JAX binds
    ``s - m`` for ``s[b, h, q, k]`` and ``m[b, h, q, 1]`` as it is): XLA fuses it into
    an elementwise reader, broadcast included.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> f = lambda s: jnp.exp(s - s.max(-1, keepdims=True))
        >>> g = build_graph(trace(f, (jnp.ones((4, 8)),), {}), {})
        >>> [a.eqn.primitive.name for a in g.apps if _row_broadcast(g, a)]
        ['sub']
    """
    if app.kind is not AppKind.EQN or not app.results or not app.rule.plain:
        return False
    shape = graph.shapes[app.results[0]]
    return all(
        len(graph.shapes[u]) == len(shape)
        and all(s in (1, r) for s, r in zip(graph.shapes[u], shape))
        for u in app.operands
    ) and any(graph.shapes[u] != shape for u in app.operands)


# what XLA's CPU backend fuses into a batched matmul after it (the `__ynn_fusion` that
# holds the attention backward's score gradient and its softmax backward): arithmetic,
# broadcasts and row sums
_EPILOGUE = frozenset({"add", "add_any", "sub", "mul", "div", "neg", "broadcast_in_dim"})


def _epilogue_regions(graph, owner, producer, readers, scope) -> tuple[set[int], set[int]]:
    """The buffers XLA's CPU backend fuses into batched matmuls, and those their fusions
    write. From a `dot_general` with batch dims, the fusion takes in every reader in the
    same computation that is arithmetic (`_EPILOGUE`, operands broadcast over size-1 dims
    included) or a sum over trailing dims, and so on from theirs: a value all of whose
    readers it takes is never stored (``inside``, the product first); one something else
    reads is the fusion's output (``outputs``, stored even where a plain elementwise
    reader would fuse it). Measured on the 70B step's attention backward at 256 devices:
    the score gradient's matmul, its division by the softmax's sum, the row sum of its
    product with the probabilities and the rest of the softmax backward are one fusion
    with one score-sized output, where the forward's score matmul, read by the mask's
    select, is a fusion of its own.

    Example:
        >>> import jax, jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> from jaxshard.cost import liveness
        >>> f = lambda q, k: jnp.sum((q @ k) * 2, axis=-1)   # q, k batched: (2, 4, 4)
        >>> g = build_graph(trace(f, (jnp.ones((2, 4, 4)), jnp.ones((2, 4, 4))), {}), {})
        >>> n = len(fused_liveness(g, liveness(g)).intermediates)
        >>> n, len(fused_liveness(g, liveness(g), matmul_epilogues=True).intermediates)
        (1, 0)
    """
    inside: set[int] = set()
    outputs: set[int] = set()

    def takes(r: int, where) -> bool:
        app = graph.apps[r]
        if app.kind is not AppKind.EQN or scope(r) != where:
            return False
        name = app.eqn.primitive.name
        if name == "reduce_sum":
            rank = len(graph.shapes[app.operands[0]])
            axes = tuple(sorted(app.eqn.params["axes"]))
            return axes == tuple(range(rank - len(axes), rank))
        return name in _EPILOGUE

    for a, app in enumerate(graph.apps):
        if app.kind is not AppKind.EQN or app.eqn.primitive.name != "dot_general":
            continue
        if not app.eqn.params["dimension_numbers"][1][0]:
            continue  # no batch dims: XLA fuses nothing after it
        where, region, todo = scope(a), {a}, [a]
        while todo:
            for v in graph.apps[todo.pop()].results:
                for r in readers.get(owner[v], ()):
                    if r not in region and takes(r, where):
                        region.add(r)
                        todo.append(r)
        if not any(graph.apps[r].eqn.primitive.name == "reduce_sum" for r in region):
            continue  # no row sum: XLA runs the matmul alone, its epilogue in a loop fusion
        for r in region:
            for v in graph.apps[r].results:
                o = owner[v]
                if producer.get(o) != r:
                    continue
                if all(u in region for u in readers.get(o, ())) and readers.get(o):
                    inside.add(o)
                else:
                    outputs.add(o)
    return inside, outputs - inside


def memory_estimate(
    graph,
    dims: Sequence[Sequence[DimSharding]],
    axis_sizes: Mapping[str, int],
    out_dims: Sequence[Sequence[DimSharding]] | None = None,
    live: Liveness | None = None,
    extra: Iterable[tuple] = (),
) -> MemoryEstimate:
    """Per-device memory of a layout of every value of ``graph``; ``extra`` adds buffers
    no value holds, as ``(first, last, bytes)`` or ``(first, last, bytes, what)``: alive
    from application ``first`` to ``last`` (the gathered copy of a parameter stored
    apart); `peak_buffers` lists what is alive at the peak.

    The approximation: a linear scan over the equations in program order, each
    intermediate alive from the equation that makes it to its last reader, every one a
    buffer of its own. XLA fuses elementwise chains (fewer, shorter-lived buffers) and
    may reorder, so this over-counts activations of unfused code; arguments and results
    (kept apart, as without donation) are exact. A loop's stack that XLA's buffer
    assignment puts in the buffer of a result written after it (`_in_result_buffers`: a
    scanned gradient in a new weight's buffer) costs nothing of its own.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sin(x) * 2, (jnp.ones((8, 4)),), {}), {})
        >>> memory_estimate(g, [[("data",), ()]] * len(g.shapes), {"data": 2})
        MemoryEstimate(arguments=64, results=64, activations=64, peak_app=0)
    """
    return _Curve(graph, dims, axis_sizes, out_dims, live, extra).estimate


def peak_buffers(graph, *args, **kwargs) -> list[tuple[int, int | str]]:
    """What `memory_estimate` (given the same arguments) holds at its peak, largest
    first: ``(bytes per device, value)`` for an intermediate, ``(bytes per device,
    what)`` for a buffer of ``extra`` (``what`` its fourth element, or "a buffer no
    value holds"). Where the peak is a run of work the schedule puts at one time
    (`transient_peaks`), the run's buffers are all listed although not all are alive at
    once, so the list can add up to more than the estimate's activations.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sin(x) * 2, (jnp.ones((8, 4)),), {}), {})
        >>> peak_buffers(g, [[("data",), ()]] * len(g.shapes), {"data": 2})
        [(64, 1)]
    """
    return _Curve(graph, *args, **kwargs).at_peak()


class _Curve:
    """`memory_estimate`'s account: the arguments' and results' bytes, and each
    buffer's bytes and life over the schedule."""

    def __init__(self, graph, dims, axis_sizes, out_dims=None, live=None, extra=()):
        live = live or liveness(graph)
        out_dims = out_dims if out_dims is not None else [dims[v] for v in graph.out_vids]
        args = sum(
            per_device_bytes(graph.shapes[v], graph.dtypes[v], dims[v], axis_sizes)
            for v in set(graph.in_vids)
        )
        seen: set[int] = set()
        results = 0
        for v, d in zip(graph.out_vids, out_dims):
            if v not in seen:
                seen.add(v)
                results += per_device_bytes(graph.shapes[v], graph.dtypes[v], d, axis_sizes)
        n_apps = len(graph.apps)
        self.live, self.extra = live, [x for x in extra if x[2]]
        self.sizes = self.end = None
        if not (len(live.intermediates) or self.extra) or not n_apps:
            self.estimate = MemoryEstimate(args, results, 0, -1)
            return
        sizes = np.array(
            [buffer_bytes(graph, v, dims, axis_sizes, live) for v in live.intermediates],
            dtype=np.int64,
        )
        end = live.end
        for v, t in live.squeezable.items():
            if 1 in per_device_shape(graph.shapes[v], dims[v], axis_sizes):
                end = end.copy() if end is live.end else end
                end[v] = t
        # XLA's buffer assignment puts a loop's stack in a result's buffer when that is
        # written after the stack's last reader
        sizes = _in_result_buffers(graph, live, end, sizes, out_dims, axis_sizes)
        delta = np.zeros(n_apps + 1, dtype=np.int64)
        np.add.at(delta, live.start[live.intermediates], sizes)
        np.add.at(delta, end[live.intermediates] + 1, -sizes)
        for first, last, b, *_ in self.extra:
            delta[first] += int(b)
            delta[last + 1] -= int(b)
        for t, excess in transient_peaks(live, end, sizes):
            delta[t] -= excess
            delta[t + 1] += excess
        curve = np.cumsum(delta)[:n_apps]
        peak = int(np.argmax(curve))
        self.sizes, self.end = sizes, end
        self.estimate = MemoryEstimate(args, results, int(curve[peak]), peak)

    def at_peak(self) -> list[tuple[int, int | str]]:
        """`peak_buffers`."""
        t = self.estimate.peak_app
        if t < 0:
            return []
        live, inter = self.live, self.live.intermediates
        (held,) = np.nonzero((live.start[inter] <= t) & (self.end[inter] >= t) & (self.sizes > 0))
        found: list[tuple[int, int | str]] = [(int(self.sizes[i]), int(inter[i])) for i in held]
        found += [
            (int(x[2]), x[3] if len(x) > 3 else "a buffer no value holds")
            for x in self.extra
            if x[0] <= t <= x[1]
        ]
        return sorted(found, key=lambda f: -f[0])


def _in_result_buffers(graph, live: Liveness, end, sizes, out_dims, axis_sizes) -> np.ndarray:
    """``sizes`` (of ``live.intermediates``) less the loop stacks and carries XLA's
    buffer assignment puts in a result's buffer. XLA's ``BufferAssigner`` makes the
    results' buffers first, then tries each temporary, largest first (ties: the
    earliest), in the smallest result buffer of at least its size (ties: the one made
    last) that nothing holds over the temporary's life: the result itself from its
    first write to the end of the step, and the temporaries placed there before. A stack
    goes there when the result is first written after its last reader (a scanned
    gradient in its new weights' buffer, a forward's residuals in a new weight stack's);
    a plain SGD update reads its gradient as it writes the new weights, so that stack
    stays apart. A loop's carry (one buffer from its initial value to the last reader of
    the loop's result: a gradient accumulated over microbatches) is placed the same way.
    Other temporaries keep buffers of their own: XLA places them the same way, but in a
    step without loops it schedules the updates earlier than program order (placing
    them too made searched unrolled steps compile over their budgets), and placing a
    loop body's temporaries too took a scanned Llama step's estimate from 0.95x to 0.89x
    (the estimate holds fewer of its other buffers than XLA does).

    Example:
        >>> _in_result_buffers(g, live, live.end, sizes, out_dims, {"data": 2})  # doctest: +SKIP
        array([0, 512])
    """
    inter = live.intermediates
    carried = {  # a loop carry's buffer (an accumulator) spans the loop like a stack
        live.owner[v]
        for a in getattr(graph, "carry_links", ())
        for v in (*graph.apps[a].operands, *graph.apps[a].results)
    }
    stacks = [
        i for i, v in enumerate(inter.tolist()) if (v in live.stacked or v in carried) and sizes[i]
    ]
    if not stacks:
        return sizes
    made, seen = [], set()
    for o, r in enumerate(graph.out_vids):
        own = live.owner[r]
        if own not in seen:
            seen.add(own)
            size = per_device_bytes(graph.shapes[r], graph.dtypes[r], out_dims[o], axis_sizes)
            made.append((size, live.results_from.get(own, math.inf)))
    made.sort(key=lambda b: (b[0], -b[1]))  # the order XLA tries them in
    room = [b[0] for b in made]
    held: list[tuple[list[int], list[int]]] = [([], []) for _ in made]  # starts, ends
    sizes = sizes.copy()
    for i in sorted(stacks, key=lambda i: (-int(sizes[i]), int(live.start[inter[i]]))):
        v = int(inter[i])
        first, last = int(live.start[v]), int(end[v])
        for k in range(bisect.bisect_left(room, int(sizes[i])), len(made)):
            starts, ends = held[k]
            j = bisect.bisect_right(starts, last)
            if made[k][1] <= last or (j and ends[j - 1] >= first):
                continue
            starts.insert(j, first)
            ends.insert(j, last)
            sizes[i] = 0
            break
    return sizes


def transient_peaks(live: Liveness, end: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
    """Where the schedule puts a run of applications at one time (the work XLA hoists
    before a loop: a pipeline's loss head before its last loop), the buffers made and
    freed within that run are not all alive at once: they come and go in program order.
    Per such time, ``(time, bytes)`` to take off the sum of those buffers (``sizes``, in
    the order of ``live.intermediates``; ``end``: their ends) for the peak of the run.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.cost import liveness
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sin(jnp.cos(x)) * 2, (jnp.ones(4),), {}), {})
        >>> live = liveness(g)
        >>> transient_peaks(live, live.end, np.array([16, 16]))  # each at a time of its own
        []
    """
    if not live.span:
        return []
    inter = live.intermediates
    # memory_estimate runs per layout the search prices: select the few candidates at once
    (picked,) = np.nonzero((live.start[inter] == end[inter]) & (sizes[: len(inter)] > 0))
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for i in picked:
        v = int(inter[i])
        if v in live.span:
            first, last = live.span[v]
            groups.setdefault(int(live.start[v]), []).append((first, last, int(sizes[i])))
    out = []
    for t, members in groups.items():
        if len(members) < 2:
            continue
        events = sorted(
            [(f, b) for f, _, b in members] + [(last + 1, -b) for _, last, b in members]
        )
        now = peak = 0
        for _, b in events:
            now += b
            peak = max(peak, now)
        total = sum(b for *_, b in members)
        if total > peak:
            out.append((t, total - peak))
    return out


def transposed_operands(
    graph,
    dims: Sequence[Sequence[DimSharding]],
    axis_sizes: Mapping[str, int],
    live: Liveness,
    ends: dict[int, int] | None = None,
    reread: dict[int, int] | None = None,
) -> list[tuple[int, int, int, str]]:
    """The copies XLA's CPU backend makes of matmul operands it must transpose
    (`memory_estimate`'s ``extra``: ``(first, last, bytes per device, what)``). Its matmuls read
    the left operand as (free, contracted) dims, each group collapsed into one (or, for a
    single contracted and a single free dim, transposed as it is); a left operand whose
    contracted dims come before its free ones (a weight gradient contracting the batch
    and sequence dims, the leading dims of the activation gradient it reads) is copied
    in that order, unless an equation of the matmul's computation makes it for this
    matmul alone (the maker then writes that order). The copy lives from when the
    operand is made (inside the matmul's computation) until the matmul; the operand
    itself is then free after its other readers, which ``ends`` (when given) receives
    per buffer: the time of its last reader but the matmul. Measured on XLA's CPU
    programs: the MLP's activation gradients, also read by the input gradient's matmul,
    are kept twice at the backward pass's peak, once transposed, and an activation read
    by another matmul besides (the forward's next layer) is freed after that one.
    An operand an elementwise fusion makes is copied by a second fusion that computes it
    again from that fusion's inputs (the logits' gradient, from the log-softmax's
    exponential and the labels' scatter: four logit-sized buffers at once in the 8B
    pipeline), so those inputs live until the copy is made and the operand is not
    written over one of them: ``reread`` (when given) receives per input buffer the
    time of the copy (`_recomputed_from`).

    Example:
        >>> import jax, jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.cost import liveness
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> def f(h, x):   # contracts the batch and sequence dims of both
        ...     return jnp.sin(h).sum() + jnp.einsum("bsf,bsd->fd", jnp.sin(h), x).sum()
        >>> g = build_graph(trace(f, (jnp.ones((2, 4, 8)), jnp.ones((2, 4, 3))), {}), {})
        >>> transposed_operands(g, [[(), (), ()]] * len(g.shapes), {}, liveness(g))
        [(0, 3, 256, 'a transposed copy of %... (2, 4, 8) for dot_general at ...')]
    """
    made = graph.producers()
    readers: dict[int, int] = {}  # per buffer (common subexpressions are one)
    reading: dict[int, list[int]] = {}  # per buffer, its readers (for ``ends`` alone)
    for b, app in enumerate(graph.apps):
        for o in {live.owner[v] for v in app.operands}:
            readers[o] = readers.get(o, 0) + 1
            if ends is not None:
                reading.setdefault(o, []).append(b)
    at = live.schedule.at if live.schedule is not None else np.arange(len(graph.apps))
    copies = []
    stored = None  # the buffers `fused_liveness` keeps, once a copy needs them
    for a, app in enumerate(graph.apps):
        if app.kind is not AppKind.EQN or app.eqn.primitive.name != "dot_general":
            continue
        (lc, rc), (lb, rb) = app.eqn.params["dimension_numbers"]
        for k, (v, batch, summed) in enumerate(zip(app.operands, (lb, rb), (lc, rc))):
            local = per_device_shape(graph.shapes[v], dims[v], axis_sizes)
            if _read_as_it_is(local, tuple(batch), tuple(summed), left=k == 0):
                continue
            maker = made.get(v)
            own = maker is not None and xla_scope(
                graph.apps[maker].where, live.inlined
            ) == xla_scope(app.where, live.inlined)
            if own and readers.get(live.owner[v], 0) == 1:
                continue  # its maker writes it in the order the matmul reads
            t = int(at[a])
            o = live.owner[v]
            first = int(live.start[o]) if own and 0 <= live.start[o] <= t else t
            size = per_device_bytes(graph.shapes[v], graph.dtypes[v], dims[v], axis_sizes)
            what = f"a transposed copy of %{v} {tuple(graph.shapes[v])} for {app.describe()}"
            copies.append((first, t, size, what))
            if reread is not None and own:
                if stored is None:
                    stored = set(live.intermediates.tolist())
                for i in _recomputed_from(graph, live.owner, stored, made, maker):
                    if live.end[i] < first:
                        reread[i] = max(reread.get(i, first), first)
            if ends is not None and own and first < t and live.end[o] >= 0:
                others = [int(at[b]) for b in reading.get(o, ()) if b != a]
                ends[o] = min(ends.get(o, live.end[o]), max(others, default=first))
    return copies


def _region_inputs(
    graph,
    owner,
    producer: Mapping[int, int],
    inside: Callable[[int], bool],
    root: int,
    apps: list[int] | None = None,
) -> Iterator[int]:
    """The buffers the fusion rooted at application ``root`` reads, in the order it
    reaches them: a buffer ``inside`` says is computed within the fusion is not read but
    made there by its ``producer``, whose operands are followed in turn. ``apps`` (when
    given) receives every application of the fusion."""
    todo, seen = [root], {root}
    while todo:
        a = todo.pop()
        if apps is not None:
            apps.append(a)
        for u in graph.apps[a].operands:
            o = owner[u]
            if not inside(o):
                yield o
            elif producer[o] not in seen:
                seen.add(producer[o])
                todo.append(producer[o])


def _recomputed_from(
    graph, owner, stored: set[int], made: Mapping[int, int], root: int
) -> list[int]:
    """The ``stored`` buffers a fusion rooted at application ``root`` reads, when XLA
    would compute it again for a second reader (it is elementwise and nothing in it is
    `EXPENSIVE`, which XLA does not duplicate); else none. The fusion takes in the values
    `fused_liveness` does not store."""
    apps: list[int] = []
    inside = lambda o: o not in stored and o in made  # noqa: E731
    found = [o for o in _region_inputs(graph, owner, made, inside, root, apps) if o in stored]
    for a in apps:
        app = graph.apps[a]
        if app.eqn.primitive.name in EXPENSIVE:
            return []
        if not (_elementwise(graph, app) or _row_broadcast(graph, app)):
            if app.eqn.primitive.name != "broadcast_in_dim":
                return []
    return list(dict.fromkeys(found))


def _elementwise(graph, app) -> bool:
    """Whether ``app`` is a plain elementwise equation: operands of its result's shape, or
    scalars."""
    shape = graph.shapes[app.results[0]] if app.results else None
    return (
        app.kind is AppKind.EQN
        and app.rule.plain
        and all(graph.shapes[u] in (shape, ()) for u in app.operands)
    )


def _read_as_it_is(local: Sequence[int], batch: tuple, summed: tuple, left: bool) -> bool:
    """Whether a CPU matmul reads an operand of per-device shape ``local`` without a
    transposed copy (`transposed_operands`); dims of one element are ignored. A matmul
    without batch dims collapses each operand's contracted dims in the order it lists
    them (``summed``): either operand holding two of them in another order is copied
    (``einsum("tec,ecd->td")`` lists (c, e): both its operands are copied), and so is a
    left operand whose contracted dims come before its free ones (measured); batched
    matmuls (attention, experts) are taken as read as they are."""
    if batch:
        return True
    held = [d for d in range(len(local)) if local[d] != 1 and d in summed]
    if held != [d for d in summed if local[d] != 1]:
        return False
    if not left:
        return True
    kinds = "".join("c" if d in summed else "f" for d in range(len(local)) if local[d] != 1)
    grouped = kinds == "".join(sorted(kinds, reverse=True))  # free dims, then contracted
    return grouped or kinds == "cf"  # one contracted and one free dim: a transposed matrix


def buffer_bytes(graph, v: int, dims, axis_sizes: Mapping[str, int], live: Liveness) -> int:
    """Per-device bytes of intermediate ``v``'s buffer: its layout's share, or for a loop's
    stacked input or result whose per-iteration value is laid out otherwise, the larger of
    that and the stack in the per-iteration layout (XLA fills a scan's stacked gradient in
    the layout each iteration computes it in, and moves it to its own after the loop).

    Example:
        >>> buffer_bytes(graph, v, plan.dims, plan.axis_sizes, live)  # doctest: +SKIP
        4294967296
    """
    own = per_device_bytes(graph.shapes[v], graph.dtypes[v], dims[v], axis_sizes)
    inner = live.stacked.get(v)
    if inner is None or dims[inner] is None:
        return own
    if slices_locally(dims[v][1:], dims[inner]):
        return own  # the stack's layout slices the iteration's: each slice is cut locally
    layers = graph.shapes[v][0]
    each = per_device_bytes(graph.shapes[inner], graph.dtypes[inner], dims[inner], axis_sizes)
    return max(own, layers * each)


class MemoryCurve:
    """`memory_estimate` of one layout, kept so that the estimate of a few values laid
    out otherwise costs only those values: for pricing one decision after another.

    Example:
        >>> import jax.numpy as jnp, jaxshard.rules
        >>> from jaxshard.trace import trace
        >>> from jaxshard.graph import build_graph
        >>> g = build_graph(trace(lambda x: jnp.sin(x) * 2, (jnp.ones((8, 4)),), {}), {})
        >>> curve = MemoryCurve(g, [[(), ()]] * len(g.shapes), {"data": 2})
        >>> curve.total, curve.total_with({v: [("data",), ()] for v in range(len(g.shapes))})
        (384, 192)
    """

    def __init__(
        self,
        graph,
        dims: Sequence[Sequence[DimSharding]],
        axis_sizes: Mapping[str, int],
        sources: Sequence[int] | None = None,
        live: Liveness | None = None,
    ):
        self.graph, self.axis_sizes = graph, axis_sizes
        self.live = live or liveness(graph)
        # each distinct result, by the value whose layout it takes (an argument for a tie)
        sources = list(sources if sources is not None else graph.out_vids)
        seen: set[int] = set()
        self.results: list[int] = []
        self.results_sources = sources
        for v, src in zip(graph.out_vids, sources):
            if v not in seen:
                seen.add(v)
                self.results.append(src)
        self.args = sorted(set(graph.in_vids))
        self.position = {int(v): i for i, v in enumerate(self.live.intermediates)}
        self.sizes = np.array(
            [self._bytes(v, dims[v]) for v in self.live.intermediates], dtype=np.int64
        )
        self.dims = dims
        # each argument's and result's bytes, counted once per time it is held
        self._times_held = Counter([*self.args, *self.results])
        self._held = {v: self._bytes(v, dims[v]) for v in self._times_held}
        self._held_total = sum(b * self._times_held[v] for v, b in self._held.items())
        self.total = self.total_with({})

    def _bytes(self, v: int, dims) -> int:
        return per_device_bytes(self.graph.shapes[v], self.graph.dtypes[v], dims, self.axis_sizes)

    def update(self, changed: Mapping[int, Sequence[DimSharding]]) -> None:
        """Take the layouts in ``changed`` for good (``dims``, given at construction, must
        already hold them)."""
        for v in changed:
            i = self.position.get(v)
            if i is not None:
                self.sizes[i] = self._bytes(v, self.dims[v])
            if v in self._held:
                new = self._bytes(v, self.dims[v])
                self._held_total += (new - self._held[v]) * self._times_held[v]
                self._held[v] = new
        self.total = self.total_with({})

    def total_with(self, changed: Mapping[int, Sequence[DimSharding]]) -> int:
        """Arguments + results + peak activations with the values in ``changed`` laid out
        as given there and every other value as at construction."""
        held = self._held_total
        for v, layout in changed.items():
            if v in self._held:
                held += (self._bytes(v, layout) - self._held[v]) * self._times_held[v]
        live = self.live
        if not len(live.intermediates) or not self.graph.apps:
            return held
        sizes = self.sizes
        moved = [(self.position[v], v) for v in changed if v in self.position]
        if moved:
            sizes = sizes.copy()
            for i, v in moved:
                sizes[i] = self._bytes(v, changed[v])
        n_apps = len(self.graph.apps)
        delta = np.zeros(n_apps + 1, dtype=np.int64)
        np.add.at(delta, live.start[live.intermediates], sizes)
        np.add.at(delta, live.end[live.intermediates] + 1, -sizes)
        return held + int(np.cumsum(delta)[:n_apps].max())
