"""Every rule validated by execution.

A rule (`jaxshard.rule`) factors an equation's operand and result dims into named
factors of three kinds: pass-through (sharding it shards the result alike, no
communication), reduction (contracted: sharding it leaves the result a pending partial
sum) and need-replication (a sort or scan dim: never sharded); a pass-through or
reduction factor may be windowed (a spatial dim: split, each shard fetches a halo from
its neighbours, whose collective-permutes the check predicts; case ids end in
``-window``). These claims are what this module checks by running the equations.

For each equation of each program in `rule_samples.SAMPLES` whose primitive has a rule,
and each pass-through or reduction factor of that rule that splits over 2 devices, run
the equation alone under the shardings the rule implies — every dim the factor leads
split over mesh axis ``x``, everything else replicated — and compare with the unsharded
result. A pass-through factor must also compile to a program without collectives; a
reduction factor may all-reduce but must give the same numbers.

A factor that sits behind another factor of size > 1 in some dim (``b`` in a reshape
``[a, b] -> [ab]``) is not a case: no PartitionSpec splits a dim along a minor factor,
and the engine never shards it alone.

Cases are collected at import time from the traced samples (abstract values only); the
concrete operands of an equation are computed on first use by interpreting the sample's
jaxpr, once per sample. A new rule whose primitive appears in no sample fails
`test_every_rule_has_a_sample`.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import jax
import jaxshard.rules  # noqa: F401 - registers the catalogue
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal
from jax.extend.core import primitives as p
from kernel_samples import SAMPLES as KERNEL_SAMPLES
from rule_samples import REFERENCE_SAMPLES
from rule_samples import SAMPLES as RULE_SAMPLES

from jaxshard.check import check_factor, two_device_mesh
from jaxshard.check import checkable as _testable
from jaxshard.rule import _REGIONS, _RULES, Rule, rule_fn_for

SAMPLES = RULE_SAMPLES + KERNEL_SAMPLES

# "case id" -> what is wrong with the rule; each is an xfail(strict=True), so fixing the
# rule makes the case pass and the stale entry fail until it is removed here.
# Not rule bugs: JAX 0.10.2 on CPU cannot compile mulhi (which the philox hashes use)
# under any sharding annotation ("Unable to convert MHLO to StableHLO", even replicated);
# these run once JAX can.
_MULHI = "JAX 0.10.2 cannot lower a sharded mulhi on CPU"
KNOWN_RULE_BUGS: dict[str, str] = {
    "mulhi-mulhi-a-pass": _MULHI,
    "philox2x32-philox2x32-a-pass": _MULHI,
    "philox2x32-philox2x32-b-pass": _MULHI,
    "philox4x32-philox4x32-a-pass": _MULHI,
    "philox4x32-philox4x32-b-pass": _MULHI,
}

# XLA computes these with a while loop whose termination test reduce_or's a convergence
# flag over the whole array, so a sharded run all-reduces a pred[] scalar per iteration.
# No data moves, so the pass-through rule is right; these may only all-reduce that flag.
SCALAR_FLAG_COLLECTIVES = frozenset(
    {"igamma", "igammac", "igamma_grad_a", "regularized_incomplete_beta"}
)
_FLAG_ALL_REDUCE = re.compile(r"=\s*pred\[\]\s+all-reduce(?:-start)?\(")

# Call-like higher-order primitives whose inner jaxpr takes the operands positionally
# (see rules/structure.py): their equations are walked as part of the sample.
_CALLS = frozenset({p.jit_p, p.closed_call_p, p.remat_p, p.custom_jvp_call_p, p.custom_vjp_call_p})


# --- walking and interpreting a sample's jaxpr -------------------------------------------


def _inner(eqn: JaxprEqn) -> tuple[Jaxpr, tuple]:
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(inner, ClosedJaxpr):
        return inner.jaxpr, tuple(inner.consts)
    return inner, ()


def _equations(jaxpr: Jaxpr, path: tuple[int, ...] = ()):
    """(path, eqn) for every equation, depth first, entering call-like primitives."""
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive in _CALLS:
            yield from _equations(_inner(eqn)[0], path + (i,))
        else:
            yield path + (i,), eqn


def bind(eqn: JaxprEqn, invals) -> list:
    """Apply one equation to values; always a list of results."""
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _interpret(jaxpr: Jaxpr, consts, args, record: dict, path: tuple[int, ...] = ()) -> list:
    """Evaluate ``jaxpr`` equation by equation; ``record[path] = (invals, outvals)``."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive in _CALLS:
            inner, inner_consts = _inner(eqn)
            outvals = _interpret(inner, inner_consts, invals, record, path + (i,))
        else:
            outvals = bind(eqn, invals)
            record[path + (i,)] = (invals, outvals)
        env.update(zip(eqn.outvars, outvals))
    return [read(v) for v in jaxpr.outvars]


@functools.cache
def _traced(sample_index: int) -> ClosedJaxpr:
    _, fn, args = SAMPLES[sample_index]
    return jax.make_jaxpr(fn)(*args)


@functools.cache
def _values(sample_index: int) -> dict:
    closed = _traced(sample_index)
    record: dict = {}
    _interpret(closed.jaxpr, closed.consts, SAMPLES[sample_index][2], record)
    return record


# --- cases -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One equation of one sample under one factor's sharding (``factor`` None: no rule)."""

    sample_index: int
    path: tuple[int, ...]
    eqn: JaxprEqn
    rule: Rule | None = None
    factor: int | None = None
    error: str | None = None  # building the rule raised


def _eqn_key(eqn: JaxprEqn) -> tuple:
    ins = tuple((str(v.aval), repr(v.val) if isinstance(v, Literal) else None) for v in eqn.invars)
    return eqn.primitive.name, repr(sorted(eqn.params.items(), key=lambda kv: kv[0])), ins


def _collect() -> tuple[list, set]:
    params, seen_keys, used_ids, covered = [], set(), set(), set()

    def add(case: Case, case_id: str, marks=()):
        base, n = case_id, 2
        while case_id in used_ids:
            case_id, n = f"{base}#{n}", n + 1
        used_ids.add(case_id)
        params.append(pytest.param(case, id=case_id, marks=marks))

    for index, (sample_id, _, _) in enumerate(SAMPLES):
        unruled = set()
        for path, eqn in _equations(_traced(index).jaxpr):
            prim = eqn.primitive
            covered.add(prim)
            name = prim.name
            rule_fn = rule_fn_for(prim)
            if rule_fn is None:
                if prim not in _REGIONS and name not in unruled:
                    unruled.add(name)  # a sample is for a ruled primitive: a failing case
                    error = (
                        f"primitive {name!r} in sample {sample_id!r} has no rule: add one in "
                        "rules/ or take the sample out"
                    )
                    add(Case(index, path, eqn, error=error), f"{sample_id}-{name}-norule")
                continue
            eqn_key = _eqn_key(eqn)
            try:
                rule = rule_fn(eqn)
            except Exception as e:  # noqa: BLE001 - reported by the case
                if eqn_key not in seen_keys:
                    seen_keys.add(eqn_key)
                    error = f"building the rule raised {type(e).__name__}: {e}"
                    add(Case(index, path, eqn, error=error), f"{sample_id}-{name}-rule")
                continue
            for f, factor in enumerate(rule.factors):
                key = eqn_key + (f,)
                if not _testable(rule, f) or key in seen_keys:
                    continue
                seen_keys.add(key)
                kind = factor.kind.value + ("-window" if factor.window is not None else "")
                case_id = f"{sample_id}-{name}-{factor.name}-{kind}"
                marks = ()
                if case_id in KNOWN_RULE_BUGS:
                    marks = pytest.mark.xfail(reason=KNOWN_RULE_BUGS[case_id], strict=True)
                add(Case(index, path, eqn, rule, f), case_id, marks)
    return params, covered


CASES, COVERED = _collect()


# --- running a case ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh2():
    """Two devices on one Auto axis ``x``."""
    return two_device_mesh()


def _flag_all_reduces(text: str) -> Counter:
    return Counter({"all-reduce": len(_FLAG_ALL_REDUCE.findall(text))})


@pytest.mark.parametrize("case", CASES)
def test_rule_executes_sharded(case: Case, mesh2) -> None:
    if case.error is not None:
        pytest.fail(case.error)
    eqn, rule, f = case.eqn, case.rule, case.factor
    invals, expected = _values(case.sample_index)[case.path]
    rule.check(
        [getattr(v.aval, "shape", ()) for v in eqn.invars],
        [getattr(v.aval, "shape", ()) for v in eqn.outvars],
        eqn.primitive.name,
    )
    # literals stay in the equation; the rest are the call's operands
    positions = [i for i, v in enumerate(eqn.invars) if not isinstance(v, Literal)]
    ruled = Rule(rule.factors, tuple(rule.operands[i] for i in positions), rule.results)

    def run(*ops):
        vals = list(invals)
        for i, op in zip(positions, ops):
            vals[i] = op
        return tuple(bind(eqn, vals))

    tolerated = _flag_all_reduces if eqn.primitive.name in SCALAR_FLAG_COLLECTIVES else None
    args = [invals[i] for i in positions]
    check_factor(run, ruled, f, args, expected, mesh2, eqn.primitive.name, tolerated=tolerated)


def test_every_rule_has_a_sample() -> None:
    # primitives that cannot run here are traced only (tests/test_attention_rule.py)
    traced = {e.primitive for _, fn, args in REFERENCE_SAMPLES for e in _reference_eqns(fn, args)}
    missing = sorted(prim.name for prim in _RULES if prim not in COVERED | traced)
    assert not missing, (
        f"primitives with a rule but no equation in tests/rule_samples.py: {missing}; "
        "add a sample program for each"
    )


def _reference_eqns(fn, args) -> list:
    return [eqn for _, eqn in _equations(jax.make_jaxpr(fn)(*args).jaxpr)]


def test_known_rule_bugs_name_cases() -> None:
    ids = {param.id for param in CASES}
    stale = sorted(set(KNOWN_RULE_BUGS) - ids)
    assert not stale, f"KNOWN_RULE_BUGS entries that name no case (fixed? remove them): {stale}"


def test_cases_are_collected() -> None:
    runnable = [c for c in CASES if c.values[0].factor is not None]
    assert len(runnable) >= len(_RULES), "fewer executed cases than rules: collection broke"


# 3x3 kernels: the window geometry a spatial split is checked with; the kernel's own
# window dims are need-replication, never split
ODD_KERNELS = frozenset({"conv2d-grad-strided", "conv2d-grad-dilated"})


def test_samples_have_even_dims() -> None:
    odd = [
        (sample_id, np.shape(a))
        for sample_id, _, args in SAMPLES
        for i, a in enumerate(jax.tree_util.tree_leaves(args))
        if any(s % 2 for s in np.shape(a) if s != 1) and not (sample_id in ODD_KERNELS and i == 1)
    ]
    assert not odd, f"sample arguments with odd dims (factors could not split): {odd}"
