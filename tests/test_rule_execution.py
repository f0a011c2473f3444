"""Every rule validated by execution.

A rule (`jaxshard.rule`) factors an equation's operand and result dims into named
factors of three kinds: pass-through (sharding it shards the result alike, no
communication), reduction (contracted: sharding it leaves the result a pending partial
sum) and need-replication (a sort or scan dim: never sharded). These claims are what
this module checks by running the equations.

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
import jax.numpy as jnp
import jaxshard.rules  # noqa: F401 - registers the catalogue
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal
from jax.extend.core import primitives as p
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from rule_samples import SAMPLES

from jaxshard.rule import _REGIONS, _RULES, FactorKind, Rule, rule_fn_for
from jaxshard.verify import hlo_collectives

# "case id" -> what is wrong with the rule; each is an xfail(strict=True), so fixing the
# rule makes the case pass and the stale entry fail until it is removed here.
KNOWN_RULE_BUGS: dict[str, str] = {}

# XLA computes these with a while loop whose termination test reduce_or's a convergence
# flag over the whole array, so a sharded run all-reduces a pred[] scalar per iteration.
# No data moves, so the pass-through rule is right; these may only all-reduce that flag.
SCALAR_FLAG_COLLECTIVES = frozenset(
    {"igamma", "igammac", "igamma_grad_a", "regularized_incomplete_beta"}
)
_FLAG_ALL_REDUCE = re.compile(r"=\s*pred\[\]\s+all-reduce(?:-start)?\(")

AXIS = "x"
TESTED_KINDS = (FactorKind.PASS, FactorKind.REDUCTION)
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


def _leads(dim: tuple[int, ...], f: int, rule: Rule) -> bool:
    """Whether splitting this dim in 2 splits factor ``f``: every factor before it is 1."""
    return f in dim and all(rule.factors[g].size == 1 for g in dim[: dim.index(f)])


def _testable(rule: Rule, f: int) -> bool:
    factor = rule.factors[f]
    if factor.kind not in TESTED_KINDS or factor.size % 2:
        return False
    dims = [d for t in rule.operands + rule.results for d in t if f in d]
    return bool(dims) and all(_leads(d, f, rule) for d in dims)


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
                    unruled.add(name)
                    reason = f"no rule registered for primitive {name!r} yet"
                    add(
                        Case(index, path, eqn),
                        f"{sample_id}-{name}-norule",
                        pytest.mark.skip(reason=reason),
                    )
                continue
            eqn_key = _eqn_key(eqn)
            try:
                rule = rule_fn(eqn)
            except Exception as e:  # noqa: BLE001 - reported by the case
                if eqn_key not in seen_keys:
                    seen_keys.add(eqn_key)
                    error = f"{type(e).__name__}: {e}"
                    add(Case(index, path, eqn, error=error), f"{sample_id}-{name}-rule")
                continue
            for f, factor in enumerate(rule.factors):
                key = eqn_key + (f,)
                if not _testable(rule, f) or key in seen_keys:
                    continue
                seen_keys.add(key)
                case_id = f"{sample_id}-{name}-{factor.name}-{factor.kind.value}"
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
    return jax.make_mesh((2,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])


def _spec(dims: tuple[tuple[int, ...], ...], f: int, rule: Rule) -> P:
    return P(*(AXIS if _leads(d, f, rule) else None for d in dims))


def _plain(x) -> np.ndarray:
    """A numpy array to compare: key data for keys, float64 for every float dtype."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = np.asarray(x)
    return x.astype(np.float64) if "float" in x.dtype.name else x


def _assert_same(actual, expected, what: str) -> None:
    a, e = _plain(actual), _plain(expected)
    assert a.shape == e.shape and actual.dtype == expected.dtype, (
        f"{what}: sharded result is {actual.dtype}{a.shape}, unsharded {expected.dtype}{e.shape}"
    )
    if np.issubdtype(e.dtype, np.inexact):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(a, e, err_msg=what)


@pytest.mark.parametrize("case", CASES)
def test_rule_executes_sharded(case: Case, mesh2) -> None:
    if case.error is not None:
        pytest.fail(f"building the rule raised {case.error}")
    eqn, rule, f = case.eqn, case.rule, case.factor
    invals, expected = _values(case.sample_index)[case.path]
    rule.check(
        [getattr(v.aval, "shape", ()) for v in eqn.invars],
        [getattr(v.aval, "shape", ()) for v in eqn.outvars],
        eqn.primitive.name,
    )
    positions = [i for i, v in enumerate(eqn.invars) if not isinstance(v, Literal)]
    in_shardings = tuple(NamedSharding(mesh2, _spec(rule.operands[i], f, rule)) for i in positions)
    out_shardings = tuple(NamedSharding(mesh2, _spec(d, f, rule)) for d in rule.results)

    def run(*ops):
        vals = list(invals)
        for i, op in zip(positions, ops):
            vals[i] = op
        return tuple(bind(eqn, vals))

    ops = [jax.device_put(invals[i], s) for i, s in zip(positions, in_shardings)]
    jitted = jax.jit(run, in_shardings=in_shardings, out_shardings=out_shardings)
    compiled = jitted.lower(*ops).compile()
    actual = compiled(*ops)
    factor = rule.factors[f]
    where = f"{eqn.primitive.name} rule {rule}, factor {factor.name} ({factor.kind.value})"
    assert len(actual) == len(expected), f"{where}: {len(actual)} results, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        _assert_same(a, e, f"{where}: result {i} differs from the unsharded run")
    if factor.kind is FactorKind.REDUCTION:
        _check_declared_combination(case, invals, expected, positions, in_shardings, mesh2, where)
    if factor.kind is FactorKind.PASS:
        text = compiled.as_text()
        collectives = hlo_collectives(text)
        if eqn.primitive.name in SCALAR_FLAG_COLLECTIVES:
            flags = len(_FLAG_ALL_REDUCE.findall(text))
            collectives = collectives - Counter({"all-reduce": flags})
        assert not collectives, (
            f"{where}: communication-free factor produced a collective: {dict(collectives)}; "
            f"in specs {[s.spec for s in in_shardings]}, out specs "
            f"{[s.spec for s in out_shardings]}"
        )


_COMBINERS = {
    "sum": lambda x: jax.lax.psum(x, AXIS),
    "max": lambda x: jax.lax.pmax(x, AXIS),
    "min": lambda x: jax.lax.pmin(x, AXIS),
    "prod": lambda x: jnp.prod(jax.lax.all_gather(x, AXIS), axis=0),
    "and": lambda x: jax.lax.pmin(x.astype(jnp.int32), AXIS).astype(x.dtype),
    "or": lambda x: jax.lax.pmax(x.astype(jnp.int32), AXIS).astype(x.dtype),
}


def _check_declared_combination(
    case, invals, expected, positions, in_shardings, mesh2, where
) -> None:
    """EasyDist's check: run the equation on each device's shards (shard_map), combine the
    partial results the way the rule declares, and compare with the global result.

    An operand without the reduced factor that has the result's shape (scatter-add's base)
    is an addend every device holds; under a sum it must count once, so it is kept on
    device 0 and zeroed elsewhere (a partial value).
    """
    eqn, rule, f = case.eqn, case.rule, case.factor
    combine = rule.factors[f].combine

    def local(*ops):
        vals = list(invals)
        first = jax.lax.axis_index(AXIS) == 0
        for i, op in zip(positions, ops):
            has_f = any(f in d for d in rule.operands[i])
            addend = np.shape(op) == tuple(eqn.outvars[0].aval.shape) and np.ndim(op) > 0
            if combine == "sum" and not has_f and addend:
                op = jnp.where(first, op, jnp.zeros_like(op))
            vals[i] = op
        return tuple(_COMBINERS[combine](r) for r in bind(eqn, vals))

    out_specs = tuple(P() for _ in rule.results)
    in_specs = tuple(s.spec for s in in_shardings)
    mapped = jax.shard_map(
        local, mesh=mesh2, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    ops = [jax.device_put(invals[i], s) for i, s in zip(positions, in_shardings)]
    combined = jax.jit(mapped)(*ops)
    for i, (a, e) in enumerate(zip(combined, expected)):
        _assert_same(
            a,
            e,
            f"{where}: combining per-device results by {combine} differs from the global result {i}",
        )


def test_every_rule_has_a_sample() -> None:
    missing = sorted(prim.name for prim in _RULES if prim not in COVERED)
    assert not missing, (
        f"primitives with a rule but no equation in tests/rule_samples.py: {missing}; "
        "add a sample program for each"
    )


def test_known_rule_bugs_name_cases() -> None:
    ids = {param.id for param in CASES}
    stale = sorted(set(KNOWN_RULE_BUGS) - ids)
    assert not stale, f"KNOWN_RULE_BUGS entries that name no case (fixed? remove them): {stale}"


def test_cases_are_collected() -> None:
    runnable = [c for c in CASES if c.values[0].factor is not None]
    assert len(runnable) >= len(_RULES), "fewer executed cases than rules: collection broke"


def test_samples_have_even_dims() -> None:
    odd = [
        (sample_id, np.shape(a))
        for sample_id, _, args in SAMPLES
        for a in jax.tree_util.tree_leaves(args)
        if any(s % 2 for s in np.shape(a) if s != 1)
    ]
    assert not odd, f"sample arguments with odd dims (factors could not split): {odd}"
