"""Rules checked by execution, EasyDist-style: a wrong rule is caught before it trains a
wrong model.

For each factor a rule allows to be sharded, the call runs under `jax.jit` on two
devices with the shardings the rule implies — every dim the factor leads split over one
mesh axis, everything else replicated — and must match the unsharded result. A
pass-through factor must also compile to a program without collectives. A reduction
factor is checked again per device under `shard_map`: each device's partial results,
combined the way the rule declares (sum, max, ...), must give the global result; an
indexed one (a lookup by global indices, see `jaxshard.rule.Factor`) must compile to
all-reduces only. A windowed factor (a spatial dim, see `jaxshard.rule.Window`) must
compile to exactly the collective-permutes of the halo its window predicts for two
shards (and all-reduces, for a windowed reduction), nothing else. The catalogue's own
test (`tests/test_rule_execution.py`) and `check_rule` share this core.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxshard.cost import CollectiveKind
from jaxshard.errors import ShardingError
from jaxshard.kernels import sdy_rule, to_rule, with_rule
from jaxshard.rule import FactorKind, Rule
from jaxshard.verify import compiled_collectives, hlo_collectives

AXIS = "x"
TESTED_KINDS = (FactorKind.PASS, FactorKind.REDUCTION)


class RuleCheckError(ShardingError):
    """A rule's factor, run sharded as the rule says, disagrees with the unsharded run."""


def leads(dim: tuple[int, ...], f: int, rule: Rule) -> bool:
    """Whether splitting this dim in 2 splits factor ``f``: every factor before it is 1.

    Example:
        >>> from jaxshard.rule import RuleBuilder
        >>> b = RuleBuilder(n_operands=1, n_results=1, ranks=([1], [2]))  # (6,) -> (2, 3)
        >>> _ = b.add_factor(operand_dims={0: 0}, result_dims={0: 0}, size=2)
        >>> _ = b.add_factor(operand_dims={0: 0}, result_dims={0: 1}, size=3)
        >>> r = b.build()
        >>> leads(r.operands[0][0], 0, r), leads(r.operands[0][0], 1, r)
        (True, False)
    """
    return f in dim and all(rule.factors[g].size == 1 for g in dim[: dim.index(f)])


def checkable(rule: Rule, f: int) -> bool:
    """Whether factor ``f`` can be checked on 2 devices: a pass-through or reduction factor
    of even size that leads every dim it is in (no PartitionSpec splits a minor factor).

    Example:
        >>> r = to_rule(sdy_rule("m k, k n -> m n", reduction_factors=("k",)),
        ...             [(2, 4), (4, 3)], [(2, 3)], "matmul")
        >>> [checkable(r, f) for f in range(3)]
        [True, True, False]
    """
    factor = rule.factors[f]
    if factor.kind not in TESTED_KINDS or factor.size % 2:
        return False
    dims = [d for t in rule.operands + rule.results for d in t if f in d]
    return bool(dims) and all(leads(d, f, rule) for d in dims)


def factor_spec(dims: tuple[tuple[int, ...], ...], f: int, rule: Rule) -> P:
    """The spec that splits every dim factor ``f`` leads over axis ``x``."""
    return P(*(AXIS if leads(d, f, rule) else None for d in dims))


def two_device_mesh() -> Mesh:
    """Two devices on one Auto axis ``x``; a clear error when there are fewer."""
    devices = jax.devices()
    if len(devices) < 2:
        raise ShardingError(
            "checking a rule by execution needs 2 devices; on a CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=2 before importing jax"
        )
    return jax.make_mesh((2,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices[:2])


def _plain(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = np.asarray(x)
    return x.astype(np.float64) if "float" in x.dtype.name else x


def assert_same(actual, expected, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Raise `RuleCheckError` unless two results agree (dtype, shape, values)."""
    a, e = _plain(actual), _plain(expected)
    if a.shape != e.shape or actual.dtype != expected.dtype:
        raise RuleCheckError(
            f"{what}: sharded result is {actual.dtype}{a.shape}, "
            f"unsharded {expected.dtype}{e.shape}"
        )
    try:
        if np.issubdtype(e.dtype, np.inexact):
            np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(a, e)
    except AssertionError as err:
        raise RuleCheckError(f"{what}{err}") from None


_COMBINERS = {
    "sum": lambda x: jax.lax.psum(x, AXIS),
    "max": lambda x: jax.lax.pmax(x, AXIS),
    "min": lambda x: jax.lax.pmin(x, AXIS),
    "prod": lambda x: jnp.prod(jax.lax.all_gather(x, AXIS), axis=0),
    "and": lambda x: jax.lax.pmin(x.astype(jnp.int32), AXIS).astype(x.dtype),
    "or": lambda x: jax.lax.pmax(x.astype(jnp.int32), AXIS).astype(x.dtype),
}


def check_factor(
    apply: Callable[..., Sequence[Any]],
    rule: Rule,
    f: int,
    args: Sequence[Any],
    expected: Sequence[Any],
    mesh: Mesh,
    what: str,
    local: Callable[..., Sequence[Any]] | None = None,
    tolerated: Callable[[str], Counter] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Run ``apply(*args)`` (a tuple of results) with factor ``f`` of ``rule`` split over
    the 2-device ``mesh`` and raise `RuleCheckError` naming the factor unless it behaves
    as the rule says. ``local`` (default ``apply``) is what runs per device for a
    reduction factor; ``tolerated(hlo_text)`` counts collectives a pass-through factor
    may still compile to (a scalar flag, say).

    Example:
        >>> import jax.numpy as jnp
        >>> r = to_rule(sdy_rule("m k, k n -> m n", reduction_factors=("k",)),
        ...             [(2, 4), (4, 2)], [(2, 2)], "matmul")
        >>> a, b = jnp.ones((2, 4)), jnp.ones((4, 2))
        >>> mm = lambda a, b: (a @ b,)
        >>> check_factor(mm, r, 1, (a, b), mm(a, b), two_device_mesh(), "matmul")
    """
    factor = rule.factors[f]
    where = f"{what}: rule {rule}, factor {factor.name!r} ({factor.kind.value})"
    in_shardings = tuple(NamedSharding(mesh, factor_spec(d, f, rule)) for d in rule.operands)
    out_shardings = tuple(NamedSharding(mesh, factor_spec(d, f, rule)) for d in rule.results)
    ops = [jax.device_put(a, s) for a, s in zip(args, in_shardings)]
    jitted = jax.jit(lambda *a: tuple(apply(*a)), in_shardings=in_shardings,
                     out_shardings=out_shardings)  # fmt: skip
    try:
        compiled = jitted.lower(*ops).compile()
        actual = compiled(*ops)
    except Exception as e:  # noqa: BLE001 - e.g. the function cannot run on a shard
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise RuleCheckError(f"{where}: running it sharded failed: {first}") from e
    if len(actual) != len(expected):
        raise RuleCheckError(f"{where}: {len(actual)} results, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_same(a, e, f"{where}: result {i} differs from the unsharded run", rtol, atol)
    if factor.window is not None:
        _check_halo(compiled.as_text(), rule, f, args, mesh, where, tolerated)
    elif factor.kind is FactorKind.REDUCTION and factor.indexed:
        # run alone on a shard, the lookup would read global indices as local ones: the
        # sharded run above checked the numbers; the claim left is that the partial
        # lookups are summed (an all-reduce), not the table gathered first
        moved = set(hlo_collectives(compiled.as_text())) - {CollectiveKind.ALL_REDUCE}
        if moved:
            raise RuleCheckError(
                f"{where}: an indexed reduction must compile to all-reduces of its partial "
                f"lookups, but sharding it compiled to {sorted(moved)}; declare it "
                "need-replication"
            )
    elif factor.kind is FactorKind.REDUCTION:  # a window's shards alone miss their halos
        _check_combination(local or apply, rule, f, args, expected, in_shardings, mesh, where,
                           rtol, atol)  # fmt: skip
    if factor.plain:
        text = compiled.as_text()
        collectives = hlo_collectives(text)
        if tolerated is not None:
            collectives = collectives - tolerated(text)
        if collectives:
            raise RuleCheckError(
                f"{where}: a pass-through factor must need no communication, but sharding it "
                f"compiled to collectives {dict(collectives)} (in specs "
                f"{[s.spec for s in in_shardings]}, out specs {[s.spec for s in out_shardings]})"
                "; if the results need every shard, declare it a reduction or "
                "need-replication factor"
            )


def _check_halo(text, rule, f, args, mesh, where, tolerated) -> None:
    """A windowed factor split in 2 must compile to the collective-permutes its window
    predicts (`jaxshard.rule.Window.permutes`: the rows from each neighbour times the
    read operand's cross-section), plus all-reduces for a reduction, and nothing else.
    One whose shards would need more than a halo makes no claim past the numbers (the
    engine works it whole)."""
    window = rule.factors[f].window
    rows = window.permutes(2)
    if rows is None:
        return
    t = window.operand
    dims = rule.operands[t]
    dim = next(d for d, fl in enumerate(dims) if f in fl)
    local = [n // (2 if leads(fl, f, rule) else 1) for n, fl in zip(np.shape(args[t]), dims)]
    section = (
        math.prod(n for d, n in enumerate(local) if d != dim) * np.dtype(args[t].dtype).itemsize
    )
    want = Counter(r * section for r in rows)
    found = compiled_collectives(text, mesh)
    have = Counter(c.bytes for c in found if c.kind == CollectiveKind.PERMUTE)
    others = Counter(c.kind for c in found if c.kind != CollectiveKind.PERMUTE)
    if tolerated is not None:
        others -= tolerated(text)
    if rule.factors[f].kind is FactorKind.REDUCTION:
        others.pop(CollectiveKind.ALL_REDUCE, None)
    if have != want or others:
        raise RuleCheckError(
            f"{where}: a windowed factor split in 2 must compile to collective-permutes of "
            f"{sorted(want.elements())} bytes (its halo), but compiled to permutes of "
            f"{sorted(have.elements())} bytes and {dict(others) or 'no other collectives'}; "
            "fix the window's geometry, or declare the factor need-replication"
        )


def _check_combination(local, rule, f, args, expected, in_shardings, mesh, where, rtol, atol):
    """Run on each device's shards (shard_map) and combine the partial results as the rule
    declares. An operand without the reduced factor that has the result's shape (a
    scatter-add's base) is an addend every device holds; under a sum it must count once,
    so it is kept on device 0 and zeroed elsewhere."""
    combine = rule.factors[f].combine
    out_shape = tuple(np.shape(expected[0])) if expected else ()

    def per_device(*ops):
        first = jax.lax.axis_index(AXIS) == 0
        vals = []
        for i, op in enumerate(ops):
            has_f = any(f in d for d in rule.operands[i])
            addend = np.shape(op) == out_shape and np.ndim(op) > 0
            if combine == "sum" and not has_f and addend:
                op = jnp.where(first, op, jnp.zeros_like(op))
            vals.append(op)
        return tuple(_COMBINERS[combine](r) for r in local(*vals))

    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=tuple(s.spec for s in in_shardings),
        out_specs=tuple(P() for _ in rule.results),
        check_vma=False,
    )
    ops = [jax.device_put(a, s) for a, s in zip(args, in_shardings)]
    combined = jax.jit(mapped)(*ops)
    for i, (a, e) in enumerate(zip(combined, expected)):
        assert_same(
            a, e, f"{where}: combining per-device results by {combine} differs from result {i}",
            rtol, atol,
        )  # fmt: skip


def check_rule(
    fn: Callable,
    rule: Any,
    *example_args: Any,
    reduction_factors: Sequence[str] = (),
    need_replication_factors: Sequence[str] = (),
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **factor_sizes: int,
) -> list[str]:
    """Check a kernel's sharding rule by running it, before planning relies on it.

    ``rule`` is written as for `with_rule` (custom_partitioning's notation). Each factor
    the rule lets planning shard is split over 2 devices: the call, wrapped with
    `with_rule` so each device runs ``fn`` on its own shards, must match ``fn`` run
    unsharded; a pass-through factor must compile to no collective; a reduction
    factor's per-device results must sum to the global result. Raises `RuleCheckError`
    naming the first factor that fails; returns the names of the factors checked
    (factors of odd size, minor factors of a compound dim and need-replication
    factors cannot be split in 2 and are not). Needs 2 devices (on a CPU,
    ``XLA_FLAGS=--xla_force_host_platform_device_count=2``).

    Example:
        >>> import jax.numpy as jnp
        >>> x, w = jnp.ones((4, 6)), jnp.ones((6, 8))
        >>> check_rule(jnp.matmul, "i j, j k -> i k", x, w, reduction_factors=("j",))
        ['i', 'j', 'k']
        >>> check_rule(jnp.cumsum, "i -> i", jnp.arange(4.0))
        Traceback (most recent call last):
        ...
        jaxshard.check.RuleCheckError: check_rule(cumsum): ...factor 'i' (pass): result 0 ...
    """
    sdy = sdy_rule(
        rule,
        reduction_factors=reduction_factors,
        need_replication_factors=need_replication_factors,
        **factor_sizes,
    )
    name = getattr(fn, "__name__", type(fn).__name__)
    what = f"check_rule({name})"
    args = [jnp.asarray(a) for a in example_args]
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    ruled = to_rule(sdy, [a.shape for a in args], [np.shape(e) for e in expected], what)
    wrapped = with_rule(sdy)(fn)
    flat = lambda *a: jax.tree_util.tree_leaves(fn(*a))  # noqa: E731
    mesh = two_device_mesh()
    checked = []
    for f, factor in enumerate(ruled.factors):
        if checkable(ruled, f):
            apply = lambda *a: jax.tree_util.tree_leaves(wrapped(*a))  # noqa: E731
            check_factor(apply, ruled, f, args, expected, mesh, what, local=flat,
                         rtol=rtol, atol=atol)  # fmt: skip
            checked.append(factor.name)
    return checked
