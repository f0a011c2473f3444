"""Fully automatic search: the shardings hints leave free, chosen by an integer program.

Outline, module by module:

1. `problem` builds the problem from the traced graph, from two parts: `decisions` (dim
   classes, groups, candidates) and `terms` (the joint costs). Propagation moves a sharding along
   the factors of every rule, so the (value, dim) pairs one factor connects form a *dim
   class* (the residual stream's model dim across all layers, one layer's attention
   heads, the batch): whatever axes one member carries, propagation gives to all. Where
   a factor would put one class on two dims of a tensor (attention's query and key
   positions of one sequence) or on two factors of one equation, that dim is cut from
   the factor instead and the equation prices moving it (the keys gathered for a
   sequence split over a mesh axis): the positions stay one decision. A sharding
   constraint inside the step lays out its value, not the state behind it: where a
   class the program pins meets one holding an open dim of state, the dim least its own
   layout is cut (a state leaf's own dim, or a result made from state without passing
   a pin, such as a weight's gradient, before a pinned value's, before the rest), so
   MaxText's activations may keep "tensor" on their embedding dim while its weights
   take it on their hidden dim. A class
   is pinned by a hint, decided if it holds a dim of an undecided argument, else
   replicated. Repeated layers share decisions: arguments are grouped by their path with
   layer indices as ``*`` (``params/layers/*/attn/wq``) and shape, optimizer state joins
   the parameter whose path ends its own. With a memory budget each group may also store
   an extra mesh axis (or the whole mesh) on a free dim: its optimizer state alone
   (ZeRO-1), or, for a parameter every use of which contracts it, the parameter with its
   state (FSDP/ZeRO-3: gathered once in each XLA computation that uses it, the gathered
   copy alive from its first use there to its last; that axis alone is storage, the rest
   of its layout the computation's). Each decision picks one candidate (unsharded, or one mesh axis dividing
   all its sizes; a class holding a data argument's dim, the unhinted batch, may also
   take any two or more axes at once whose sizes' product divides it); a dim whose
   factor fewer axes divide than its class (8 key heads repeated into 64 query heads on
   a 32-way axis) is cut from that factor rather than narrowing the class; costs come
   from the rules (a sharded reduction factor leaves its results partial: an all-reduce;
   a sharded need-replication factor gathers its operands; one axis may not shard two
   dims; with ``CostModel(flops=...)`` each equation's FLOPs over the devices that split
   it), and equations with the same rule and decisions count once with their multiplicity, so a
   48-layer model costs little more than a 12-layer one.
2. `memory` prices per-device memory (a mixin of the problem): arguments, results and the
   live activations at an equation, per joint choice of the decisions they depend on
   (with the copies cut dims are moved to, one per layout and XLA computation, alive
   from the first equation that moves them to the last: `memory.Moved`);
   buffers are counted as XLA's fusion leaves them (`memory.fused_liveness`), so that a
   budget compares with the compiled program's memory.
3. `solver` writes the integer program for HiGHS (``highspy``): a one-hot variable per
   decision candidate and one per joint choice of the decisions an equation or tensor
   touches; it minimizes the estimated time (communication, and compute) of one step
   (`jaxshard.cost.CostModel`) subject to memory at the peak equations at most the budget
   (rows added lazily until the layout's own peak fits), within the time limit. When no
   layout fits, it finds the smallest-memory one instead, and splits the largest buffers
   at that layout's propagated peak further while its estimate falls (`_shrunk`).
4. `result` reports: the chosen hints go through ordinary propagation (`search_hints`,
   here), whose plan gives the reported bytes and memory, and `SearchResult` explains it;
   a budget nothing meets is an error naming the smallest footprint. Where propagation
   moves far more bytes than the model counted for its optimum, that layout is excluded
   and the program solved again (`_repriced`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from jax.sharding import Mesh, PartitionSpec

from jaxshard.baseline import compiled_memory
from jaxshard.cost import CostModel, MemoryEstimate, human_bytes, step_bytes, step_time
from jaxshard.errors import ShardingError, warn
from jaxshard.lower import Lowered
from jaxshard.plan import Plan, gc_paused, plan_from_graph, trace_graph
from jaxshard.search.problem import US, Problem, group_key
from jaxshard.search.refs import decision_of
from jaxshard.search.result import SearchResult, raise_over_budget
from jaxshard.search.solver import Infeasible, smallest_memory, solve

__all__ = ["SearchResult", "group_key", "search_hints"]


def search_hints(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    mesh: Mesh,
    hints: Mapping[str, PartitionSpec] | None = None,
    *,
    memory_budget: float | None = None,
    time_limit: float = 30.0,
    cost_model: CostModel | None = None,
    progress: Callable[[str], None] | None = None,
    calibrate_memory: bool = False,
) -> SearchResult:
    """Choose PartitionSpecs for every argument leaf ``hints`` leave free.

    Minimizes the estimated time of one call of ``fn`` under ``cost_model`` (default
    `CostModel()`): its communication, plus its compute when the model has ``flops``
    (then replicated work costs its share too), keeping the estimated per-device memory at
    most ``memory_budget`` bytes when given (else memory only breaks ties): within 95% of
    it where a layout fits there (`HEADROOM`, for the heap packing XLA adds), else within
    the budget with a `JaxshardWarning`. Stops the
    solver after ``time_limit`` seconds of the whole search, returning the best layout
    found (``optimal=False``) with a `JaxshardWarning` that says so; where the limit stops
    it over the budget, the smallest-memory layout is searched for instead, for up to
    ``max(time_limit, RESCUE_SECONDS)`` seconds more (5 s at least). ``progress``
    receives one line per stage and per improved solution; by default the lines go to
    stderr once the search has run for 5 s, so only long searches show them. A budget
    no layout meets raises `ShardingError` naming the smallest footprint found. With
    ``calibrate_memory`` (and a budget) the search compiles its plan and, where the
    compiled program's memory differs from the estimate, searches again with the budget
    rescaled by their ratio (at most four compiles), keeping the plan that moves
    the fewest bytes among those whose compiled memory fits the budget.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> def mlp(params, x):
        ...     return jnp.sum(jax.nn.relu(x @ params["w1"]) @ params["w2"])
        >>> params = {"w1": jnp.ones((16, 64)), "w2": jnp.ones((64, 16))}
        >>> result = search_hints(jax.grad(mlp), (params, jnp.ones((8, 16))), {}, mesh,
        ...                       {"x": P("data")})
        >>> result.hints["params/w1"], result.hints["params/w2"]
        (P(None, 'model'), P('model', None))
        >>> result.optimal
        True
    """
    t0 = time.perf_counter()
    say = progress or _LateProgress(t0)
    hints = dict(hints or {})
    traced, graph = trace_graph(fn, args, kwargs, mesh)
    with gc_paused():
        say(f"traced {len(graph.apps)} equations, {len(graph.shapes)} values "
            f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
        problem = Problem(traced, graph, mesh, hints, cost_model or CostModel(), memory_budget)
        say(
            f"coarsened: {len(problem.groups)} argument groups, {len(problem.decisions)} "
            f"decisions, {len(problem.terms)} joint terms ({time.perf_counter() - t0:.1f} s)"
        )
        tried: list[tuple[MemoryEstimate, Plan, dict[int, int]]] = []

        # the search priced its leaves' layouts: a parameter stored on an extra axis is
        # gathered at its uses (that axis alone is storage: the rest of its layout is the
        # computation's), the rest (optimizer state too) is the computation's layout
        def storage(choice):
            return {
                graph.in_vids[i]: problem.storage_axes(i, choice) or False
                for i in problem.leaf_group
            }

        def propagated(choice):  # the chosen layouts go to propagation as pins
            plan = plan_from_graph(
                traced, graph, mesh, hints, problem.cost_model, storage=storage(choice),
                chosen=problem.layouts_for(choice),
            )  # fmt: skip
            memory = plan.estimated_memory
            tried.append((memory, plan, choice))
            return plan, memory

        def settle(target: float | None, strict: bool = True):
            """Solve, propagate, and solve again within a smaller budget while
            propagation needs more memory than the model said (``target``: the budget in
            the estimate's units). When no layout fits, the smallest-memory one found: an
            error if ``strict``."""
            for _ in range(3):
                try:
                    choice, optimal, status = solve(problem, t0, time_limit, say)
                except Infeasible as e:
                    # the model's smallest layouts, and the hints' own (nothing split
                    # further), which the model may overrate where propagation gathers
                    for smallest in [*e.choices, problem.baseline()]:
                        propagated(smallest)
                    best = _fewest_bytes_within(tried, target)
                    if best is not None:
                        # propagation fits where the model did not: of those layouts, the
                        # one moving the fewest bytes (split further, the smallest would
                        # trade bytes for memory the budget does not ask for)
                        memory, plan, choice = best
                        status = (
                            "the model put every layout over budget: of its smallest, the "
                            "one moving the fewest bytes within it once propagated"
                        )
                        return Settled(plan, memory, choice, False, status)
                    _shrunk(problem, tried, propagated, t0 + max(time_limit, RESCUE_SECONDS))
                    memory, plan, choice = min(tried, key=lambda t: t[0].total)
                    if target is None:  # no budget: the model's constraints admit nothing
                        status = "the model admitted no layout: the smallest-memory one tried"
                        return Settled(plan, memory, choice, False, status)
                    if strict and memory.total > target:
                        raise_over_budget(problem, memory_budget, memory, plan)
                    status = "the smallest-memory layout: the model put every layout over budget"
                    return Settled(plan, memory, choice, False, status)
                plan, memory = propagated(choice)
                say(f"propagated: {human_bytes(step_bytes(plan))} of collectives, "
                    f"{human_bytes(memory.total)} of memory per device "
                    f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
                if target is None or memory.total <= target:
                    found = Settled(plan, memory, choice, optimal, status)
                    found = _repriced(problem, found, target, propagated, t0, time_limit, say)
                    return _relaxed(problem, found, target, propagated, t0, time_limit, say)
                if not optimal:
                    # the time limit stopped the solver over the budget: a budget is a
                    # promise, so the layout of least memory instead (a smaller problem,
                    # given a few seconds more), or no plan
                    deadline = time.perf_counter() + max(time_limit, RESCUE_SECONDS)
                    points = [memory.peak_app] if memory.peak_app >= 0 else []
                    for extras in (False, True):
                        propagated(smallest_memory(problem, list(points), extras, deadline))
                    memory, plan, choice = min(tried, key=lambda t: t[0].total)
                    if memory.total <= target:
                        status += "; over the budget, so the smallest-memory layout instead"
                        return Settled(plan, memory, choice, False, status)
                    if strict:
                        raise_over_budget(problem, memory_budget, memory, plan)
                    return Settled(plan, memory, choice, False, "the smallest-memory layout found")
                modeled = problem.memory(choice).total
                problem.budget *= min(modeled / memory.total, 0.999)
                say(f"propagation needs {human_bytes(memory.total)}, the model said "
                    f"{human_bytes(modeled)}: searching again within "
                    f"{human_bytes(problem.budget)}")  # fmt: skip
            best = _fewest_bytes_within(tried, target)
            if best is not None:  # a layout propagated on the way fits
                memory, plan, choice = best
                return Settled(plan, memory, choice, False, "the best layout found within it")
            memory, plan, choice = min(tried, key=lambda t: t[0].total)
            if strict:
                raise_over_budget(problem, memory_budget, memory, plan)
            return Settled(plan, memory, choice, False, "the smallest-memory layout found")

        calibrate = calibrate_memory and memory_budget is not None
        if memory_budget is not None and not calibrate:
            # a budget is a promise: plan within the estimate's headroom first, and only
            # where nothing fits there, up to the budget itself (with a warning)
            problem.budget = memory_budget * HEADROOM
            found = settle(problem.budget, strict=False)
            if found.memory.total > memory_budget * HEADROOM:
                problem.budget = memory_budget
                found = settle(memory_budget)
                if found.memory.total > memory_budget * HEADROOM:
                    warn(
                        f"jaxshard's plan is estimated at {human_bytes(found.memory.total)} "
                        f"per device, within {100 * (1 - HEADROOM):.0f}% of the memory budget "
                        f"of {human_bytes(memory_budget)}: the compiled program may exceed "
                        "it. Pass calibrate_memory=True to check it against the compiled "
                        "program."
                    )
            plan, memory, choice, optimal, status = found
        else:
            # a budget the estimate puts out of reach may still fit once compiled
            plan, memory, choice, optimal, status = settle(memory_budget, strict=not calibrate)
        compiled = None
        if calibrate:
            plan, memory, choice, optimal, status, compiled = _calibrated(
                problem, memory_budget, settle, Settled(plan, memory, choice, optimal, status),
                say, propagated,
            )  # fmt: skip
    seconds = time.perf_counter() - t0
    if not optimal:
        warn(
            f"jaxshard search did not prove its layout optimal ({status}) after {seconds:.1f} s; "
            "the plan is the best layout found. Raise the time limit for a better one."
        )
    est_time, est_bytes = problem.comm(choice)
    text = problem.explain(choice, plan, memory, optimal, status, seconds)
    if compiled is not None:
        text += f"\ncompiled program: {compiled / 2**20:.2f} MiB per device (checked by the search)"
    result = SearchResult(
        problem.hints_for(choice), step_bytes(plan), memory.total, seconds, optimal, text,
        est_bytes, est_time / US, memory, plan, memory_budget, compiled,
    )  # fmt: skip
    plan._attach(search_result=result)
    return result


# the most compiles `calibrate_memory` makes searching (one more, of the hints' own
# layout, where none of those fits)
COMPILES = 4
# the share of a memory budget the search plans within, where it can: XLA's buffer
# assignment packs the heap with a few percent the estimate does not see (fragmentation
# between buffers of different sizes and lifetimes: 4.7% of the 8B shape's searched plan)
HEADROOM = 0.95
# layouts whose propagated collectives exceed the model's count by more than this factor
# are excluded and the integer program solved again, at most REPRICES times
MISPRICED = 1.1
REPRICES = 4


def _shrunk(problem, tried: list, propagated, deadline: float) -> None:
    """Where the model puts every layout over the budget, its smallest-memory layouts
    need not be the smallest once propagated: the model gives a class one layout
    everywhere, propagation gives a value its nearest pin's (an output projection whose
    vocabulary splits over "tensor" only where its input's embedding dim, pinned there,
    is gathered first). So the largest buffers at the smallest propagated layout's peak
    are split further, one decision at a time, each by the integer program solved again
    for least memory with that decision fixed (the decisions it constrains follow), for
    up to `SHRINK_ROUNDS` rounds while the estimate falls; every layout tried joins
    ``tried``."""
    for _ in range(SHRINK_ROUNDS):
        memory, plan, choice = min(tried, key=lambda t: t[0].total)
        points = [memory.peak_app] if memory.peak_app >= 0 else []
        for d, c in _splits_at_peak(problem, plan, choice, memory):
            if time.perf_counter() >= deadline:
                return
            found = smallest_memory(problem, points, True, deadline, {d: c})
            if found.get(d) == c:
                propagated(found)
        if min(t[0].total for t in tried) >= memory.total:
            return


def _splits_at_peak(problem, plan: Plan, choice, memory: MemoryEstimate) -> list:
    """``(decision, candidate)`` pairs that would split a dim of one of the largest
    buffers at ``plan``'s estimated peak (at least `SHRINK_SHARE` of its activations)
    that ``choice`` leaves whole, largest buffer first, at most `SHRINK_TRIES`."""
    pairs = []
    for size, v in plan.peak_values():
        if isinstance(v, str) or size < SHRINK_SHARE * memory.activations:
            continue
        for ref, axes in zip(problem.refs(v), plan.dims[v]):
            d = decision_of(ref)
            if d is None or axes or choice.get(d, 0) != 0:
                continue
            for c, cand in enumerate(problem.decisions[d].candidates):
                if cand and (d, c) not in pairs:
                    pairs.append((d, c))
    return pairs[:SHRINK_TRIES]


# where no layout fits: the rounds and tries per round of `_shrunk`, and the share of
# the peak's activations a buffer must hold to be split further
SHRINK_ROUNDS = 2
SHRINK_TRIES = 4
SHRINK_SHARE = 0.1


def _fewest_bytes_within(tried: list, target: float | None):
    """Of the ``(memory, plan, choice)`` layouts propagated so far, the one moving the
    fewest bytes among those whose estimate is within ``target``; None when none is."""
    fits = [t for t in tried if target is not None and t[0].total <= target]
    return min(fits, key=lambda t: step_bytes(t[1])) if fits else None


def _repriced(problem, found: Settled, target, propagated, t0, time_limit, say) -> Settled:
    """``found``, or a layout that moves fewer bytes once propagated: the class model
    prices each decision from the rules, and where propagation resolves a layout into more
    collectives than the model counted (classes cut apart meeting again, a conflict
    settled the other way), the model's optimum may not be the best layout. Each such
    layout is excluded and the program solved again (``REPRICES`` times at most, within
    the time limit); of the layouts propagated, the one that moves the fewest bytes within
    the budget is kept."""
    fits = [found]
    current = found
    for _ in range(REPRICES):
        modeled = problem.comm(current.choice)[1]
        if step_bytes(current.plan) <= MISPRICED * modeled + 2**20 or not current.optimal:
            break
        if time.perf_counter() - t0 >= time_limit:
            break
        problem.excluded.append(dict(current.choice))
        say(f"propagation moves {human_bytes(step_bytes(current.plan))}, the model said "
            f"{human_bytes(modeled)}: solving again without that layout")  # fmt: skip
        current = _solved_again(problem, found, propagated, t0, time_limit, say)
        if current is None:
            break
        if target is None or current.memory.total <= target:
            fits.append(current)
    best = min(fits, key=lambda f: step_bytes(f.plan))
    problem.excluded.clear()
    return best


def _solved_again(problem, found: Settled, propagated, t0, time_limit, say) -> Settled | None:
    """The integer program solved again as ``problem`` now stands (a layout excluded, a
    budget moved) and propagated; None when no layout is left. Optimal only if ``found``
    was too."""
    try:
        choice, optimal, status = solve(problem, t0, time_limit, say)
    except Infeasible:
        return None
    plan, memory = propagated(choice)
    return Settled(plan, memory, choice, optimal and found.optimal, status)


RELAXES = 3  # the most solves `_relaxed` adds
BINDING = 0.98  # a layout whose modeled memory is this near its budget was held back by it
RELAX_STEP = 1.25  # the least a model budget is raised by


def _relaxed(problem, found: Settled, target, propagated, t0, time_limit, say) -> Settled:
    """``found``, or a faster layout the memory model ruled out: the model over-estimates
    some layouts (it counts buffers XLA shares), so where the budget held the optimum
    back, the program is solved again within a model budget raised by the headroom
    propagation leaves ``found`` (at least ``RELAX_STEP``), and halfway back when the
    result does not fit once propagated (``RELAXES`` solves at most). Of the layouts
    propagated within ``target``, the one of least estimated step time is kept."""
    if target is None or problem.budget is None:
        return found
    original = problem.budget
    best, fitting, failing = found, problem.budget, None
    seconds = lambda s: step_time(s.plan, problem.cost_model).total  # noqa: E731
    for _ in range(RELAXES):
        if time.perf_counter() - t0 >= time_limit:
            break
        if failing is None:
            if problem.memory(best.choice).total < BINDING * fitting:
                break  # the budget did not bind: the model's optimum stands
            # the over-estimate is the other layouts', not this one's: step up regardless
            trial = fitting * max(target / max(best.memory.total, 1), RELAX_STEP)
        else:
            trial = (fitting * failing) ** 0.5
        if trial <= fitting / BINDING:
            break
        problem.budget = trial
        say(f"propagation needs {human_bytes(best.memory.total)} of {human_bytes(target)}: "
            f"solving again within a model budget of {human_bytes(trial)}")  # fmt: skip
        candidate = _solved_again(problem, found, propagated, t0, time_limit, say)
        if candidate is None:
            break
        if candidate.memory.total > target:
            failing = trial
            continue
        fitting = trial
        if seconds(candidate) < seconds(best):
            best = candidate
    problem.budget = original
    return best


# the least seconds the smallest-memory search may take past a time limit that stopped
# the solver over its budget (a layout over its budget is never returned)
RESCUE_SECONDS = 5.0


class Settled(NamedTuple):
    """What one solve found, propagated: the plan, its memory estimate, the choice per
    decision, whether the solver proved it optimal, and the solver's status."""

    plan: Plan
    memory: MemoryEstimate
    choice: dict[int, int]
    optimal: bool
    status: str


class _Checked(NamedTuple):
    """A plan `_calibrated` compiled: what `settle` found, and its compiled memory."""

    plan: Plan
    memory: MemoryEstimate
    choice: dict[int, int]
    optimal: bool
    status: str
    compiled: int


def _calibrated(problem, budget: float, settle, first: Settled, say, propagated) -> _Checked:
    """Check the searched plan against its compiled program and search again with the
    budget rescaled by the compiled program's memory over the estimate (``COMPILES`` at
    most): the estimate misses XLA's fusion and buffer reuse by some percent either way,
    and the compiled program decides whether a layout fits. Keeps the plan that moves
    the fewest bytes among those whose compiled memory fits; where none does, the hints'
    own layout (nothing split further) is compiled too, as the search must not do worse
    than the hints it was given; raises when that does not fit either."""
    found = first
    checked: list[_Checked] = []
    for attempt in range(COMPILES):
        compiled = compiled_memory(Lowered(found.plan).lower().compile())
        checked.append(_Checked(*found, compiled))
        say(f"compiled: {human_bytes(compiled)} per device, estimated "
            f"{human_bytes(found.memory.total)}, budget {human_bytes(budget)}")  # fmt: skip
        if attempt == COMPILES - 1:
            break
        problem.budget = _next_target([(c.memory.total, c.compiled) for c in checked], budget)
        found = settle(problem.budget, strict=False)
        # the same layouts (choices differing only in decisions no leaf shows plan
        # alike), or an unproven layout the estimate already puts over the target: not
        # compiled
        layouts = problem.layouts_for(found.choice)
        if any(layouts == problem.layouts_for(c.choice) for c in checked):
            break
        if not found.optimal and found.memory.total > problem.budget:
            break
    fits = [c for c in checked if c.compiled <= budget]
    baseline = problem.baseline()
    if not fits and not any(problem.layouts_for(c.choice) == problem.layouts_for(baseline)
                            for c in checked):  # fmt: skip
        plan, memory = propagated(baseline)
        compiled = compiled_memory(Lowered(plan).lower().compile())
        checked.append(_Checked(plan, memory, baseline, False, "the hints' own layout", compiled))
        fits = [c for c in checked if c.compiled <= budget]
    if not fits:
        smallest = min(c.compiled for c in checked)
        raise ShardingError(
            f"no layout fits the memory budget of {human_bytes(budget, 2)} per device in "
            f"the compiled program: the smallest the search found needs "
            f"{human_bytes(smallest, 2)} ({smallest} bytes, compiled). Raise the "
            "budget to at least that, use a larger mesh, or shrink the batch."
        )
    return min(fits, key=lambda c: (step_bytes(c.plan), c.compiled))


def _next_target(points: list[tuple[int, int]], budget: float) -> float:
    """The next budget in the estimate's units, from the (estimated, compiled) memory of
    the plans compiled so far: the secant through the last two where the compiled memory
    moved with the estimate, else the last estimate scaled by budget over its compiled
    memory; within half to twice the last estimate.

    Example:
        >>> _next_target([(100, 110)], 100.0)
        90.9090909090909
        >>> _next_target([(100, 110), (90, 108)], 100.0)
        50.0
    """
    e1, c1 = points[-1]
    target = e1 * budget / c1
    if len(points) > 1:
        e0, c0 = points[-2]
        if (e1 - e0) * (c1 - c0) > 0:
            target = e1 + (budget - c1) * (e1 - e0) / (c1 - c0)
    return min(max(target, e1 / 2), e1 * 2)


class _LateProgress:
    """Progress lines on stderr, but only once the search has run ``after`` seconds
    (the lines held until then come first): short searches stay quiet."""

    def __init__(self, t0: float, after: float = 5.0):
        self.t0, self.after, self.held = t0, after, []

    def __call__(self, message: str) -> None:
        seconds = time.perf_counter() - self.t0
        self.held.append(f"jaxshard search [{seconds:5.1f} s] {message}")
        if seconds >= self.after:
            print("\n".join(self.held), file=sys.stderr, flush=True)
            self.held.clear()
