"""The lattice: merge, spec conversion, and compound-dim (reshape) factor mapping."""

import pytest
from jax.sharding import PartitionSpec as P

from jaxshard.errors import ShardingError
from jaxshard.lattice import check_dims, from_spec, join_axes, merge_dim, split_axes, to_spec

SIZES = {"x": 2, "y": 4, "z": 2}


@pytest.mark.parametrize(
    "a, b, merged, conflict",
    [
        (None, None, None, False),
        (None, ("x",), ("x",), False),
        ((), None, (), False),
        (("x",), ("x",), ("x",), False),
        ((), ("x",), (), True),
        (("x",), ("y",), ("x",), True),
        (("x", "y"), ("x",), ("x", "y"), True),
    ],
    ids=["open-open", "open-x", "rep-open", "x-x", "rep-vs-x", "x-vs-y", "xy-vs-x"],
)
def test_merge_dim(a, b, merged, conflict):
    assert merge_dim(a, b) == (merged, conflict)


def test_merge_is_monotone_and_commutative_on_agreement():
    values = [None, (), ("x",), ("y",), ("x", "y")]
    for a in values:
        for b in values:
            m, conflict = merge_dim(a, b)
            if not conflict:
                assert m == merge_dim(b, a)[0]
                assert m is not None or (a is None and b is None)


@pytest.mark.parametrize(
    "spec, rank, dims",
    [
        (P("x"), 2, (("x",), None)),
        (P(None, "y"), 2, ((), ("y",))),
        (P(P.UNCONSTRAINED, ("x", "y")), 3, (None, ("x", "y"), None)),
        (P(), 1, (None,)),
    ],
)
def test_from_spec(spec, rank, dims):
    assert from_spec(spec, rank) == dims


@pytest.mark.parametrize(
    "dims, spec",
    [
        ([("x",), (), ()], P("x")),
        ([(), ("y",)], P(None, "y")),
        ([None, ()], P(P.UNCONSTRAINED)),
        ([("x", "y")], P(("x", "y"))),
    ],
)
def test_to_spec_round_trip(dims, spec):
    assert to_spec(dims) == spec
    assert from_spec(spec, len(dims))[: len(spec)] == tuple(dims)[: len(spec)]


@pytest.mark.parametrize(
    "dims, shape, message",
    [
        ([("w",)], (8,), "not in the mesh"),
        ([("x",), ("x",)], (8, 8), "used twice"),
        ([("y",)], (6,), "do not divide"),
    ],
    ids=["unknown-axis", "axis-twice", "not-divisible"],
)
def test_check_dims_rejects(dims, shape, message):
    with pytest.raises(ShardingError, match=message):
        check_dims(dims, shape, SIZES, "params/w")


# Reshape table: a compound dim's axes split over its factors and joined back.
@pytest.mark.parametrize(
    "axes, sizes, parts, left",
    [
        (("x",), (6, 12), (("x",), ()), ()),  # merge: major factor takes the axis
        (("x", "y"), (2, 12), (("x",), ("y",)), ()),  # major fully sharded, minor continues
        (("y",), (6, 12), ((), ()), ("y",)),  # sharded minor cannot pass: left over
        (("x", "y"), (4, 8), (("x",), ()), ("y",)),  # major not full: y cannot reach minor
        ((), (3, 5), ((), ()), ()),
    ],
    ids=[
        "merge-major",
        "major-full-then-minor",
        "minor-cannot-pass",
        "partial-major",
        "replicated",
    ],
)
def test_split_axes(axes, sizes, parts, left):
    assert split_axes(axes, sizes, SIZES) == (parts, left)


@pytest.mark.parametrize(
    "factors, sizes, dim, exact",
    [
        ([("x",), ()], (2, 12), ("x",), True),
        ([("x",), ("y",)], (2, 12), ("x", "y"), True),
        ([(), ("y",)], (6, 12), (), False),
        ([None, ("x",)], (6, 12), None, True),
        ([("x",), None], (2, 12), ("x",), True),
    ],
    ids=["major", "both", "minor-only-inexact", "major-open", "minor-open"],
)
def test_join_axes(factors, sizes, dim, exact):
    assert join_axes(factors, sizes, SIZES) == (dim, exact)
