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
stacks move from layer order to that layout once per step (`interleave`), stage s on
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
from jax.extend.core import jaxpr_as_fun
from jax.sharding import PartitionSpec as P

from jaxshard import pipeline_1f1b
from jaxshard.annotate import PinKind, hint_p
from jaxshard.errors import ShardingError
from jaxshard.jax_compat import caller_line
from jaxshard.pipeline_body import (
    ORIGINAL_SCAN,
    Rejected,
    activate,
    active_interception,
    independence,
    microbatched,
)
from jaxshard.pipeline_moves import (
    CHUNK,
    chunk_policy,
    interleave,
    join,
    pin_origins,
    replicate,
    shift,
    split,
)

SCHEDULES = ("gpipe", "1f1b", "circular")


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
        if self.replicate and self.schedule == "1f1b":
            raise ShardingError(
                "Pipeline(schedule='1f1b', replicate=True): the 1F1B schedule sums the weight "
                "gradients over data-parallel replicas inside its loop; drop replicate=True "
                "(or use schedule='gpipe' with it)"
            )
        if self.repeats > 1 and self.schedule != "circular":
            raise ShardingError(
                f"Pipeline(repeats={self.repeats}) applies to schedule='circular' only; write "
                f"Pipeline({self.axis!r}, {self.microbatches}, schedule='circular', "
                f"repeats={self.repeats})"
            )

    def bubble(self, stages: int) -> float:
        """The fraction of a step each stage idles: (S−1)/(v·M+S−1), v = 1 for GPipe.

        Example:
            >>> [round(Pipeline(microbatches=m).bubble(4), 2) for m in (1, 4, 16)]
            [0.75, 0.43, 0.16]
        """
        return _bubble(stages, self.microbatches, self.repeats)

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
    note: str = ""  # why 1F1B, asked for, runs this loop on the GPipe schedule

    @property
    def iterations(self) -> int:
        """v·M + S − 1: the loop's iterations, forward (the backward runs as many); for
        1F1B, M + 2S − 2 (S − 1 of them forward only, S − 1 backward only)."""
        if self.schedule == "1f1b":
            return self.microbatches + 2 * self.stages - 2
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def held(self) -> int:
        """Microbatches whose stage inputs (or saved activations) a stage holds at once:
        M + S − 1 iterations' worth for GPipe, 2S − 1 for 1F1B whatever M.

        Example:
            >>> PipelinedLoop("f.py:1", 8, 4, 16, 64, ((64, 8),), 0, schedule="1f1b").held
            7
        """
        if self.schedule == "1f1b":
            return 2 * self.stages - 1
        return self.iterations

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
                f"{v} chunks of {_layers(chunk)} each (stage s holds chunks s, s+{s}"
                + (f", s+{2 * s}" if v > 2 else "")
                + (", ..." if v > 3 else "")
                + ")"
            )
            schedule = (
                f"  circular schedule: each microbatch passes the stages {v} times; "
                f"{self.iterations} iterations forward, then as many backward; bubble "
                f"(S-1)/(vM+S-1) = {self.bubble:.1%} of each stage's work is discarded"
            )
        elif self.schedule == "1f1b":
            held = f"{_layers(self.layers // s)} each"
            schedule = (
                f"  1F1B schedule: {_iterations(s - 1)} forward only, {m} of one microbatch "
                f"forward and another backward on every stage (the loss head runs per "
                f"microbatch), {s - 1} backward only; each stage holds its layers' inputs for at most "
                f"2S-1 = {self.held} microbatches and recomputes inside each layer backward; bubble "
                f"(S-1)/(M+S-1) = {self.bubble:.1%} of each stage's work is discarded"
            )
        else:
            held = f"{_layers(self.layers // s)} each"
            schedule = (
                f"  GPipe schedule: {self.iterations} iterations forward, then as many "
                f"backward; bubble (S-1)/(M+S-1) = {self.bubble:.1%} of each stage's work "
                "is discarded"
            )
            if self.note:
                schedule += f"\n  1F1B asked for, GPipe run: {self.note}"
        lines = [
            f"scan at {self.line}: {self.layers} layers over {s} stages ({held}), "
            f"{m} microbatches of {self.batch // m} rows",
            schedule,
            f"  carry {', '.join(str(c) for c in self.carry)} moves one stage per iteration "
            "by collective-permute"
            + (", its gradient one stage back" if self.schedule == "1f1b" else ""),
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


def _iterations(n: int) -> str:
    return f"{n} iteration" + ("s" if n != 1 else "")


def _layers(n: int) -> str:
    return f"{n} layer" + ("s" if n != 1 else "")


def _positive_int(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _bubble(stages: int, microbatches: int, laps: int) -> float:
    return (stages - 1) / (laps * microbatches + stages - 1)


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
    # 1F1B: a loss being traced with its layer scan as a marker (`pipeline_1f1b`), the
    # scans it captured, and why the last loss asked to run 1F1B runs GPipe
    capturing: bool = False
    captured: list = field(default_factory=list)
    fallback: str = ""

    def record_1f1b(self, loop: Any) -> None:
        """Record a layer scan run on the 1F1B schedule."""
        self.loops.append(
            PipelinedLoop(loop.line, loop.layers, loop.stages, loop.m, loop.batch,
                          loop.carry_shapes, len(loop.batch_consts), (), "1f1b", 1)
        )  # fmt: skip

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
    outer = activate(seen)
    with _PATCH:
        _PLANNING += 1
        jax.lax.scan = _scan
        # every planning's calls pass through unless it runs 1F1B (`pipeline_1f1b`)
        jax.value_and_grad, jax.grad = pipeline_1f1b.value_and_grad, pipeline_1f1b.grad
    try:
        yield seen
    finally:
        activate(outer)
        with _PATCH:
            _PLANNING -= 1
            if _PLANNING == 0:
                jax.lax.scan = ORIGINAL_SCAN
                jax.value_and_grad = pipeline_1f1b.ORIGINAL_VALUE_AND_GRAD
                jax.grad = pipeline_1f1b.ORIGINAL_GRAD


def _scan(f, init, xs=None, length=None, reverse=False, unroll=1, _split_transpose=False):
    """`jax.lax.scan`, pipelined when it qualifies (module doc)."""
    seen: Interception | None = active_interception()
    plain = (f, init, xs, length, reverse, unroll, _split_transpose)
    if seen is None or seen.busy:
        return ORIGINAL_SCAN(*plain)
    line = _caller_line()
    seen.busy += 1
    try:
        loop = _Loop.of(f, init, xs, reverse, seen, line)
    except Rejected as why:
        seen.left.append((line, str(why)))
        loop = None
    finally:
        seen.busy -= 1
    if loop is None:
        return ORIGINAL_SCAN(*plain)
    if seen.capturing:  # a loss traced for 1F1B: the scan is split out of it
        return pipeline_1f1b.capture(loop, init, xs, seen)
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
        """Analyse a scan; `Rejected` when it does not qualify, a ShardingError when it
        would but its sizes do not divide."""
        carry, carry_tree = jax.tree_util.tree_flatten(init)
        stacked, xs_tree = jax.tree_util.tree_flatten(xs)
        if not stacked:
            raise Rejected("it has no xs (stacked per-layer arrays) to split over stages")
        if not carry or any(np.ndim(c) == 0 for c in carry):
            raise Rejected(
                "its carry is not a batch of activations (every carry leaf needs a leading batch dim)"
            )
        batch = int(np.shape(carry[0])[0])
        if any(np.shape(c)[0] != batch for c in carry):
            raise Rejected(
                "its carry leaves differ in their leading dim "
                f"{[np.shape(c)[0] for c in carry]}; the pipeline needs the batch first in each"
            )
        layers = int(np.shape(stacked[0])[0])
        m, s, axis = seen.pipeline.microbatches, seen.stages, seen.pipeline.axis
        v = seen.pipeline.repeats  # above 1 only when circular (checked)
        n_carry = len(carry)

        def flat_body(*flat):
            c = jax.tree_util.tree_unflatten(carry_tree, flat[:n_carry])
            x = jax.tree_util.tree_unflatten(xs_tree, flat[n_carry:])
            new_c, y = f(c, x)
            new_flat, new_tree = jax.tree_util.tree_flatten(new_c)
            if new_tree != carry_tree:
                raise Rejected("its body returns a carry of another structure than it takes")
            ys = jax.tree_util.tree_leaves(y)
            if ys:
                raise Rejected(
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
        analysis = independence(closed, n_carry, len(stacked), m * r)
        micro = microbatched(analysis, closed, m * r)
        replicas = seen.replicas if r > 1 else ()
        return cls(
            line=line, layers=layers, stages=s, micro=micro, m=m, laps=v, axis=axis, consts=consts,
            batch_consts=analysis.batch_consts, carry_tree=carry_tree, xs_tree=xs_tree,
            n_carry=n_carry, reverse=reverse, seen=seen, batch=batch,
            carry_shapes=tuple(tuple(np.shape(c)) for c in carry), r=r, replicas=replicas,
            replica_entry=replicas[0] if len(replicas) == 1 else replicas,
            chunk_policy=chunk_policy(micro),
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
        layers, slots, whole = pin_origins(self.line)

        def pin(x, spec, origin=slots):
            return hint_p.bind(x, spec=spec, origin=origin)

        if laps > 1:  # (S, V, per, ...): stage s holds chunks s, s+S, s+2S, ...
            stacked = [pin(x.reshape(s, laps, per, *x.shape[1:]), P(axis), layers) for x in stacked]
            # (S, per, V, ...): the layer scan of a stage steps over per, each layer's V
            # chunks at hand, the loop's constants as in GPipe
            stacked = [jnp.swapaxes(x, 1, 2) for x in interleave(stacked, axis, s, laps)]
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
        micro = [split(v, d, m) for v, d in moving]
        if r > 1:
            micro = [replicate(v, d + 1, r) for v, (_, d) in zip(micro, moving)]
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
                    return tuple(body(*consts, *c, *(checkpoint_name(x, CHUNK) for x in w)))

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
            return (shift(buf, axis, s), new_outs), None

        first_slot = [jnp.broadcast_to(v[0], (s, *v.shape[1:])) for v in micro]
        buf = [pin(b, slot_spec) for b in first_slot]
        # circular: one array holds each microbatch's latest carry (its input, then its
        # output after each pass), read at the start of every pass
        start = (lambda v: v) if laps > 1 else jnp.zeros_like
        outs = [pin(start(v), micro_spec, whole) for v in micro[:n_carry]]
        (_, outs), _ = jax.lax.scan(tick, (buf, outs), jnp.arange(laps * m + s - 1))
        schedule = "circular" if laps > 1 else "gpipe"  # one chunk per stage is GPipe
        note = ""
        if self.seen.pipeline.schedule == "1f1b":
            note = self.seen.fallback or (
                "the loss around this scan is not differentiated by jax.value_and_grad or "
                "jax.grad, which 1F1B runs per microbatch"
            )
        self.seen.loops.append(
            PipelinedLoop(self.line, self.layers, s, m, self.batch, self.carry_shapes,
                          len(self.batch_consts), self.replicas if r > 1 else (), schedule,
                          laps, note)
        )  # fmt: skip
        if r > 1:  # (M, R, rows/R, ...) -> (M, rows, ...)
            outs = [o.reshape(o.shape[0], o.shape[1] * o.shape[2], *o.shape[3:]) for o in outs]
        new_carry = [join(o) for o in outs]
        return jax.tree_util.tree_unflatten(self.carry_tree, new_carry), None
