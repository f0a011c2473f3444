"""Pipeline parallelism from unchanged code: a scan over layers runs as a GPipe or a
circular pipeline.

``auto_shard(mesh, hints, pipeline=Pipeline(axis="stage", microbatches=M))`` traces the
step with `jax.lax.scan` intercepted. A scan *qualifies* when it loops over stacked
per-layer arrays (``xs``, leading dim L) with a carry whose leading dim is the batch B,
returns only the carry, and the factor rules prove its body treats the batch rows
independently: a pseudo mesh axis of size M pinned on the carry's batch dim must reach
the new carry on the same dim, never be summed over (no reduction over the batch), never
need resharding (no rule mixes rows), and never reach ``xs``. Values the body closes
over that carry the batch (a mask of shape (B, T)) travel with their microbatch.

A qualifying scan is replaced by a pipeline over the mesh axis ``axis`` of size S:
stage s holds layers [s·L/S, (s+1)·L/S) (the stacked arrays reshaped to (S, L/S, ...)
and pinned on the stage dim, so the parameters and their optimizer state are stored
split over the stage axis on the layer dim); the batch is split into M microbatches
(microbatch m holds rows m, M+m, 2M+m, ... so a data-parallel batch dim stays
sharded); a buffer holds one microbatch per stage, and each of M+S−1 iterations feeds
the next microbatch to stage 0, runs every stage's layers on its slot (a `vmap` over
the stage dim), collects the finished microbatch from the last stage and shifts the
buffer one stage on with a collective-permute (`lax.ppermute` in a `shard_map` manual
over the stage axis only). The step's own `jax.grad` differentiates this loop: the
backward pass is the reverse loop (GPipe: all forward microbatches, then all backward),
and per-layer weight gradients come out summed over microbatches. The body runs on
microbatch-sized values: its shapes are rewritten from the propagation (a reshape to
(B, T, H, Dh) becomes (B/M, T, H, Dh)); custom derivative rules inside the body are
inlined (their primal is differentiated).

Bubble iterations compute on real data (the buffer starts as copies of the first
microbatch) whose results are dropped, so no NaN enters the gradients from them.

The circular schedule (``schedule="circular", repeats=v``) runs v·M+S−1 iterations over
stages that hold v chunks of L/(S·v) layers each (stage s: chunks s, s+S, ...): the
stacks move from layer order to that layout once per step (`_interleave`), stage s on
iteration t runs its chunk (t−s)//M on its slot, and one array holds each microbatch's
latest activations, fed to stage 0 again at the start of its next pass.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun
from jax.extend.core import primitives as prims
from jax.sharding import PartitionSpec as P

from jaxshard.annotate import Pin, PinKind, hint_p
from jaxshard.errors import ShardingError
from jaxshard.graph import Graph, build_graph
from jaxshard.jax_compat import (
    bind_with_source,
    caller_line,
    consts_as_inputs,
    scan_counts,
    user_context,
)
from jaxshard.propagate import Propagator
from jaxshard.rule import region_fn_for
from jaxshard.trace import Traced

MICROBATCH = "__microbatch__"  # the pseudo mesh axis that proves batch independence


SCHEDULES = ("gpipe", "circular")


@dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism for `auto_shard`: the layer scans of the step run as a
    pipeline over mesh axis ``axis`` with ``microbatches`` microbatches (module doc).

    ``schedule="gpipe"`` (the default): stage s holds one contiguous block of L/S layers.
    ``schedule="circular"`` with ``repeats=v``: stage s holds the v layer chunks s, s+S,
    s+2S, ... of L/(S·v) layers each, and every microbatch passes the ring of stages v
    times, which shrinks the bubble from (S−1)/(M+S−1) to (S−1)/(v·M+S−1) for one more
    stage-to-stage transfer per chunk. Circular needs at least S microbatches (a
    microbatch's next lap starts after its previous one left the last stage).

    Example:
        >>> Pipeline(axis="stage", microbatches=4).bubble(stages=2)
        0.2
        >>> Pipeline("stage", 4, schedule="circular", repeats=2).bubble(stages=2)
        0.1111111111111111
    """

    axis: str = "stage"
    microbatches: int = 4
    # data parallelism inside the pipeline: with True, each microbatch is split over the
    # mesh axes that shard its rows, every replica adds up its own weight gradients and
    # they are summed once per step (fewer bytes; XLA keeps the per-replica accumulators:
    # more memory). False: the gradients are summed over those axes every iteration.
    replicate: bool = False
    schedule: str = "gpipe"
    repeats: int = 1  # layer chunks per stage, with schedule="circular"

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise ShardingError(
                f"Pipeline(axis={self.axis!r}): the axis is the name of a mesh axis, e.g. "
                "Pipeline(axis='stage', microbatches=4)"
            )
        if not _positive_int(self.microbatches):
            raise ShardingError(
                f"Pipeline(microbatches={self.microbatches!r}): give a positive int that "
                "divides the batch, e.g. microbatches=4"
            )

        if not isinstance(self.replicate, bool):
            raise ShardingError(f"Pipeline(replicate={self.replicate!r}): True or False")
        if self.schedule == "1f1b":
            raise ShardingError(
                "Pipeline(schedule='1f1b'): jaxshard does not run the one-forward-one-backward "
                "schedule; use schedule='circular' with repeats=2 or more for a smaller bubble, "
                "or fewer microbatches for less activation memory"
            )
        if self.schedule not in SCHEDULES:
            raise ShardingError(
                f"Pipeline(schedule={self.schedule!r}): one of {SCHEDULES}, e.g. "
                "Pipeline('stage', 8, schedule='circular', repeats=2)"
            )
        if not _positive_int(self.repeats):
            raise ShardingError(
                f"Pipeline(repeats={self.repeats!r}): give a positive int, the layer chunks "
                "each stage holds, e.g. repeats=2"
            )
        if self.repeats > 1 and self.schedule != "circular":
            raise ShardingError(
                f"Pipeline(repeats={self.repeats}) applies to schedule='circular' only; write "
                f"Pipeline({self.axis!r}, {self.microbatches}, schedule='circular', "
                f"repeats={self.repeats})"
            )

    @property
    def laps(self) -> int:
        """How many times each microbatch passes the stages: ``repeats`` when circular."""
        return self.repeats if self.schedule == "circular" else 1

    def bubble(self, stages: int) -> float:
        """The fraction of a step each stage idles: (S−1)/(v·M+S−1), v = 1 for GPipe.

        Example:
            >>> [round(Pipeline(microbatches=m).bubble(4), 2) for m in (1, 4, 16)]
            [0.75, 0.43, 0.16]
        """
        return _bubble(stages, self.microbatches, self.laps)

    def check_mesh(self, axis_names: Sequence[str]) -> None:
        """A ShardingError unless the pipeline's axis is one of the mesh's.

        Example:
            >>> Pipeline(axis="stage").check_mesh(("stage", "data"))
        """
        if self.axis not in axis_names:
            raise ShardingError(
                f"Pipeline(axis={self.axis!r}) is not an axis of the mesh {tuple(axis_names)}; "
                f"add a {self.axis!r} axis to the mesh (e.g. jax.make_mesh((2, 2, 2), "
                f"({self.axis!r}, 'data', 'model'))) or name one of its axes"
            )


@dataclass(frozen=True)
class PipelinedLoop:
    """A scan jaxshard pipelined: where, its layers, stages, microbatches, batch and
    schedule.

    Example:
        >>> loop = PipelinedLoop("model.py:40 (loss)", 8, 2, 4, 16, ((16, 64, 32),), 0)
        >>> loop.bubble, loop.describe().splitlines()[0]
        (0.2, 'scan at model.py:40 (loss): 8 layers over 2 stages (4 layers each), 4 microbatches of 4 rows')
    """

    line: str
    layers: int
    stages: int
    microbatches: int
    batch: int
    carry: tuple[tuple[int, ...], ...]
    moving_consts: int  # values the body closes over that carry the batch
    replicas: tuple[str, ...] = ()  # mesh axes each microbatch's rows are split over
    schedule: str = "gpipe"
    repeats: int = 1  # layer chunks per stage (circular)

    @property
    def iterations(self) -> int:
        """v·M + S − 1: the loop's iterations, forward (the backward runs as many)."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """(S−1)/(v·M+S−1): the share of each stage's iterations that compute nothing kept."""
        return _bubble(self.stages, self.microbatches, self.repeats)

    def describe(self) -> str:
        """Lines for `Plan.explain`."""
        s, m, v = self.stages, self.microbatches, self.repeats
        if self.schedule == "circular":
            chunk = self.layers // (s * v)
            held = (
                f"{v} chunks of {chunk} layers each (stage s holds chunks s, s+{s}"
                + (f", s+{2 * s}" if v > 2 else "")
                + (", ..." if v > 3 else "")
                + ")"
            )
            schedule = (
                f"  circular schedule: each microbatch passes the stages {v} times; "
                f"{self.iterations} iterations forward, then as many backward; bubble "
                f"(S-1)/(vM+S-1) = {self.bubble:.1%} of each stage's work is discarded"
            )
        else:
            held = f"{self.layers // s} layers each"
            schedule = (
                f"  GPipe schedule: {self.iterations} iterations forward, then as many "
                f"backward; bubble (S-1)/(M+S-1) = {self.bubble:.1%} of each stage's work "
                "is discarded"
            )
        lines = [
            f"scan at {self.line}: {self.layers} layers over {s} stages ({held}), "
            f"{m} microbatches of {self.batch // m} rows",
            schedule,
            f"  carry {', '.join(str(c) for c in self.carry)} moves one stage per iteration "
            "by collective-permute",
        ]
        if self.replicas:
            lines.append(
                f"  each microbatch's rows split over {', '.join(self.replicas)}: per replica "
                "the weight gradients add up over iterations and are summed once after the loop"
            )
        if self.moving_consts:
            lines.append(
                f"  {self.moving_consts} value(s) the body closes over carry the batch and "
                "move with their microbatch"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        """A JSON-able record (`Plan.to_json`); the schedule only where it is not GPipe."""
        record = {
            "line": self.line,
            "layers": self.layers,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "batch": self.batch,
            "replicas": list(self.replicas),
        }
        if self.schedule != "gpipe":
            record.update(schedule=self.schedule, repeats=self.repeats)
        return record


def replica_axes(plan: Any, pipeline: Pipeline) -> tuple[str, ...]:
    """The mesh axes a plan put on the rows of the pipeline's microbatches (other than
    the stage axis): a second planning splits each microbatch over them (`_Loop.run`).

    Example:
        >>> replica_axes(plan, Pipeline("stage", 4))  # doctest: +SKIP
        ('data',)
    """
    axes: list[str] = []
    if not pipeline.replicate:
        return ()
    for vid, pin in plan.graph.pins.items():
        if pin.kind is PinKind.MICROBATCHES and len(pin.dims) > 1 and pin.dims[0] == ():
            axes += [a for a in plan.dims[vid][1] or () if a != pipeline.axis and a not in axes]
    return tuple(axes)


def _positive_int(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _bubble(stages: int, microbatches: int, laps: int) -> float:
    return (stages - 1) / (laps * microbatches + stages - 1)


class _Rejected(Exception):
    """A scan that does not qualify, with the reason."""


@dataclass
class Interception:
    """What one planning's tracing pipelined (``loops``) and which scans it left as they
    were and why (``left``: (source line, reason))."""

    pipeline: Pipeline
    stages: int
    axis_sizes: dict[str, int] = field(default_factory=dict)
    replicas: tuple[str, ...] = ()  # mesh axes that split each microbatch's rows
    loops: list[PipelinedLoop] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)
    busy: int = 0

    def check(self) -> None:
        """A ShardingError naming every scan seen and why, when none was pipelined."""
        if self.loops:
            return
        seen = "".join(f"\n  scan at {line}: {why}" for line, why in self.left) or (
            "\n  (the step calls no jax.lax.scan)"
        )
        raise ShardingError(
            f"pipeline={self.pipeline}: no scan of the step qualifies for pipelining.{seen}\n"
            "Run the layers as jax.lax.scan(body, x, stacked_params) with the activations "
            "(batch first) as the carry and the per-layer parameters as xs, returning "
            "(new_x, None); or drop pipeline= to plan without pipelining."
        )


_ACTIVE = threading.local()  # the Interception of the planning on this thread, if any
_ORIGINAL_SCAN = jax.lax.scan
# `jax.lax.scan` is the interceptor while any thread plans a pipeline; `_scan` passes the
# calls of every other thread through, and the last interception to end restores it
_PATCH = threading.Lock()
_PLANNING = 0


@contextlib.contextmanager
def intercepting(
    pipeline: Pipeline | None, mesh: Any, replicas: tuple[str, ...] = ()
) -> Iterator[Interception | None]:
    """While tracing under this context, `jax.lax.scan` calls that qualify run as a
    pipeline over ``pipeline.axis`` of ``mesh``; yields the `Interception` (None and no
    effect when ``pipeline`` is None). The caller checks `Interception.check` after
    tracing.

    Example:
        >>> with intercepting(None, mesh) as seen:  # doctest: +SKIP
        ...     plan = make_plan(step, args, {}, mesh, hints)
    """
    if pipeline is None:
        yield None
        return
    pipeline.check_mesh(mesh.axis_names)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    seen = Interception(pipeline, sizes[pipeline.axis], sizes, tuple(replicas))
    global _PLANNING
    outer = getattr(_ACTIVE, "value", None)
    _ACTIVE.value = seen
    with _PATCH:
        _PLANNING += 1
        jax.lax.scan = _scan
    try:
        yield seen
    finally:
        _ACTIVE.value = outer
        with _PATCH:
            _PLANNING -= 1
            if _PLANNING == 0:
                jax.lax.scan = _ORIGINAL_SCAN


def _scan(f, init, xs=None, length=None, reverse=False, unroll=1, _split_transpose=False):
    """`jax.lax.scan`, pipelined when it qualifies (module doc)."""
    seen: Interception | None = getattr(_ACTIVE, "value", None)
    plain = (f, init, xs, length, reverse, unroll, _split_transpose)
    if seen is None or seen.busy:
        return _ORIGINAL_SCAN(*plain)
    line = _caller_line()
    seen.busy += 1
    try:
        loop = _Loop.of(f, init, xs, reverse, seen, line)
    except _Rejected as why:
        seen.left.append((line, str(why)))
        loop = None
    finally:
        seen.busy -= 1
    if loop is None:
        return _ORIGINAL_SCAN(*plain)
    seen.busy += 1
    try:
        return loop.run(init, xs)
    finally:
        seen.busy -= 1


def _caller_line() -> str:
    return caller_line()


class _Loop:
    """One qualifying scan: its body at microbatch size and how to run it pipelined."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    @classmethod
    def of(cls, f, init, xs, reverse: bool, seen: Interception, line: str) -> _Loop:
        """Analyse a scan; `_Rejected` when it does not qualify, a ShardingError when it
        would but its sizes do not divide."""
        carry, carry_tree = jax.tree_util.tree_flatten(init)
        stacked, xs_tree = jax.tree_util.tree_flatten(xs)
        if not stacked:
            raise _Rejected("it has no xs (stacked per-layer arrays) to split over stages")
        if not carry or any(np.ndim(c) == 0 for c in carry):
            raise _Rejected(
                "its carry is not a batch of activations (every carry leaf needs a leading batch dim)"
            )
        batch = int(np.shape(carry[0])[0])
        if any(np.shape(c)[0] != batch for c in carry):
            raise _Rejected(
                "its carry leaves differ in their leading dim "
                f"{[np.shape(c)[0] for c in carry]}; the pipeline needs the batch first in each"
            )
        layers = int(np.shape(stacked[0])[0])
        m, s, axis = seen.pipeline.microbatches, seen.stages, seen.pipeline.axis
        v = seen.pipeline.laps
        n_carry = len(carry)

        def flat_body(*flat):
            c = jax.tree_util.tree_unflatten(carry_tree, flat[:n_carry])
            x = jax.tree_util.tree_unflatten(xs_tree, flat[n_carry:])
            new_c, y = f(c, x)
            new_flat, new_tree = jax.tree_util.tree_flatten(new_c)
            if new_tree != carry_tree:
                raise _Rejected("its body returns a carry of another structure than it takes")
            ys = jax.tree_util.tree_leaves(y)
            if ys:
                raise _Rejected(
                    "its body returns per-layer outputs (ys); the pipeline takes scans that "
                    "return (new_carry, None)"
                )
            return new_flat

        avals = [jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in carry]
        avals += [jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)) for x in stacked]
        closed = jax.make_jaxpr(flat_body)(*avals)
        if v > 1 and layers % (s * v):
            raise ShardingError(
                f"pipeline over {axis!r}: the scan at {line} has {layers} layers, which "
                f"{s} stages x {v} repeats (circular schedule) do not divide; use a layer "
                f"count divisible by {s * v}, or repeats= a divisor of {layers // s}"
                if layers % s == 0
                else f"pipeline over {axis!r}: the scan at {line} has {layers} layers, which "
                f"{s} stages x {v} repeats (circular schedule) do not divide; use a layer "
                f"count divisible by {s * v}"
            )
        if v > 1 and m < s:
            raise ShardingError(
                f"pipeline over {axis!r}: the scan at {line} on a circular schedule over {s} "
                f"stages needs at least {s} microbatches (a microbatch starts its next pass "
                f"of the stages after it left the last one), got microbatches={m}; use "
                f"microbatches >= {s}"
            )
        if layers % s:
            raise ShardingError(
                f"pipeline over {axis!r}: the scan at {line} has {layers} layers, which the "
                f"{s} stages of mesh axis {axis!r} do not divide; use a layer count divisible "
                f"by {s} or a mesh whose {axis!r} axis divides {layers}"
            )
        if batch % m:
            raise ShardingError(
                f"pipeline over {axis!r}: the scan at {line} carries a batch of {batch} rows, "
                f"which {m} microbatches do not divide; pick microbatches= a divisor of {batch}"
            )
        consts = list(closed.consts)
        r = math.prod(seen.axis_sizes[a] for a in seen.replicas)
        if (batch // m) % r:  # the rows of a microbatch do not split over the replicas
            r = 1
        analysis = _independence(closed, n_carry, len(stacked), m * r)
        micro = _microbatched(analysis, closed, m * r)
        replicas = seen.replicas if r > 1 else ()
        return cls(
            line=line, layers=layers, stages=s, micro=micro, m=m, laps=v, axis=axis, consts=consts,
            batch_consts=analysis.batch_consts, carry_tree=carry_tree, xs_tree=xs_tree,
            n_carry=n_carry, reverse=reverse, seen=seen, batch=batch,
            carry_shapes=tuple(tuple(np.shape(c)) for c in carry), r=r, replicas=replicas,
            replica_entry=replicas[0] if len(replicas) == 1 else replicas,
            chunk_policy=_chunk_policy(micro),
        )  # fmt: skip

    def run(self, init, xs):
        """The pipelined loop on the scan's own operands; returns ``(carry, None)``.

        With replica axes (``self.replicas``: the mesh axes that shard the microbatch
        rows, from a first plan), every stage's weights get a leading replica dim split
        over them and each microbatch is split into R row groups run side by side
        (``vmap``): each replica then accumulates its own weight gradient over the
        iterations, and the sum over replicas (one all-reduce) happens once, after the
        loop, instead of once per iteration."""
        s, m, laps, axis = self.stages, self.m, self.laps, self.axis
        per = self.layers // (s * laps)
        r, rep = self.r, self.replica_entry
        carry = jax.tree_util.tree_leaves(init)
        stacked = jax.tree_util.tree_leaves(xs)
        if self.reverse:  # layers L-1 ... 0: the same pipeline over the flipped stack
            stacked = [jnp.flip(x, 0) for x in stacked]
        layers = (PinKind.PIPELINE, f"the pipeline's stages (scan at {self.line})")
        slots = (PinKind.MICROBATCHES, f"the pipeline's microbatch slots (scan at {self.line})")
        whole = (PinKind.MICROBATCHES, f"the pipeline's microbatches (scan at {self.line})")

        def pin(x, spec, origin=slots):
            return hint_p.bind(x, spec=spec, origin=origin)

        if laps > 1:  # (S, V, per, ...): stage s holds chunks s, s+S, s+2S, ...
            stacked = [pin(x.reshape(s, laps, per, *x.shape[1:]), P(axis), layers) for x in stacked]
            # (S, per, V, ...): the layer scan of a stage steps over per, each layer's V
            # chunks at hand, the loop's constants as in GPipe
            stacked = [jnp.swapaxes(x, 1, 2) for x in _interleave(stacked, axis, s, laps)]
        else:  # (S, per, ...): stage s holds the s-th block of layers
            stacked = [x.reshape(s, per, *x.shape[1:]) for x in stacked]
        stacked = [pin(x, P(axis), layers) for x in stacked]
        if r > 1:  # (S, R, [V,] per, ...): one copy of each stage's layers per replica
            stacked = [
                pin(jnp.broadcast_to(x[:, None], (s, r, *x.shape[1:])), P(axis, rep), layers)
                for x in stacked
            ]
        moving = [(c, 0) for c in carry] + [(self.consts[i], d) for i, d in self.batch_consts]
        # (M, [R,] ...) per moving value, every microbatch on every stage: indexed per
        # iteration, so the microbatch dim is never split (a batch over the stage axis
        # outside the pipeline is gathered here once, not once per iteration)
        micro = [_split(v, d, m) for v, d in moving]
        if r > 1:
            micro = [_replicate(v, d + 1, r) for v, (_, d) in zip(micro, moving)]
        micro_spec = P(None, rep) if r > 1 else P(None)
        slot_spec = P(axis, rep) if r > 1 else P(axis)
        micro = [pin(v, micro_spec, whole) for v in micro]
        n_carry, fixed = self.n_carry, dict(enumerate(self.consts))
        body = jaxpr_as_fun(self.micro)
        batch_index = {i: n_carry + j for j, (i, _) in enumerate(self.batch_consts)}

        def stage(weights, slot, chunk=None):
            consts = [slot[batch_index[i]] if i in batch_index else fixed[i] for i in fixed]

            def layer(c, w):
                return tuple(body(*consts, *c, *w)), None

            if chunk is not None:  # each layer's weights of the current pass's chunk

                @functools.partial(jax.checkpoint, policy=self.chunk_policy)
                def chunk_layer(c, w_all, chunk):
                    w = [jax.lax.dynamic_index_in_dim(x, chunk, 0, False) for x in w_all]
                    return tuple(body(*consts, *c, *(checkpoint_name(x, _CHUNK) for x in w)))

                def layer(c, w_all):  # noqa: F811 (the chunk's layer replaces the plain one)
                    return chunk_layer(c, w_all, chunk), None

            c, _ = jax.lax.scan(layer, tuple(slot[:n_carry]), tuple(weights))
            return [*c, *slot[n_carry:]]

        if laps > 1:
            per_replica = jax.vmap(stage, in_axes=(0, 0, None)) if r > 1 else stage
            run_stages = jax.vmap(per_replica)
        else:
            run_stages = jax.vmap(jax.vmap(stage) if r > 1 else stage)
        stage_ids = jnp.arange(s)

        def on_stage(mask, v):
            return mask.reshape((s,) + (1,) * (v.ndim - 1))

        def tick(state, t):
            buf, outs = state
            if laps > 1:  # a microbatch's later passes start from its last stage output
                j = t % m
                feed = [jax.lax.dynamic_index_in_dim(v, j, 0, False) for v in outs]
                feed += [jax.lax.dynamic_index_in_dim(v, j, 0, False) for v in micro[n_carry:]]
            else:
                j = jnp.minimum(t, m - 1)
                feed = [jax.lax.dynamic_index_in_dim(v, j, 0, False) for v in micro]
            first = (stage_ids == 0) & (t < laps * m)
            buf = [jnp.where(on_stage(first, b), f[None], b) for f, b in zip(feed, buf)]
            buf = [pin(b, slot_spec) for b in buf]
            if laps > 1:  # stage s is on pass (t - s) // M of its microbatch
                chunk = jnp.clip((t - stage_ids) // m, 0, laps - 1)
                buf = [pin(b, slot_spec) for b in run_stages(stacked, buf, chunk)]
            else:
                buf = [pin(b, slot_spec) for b in run_stages(stacked, buf)]
            last = stage_ids == s - 1
            j = (t - (s - 1)) % m if laps > 1 else jnp.clip(t - (s - 1), 0, m - 1)
            new_outs = []
            for o, b in zip(outs, buf[:n_carry]):
                done = jnp.sum(jnp.where(on_stage(last, b), b, jnp.zeros_like(b)), axis=0)
                kept = jax.lax.dynamic_index_in_dim(o, j, 0, False)
                done = jnp.where(t >= s - 1, done, kept)
                o = jax.lax.dynamic_update_index_in_dim(o, done, j, 0)
                new_outs.append(pin(o, micro_spec, whole))
            return (_shift(buf, axis, s), new_outs), None

        first_slot = [jnp.broadcast_to(v[0], (s, *v.shape[1:])) for v in micro]
        buf = [pin(b, slot_spec) for b in first_slot]
        # circular: one array holds each microbatch's latest carry (its input, then its
        # output after each pass), read at the start of every pass
        start = (lambda v: v) if laps > 1 else jnp.zeros_like
        outs = [pin(start(v), micro_spec, whole) for v in micro[:n_carry]]
        (_, outs), _ = jax.lax.scan(tick, (buf, outs), jnp.arange(laps * m + s - 1))
        schedule = "circular" if laps > 1 else "gpipe"  # one chunk per stage is GPipe
        self.seen.loops.append(
            PipelinedLoop(self.line, self.layers, s, m, self.batch, self.carry_shapes,
                          len(self.batch_consts), self.replicas if r > 1 else (), schedule,
                          laps)
        )  # fmt: skip
        if r > 1:  # (M, R, rows/R, ...) -> (M, rows, ...)
            outs = [o.reshape(o.shape[0], o.shape[1] * o.shape[2], *o.shape[3:]) for o in outs]
        new_carry = [_join(o) for o in outs]
        return jax.tree_util.tree_unflatten(self.carry_tree, new_carry), None


# a circular stage's weights for the current pass are a slice of its chunks, taken per
# layer inside a checkpoint that recomputes it for the backward pass: saved, the loop
# would keep a copy of the chunk's weights per iteration; recomputed, it keeps the
# stored chunks once, as GPipe keeps its stage's layers
_CHUNK = "jaxshard_pipeline_chunk"


def _chunk_policy(body: ClosedJaxpr):
    """The checkpoint policy of a circular stage's layer: the body's own where the body
    is one `jax.checkpoint` (an outer policy overrides an inner one, so the outer one
    is the body's), else save everything as the plain body does; never the chunk's
    weights (`_CHUNK`)."""
    eqns = body.jaxpr.eqns
    if len(eqns) == 1 and eqns[0].primitive is prims.remat_p:
        base = eqns[0].params["policy"] or jax.checkpoint_policies.nothing_saveable
    else:
        base = jax.checkpoint_policies.everything_saveable

    def policy(prim, *args, **params):
        return params.get("name") != _CHUNK and base(prim, *args, **params)

    return policy


def _interleave(stacked: list, axis: str, stages: int, laps: int) -> list:
    """(S, V, per, ...) stacks stored in layer order (stage d holds chunks d·V ... d·V+V−1,
    the layout of the user's (L, ...) array split over ``axis``) -> the circular layout
    (stage e holds chunks e, e+S, e+2S, ...).

    Forward, a reshape and a transpose, which the planner sees through (a layout the
    uses give the chunks reaches the stored stack) and XLA moves with an all-to-all.
    Backward, the gradients go back by `_move_chunks`: every stage sends V chunks and
    receives V, in V rounds of one collective-permute of a chunk each (the reshape's own
    transpose would gather the whole stack on every stage)."""
    move = jax.custom_vjp(functools.partial(_chunks_in_ring_order, stages, laps))
    back = functools.partial(_move_chunks, axis=axis, rounds=_chunk_rounds(stages, laps, True))
    move.defvjp(lambda x: (move(x), None), lambda _, g: (back(g),))
    return [move(x) for x in stacked]


def _chunks_in_ring_order(stages: int, laps: int, x):
    flat = x.reshape(stages * laps, *x.shape[2:])  # chunk c = d·V + i
    return jnp.swapaxes(flat.reshape(laps, stages, *x.shape[2:]), 0, 1)  # [e, j]: c = j·S + e


def _move_chunks(x, axis: str, rounds: list):
    """``x`` (S, V, ...) split over ``axis`` with each stage's V chunks moved by
    ``rounds`` (`_chunk_rounds`): one collective-permute per round."""

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


def _chunk_rounds(
    stages: int, laps: int, back: bool = False
) -> list[tuple[list, list[int], list[int]]]:
    """The moves from layer order to ring order (``back``: the other way) in rounds: per
    round the (source, destination) stage pairs, the local chunk each stage sends and
    the local slot each stage receives into. Chunk c is at stage c // V, slot c % V in
    layer order and at stage c % S, slot c // S in ring order; the transfers form a
    V-regular bipartite multigraph, which splits into V perfect matchings (König),
    found one at a time by augmenting paths.

    Example:
        >>> [pairs for pairs, _, _ in _chunk_rounds(2, 2)]
        [[(0, 1), (1, 0)], [(0, 0), (1, 1)]]
    """
    if back:
        return [
            ([(e, d) for d, e in pairs], recv, send)
            for pairs, send, recv in _chunk_rounds(stages, laps)
        ]
    left = {d: [(c % stages, c) for c in range(d * laps, (d + 1) * laps)] for d in range(stages)}
    rounds = []
    for _ in range(laps):
        match: dict[int, tuple[int, int]] = {}  # destination -> (source, chunk)

        def augment(d: int, seen: set) -> bool:
            for e, c in left[d]:
                if e in seen:
                    continue
                seen.add(e)
                if e not in match or augment(match[e][0], seen):
                    match[e] = (d, c)
                    return True
            return False

        for d in range(stages):
            if not augment(d, set()):  # a regular bipartite multigraph always has one
                raise AssertionError("no perfect matching of the pipeline's chunks")
        send, recv, pairs = [0] * stages, [0] * stages, []
        for e, (d, c) in sorted(match.items(), key=lambda kv: kv[1][0]):
            left[d].remove((e, c))
            pairs.append((d, e))
            send[d], recv[e] = c % laps, c // stages
        rounds.append((pairs, send, recv))
    return rounds


def _split(v, d: int, m: int):
    """(..., B at d, ...) -> (M, ...) with microbatch k holding rows k, M+k, 2M+k, ...
    (strided, so a batch dim sharded over a mesh axis stays sharded in each
    microbatch); the rows stay at d + 1."""
    v = jnp.moveaxis(v, d, 0)
    v = jnp.swapaxes(v.reshape(v.shape[0] // m, m, *v.shape[1:]), 0, 1)
    return jnp.moveaxis(v, 1, d + 1)


def _replicate(v, d: int, r: int):
    """(M, ..., rows at d, ...) -> (M, R, ..., rows/R at d + 1, ...): replica k holds the
    k-th block of rows, as a mesh axis sharding the rows holds them."""
    v = jnp.moveaxis(v, d, 1)
    v = v.reshape(v.shape[0], r, v.shape[1] // r, *v.shape[2:])
    return jnp.moveaxis(v, 2, d + 1)


def _join(v):
    """The inverse of `_split` for rows at dim 1 (the carry's batch)."""
    v = jnp.swapaxes(v, 0, 1)
    return v.reshape(v.shape[0] * v.shape[1], *v.shape[2:])


def _shift(buf: list, axis: str, stages: int) -> list:
    """Each stage's slot to the next stage (the last one's to the first): a
    collective-permute over ``axis``, every other mesh axis left automatic."""
    perm = [(i, (i + 1) % stages) for i in range(stages)]
    specs = tuple(P(axis) for _ in buf)
    moved = jax.shard_map(
        lambda *b: [jax.lax.ppermute(x, axis, perm) for x in b],
        in_specs=specs,
        out_specs=list(specs),
        axis_names={axis},
    )(*buf)
    return list(moved)


# --- proving the body treats the batch independently ------------------------------------


@dataclass
class _Analysis:
    graph: Graph
    dims: list
    batch_consts: list[tuple[int, int]]  # (const index, its batch dim)
    n_consts: int


def _independence(closed: ClosedJaxpr, n_carry: int, n_xs: int, m: int) -> _Analysis:
    """Propagate a pseudo axis of size ``m`` from the carry's batch dim through the body
    (consts first as inputs); `_Rejected` naming the equation that mixes rows."""
    n_consts = len(closed.consts)
    jaxpr = consts_as_inputs(closed.jaxpr)
    n_in = len(jaxpr.invars)
    names = [f"const/{i}" for i in range(n_consts)]
    names += [f"carry/{i}" for i in range(n_carry)] + [f"xs/{i}" for i in range(n_xs)]
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
    carry_in = graph.in_vids[n_consts : n_consts + n_carry]
    for vid in carry_in:
        rank = len(graph.shapes[vid])
        prop.pin(vid, Pin(((MICROBATCH,),) + (None,) * (rank - 1), "the pipeline's microbatches"))
    prop.run()
    dims = prop.state.dims

    def has(vid: int) -> list[int]:
        return [d for d, ax in enumerate(dims[vid]) if ax and MICROBATCH in ax]

    for a, app in enumerate(graph.apps):
        working, partial = prop.working(a)
        if MICROBATCH in partial:
            raise _Rejected(f"its body sums over the batch at {app.describe()}")
        for vid, d, want in working:
            held, wanted = dims[vid][d] or (), want or ()
            if (MICROBATCH in held) != (MICROBATCH in wanted):
                raise _Rejected(f"its body mixes batch rows at {app.describe()}")
    for i, vid in enumerate(graph.out_vids):
        if has(vid) != [0]:
            raise _Rejected(
                f"its body's new carry leaf {i} does not keep the batch on its leading dim "
                f"(batch found on dims {has(vid)})"
            )
    for i, vid in enumerate(graph.in_vids[n_consts + n_carry :]):
        if has(vid):
            raise _Rejected(f"its xs leaf {i} has a batch dim; xs must be per-layer parameters")
    batch_consts = []
    for i, vid in enumerate(graph.in_vids[:n_consts]):
        found = has(vid)
        if len(found) > 1:
            raise _Rejected(f"a value its body closes over has the batch on dims {found}")
        if found:
            batch_consts.append((i, found[0]))
    return _Analysis(graph, dims, batch_consts, n_consts)


# --- the body at microbatch size ----------------------------------------------------------


def _microbatched(analysis: _Analysis, closed: ClosedJaxpr, m: int) -> ClosedJaxpr:
    """The body (consts first as inputs) re-traced on microbatch-sized values."""
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

            c, ys = _ORIGINAL_SCAN(
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
