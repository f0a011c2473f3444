"""The integer program and its solver (HiGHS): one-hot columns per decision candidate
and per joint choice, memory rows added lazily at the peak equations, the time limit, and
the smallest-memory layout when no layout meets the budget."""

from __future__ import annotations

import functools
import itertools
import os
import sys
import time
from collections.abc import Mapping

import numpy as np

from jaxshard.cost import (
    human_bytes,
)
from jaxshard.errors import JaxshardBug
from jaxshard.search.problem import MEMORY_TIEBREAK, Problem

# Chosen hints carry this regex comment into the plan, so an origin reads


class Infeasible(Exception):
    """No layout meets the budget in the model; ``choices`` are its smallest-memory ones
    (without and with extra storage axes)."""

    def __init__(self, choices: list[dict[int, int]]):
        super().__init__()
        self.choices = choices


def solve(self: Problem, t0: float, time_limit: float, say) -> tuple[dict[int, int], bool, str]:
    """The best choice per decision: (choice, optimal, solver status text)."""
    import highspy

    if not self.decisions:
        return {}, True, "nothing to decide"
    if time.perf_counter() - t0 >= time_limit:
        return self.baseline(), False, "the time limit ran out before the solver started"
    model = Model(self)
    rows_added: set[int] = set()
    live = self.live
    peak0 = self.peak(self.baseline())
    points = [peak0] if self.budget is not None and peak0 >= 0 else []
    if self.budget is not None:  # the rows earlier solves of this problem needed
        points = list(dict.fromkeys([*points, *self.memory_points]))
    for t in points:
        model.add_memory_row(*self.activation_row(t), self.static, self.budget)
        rows_added.add(t)
    optimal, status = True, ""
    for _ in range(16):
        left = time_limit - (time.perf_counter() - t0)
        result = model.run(max(left, 1e-3), say)
        if result is None:
            if model.status == highspy.HighsModelStatus.kInfeasible:
                points = sorted(rows_added)
                deadline = t0 + time_limit
                raise Infeasible(
                    [smallest_memory(self, points, e, deadline) for e in (False, True)]
                )
            return self.baseline(), False, f"no layout found in time ({model.status_text})"
        choice, is_optimal = result
        optimal &= is_optimal
        status = model.status_text
        if model.status == highspy.HighsModelStatus.kTimeLimit:
            status = "the time limit stopped the solver: the best layout it found"
        if self.budget is None or not len(live.intermediates):
            break
        memory = self.memory(choice)
        if memory.total <= self.budget * (1 + 1e-9) or memory.peak_app in rows_added:
            break
        say(f"layout needs {human_bytes(memory.total)} at equation {memory.peak_app}: "
            "adding that memory constraint")  # fmt: skip
        model.add_memory_row(*self.activation_row(memory.peak_app), self.static, self.budget)
        rows_added.add(memory.peak_app)
        self.memory_points.append(memory.peak_app)
        if not is_optimal:
            break
    return choice, optimal, status


class Model:
    """The HiGHS model: a one-hot binary per decision candidate, a binary per allowed
    joint choice of each multi-decision term (its marginals equal the one-hots)."""

    def __init__(self, problem: Problem):
        import highspy

        self.highspy = highspy
        self.problem = problem
        decisions = problem.decisions
        self.x: list[list[int]] = []
        n = 0
        for dec in decisions:
            self.x.append(list(range(n, n + len(dec.candidates))))
            n += len(dec.candidates)
        cost = [0.0] * n
        upper = [1.0] * n
        rows: list[tuple[dict[int, float], float, float]] = []
        for cols in self.x:
            rows.append(({c: 1.0 for c in cols}, 1.0, 1.0))
        self.col_of: dict[tuple[int, ...], np.ndarray] = {}
        for key, term in problem.terms.items():
            weight = term.time + MEMORY_TIEBREAK * term.memory + term.bias
            if len(key) == 1:
                cols = np.array(self.x[key[0]])
                for c, w, ok in zip(cols, weight, term.allowed):
                    cost[c] += w
                    if not ok:
                        upper[c] = 0.0
                self.col_of[key] = cols
                continue
            cols = np.full(len(weight), -1)
            combos = list(itertools.product(*(range(s) for s in term.sizes)))
            for j in range(len(combos)):
                if term.allowed[j]:
                    cols[j] = n
                    cost.append(float(weight[j]))
                    upper.append(1.0)
                    n += 1
            self.col_of[key] = cols
            rows.extend((row, 0.0, 0.0) for row in self._links(key, cols, combos))
        self.n = n
        h = _quiet_highs()
        h.setOptionValue("mip_rel_gap", 1e-6)
        h.setOptionValue("presolve_rule_off", _presolve_rules_off())
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, len(rows)
        lp.col_cost_ = np.array(cost)
        lp.col_lower_ = np.zeros(n)
        lp.col_upper_ = np.array(upper)
        lp.row_lower_ = np.array([r[1] for r in rows])
        lp.row_upper_ = np.array([r[2] for r in rows])
        starts, index, value = [0], [], []
        for row, _, _ in rows:
            index += list(row)
            value += list(row.values())
            starts.append(len(index))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, len(rows)
        lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(value, dtype=np.float64)
        lp.integrality_ = [highspy.HighsVarType.kInteger] * n
        h.passModel(lp)
        self.h = h
        # layouts propagation showed the model misprices: each excluded as a whole
        for choice in getattr(problem, "excluded", ()):
            cols = np.array([self.x[d][c] for d, c in choice.items()], dtype=np.int32)
            h.addRow(-highspy.kHighsInf, len(cols) - 1.0, len(cols), cols, np.ones(len(cols)))
        self.status = None
        self.status_text = ""
        self._say = None
        h.cbMipImprovingSolution.subscribe(self._improved)

    def _improved(self, event) -> None:
        if self._say is not None:
            value = event.data_out.objective_function_value
            self._say(f"solver: better layout found, estimated {value / 1e3:.3f} ms per step")

    def columns(self, key: tuple[int, ...]) -> np.ndarray:
        """The model's column per joint choice of ``key`` (-1: not allowed)."""
        cols = self.col_of.get(key)
        if cols is None:
            if len(key) == 1:
                cols = self.col_of[key] = np.array(self.x[key[0]])
            elif key in self.problem.terms:
                cols = self._add_joint(key)
            else:
                raise JaxshardBug(f"search: no joint variables for decisions {key}")
        return cols

    def _add_joint(self, key: tuple[int, ...]) -> np.ndarray:
        """Columns for a joint term made after the model was passed to HiGHS (a memory
        row's buffer whose layout depends on several decisions at once), tied to the
        one-hots as in the constructor."""
        hs, h = self.highspy, self.h
        term = self.problem.terms[key]
        weight = term.time + MEMORY_TIEBREAK * term.memory + term.bias
        combos = list(itertools.product(*(range(s) for s in term.sizes)))
        cols = np.full(len(combos), -1)
        none = np.array([], dtype=np.int32)
        for j in range(len(combos)):
            if term.allowed[j]:
                cols[j] = h.getNumCol()
                h.addCol(float(weight[j]), 0.0, 1.0, 0, none, np.array([]))
                h.changeColIntegrality(int(cols[j]), hs.HighsVarType.kInteger)
        for row in self._links(key, cols, combos):
            idx = np.array(list(row), dtype=np.int32)
            h.addRow(0.0, 0.0, len(idx), idx, np.array(list(row.values())))
        self.col_of[key] = cols
        return cols

    def _links(self, key, cols, combos) -> list[dict[int, float]]:
        """The rows (each equal to 0) tying a joint term's columns to its decisions'
        one-hots: per decision and candidate, the joint columns choosing it sum to it."""
        links = []
        for pos, d in enumerate(key):
            for cand, xc in enumerate(self.x[d]):
                row = {int(cols[j]): 1.0 for j, combo in enumerate(combos)
                       if combo[pos] == cand and cols[j] >= 0}  # fmt: skip
                row[xc] = row.get(xc, 0.0) - 1.0
                links.append(row)
        return links

    def memory_expression(self, const, rows, static) -> tuple[dict[int, float], float]:
        """Per-device memory as ``(coefficients, constant)`` over the model's columns."""
        coef: dict[int, float] = {}
        total = const + static
        for key, term in self.problem.terms.items():
            if term.memory.any():
                for c, m in zip(self.columns(key), term.memory):
                    if c >= 0:
                        coef[int(c)] = coef.get(int(c), 0.0) + float(m)
        for key, row in rows.items():
            for c, m in zip(self.columns(key), row):
                if c >= 0:
                    coef[int(c)] = coef.get(int(c), 0.0) + float(m)
        return coef, total

    def add_memory_row(self, const, rows, static, budget) -> None:
        """Memory at one equation (arguments, results, live activations) ≤ budget."""
        coef, total = self.memory_expression(const, rows, static)
        idx = np.array(list(coef), dtype=np.int32)
        val = np.array(list(coef.values()))
        self.h.addRow(-self.highspy.kHighsInf, float(budget - total), len(idx), idx, val)

    def allow_extras(self, decisions, allowed: bool) -> None:
        """Allow or forbid every non-None candidate of the extra-axis ``decisions``."""
        cols = np.array([c for d in decisions for c in self.x[d][1:]], dtype=np.int32)
        if len(cols):
            upper = np.ones(len(cols)) if allowed else np.zeros(len(cols))
            self.h.changeColsBounds(len(cols), cols, np.zeros(len(cols)), upper)

    def fix(self, decision: int, candidate: int) -> None:
        """Forbid every candidate of ``decision`` but ``candidate``."""
        off = np.array([c for k, c in enumerate(self.x[decision]) if k != candidate], np.int32)
        self.h.changeColsBounds(len(off), off, np.zeros(len(off)), np.zeros(len(off)))

    def run(self, time_limit: float, say) -> tuple[dict[int, int], bool] | None:
        hs = self.highspy
        self.h.setOptionValue("time_limit", float(time_limit))
        self._say = say
        self.h.run()
        self._say = None
        self.status = self.h.getModelStatus()
        self.status_text = self.h.modelStatusToString(self.status)
        info = self.h.getInfo()
        if info.primal_solution_status != hs.SolutionStatus.kSolutionStatusFeasible:
            return None
        values = self.h.getSolution().col_value
        choice = {d: int(np.argmax([values[c] for c in cols])) for d, cols in enumerate(self.x)}
        return choice, self.status == hs.HighsModelStatus.kOptimal


def smallest_memory(
    problem: Problem,
    points: list[int],
    extras: bool,
    deadline: float,
    fixed: Mapping[int, int] | None = None,
) -> dict[int, int]:
    """The layout of least estimated per-device memory, ignoring communication: the
    largest memory over the equations in ``points`` (and each layout's own peak, added
    as found) is minimized. ``extras``: whether groups may store extra axes; ``fixed``:
    decisions whose candidate is given. The solver stops at ``deadline`` (a
    `time.perf_counter` time) with the best layout found so far."""
    model = Model(problem)
    model.allow_extras(range(problem.n_class_decisions, len(problem.decisions)), extras)
    hs, h = model.highspy, model.h
    for d, c in (fixed or {}).items():
        model.fix(d, c)
    m = h.getNumCol()  # a column bounding every memory row from above: minimized
    h.changeColsCost(m, np.arange(m, dtype=np.int32), np.zeros(m))
    h.addCol(1.0, 0.0, hs.kHighsInf, 0, np.array([], dtype=np.int32), np.array([]))

    def bound(t: int) -> None:
        coef, total = model.memory_expression(*problem.activation_row(t), problem.static)
        idx = np.array([*coef, m], dtype=np.int32)
        h.addRow(-hs.kHighsInf, -total, len(idx), idx, np.array([*coef.values(), -1.0]))

    points = list(points) or [problem.memory(problem.baseline()).peak_app]
    for t in points:
        bound(t)
    choice = problem.baseline()
    for _ in range(8):
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        found = model.run(left, None)
        if found is None:
            break
        choice = found[0]
        peak = problem.memory(choice).peak_app
        if peak in points:
            break
        points.append(peak)
        bound(peak)
    return choice


# HiGHS's presolve rule "Probing" (its bit in ``presolve_rule_off``, as HiGHS 1.16 numbers
# its rules): on these programs (one-hot columns, joint columns tied to them by equality
# rows) probing is most of the solve and fixes nothing the branch and bound would not. On
# the 297 programs the real-size benchmark's searches solve, switching it off gives the
# same optimum every time in 44% of the seconds (20.4 s against 46.4 s; the 70B shape's
# searches on 1024 devices 5-7x faster each)
PROBING = 15


@functools.cache
def _presolve_rules_off() -> int:
    """The ``presolve_rule_off`` bit mask for the search's programs under the installed
    HiGHS (`probing_off`); looked up once per process."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return probing_off(version("highspy"))
    except PackageNotFoundError:
        return 0


def probing_off(highs_version: str) -> int:
    """The ``presolve_rule_off`` mask switching probing off in HiGHS ``highs_version``:
    where it numbers its rules as 1.16 does (an older one keeps its default: another
    numbering would switch another rule off; every presolve rule is exact, so only the
    seconds would differ).

    Example:
        >>> probing_off("1.16.0") == 1 << PROBING, probing_off("1.15.1"), probing_off("dev")
        (True, 0, 0)
    """
    try:
        major, minor = (int(x) for x in highs_version.split(".")[:2])
    except ValueError:
        return 0
    return 1 << PROBING if (major, minor) >= (1, 16) else 0


def _quiet_highs():
    """A `highspy.Highs` that writes nothing: HiGHS 1.16 prints its banner on stdout
    while the object is built, before ``output_flag`` can be turned off, so the
    construction runs with file descriptor 1 pointed at the null device (a program
    printing the search's explanation, the CLI, would otherwise start with the banner).

    Example:
        >>> _quiet_highs().getOptionValue("output_flag")[1]
        False
    """
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    return h
