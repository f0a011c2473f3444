"""Verification: what XLA actually inserted, read from the compiled program, against the plan.

`verify` compiles a plan's program, reads every collective with its runs per call
(`jaxshard.hlo.compiled_collectives`), matches them to the collectives the plan predicts
run for run (a scan body's reshards once per iteration; a while loop's, whose trip count
planning cannot know, against any number of runs), and reports every surprise: a
collective not predicted, a predicted one missing, and XLA's own warnings (involuntary
full rematerialization, replication of a non-divisible dim) captured from its log
during the compile. Kind, mesh axes and bytes must agree, except for two ways XLA
realizes the same transfer: a multi-axis collective one axis at a time, and a
reduce-scatter as an all-reduce of its input. A predicted move of a value made from
constants only (an iota) may be missing: XLA may compute the constant in the layout its
reader wants instead (`constant_moves`). Both sides' bytes per device per call
(ring volumes, as the cost model counts them) come with the result, and the compiled
program's per-device memory: over the memory budget of the search that made the plan,
that is a surprise too.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace

from jaxshard.baseline import compiled_memory
from jaxshard.cost import Collective, CollectiveKind, human_bytes
from jaxshard.hlo import (  # noqa: F401  (hlo_collectives and computation_runs: re-exported)
    compiled_collectives,
    computation_runs,
    hlo_collectives,
)
from jaxshard.lower import Lowered
from jaxshard.plan import register_stage
from jaxshard.plan.apps import made_runs

_WARNINGS = re.compile(
    r"(involuntary full rematerialization|[Ii]nvoluntary|replicat\w+ .*not divisible)"
)


def predicted_kinds(plan) -> set[str]:
    """Kinds of collective a plan's reshards and pending reductions call for.

    Example:
        >>> predicted_kinds(plan)  # doctest: +SKIP
        {'all-reduce'}
    """
    return {step.kind for r in plan.reshards for step in r.steps}


def _runs_total(collectives: list[Collective]) -> tuple[int, int]:
    """(runs per call of those with a known count, how many have an unknown count)."""
    return (
        sum(c.runs for c in collectives if c.runs is not None),
        sum(c.runs is None for c in collectives),
    )


@dataclass
class Verification:
    """What `verify` found: predicted and compiled collectives, every surprise, and both
    sides' bytes per device per call (ring volumes, loop bodies times their trip counts;
    a loop of unknown trip count counts once, and ``unknown_trips`` says how many), and
    the compiled program's per-device memory with the search's budget, if any."""

    predicted: list[Collective]
    found: list[Collective]
    unpredicted: list[Collective] = field(default_factory=list)
    missing: list[Collective] = field(default_factory=list)
    xla_warnings: list[str] = field(default_factory=list)
    predicted_bytes: float = 0.0
    compiled_bytes: float = 0.0
    unknown_trips: int = 0
    compiled_memory: int | None = None
    memory_budget: float | None = None

    @property
    def surprises(self) -> list[str]:
        """Every mismatch, one line each (empty when the program is what the plan said)."""
        return (
            [f"not predicted: {c}" for c in self.unpredicted]
            + [f"predicted but missing: {c}" for c in self.missing]
            + [f"XLA warning: {w}" for w in self.xla_warnings]
            + self._over_budget()
        )

    def _over_budget(self) -> list[str]:
        if self.memory_budget is None or self.compiled_memory is None:
            return []
        if self.compiled_memory <= self.memory_budget:
            return []
        return [
            f"over the memory budget: the compiled program needs "
            f"{human_bytes(self.compiled_memory)} per device, the budget is "
            f"{human_bytes(self.memory_budget)} (the search's estimate was lower): search "
            "with calibrate_memory=True to check the plan against its compiled program, or "
            "with a smaller memory_budget"
        ]

    @property
    def ok(self) -> bool:
        """True when there are no surprises."""
        return not self.surprises

    def __str__(self) -> str:
        def side(cs: list[Collective], b: float) -> str:
            runs, unknown = _runs_total(cs)
            more = f" + {unknown} in loops of unknown trip count" if unknown else ""
            return f"{runs} runs{more}, {human_bytes(b)} per device per call"

        head = (
            f"{len(self.found)} compiled collectives ({side(self.found, self.compiled_bytes)}), "
            f"{len(self.predicted)} predicted ({side(self.predicted, self.predicted_bytes)})"
        )
        return "\n".join([head + (": as planned" if self.ok else ":"), *self.surprises])


def predicted_collectives(plan) -> list[Collective]:
    """The collectives a plan's reshards and pending reductions call for, per device, each
    with the times it runs per call (None inside a while loop: its trip count is not
    known when planning).

    Example:
        >>> predicted_collectives(plan)[0]  # doctest: +SKIP
        Collective(kind='all-reduce', axes=frozenset({'model'}), bytes=16384)
    """
    out = []
    for r in plan.reshards:
        runs = None if r.in_while else r.runs
        # each step's own buffer, as compiled_collectives counts it (`Collective.bytes`:
        # the operand, a gather's or scatter's result, a halo's rows): a reshard in steps
        # (`reshard_steps`) gathers before it moves, and the all-to-all moves the
        # gathered array
        out += [Collective(s.kind, s.axes, round(s.bytes), s.group, runs) for s in r.steps]
    # a while loop's trip count is not known when planning
    out += [replace(c, runs=None) if c.in_while else c for c in plan.written]
    return out


def constant_moves(plan) -> Counter:
    """Runs per call of the predicted collectives that move a value made from constants
    only (an iota, a literal's broadcast; `jaxshard.plan.made_runs` counts it made
    wherever it is read): XLA may compute such a value in the layout its reader wants
    instead of moving it, so these may be missing from the compiled program.

    Example:
        >>> constant_moves(plan)  # doctest: +SKIP
        Counter({Collective(kind='all-gather', axes=frozenset({'data'}), bytes=2048): 2})
    """
    made = made_runs(plan.graph)
    found: Counter = Counter()
    for r in plan.reshards:
        if made.get(r.vid) == math.inf and not r.in_while:
            for s in r.steps:
                found[Collective(s.kind, s.axes, round(s.bytes), s.group)] += r.runs
    return found


def _excused(missing: list[Collective], optional: Counter) -> list[Collective]:
    """``missing`` less the runs of ``optional`` ones (`constant_moves`)."""
    left = []
    for c in missing:
        n = c.runs
        take = min(optional[c], n) if n is not None else 0
        optional[c] -= take
        if n is None or n > take:
            left.append(replace(c, runs=None if n is None else n - take))
    return left


def _match(
    predicted: list[Collective], found: list[Collective], sizes
) -> tuple[list[Collective], list[Collective]]:
    """Match predicted and compiled collectives run for run: ``(not predicted, missing)``,
    each with its unmatched runs. Kind, axes and bytes must agree, except for two ways
    XLA realizes the same transfer: a multi-axis collective as one step per axis, and a
    reduce-scatter as an all-reduce of its input (then a local slice). One of unknown run
    count (in a while loop) matches all runs of its kind, axes and bytes on the other
    side, at least one."""
    want, have = Counter(), Counter()  # known runs per (kind, axes, bytes)
    want_loose = [c for c in predicted if c.runs is None]
    have_loose = [c for c in found if c.runs is None]
    for c in predicted:
        if c.runs is not None:
            want[c] += c.runs
    for c in found:
        if c.runs is not None:
            have[c] += c.runs
    both = want & have
    want, have = want - both, have - both
    for c in list(want):
        for _ in range(want[c]):
            if not (_decomposed(c, have, sizes) or _reduced_then_sliced(c, have, sizes)):
                break
            want[c] -= 1
    missing, unpredicted = [], []
    for c in want_loose:
        twin = next((h for h in have_loose if h == c), None)
        if twin is not None:
            have_loose.remove(twin)
        elif have[c] > 0:
            have[c] = 0
        else:
            missing.append(c)
    for c in have_loose:
        if want[c] > 0:
            want[c] = 0
        else:
            unpredicted.append(c)
    missing += [replace(c, runs=n) for c, n in want.items() if n > 0]
    unpredicted += [replace(c, runs=n) for c, n in have.items() if n > 0]
    return unpredicted, missing


def _decomposed(c: Collective, unmatched: Counter, sizes) -> bool:
    """Match one run of a multi-axis collective XLA split into one step per axis (e.g. an
    all-gather over data,model done as all-gather over data then over model); consumes
    the steps."""
    if len(c.axes) < 2:
        return False
    axes = sorted(c.axes)
    for order in itertools.permutations(axes):
        steps, size = [], c.bytes
        for axis in reversed(order):  # the last step produces the full result
            steps.append(Collective(c.kind, frozenset({axis}), size))
            if c.kind == CollectiveKind.ALL_GATHER:
                size //= sizes[axis]
        if all(unmatched[s] > 0 for s in steps):
            for s in steps:
                unmatched[s] -= 1
            return True
    return False


def _reduced_then_sliced(c: Collective, unmatched: Counter, sizes) -> bool:
    """Match one run of a reduce-scatter that XLA made an all-reduce of the whole input,
    each device keeping its slice (backends without reduce-scatter, such as the CPU);
    consumes the all-reduce."""
    if c.kind != CollectiveKind.REDUCE_SCATTER or not all(a in sizes for a in c.axes):
        return False
    whole = Collective(
        CollectiveKind.ALL_REDUCE, c.axes, c.bytes * math.prod(sizes[a] for a in c.axes)
    )
    if unmatched[whole] > 0:
        unmatched[whole] -= 1
        return True
    return False


@contextlib.contextmanager
def _captured_stderr():
    """Capture what native code (XLA) writes to file descriptor 2."""
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        lines: list[str] = []
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            os.write(2, text.encode())  # still shown to the user
            lines.extend(text.splitlines())


def verify(plan, lowered=None) -> Verification:
    """Compile a plan's program and compare its collectives with the plan's predictions.

    ``lowered`` is a `jax.stages.Lowered` of the plan's program (e.g. ``step.lower(...)``);
    without it, the program is lowered from the plan with abstract arguments.

    Example:
        >>> result = verify(step.plan(params, opt_state, batch), step.lower(params, opt_state, batch))  # doctest: +SKIP
        >>> result.ok, result.surprises  # doctest: +SKIP
        (True, [])
    """
    if lowered is None:
        lowered = Lowered(plan).lower()
    with _captured_stderr() as log:
        compiled = lowered.compile()
        text = compiled.as_text()
    found = compiled_collectives(text, plan.mesh)
    predicted = predicted_collectives(plan)
    unpredicted, missing = _match(predicted, found, plan.axis_sizes)
    missing = _excused(missing, constant_moves(plan))
    warnings = [line.strip() for line in log if _WARNINGS.search(line)]
    compiled_bytes = sum(c.ring_bytes * (1 if c.runs is None else c.runs) for c in found)
    unknown = len({c for c in found if c.runs is None})
    searched = getattr(plan, "search_result", None)
    return Verification(
        predicted, found, unpredicted, missing, warnings,
        plan.predicted_bytes, compiled_bytes, unknown, compiled_memory(compiled),
        None if searched is None else searched.memory_budget,
    )  # fmt: skip


register_stage("verify", verify)
