"""Whole-strategy planning: choose the mesh and the parallelism, not only the layouts.

`auto_parallel` takes a step, its arguments (arrays or `jax.ShapeDtypeStruct`s), a
device count and a memory limit, and returns a `Strategy`: the mesh, the hints, and the
ranked candidates it weighed. A candidate is a factorization of the devices into named
axes, outermost first: ``data`` (the batch), ``fsdp`` (the batch too, with the search
free to store parameters over it alone), ``tensor`` (the search puts tensor, sequence
or expert parallelism there), each laid over the topology's levels (`jaxshard.topology`):
the last axis on the fastest links. For each, the layout search
(`jaxshard.search.search_hints`) lays every tensor out within the memory limit, and the
propagated plan is priced by `jaxshard.cost.step_time` (contraction FLOPs over peak
FLOP/s plus each collective over its axes' links). The candidate of least estimated
step time that fits wins.

The candidates are searched coarse to fine: every tensor degree on a two-axis mesh
(``data`` x ``tensor``) first, then, for the two best tensor degrees, every split of
the batch axes into ``data`` x ``fsdp``. A tensor axis never spans a slow level of a
multi-level topology (it stays within a node or a slice). Then, when the step runs a
layer stack under `jax.lax.scan`, pipelines: a ``stage`` axis over the slowest level
(`jaxshard.Pipeline`; on a one-level topology only when nothing else fits), for every
stage count that divides the layers and the tensor degrees of the two best meshes so
far, with the most microbatches of 4S, 2S or S that split the batch. A pipeline whose
lower bound (the program's FLOPs spread over every device and stretched by the bubble,
plus the activations it hands between stages) is no faster than the best candidate
found is pruned without being searched. The best pipeline searched is weighed again on
the circular schedule, where its layers split into two chunks per stage (half the
bubble, twice the transfers), and then with its batch axes split into ``data`` x
``fsdp`` (up to four axes: ``stage``, ``data``, ``fsdp``, ``tensor``).
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

from jaxshard.api import AutoShard, auto_shard
from jaxshard.cost import (
    CostModel,
    MemoryEstimate,
    StepTime,
    human_bytes,
    nbytes,
    program_flops,
    step_time,
)
from jaxshard.errors import JaxshardWarning, ShardingError
from jaxshard.jax_compat import scan_counts
from jaxshard.pipeline import Pipeline
from jaxshard.plan import Plan
from jaxshard.search import HEADROOM
from jaxshard.topology import Topology

ROLES = ("data", "fsdp", "tensor")  # mesh axis names, outermost first
PIPELINE_ROLES = ("stage", "data", "tensor")  # a pipeline candidate's axes
PIPELINE_SPLIT_ROLES = ("stage", "data", "fsdp", "tensor")  # with its batch axes split
REFINED = 2  # tensor degrees whose batch axes are split into data x fsdp
SEARCH_SECONDS = 4.0  # the most one mesh's layout search runs (it keeps the best found)


@dataclass
class Candidate:
    """One strategy weighed: a mesh shape over named axes, its degrees per role, and
    what the search found on it. ``time`` is the estimated seconds per step (compute +
    communication), ``memory`` the estimated bytes per device (the smallest footprint
    found when nothing fit), ``status`` what happened (``"fits"``, ``"over the memory
    limit"``, or why it could not be planned).

    Example:
        >>> Candidate((8, 8), ("data", "tensor")).degrees
        {'data': 8, 'tensor': 8}
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    status: str = "not searched"
    time: StepTime | None = None
    memory: MemoryEstimate | None = None
    predicted_bytes: float = 0.0
    hints: dict[str, PartitionSpec] = field(default_factory=dict, repr=False)
    plan: Plan | None = field(default=None, repr=False)
    seconds: float = 0.0
    microbatches: int = 0  # with a ``stage`` axis: the pipeline's microbatches
    repeats: int = 1  # above 1: the circular schedule, layer chunks per stage

    @property
    def pipeline(self) -> Pipeline | None:
        """The `jaxshard.Pipeline` of a candidate with a ``stage`` axis (else None)."""
        if not self.microbatches:
            return None
        if self.repeats > 1:
            return Pipeline("stage", self.microbatches, schedule="circular", repeats=self.repeats)
        return Pipeline("stage", self.microbatches)

    @property
    def degrees(self) -> dict[str, int]:
        """Devices per role: ``{'data': 8, 'tensor': 8}``."""
        return dict(zip(self.axes, self.shape))

    @property
    def fits(self) -> bool:
        """Whether the search found a layout within the memory limit."""
        return self.status == "fits"

    @property
    def seconds_per_step(self) -> float:
        """The estimated step time (infinite when nothing was planned)."""
        return self.time.total if self.time is not None else math.inf

    def describe(self) -> str:
        """``8x8 (data=8, tensor=8)``; a pipeline adds its microbatches (and a circular one
        its chunks per stage)."""
        text = "x".join(map(str, self.shape)) + f" ({_degrees(self)})"
        if self.microbatches:
            text += f", {self.microbatches} microbatches"
        return text + (f", circular x{self.repeats}" if self.repeats > 1 else "")


@dataclass
class Strategy:
    """What `auto_parallel` chose: ``mesh`` (a `Mesh` over the devices given, an
    `AbstractMesh` for a device count), ``hints`` (the user's hints on that mesh),
    ``cost_model`` (its axes priced by the topology), and every ``candidate`` weighed,
    best first. ``auto_shard(fn)`` makes the ready step; ``explain()`` says why.

    Example:
        >>> strategy.mesh.shape  # doctest: +SKIP
        OrderedDict([('data', 8), ('tensor', 8)])
    """

    mesh: Mesh | AbstractMesh
    hints: dict[str, PartitionSpec]
    cost_model: CostModel
    candidates: list[Candidate]
    topology: Topology
    memory_per_device: float
    seconds: float
    options: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def best(self) -> Candidate:
        """The winning candidate."""
        return self.candidates[0]

    @property
    def plan(self) -> Plan:
        """The winning candidate's plan (as `AutoShard.plan` makes it)."""
        return self.best.plan

    def auto_shard(self, fn: Callable, **options: Any) -> AutoShard:
        """``fn`` under `jaxshard.auto_shard` on this strategy's mesh, with its hints, cost
        model and memory limit (the search lays the arguments out again, as it did for
        the winner); ``options`` add to or override `auto_parallel`'s.

        Example:
            >>> step = strategy.auto_shard(train_step)  # doctest: +SKIP
            >>> params, opt_state, loss = step(params, opt_state, batch)  # doctest: +SKIP
        """
        merged = {
            "search": True,
            "memory_budget": self.memory_per_device,
            "cost_model": self.cost_model,
            "pipeline": self.best.pipeline,
            **self.options,
            **options,
        }
        return auto_shard(self.mesh, self.hints, **merged)(fn)

    def explain(self) -> str:
        """The ranked candidates and why the winner won.

        Example:
            >>> print(strategy.explain())  # doctest: +SKIP
            auto_parallel: 64 devices, 80.00 GiB per device (H100 x64: ...)
        """
        n = math.prod(self.best.shape)
        searched = [c for c in self.candidates if c.seconds > 0]
        width = max(34, *(len(c.describe()) for c in self.candidates))
        lines = [
            f"auto_parallel: {n} devices, {human_bytes(self.memory_per_device, 2)} per device "
            f"({self.topology.describe()}); {len(searched)} meshes searched in "
            f"{self.seconds:.1f} s",
            "",
            f"{'rank':>4}  {'mesh':<{width}} {'step s':>9} {'compute':>9} {'comm':>9} "
            f"{'memory':>11} {'plan s':>7}  status",
        ]
        for i, c in enumerate(self.candidates, 1):
            if c.time is not None:
                t = c.time
                times = f"{t.total:9.4f} {t.compute:9.4f} {t.total - t.compute:9.4f}"
            else:
                times = f"{'-':>9} {'-':>9} {'-':>9}"
            memory = human_bytes(c.memory.total) if c.memory is not None else "-"
            lines.append(
                f"{i:>4}  {c.describe():<{width}} {times} {memory:>11} {c.seconds:7.1f}  {c.status}"
            )
        lines += ["", _why(self.best, [c for c in self.candidates[1:] if c.fits])]
        return "\n".join(lines)


def auto_parallel(
    fn: Callable,
    *args: Any,
    devices: Sequence[Any] | int,
    memory_per_device: float,
    topology: Topology | None = None,
    cost_model: CostModel | None = None,
    hints: Mapping[str, PartitionSpec] | None = None,
    time_limit: float = 120.0,
    **options: Any,
) -> Strategy:
    """Choose the mesh, the parallelism degrees and every layout for ``fn(*args)`` on
    ``devices`` (a list of devices, or a count to plan for devices this process does
    not have: the mesh is then an `AbstractMesh`), keeping the estimated memory per
    device within ``memory_per_device`` bytes (module docstring: the candidates and how
    they are searched).

    ``topology`` says which devices share fast links (`jaxshard.Topology`; by default
    every pair alike, at ``cost_model``'s figures). ``cost_model`` overrides the
    topology's per-level pricing with one uniform model. ``hints`` constrain the choice:
    they name the roles ``data`` (on a mesh with an ``fsdp`` axis it stands for both
    batch axes), ``fsdp``, ``tensor``, and a hint naming a role the mesh lacks leaves
    that dim unsharded. So ``{"batch/.*": P("data")}`` fixes the batch to the data
    axes whatever their size. Other ``options`` go to every `auto_shard` (e.g.
    ``logical_axis_rules``, ``static_argnums``). Stops weighing candidates after
    ``time_limit`` seconds, with a warning, keeping the best found.

    When no candidate fits, a `ShardingError` gives the smallest footprint found and
    what would make it fit.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> def loss(w, x):
        ...     return jnp.mean(jnp.tanh(x @ w["a"]) @ w["b"])
        >>> w = {"a": jax.ShapeDtypeStruct((256, 1024), jnp.float32),
        ...      "b": jax.ShapeDtypeStruct((1024, 256), jnp.float32)}
        >>> x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
        >>> strategy = auto_parallel(jax.grad(loss), w, x, devices=8,
        ...                          memory_per_device=2**30, hints={"x": P("data")})
        >>> strategy.best.fits, len(strategy.candidates) > 3
        (True, True)
    """
    t0 = time.perf_counter()
    device_list, n = _devices(devices)
    if not memory_per_device > 0:
        raise ShardingError(
            f"auto_parallel(memory_per_device={memory_per_device!r}): give the bytes each "
            "device holds, e.g. 80 * 2**30"
        )
    if topology is None:
        topology = Topology.uniform(cost_model or CostModel())
    if topology.devices is not None and topology.devices != n:
        raise ShardingError(
            f"the topology {topology.name!r} has {topology.devices} devices, but "
            f"auto_parallel was given {n}; describe the devices given (e.g. "
            f"Topology.h100(nodes={max(n // 8, 1)}) for {n} H100s)"
        )
    hints = dict(hints or {})
    _check_roles(hints)

    if options.get("pipeline") is not None:
        raise ShardingError(
            f"auto_parallel(pipeline={options['pipeline']!r}): auto_parallel chooses the "
            "pipeline (its stages and microbatches) itself; leave pipeline= out"
        )
    options.pop("pipeline", None)

    def weigh(c: Candidate) -> None:
        start = time.perf_counter()
        mesh = _mesh(device_list, c.shape, c.axes)
        model = _priced(topology, cost_model, c)
        on_mesh = hints_on(hints, c.axes)
        step = auto_shard(
            mesh,
            on_mesh,
            search=True,
            memory_budget=memory_per_device,
            cost_model=model,
            pipeline=c.pipeline,
            search_time_limit=max(1.0, min(SEARCH_SECONDS, time_limit - (start - t0))),
            **options,
        )(fn)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", JaxshardWarning)
                plan = step.plan(*args)
        except ShardingError as e:
            c.memory = getattr(e, "footprint", None)
            first = str(e).split(": ", 1)[0] if c.memory is not None else _first_line(e)
            c.status = "over the memory limit" if c.memory is not None else f"n/a: {first}"
        else:
            # a plan the search could fit only within its headroom (`HEADROOM`) may not
            # fit once compiled: ranked after those that fit with it, unless none does
            near = plan.estimated_memory.total > HEADROOM * memory_per_device
            c.status = "near the memory limit" if near else "fits"
            c.plan, c.memory, c.hints = plan, plan.estimated_memory, on_mesh
            c.time, c.predicted_bytes = step_time(plan, model), plan.predicted_bytes
        c.seconds = time.perf_counter() - start

    def plain(c: Candidate) -> Plan | None:
        """The step planned from the hints alone on ``c``'s mesh: its program, to size
        pipeline candidates when no searched candidate fits."""
        mesh = _mesh(device_list, c.shape, c.axes)
        try:
            return auto_shard(mesh, hints_on(hints, c.axes), **options)(fn).plan(*args)
        except ShardingError:
            return None

    stopped = False

    def weigh_all(new: list[Candidate]) -> None:
        nonlocal stopped
        for c in new:
            if stopped or time.perf_counter() - t0 > time_limit:
                stopped = True
                return
            candidates.append(c)
            weigh(c)

    candidates: list[Candidate] = []
    weigh_all([Candidate(*_named((n // t, t))) for t in _tensor_degrees(n, topology)])
    # a mesh whose batch axes the hints could not use fails the same way split in two
    planned = sorted((c for c in candidates if c.memory is not None), key=_rank)
    for b in planned[:REFINED]:
        t = b.degrees.get("tensor", 1)
        weigh_all([Candidate(*_named((d, f, t), ROLES)) for d, f in _splits(n // t)])
    if not stopped:

        def weigh_unpruned(found: list[Candidate]) -> None:
            candidates.extend(c for c in found if c.status != "not searched")
            weigh_all([c for c in found if c.status == "not searched"])

        pipelines, plan, stacks = _pipelines(candidates, n, topology, cost_model, plain)
        weigh_unpruned(pipelines)
        # the best pipeline on the circular schedule too, then its batch axes split in
        # two, as the meshes without a stage are
        b = min((c for c in pipelines if c.memory is not None), key=_rank, default=None)
        twin = None if b is None else _circular(b, candidates, plan, stacks, topology, cost_model)
        if twin is not None:
            weigh_unpruned([twin])
            b = min((b, twin), key=_rank) if twin.memory is not None else b
        if b is not None:
            stages, data, t = (b.degrees.get(r, 1) for r in PIPELINE_ROLES)
            split = [Candidate(*_named((stages, d, f, t), PIPELINE_SPLIT_ROLES))
                     for d, f in _splits(data)]  # fmt: skip
            for c in split:
                c.microbatches, c.repeats = b.microbatches, b.repeats
            weigh_all(split)
    if not any(c.fits for c in candidates):
        for c in candidates:
            if c.status == "near the memory limit":
                c.status = "fits"
    candidates.sort(key=_rank)
    seconds = time.perf_counter() - t0
    if stopped:
        warnings.warn(
            f"auto_parallel stopped weighing candidates after its time limit of {time_limit} s; "
            "the strategy is the best of those searched. Raise time_limit to weigh them all.",
            JaxshardWarning,
            stacklevel=2,
        )
    best = candidates[0]
    if not best.fits:
        _raise_nothing_fits(candidates, n, memory_per_device)
    return Strategy(
        mesh=_mesh(device_list, best.shape, best.axes),
        hints=best.hints,
        cost_model=_priced(topology, cost_model, best),
        candidates=candidates,
        topology=topology,
        memory_per_device=memory_per_device,
        seconds=seconds,
        options=dict(options),
    )


def _pipelines(
    candidates: list[Candidate],
    n: int,
    topology: Topology,
    cost_model: CostModel | None,
    plain: Callable[[Candidate], Plan | None],
) -> tuple[list[Candidate], Plan | None, list]:
    """The pipeline candidates: a ``stage`` axis over the topology's slowest level (on a
    one-level topology only when nothing else fits: there is no slow link for it to
    spare), for every stage count that divides the layer stacks and each tensor degree
    of the two best candidates so far, the most microbatches of 4S, 2S, S that split the
    batch evenly over the data axis; with the plan they were sized from and its layer
    stacks (`_layer_stacks`). One whose lower bound (`_floor`) is no faster than
    the best found is marked pruned and not searched."""
    ranked = sorted(candidates, key=_rank)
    fitting = [c for c in ranked if c.fits]
    if len(topology.levels) == 1 and fitting:
        return [], None, []
    plan = fitting[0].plan if fitting else plain(ranked[0]) if ranked else None
    stacks = _layer_stacks(plan) if plan is not None else []
    if not stacks:
        return [], plan, []
    levels = topology.levels
    outer = (
        n if len(levels) == 1 else levels[-1].size or n // math.prod(lv.size for lv in levels[:-1])
    )
    # the tensor degrees of the best candidates planned (as the batch axes are refined):
    # a stage axis takes devices from the batch, so the best flat degree need not be the
    # best pipelined one
    planned = [c for c in ranked if c.memory is not None] or ranked[:1]
    wanted = list(dict.fromkeys(c.degrees.get("tensor", 1) for c in planned))[:REFINED]
    best = fitting[0].seconds_per_step if fitting else math.inf
    out, meshes = [], set()
    for stages, want in itertools.product(range(2, outer + 1), wanted):
        if outer % stages or any(layers % stages for layers, _, _ in stacks):
            continue
        rest = n // stages
        tensor = max(t for t in _tensor_degrees(n, topology) if rest % t == 0 and t <= want)
        if (stages, tensor) in meshes:  # both degrees round down to the same one
            continue
        meshes.add((stages, tensor))
        c = Candidate(*_named((stages, rest // tensor, tensor), PIPELINE_ROLES))
        data = c.degrees.get("data", 1)
        fits_rows = [
            m for m in (4 * stages, 2 * stages, stages)
            if all(rows % m == 0 and (rows // m) % data == 0 for _, rows, _ in stacks)
        ]  # fmt: skip
        if not fits_rows:
            c.status = (
                f"n/a: no count of {stages}-{4 * stages} microbatches splits the batch of "
                f"{stacks[0][1]} rows over {data} data-parallel devices"
            )
        else:
            c.microbatches = fits_rows[0]
            _prune(c, _floor(plan, c, stacks, _priced(topology, cost_model, c)), best)
        out.append(c)
    return out, plan, stacks


def _circular(
    b: Candidate, candidates: list[Candidate], plan: Plan, stacks, topology: Topology, cost_model
) -> Candidate | None:
    """The best pipeline ``b`` on the circular schedule, where every layer stack splits
    into two chunks per stage (half the bubble for twice the stage-to-stage transfers);
    pruned like the others when its lower bound is no faster than the best candidate.
    None where the stacks do not split so. ``plan`` and ``stacks`` are `_pipelines`'."""
    stages = b.degrees["stage"]
    if not stacks or any(layers % (2 * stages) for layers, _, _ in stacks):
        return None
    c = Candidate(b.shape, b.axes, microbatches=b.microbatches, repeats=2)
    best = min((x.seconds_per_step for x in candidates if x.fits), default=math.inf)
    _prune(c, _floor(plan, c, stacks, _priced(topology, cost_model, c)), best)
    return c


def _prune(c: Candidate, floor: float, best: float) -> None:
    """Mark pipeline candidate ``c`` pruned when its lower bound ``floor`` is no faster
    than the best step time found."""
    if floor >= best:
        c.status = (
            f"pruned: at least {floor:.4f} s per step (compute with the pipeline "
            f"bubble, and the carry between stages), not under the best {best:.4f} s"
        )


def _layer_stacks(plan: Plan) -> list[tuple[int, int, int]]:
    """``(layers, batch rows, carry bytes)`` of each scan in ``plan``'s program that loops
    over stacked per-layer arrays with a batch-first carry: the loops a pipeline could
    split (`jaxshard.pipeline` decides which qualify; this only sizes the candidates)."""
    out = []
    for app in plan.graph.apps:
        eqn = app.eqn
        if eqn is None or eqn.primitive.name != "scan":
            continue
        consts, n_carry = scan_counts(eqn.params)
        carry = [v.aval for v in eqn.invars[consts : consts + n_carry]]
        rows = {a.shape[0] if a.shape else 0 for a in carry}
        if len(eqn.invars) > consts + n_carry and len(rows) == 1 and 0 not in rows:
            carried = sum(nbytes(a.shape, a.dtype) for a in carry)
            out.append((int(eqn.params["length"]), rows.pop(), carried))
    return out


def _floor(plan: Plan, c: Candidate, stacks, model: CostModel) -> float:
    """A lower bound on pipeline candidate ``c``'s step time: the program's FLOPs spread
    evenly over the devices, the layer loops' share stretched by the bubble (their
    v·M+S−1 iterations do v·M microbatch-chunks' work; v = 1 for GPipe), plus the carry
    each stage hands on per iteration, forward and backward, split over every device of
    a stage."""
    n, stages, m, v = math.prod(c.shape), c.degrees["stage"], c.microbatches, c.repeats
    looped = program_flops(plan.graph, in_scans=True)
    flops = program_flops(plan.graph) + looped * (stages - 1) / (v * m)
    compute = flops / n / model.flops if model.flops else 0.0
    carry = max(carried for _, _, carried in stacks) / m / (n // stages)
    return compute + 2 * (v * m + stages - 1) * model.collective_time(("stage",), carry)


def hints_on(hints: Mapping[str, PartitionSpec], axes: Sequence[str]) -> dict:
    """``hints`` written with role names, on a mesh with ``axes``: ``data`` stands for
    every batch axis the mesh has (``data`` and ``fsdp``), ``fsdp`` for itself or, on a
    mesh without it, ``data``; a role the mesh lacks leaves the dim unsharded.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> hints_on({"x": P("data", "tensor")}, ("data", "fsdp", "tensor"))
        {'x': P(('data', 'fsdp'), 'tensor')}
        >>> hints_on({"x": P("data", "tensor")}, ("tensor",))
        {'x': P(None, 'tensor')}
    """
    present = set(axes)
    stands = {
        "data": tuple(a for a in ("data", "fsdp") if a in present),
        "fsdp": ("fsdp",) if "fsdp" in present else tuple(a for a in ("data",) if a in present),
        "tensor": ("tensor",) if "tensor" in present else (),
    }
    out = {}
    for key, spec in hints.items():
        entries = []
        for entry in spec:
            if entry is None or entry is PartitionSpec.UNCONSTRAINED:
                entries.append(entry)
                continue
            names = (entry,) if isinstance(entry, str) else tuple(entry)
            mapped = tuple(dict.fromkeys(a for name in names for a in stands[name]))
            entries.append(None if not mapped else mapped[0] if len(mapped) == 1 else mapped)
        out[key] = PartitionSpec(*entries)
    return out


def _check_roles(hints: Mapping[str, PartitionSpec]) -> None:
    for key, spec in hints.items():
        if not isinstance(spec, PartitionSpec):
            raise ShardingError(
                f"auto_parallel hint {key!r}: {spec!r} is not a PartitionSpec; write e.g. "
                "{'batch/.*': P('data')}"
            )
        for entry in spec:
            if entry is None or entry is PartitionSpec.UNCONSTRAINED:
                continue
            for name in (entry,) if isinstance(entry, str) else entry:
                if name not in ROLES:
                    raise ShardingError(
                        f"auto_parallel hint {key!r}: {spec} names axis {name!r}; hints to "
                        f"auto_parallel name the roles {ROLES} (it chooses the mesh), e.g. "
                        "P('data') for the batch"
                    )


def _devices(devices: Sequence[Any] | int) -> tuple[list[Any] | None, int]:
    if isinstance(devices, bool):
        raise ShardingError("auto_parallel(devices=...): a list of devices or a device count")
    if isinstance(devices, (int, np.integer)):
        if devices < 1:
            raise ShardingError(f"auto_parallel(devices={devices}): give a positive count")
        return None, int(devices)
    listed = list(devices)
    if not listed:
        raise ShardingError("auto_parallel(devices=[]): give at least one device")
    return listed, len(listed)


def _mesh(devices: list[Any] | None, shape: tuple[int, ...], axes: tuple[str, ...]):
    auto = (AxisType.Auto,) * len(axes)
    if devices is None:
        return AbstractMesh(shape, axes, axis_types=auto)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), axes, axis_types=auto)


def _priced(topology: Topology, cost_model: CostModel | None, c: Candidate) -> CostModel:
    if cost_model is None:
        return topology.cost_model(c.axes, c.shape)
    return cost_model if cost_model.flops else replace(cost_model, flops=topology.flops)


def _named(shape: tuple[int, ...], roles: tuple[str, ...] = ("data", "tensor")):
    """A shape over ``roles`` without its size-1 axes (a mesh of one device keeps data)."""
    kept = [(s, r) for s, r in zip(shape, roles) if s > 1] or [(1, "data")]
    return tuple(s for s, _ in kept), tuple(r for _, r in kept)


def _tensor_degrees(n: int, topology: Topology) -> list[int]:
    """Divisors of ``n`` a tensor axis may have: within the first level of a topology
    with more than one (it never crosses nodes or slices)."""
    divisors = [t for t in range(1, n + 1) if n % t == 0]
    if len(topology.levels) > 1 and topology.levels[0].size is not None:
        divisors = [t for t in divisors if topology.levels[0].size % t == 0]
    return divisors


def _splits(batch: int) -> list[tuple[int, int]]:
    """``(data, fsdp)`` pairs, both above 1, whose product is ``batch``."""
    return [(d, batch // d) for d in range(2, batch) if batch % d == 0 and batch // d > 1]


def _rank(c: Candidate) -> tuple:
    """Fitting candidates by step time, then the rest by footprint, then the unplanned."""
    if c.fits:
        return (0, c.seconds_per_step, c.memory.total)
    if c.memory is not None:
        return (1, c.memory.total, 0.0)
    return (2, 0.0, 0.0)


def _degrees(c: Candidate) -> str:
    return ", ".join(f"{a}={s}" for a, s in zip(c.axes, c.shape))


def _first_line(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _why(best: Candidate, others: list[Candidate]) -> str:
    t = best.time
    heaviest = sorted(t.communication.items(), key=lambda kv: -kv[1])[:3]
    comm = ", ".join(f"{','.join(axes)} {s:.4f} s" for axes, s in heaviest) or "none"
    text = (
        f"winner: {best.describe()}: estimated {t.total:.4f} s per step (compute "
        f"{t.compute:.4f} s; communication by axes: {comm}), "
        f"{human_bytes(best.memory.total, 2)} per device, "
        f"{human_bytes(best.predicted_bytes)} of collectives per device per step."
    )
    if others:
        runner = others[0]
        ratio = runner.seconds_per_step / max(t.total, 1e-12)
        text += (
            f" The next that fits, {runner.describe()}, is estimated {ratio:.2f}x slower "
            f"({runner.seconds_per_step:.4f} s: compute {runner.time.compute:.4f} s, "
            f"{human_bytes(runner.predicted_bytes)} of collectives)."
        )
    else:
        text += " No other candidate fits the memory limit."
    return text


def _raise_nothing_fits(candidates: list[Candidate], n: int, limit: float) -> None:
    sized = [c for c in candidates if c.memory is not None]
    if not sized:
        reasons = "; ".join(f"{c.describe()}: {c.status}" for c in candidates[:4])
        raise ShardingError(f"auto_parallel could not plan any mesh of {n} devices: {reasons}")
    c = min(sized, key=lambda c: c.memory.total)
    m = c.memory
    size = lambda b: human_bytes(b, 2)  # noqa: E731
    state = m.arguments + m.results
    fixes = [f"memory_per_device of at least {size(m.total)}"]
    if limit > m.activations:
        # arguments and results spread over more devices; activations as they are
        more = math.ceil(n * state / (limit - m.activations))
        fixes.append(f"about {more} devices (arguments and results spread thinner)")
    if limit > state and m.activations > 0:
        fixes.append(
            f"a batch about {m.activations / (limit - state):.1f}x smaller (peak activations "
            f"are {size(m.activations)})"
        )
    piped = [p for p in sized if p.microbatches]
    if piped:
        p = min(piped, key=lambda p: p.memory.total)
        fixes.append(
            f"more pipeline stages than the {max(p.degrees['stage'] for p in piped)} weighed "
            f"(the smallest pipeline, {p.describe()}, needs {size(p.memory.total)}, its "
            f"arguments {size(p.memory.arguments)})"
        )
    else:
        fixes.append(
            "a pipeline (none was weighed: the step has no layer stack run by jax.lax.scan "
            "over stacked per-layer weights with the activations as carry whose layers the "
            "stage counts divide, or the time limit came first)"
        )
    raise ShardingError(
        f"no parallel strategy fits {size(limit)} per device on {n} devices: the smallest "
        f"footprint found is {size(m.total)} per device on mesh {c.describe()} (arguments "
        f"{size(m.arguments)}, results {size(m.results)}, peak activations "
        f"{size(m.activations)}). It would fit with " + "; or ".join(fixes) + "."
    )
