"""The baseline every plan must beat: `jax.jit` with the same hints ("Shardy alone").

`shardy_alone` builds what a user gets without jaxshard: the hints become the
``in_shardings`` of the arguments they match (a hint's open dims, ``P.UNCONSTRAINED``
and dims past its end, replicated), every other argument replicated as the caller placed
it, and XLA's partitioner does the rest. With ``results="keep"`` (the default) each
result that is the new value of an argument (new parameters, new optimizer state) keeps
that argument's sharding, as jaxshard's plans do: the program a training loop can call
step after step without resharding between calls. ``results="free"`` leaves results to
XLA, which may return the state in another layout than it took (one step measured alone
then looks cheaper than the loop it belongs to). `compiled_cost` reads the two numbers
plans are compared on from a compiled program: collective bytes per device per call
(ring volumes, loop bodies times their trip counts) and per-device memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxshard.annotate import match_hints
from jaxshard.cost import CostModel, StepTime
from jaxshard.graph import tied_results
from jaxshard.hlo import compiled_collectives, compiled_flops
from jaxshard.lattice import to_spec
from jaxshard.plan import auto_view, mesh_axis_sizes
from jaxshard.trace import trace_on_mesh


class CompiledCost(NamedTuple):
    """Collective bytes per device per call, and per-device memory in bytes."""

    bytes: float
    memory: int


def compiled_cost(compiled: Any, mesh: Mesh) -> CompiledCost:
    """Collective bytes (ring volumes, per device per call) and memory (arguments +
    results + temporaries - aliased, per device) of a `jax.stages.Compiled`.

    Example:
        >>> compiled_cost(jax.jit(f).lower(x).compile(), mesh)  # doctest: +SKIP
        CompiledCost(bytes=24576.0, memory=1243844)
    """
    found = compiled_collectives(compiled.as_text(), mesh)
    moved = sum(c.ring_bytes * (1 if c.runs is None else c.runs) for c in found)
    return CompiledCost(moved, compiled_memory(compiled))


def compiled_step_time(compiled: Any, mesh: Mesh, model: CostModel) -> StepTime:
    """The step time `jaxshard.cost.step_time` estimates, read from a compiled program:
    its matrix multiplies' FLOPs per device (`jaxshard.hlo.compiled_flops`) over
    ``model.flops``, and each collective XLA inserted priced on the axes it spans.

    Example:
        >>> compiled_step_time(step.lower(*args).compile(), mesh, model).total  # doctest: +SKIP
        0.81
    """
    text = compiled.as_text()
    compute = compiled_flops(text) / model.flops if model.flops else 0.0
    moved = [
        (c.axes, c.ring_bytes, 1 if c.runs is None else c.runs)
        for c in compiled_collectives(text, mesh)
    ]
    return StepTime.of(compute, moved, model)


def compiled_memory(compiled: Any) -> int:
    """Per-device bytes of a `jax.stages.Compiled`: arguments + results + temporaries -
    aliased (donated arguments reused for results), from XLA's buffer assignment.

    Example:
        >>> compiled_memory(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile())  # doctest: +SKIP
        32
    """
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )  # fmt: skip


def shardy_alone(
    fn: Callable,
    args: tuple,
    mesh: Mesh,
    hints: Mapping[str, PartitionSpec],
    results: str = "keep",
) -> Any:
    """`jax.jit` of ``fn`` with ``hints`` as the ``in_shardings`` of the arguments they
    match (see the module doc), lowered for ``args`` (arrays or ShapeDtypeStructs):
    returns the `jax.stages.Lowered`.

    Example:
        >>> lowered = shardy_alone(step, (params, opt_state, batch), mesh,
        ...                        {r"batch/.*": P("data")})  # doctest: +SKIP
        >>> compiled_cost(lowered.compile(), mesh)  # doctest: +SKIP
    """
    if results not in ("keep", "free"):
        raise ValueError(f"results must be 'keep' or 'free', got {results!r}")
    traced = trace_on_mesh(fn, args, {}, mesh)
    mesh = auto_view(mesh)
    leaves, tree = jax.tree.flatten(args)
    shapes = [tuple(a.shape) for a in traced.in_avals]
    pins = match_hints(hints, traced.in_names, shapes, mesh_axis_sizes(mesh))
    specs = [
        to_spec(tuple(() if d is None else d for d in pins[i].dims)) if i in pins
        else PartitionSpec() for i in range(len(leaves))
    ]  # fmt: skip
    in_shardings = [NamedSharding(mesh, s) for s in specs]
    out_shardings = None
    if results == "keep":
        outs: list[Any] = [None] * len(traced.out_names)  # None: left to XLA
        for i, o in tied_results(traced):
            outs[o] = in_shardings[i]
        out_shardings = jax.tree_util.tree_unflatten(traced.out_tree, outs)
    jitted = jax.jit(
        fn, in_shardings=jax.tree.unflatten(tree, in_shardings), out_shardings=out_shardings
    )
    with jax.set_mesh(mesh):
        return jitted.lower(*args)
