"""A catalogue of bad (and awkward but valid) input: each case asserts the exact exception
or warning type and that the message names the culprit (key path, hint key, primitive or
source line); valid-but-unusual input (zero-size arrays, scalars, int and bool arrays,
dtype changes, device subsets, two shard_maps reading one value in different layouts)
plans, runs and matches unsharded ``jax.jit``.

Cases already in tests/test_errors.py are not repeated here: an unknown axis, a spec
longer than the rank, an axis twice inside one tuple entry, overlapping hints that
disagree, a non-divisible argument dim, the invalid regex ``batch/(x``, a tuple as a hint
value, a hint that matches nothing, a bad axis in ``jaxshard.hint``, a ``str`` leaf, and a
non-Mesh mesh. The cases below are variants those miss (a tuple entry, two dims, rank 0,
a result path, a nested leaf path, exact source lines, ...) plus the rest of the issue's
list. A jaxshard bug found here is a strict xfail describing it in its reason until fixed.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_leaves_match
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import JaxshardWarning, Pipeline, ShardingError

W = jax.ShapeDtypeStruct((12, 16), jnp.float32)
X = jax.ShapeDtypeStruct((8, 12), jnp.float32)
NHWC = ("NHWC", "HWIO", "NHWC")


def f(params, batch):
    return jnp.tanh(batch["x"] @ params["w"])


ARGS = ({"w": W}, {"x": X})


def plan(mesh, hints, fn=f, args=ARGS, **kwargs):
    return jaxshard.auto_shard(mesh, hints)(fn).plan(*args, **kwargs)


def line_of(fn, offset=1):
    """The source line ``offset`` lines below ``def`` of a nested function."""
    return fn.__code__.co_firstlineno + offset


# --- hints dict: bad specs -------------------------------------------------------------


@pytest.mark.parametrize(
    "hints, error",
    [
        pytest.param(
            {"params/w": P(("data", "nope"))},
            r"params/w \(hint 'params/w'.*\): mesh axis 'nope' is not in the mesh, whose axes "
            r"are \('data', 'model'\)",
            id="unknown-axis-in-a-tuple-entry",
        ),
        pytest.param(
            {"params/w": P("data", "data")},
            r"params/w \(hint 'params/w': P\('data', 'data'\)\): mesh axis 'data' is used twice",
            id="one-axis-on-two-dims",
        ),
        pytest.param(
            {"out": P(None, "model", None)},
            r"out: hint 'out': P\(None, 'model', None\) has 3 entries but the array has rank 2 "
            r"\(shape \(8, 16\)\)",
            id="result-spec-too-long",
        ),
        pytest.param(
            {"batch/x": P(None, ("model", "data"))},
            r"batch/x \(hint 'batch/x'.*\): dim 1 has size 12, which mesh axes "
            r"\('model', 'data'\) \(size 8\) do not divide",
            id="non-divisible-two-axes",
        ),
    ],
)
def test_bad_spec_in_hints_names_path_and_hint(mesh, hints, error):
    with pytest.raises(ShardingError, match=error):
        plan(mesh, hints)


def test_non_divisible_result_dim_forced_by_a_hint(mesh):
    # out = tanh(x @ w) is (8, 6): 'model' (4) does not divide 6
    args = ({"w": jax.ShapeDtypeStruct((12, 6), jnp.float32)}, {"x": X})
    error = (
        r"out \(hint 'out': P\(None, 'model'\)\): dim 1 has size 6, which mesh axes \('model',\)"
    )
    with pytest.raises(ShardingError, match=error):
        plan(mesh, {"out": P(None, "model")}, args=args)


def test_a_row_hint_on_a_valid_convolutions_result_that_the_axes_do_not_divide(mesh):
    # rows split over "model" stay split through the first 'SAME' convolution; the 'VALID'
    # one makes 14 rows, which the hint inside the program asks 4 devices to split
    def net(image, w):
        y = jax.lax.conv_general_dilated(image, w, (1, 1), "SAME", dimension_numbers=NHWC)
        y = jax.lax.conv_general_dilated(y, w, (1, 1), "VALID", dimension_numbers=NHWC)
        return jaxshard.hint(y, P(None, "model"))

    args = (
        jax.ShapeDtypeStruct((1, 16, 8, 2), jnp.float32),
        jax.ShapeDtypeStruct((3, 3, 2, 2), jnp.float32),
    )
    error = rf"test_bad_input.py:{line_of(net, 3)}.*dim 1 has size 14.*\('model',\)"
    with pytest.raises(ShardingError, match=error):
        plan(mesh, {"image": P(None, "model")}, fn=net, args=args)


def test_spec_on_a_scalar_is_too_long(mesh):
    error = r"scale: hint 'scale': P\(None\) has 1 entries but the array has rank 0 \(shape \(\)\)"
    with pytest.raises(ShardingError, match=error):
        plan(mesh, {"scale": P(None)}, fn=lambda x, scale: x * scale, args=(X, jnp.float32(2)))


def test_empty_spec_on_a_scalar_is_fine(mesh):
    p = plan(mesh, {"scale": P()}, fn=lambda x, scale: x * scale, args=(X, jnp.float32(2)))
    assert p.in_specs == (P(), P())


def test_invalid_regex_names_key_and_reason(mesh):
    with pytest.raises(
        ShardingError, match=r"hint key '\*' is not a valid regex: nothing to repeat"
    ):
        plan(mesh, {"*": P("data")})


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(
            "data",
            id="str",
        ),
        pytest.param(
            None,
            id="None",
        ),
        pytest.param(
            "named",
            id="NamedSharding",
        ),
    ],
)
def test_hint_value_that_is_not_a_spec_names_key_and_value(mesh, value):
    if value == "named":
        value = NamedSharding(mesh, P("data"))
    with pytest.raises(
        ShardingError, match=r"x: hint 'x'.* give a jax.sharding.PartitionSpec"
    ) as e:
        plan(mesh, {"x": value}, fn=lambda x: x * 2, args=(X,))
    assert repr(value) in str(e.value) or type(value).__name__ in str(e.value)
    assert "P('d', 'a'" not in str(e.value)


def test_hints_that_are_not_a_mapping(mesh):
    with pytest.raises(ShardingError, match=r"hints.*PartitionSpec"):
        jaxshard.auto_shard(mesh, P("data"))(lambda x: x)


@pytest.mark.parametrize("key", [0, re.compile(r"batch/.*")], ids=["int", "compiled-pattern"])
def test_hint_key_that_is_not_a_string(mesh, key):
    # an int must be rejected naming it; a compiled pattern may be accepted (it is a regex)
    # or rejected the same way, but never with a bare TypeError
    try:
        p = plan(mesh, {key: P("data")})
    except ShardingError as e:
        assert repr(key) in str(e) and "hint key" in str(e)
    else:
        assert not isinstance(key, int) and p.in_specs[1] == {"x": P("data")}


# --- hints that disagree ---------------------------------------------------------------


def test_in_function_hint_and_result_hint_disagree(mesh):
    def g(x):
        return jaxshard.hint(x * 2, P("data"))

    with pytest.raises(
        ShardingError, match=r"out: .* and hint 'out': P\('model'\) disagree on dim 0"
    ):
        plan(mesh, {"out": P("model")}, fn=g, args=(X,))


def test_two_in_function_hints_on_one_value_name_the_source_line(mesh):
    def g(x):
        y = jaxshard.hint(x * 2, P("data"))
        return jaxshard.hint(y, P("model"))

    error = rf"jaxshard.hint at .*test_bad_input.py:{line_of(g, 2)}\b.* disagree on dim 0"
    with pytest.raises(ShardingError, match=error):
        plan(mesh, {}, fn=g, args=(X,))


@pytest.mark.parametrize("other", ["in-function", "hints-dict"])
def test_disagreeing_in_function_hints_are_each_named_by_line(mesh, other):
    def g(x):
        y = jaxshard.hint(x * 2, P("data"))
        return jaxshard.hint(y, P("model")) if other == "in-function" else y

    hints = {"out": P("model")} if other == "hints-dict" else {}
    with pytest.raises(ShardingError) as e:
        plan(mesh, hints, fn=g, args=(X,))
    assert f"test_bad_input.py:{line_of(g, 1)}" in str(e.value)
    assert "the hint and" not in str(e.value) and "regexes" not in str(e.value)


def test_shard_map_disagreeing_with_an_argument_hint(mesh):
    inner = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))

    def g(x):
        return inner(x)

    error = (
        rf"x: shard_map at .*test_bad_input.py:{line_of(g)}\b.* and hint 'x': P\('model'\) "
        r"disagree on dim 0 \('data' vs 'model'\)"
    )
    with pytest.raises(ShardingError, match=error):
        plan(mesh, {"x": P("model")}, fn=g, args=(X,))


def test_shard_map_disagreeing_with_a_result_hint(mesh):
    inner = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))

    def g(x):
        return inner(x)

    error = rf"out: shard_map at .*test_bad_input.py:{line_of(g)}\b.* and hint 'out'"
    with pytest.raises(ShardingError, match=error):
        plan(mesh, {"out": P(None, "model")}, fn=g, args=(X,))


def test_two_shard_maps_reading_one_value_in_different_layouts_plan_and_run(mesh):
    # a valid program: XLA reshards between the layouts the two shard_maps fix
    by_rows = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    by_cols = jax.shard_map(
        lambda a: a * 3, mesh=mesh, in_specs=P(None, "model"), out_specs=P(None, "model")
    )
    x = np.arange(96, dtype=np.float32).reshape(8, 12)
    step = run_both(mesh, {}, lambda x: by_rows(x) + by_cols(x), x)
    assert len(step.plan(x).reshards) == 1


def test_shard_map_on_another_mesh_passes_jax_error_through(mesh):
    other = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    inner = jax.shard_map(lambda a: a * 2, mesh=other, in_specs=P("a"), out_specs=P("a"))
    with pytest.raises(ValueError, match=r"should match the mesh passed to shard_map.*'a': 4"):
        plan(mesh, {}, fn=lambda x: inner(x), args=(X,))


# --- jaxshard.hint inside the function ---------------------------------------------------


@pytest.mark.parametrize(
    "spec, error",
    [
        (P(None, ("model", "data")), r"dim 1 has size 12, which mesh axes \('model', 'data'\)"),
        (P("data", "data"), r"mesh axis 'data' is used twice"),
        (P(None, None, "data"), r"has 3 entries but the array has rank 2"),
        (P(("model", "nope")), r"mesh axis 'nope' is not in the mesh"),
    ],
    ids=["non-divisible", "axis-twice", "too-long", "unknown-axis-in-tuple"],
)
def test_bad_in_function_hint_names_its_exact_line(mesh, spec, error):
    def g(x):
        return jaxshard.hint(x + 1, spec)

    where = rf"jaxshard.hint at .*test_bad_input.py:{line_of(g)}\b"
    with pytest.raises(ShardingError, match=where + ".*" + error):
        plan(mesh, {}, fn=g, args=(X,))


# --- paths -------------------------------------------------------------------------------


def test_hint_matching_no_path_lists_them(mesh):
    # "params" is a prefix of every params path, but keys are fully matched
    with pytest.warns(JaxshardWarning, match=r"'params' matched no .*: params/w, batch/x, out"):
        plan(mesh, {"params": P("data")})


def test_hint_matching_nothing_warns_at_the_callers_line(mesh):
    with pytest.warns(JaxshardWarning) as record:
        plan(mesh, {"params": P("data")})
    assert record[0].filename == __file__


def test_non_array_leaf_deep_in_a_list_names_its_path(mesh):
    error = r"argument leaf batch/extras/1 is a object, not an array"
    with pytest.raises(ShardingError, match=error):
        plan(mesh, {}, fn=lambda batch: batch["x"], args=({"x": X, "extras": [X, object()]},))


def test_module_with_an_activation_suggests_static_leaves(mesh):
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    error = r"argument leaf model/activation is a .*static_leaves=True.*eqx.filter_jit"
    with pytest.raises(ShardingError, match=error):
        plan(mesh, {}, fn=lambda model, x: jax.vmap(model)(x), args=(mlp, X))


def test_non_array_result_names_its_path_and_suggests_static_leaves(mesh):
    error = r"result leaf out/fn is a PjitFunction, not an array.*static_leaves=True"
    with pytest.raises(ShardingError, match=error):
        plan(mesh, {}, fn=lambda x: {"y": x * 2, "fn": jnp.tanh}, args=(X,))


@pytest.mark.parametrize("value", ["yes", 1, None], ids=["str", "int", "none"])
def test_static_leaves_that_is_not_a_bool(mesh, value):
    with pytest.raises(ShardingError, match=r"static_leaves is True or False, got"):
        jaxshard.auto_shard(mesh, static_leaves=value)(lambda x: x)


@pytest.mark.parametrize(
    "options, error",
    [
        ({"search": True, "calibrate_memory": True}, r"calibrate_memory=True .* give memory_budget"),
        ({"search": True, "memory_budget": 2**20, "calibrate_memory": "yes"},
         r"calibrate_memory is True or False, got 'yes'"),
    ],
    ids=["without-a-budget", "not-a-bool"],
)  # fmt: skip
def test_calibrate_memory_needs_a_budget_and_a_bool(mesh, options, error):
    with pytest.raises(ShardingError, match=error):
        jaxshard.auto_shard(mesh, **options)(lambda x: x)


@pytest.mark.parametrize(
    "options, error",
    [
        ({"fsdp_axes": "fsdp"}, r"fsdp_axes names 'fsdp', an axis the mesh lacks; its axes are \('data', 'model'\)"),
        ({"fsdp_axes": 3}, r"fsdp_axes takes mesh axis names .* got 3"),
        ({"fsdp_axes": ("data", 1)}, r"fsdp_axes takes mesh axis names"),
        ({"fsdp_axes": "data", "search": True}, r"fsdp_axes='data' with search=True: the search chooses"),
    ],
    ids=["missing-axis", "not-a-name", "not-all-names", "with-the-search"],
)  # fmt: skip
def test_fsdp_axes_must_name_mesh_axes_and_be_used(mesh, options, error):
    with pytest.raises(ShardingError, match=error):
        jaxshard.auto_shard(mesh, **options)(lambda x: x)


def test_fsdp_axes_beside_a_saved_plan_says_which_to_drop(mesh):
    saved = jaxshard.Plan.from_json(
        jaxshard.auto_shard(mesh)(lambda x: x * 2).plan(jnp.ones(8)).to_json()
    )
    with pytest.raises(ShardingError, match=r"fsdp_axes='data' with plan=: a saved plan already"):
        jaxshard.auto_shard(mesh, plan=saved, fsdp_axes="data")(lambda x: x * 2)


def test_a_budget_no_compiled_layout_meets_names_the_compiled_footprint(mesh):
    step = jaxshard.auto_shard(
        mesh, {"batch/x": P("data")}, search=True, memory_budget=64, calibrate_memory=True
    )(f)
    error = (r"no layout fits the memory budget of 64 B per device in the compiled program: "
             r"the smallest the search found needs [\d.]+ [KM]?i?B \(\d+ bytes, compiled\)\. "
             r"Raise the budget")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JaxshardWarning)
        with pytest.raises(ShardingError, match=error):
            step.plan(*ARGS)


def test_none_inside_a_list_is_an_empty_subtree(mesh):
    p = plan(mesh, {"batch/0": P("data")}, fn=lambda batch: batch[0] * 2, args=([X, None],))
    assert p.in_specs == ([P("data"), None],)


def test_keyword_argument_paths(mesh):
    p = plan(mesh, {"y": P("data")}, fn=lambda x, y: x + y, args=(X,), y=X)
    assert p.in_specs == ((P("data"),), {"y": P("data")})


# --- meshes ------------------------------------------------------------------------------


def test_abstract_mesh_plans_but_does_not_run_or_lower():
    abstract = jax.make_mesh((2, 4), ("data", "model")).abstract_mesh
    step = jaxshard.auto_shard(abstract, {"batch/x": P("data")})(f)
    assert step.plan(*ARGS).in_specs[1] == {"x": P("data")}
    x = ({"w": np.ones((12, 16), np.float32)}, {"x": np.ones((8, 12), np.float32)})
    for action in (lambda: step(*x), lambda: step.lower(*ARGS)):
        with pytest.raises(ShardingError, match=r"planned on an AbstractMesh .*real devices"):
            action()


def test_a_mesh_that_is_no_mesh_at_all():
    with pytest.raises(ShardingError, match=r"auto_shard needs a jax.sharding.Mesh .*got tuple"):
        jaxshard.auto_shard((2, 4))(f)


def test_mesh_on_a_subset_of_devices(mesh):
    """A mesh whose devices are not all addressable cannot be built in a single-process run:
    every device JAX reports belongs to this process, so there is nothing to put in such a
    mesh (multi-process runs take the `_place` path in api.py and need
    jax.distributed). A mesh on a subset of the local devices is valid and must work."""
    assert jax.process_count() == 1
    assert all(d.process_index == jax.process_index() for d in jax.devices())
    sub = Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("data", "model"))
    step = jaxshard.auto_shard(sub, {"x": P("data", "model")})(lambda x: jnp.sin(x) * 2)
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    out = step(x)
    np.testing.assert_allclose(out, np.sin(x) * 2, rtol=1e-6)
    assert out.sharding.device_set == set(jax.devices()[4:])
    assert out.sharding.spec == P("data", "model")


# --- the function itself -----------------------------------------------------------------


def _python_if(batch):
    if batch["x"].sum() > 0:
        return batch["x"]
    return -batch["x"]


def _python_int(batch):
    return jnp.zeros(int(batch["x"][0, 0]))


TRACING_ERRORS = [
    pytest.param(
        _python_if, ({"x": X},), jax.errors.TracerBoolConversionError, id="if-on-a-tracer"
    ),
    pytest.param(
        _python_int, ({"x": X},), jax.errors.ConcretizationTypeError, id="int-of-a-tracer"
    ),
]


@pytest.mark.parametrize("fn, args, error", TRACING_ERRORS)
def test_python_control_flow_on_traced_values_passes_jax_error_through(mesh, fn, args, error):
    with pytest.raises(error):
        plan(mesh, {}, fn=fn, args=args)


@pytest.mark.parametrize("fn, args, error", TRACING_ERRORS)
def test_tracing_error_names_argument_path_and_function(mesh, fn, args, error):
    with pytest.raises(error) as e:
        plan(mesh, {}, fn=fn, args=args)
    text = str(e.value) + "".join(getattr(e.value, "__notes__", []))
    assert fn.__name__ in text and "flat_fn" not in text
    assert "batch/x" in text, text


def test_python_side_effects_run_once_per_plan(mesh):
    seen = []

    def g(x):
        seen.append(x.shape)  # a Python side effect: runs while tracing, like jax.jit
        return x * 2

    step = jaxshard.auto_shard(mesh, {"x": P("data")})(g)
    x = np.ones((8, 12), np.float32)
    step(x)
    step(x)
    assert seen == [(8, 12)] and step.plans_made == 1


def test_debug_print_inside_the_function_plans_without_warning(mesh):
    def g(x):
        jax.debug.print("x[0, 0] = {}", x[0, 0])
        return x * 2

    with warnings.catch_warnings():
        warnings.simplefilter("error", JaxshardWarning)
        assert plan(mesh, {"x": P("data")}, fn=g, args=(X,)).out_specs == P("data")


def test_non_array_result_names_its_path(mesh):
    with pytest.raises(ShardingError, match=r"result leaf out/1 is a str, not an array"):
        plan(mesh, {}, fn=lambda x: (x, "done"), args=(X,))


# --- unusual but valid input: plans, runs, matches jax.jit ----------------------------------


def run_both(mesh, hints, fn, *args):
    step = jaxshard.auto_shard(mesh, hints)(fn)
    got, want = step(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=1e-5)
    return step


def test_dtype_change_between_calls_replans(mesh):
    def g(x, w):
        return jnp.tanh(x @ w)

    step = jaxshard.auto_shard(mesh, {"x": P("data"), "w": P(None, "model")})(g)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 8), np.float32)
    for dtype, rtol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2), (jnp.float32, 1e-5)):
        a, b = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
        out = step(a, b)
        assert out.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(jax.jit(g)(a, b), np.float32), rtol=rtol
        )
    assert step.plans_made == 2  # float32, bfloat16; float32 again is cached


def test_zero_size_arrays(mesh):
    def g(x):
        return jnp.tanh(x).sum(0), x.reshape(4, 0) * 2, x.T @ x

    step = run_both(mesh, {"x": P("data", "model")}, g, np.zeros((0, 4), np.float32))
    assert step.plan(np.zeros((0, 4), np.float32)).in_specs == (P("data", "model"),)


def test_scalars_and_python_numbers(mesh):
    def g(x, scale, shift, flag):
        return x * scale + shift, jnp.where(flag, scale, -scale), (x * scale).sum()

    x = np.arange(96, dtype=np.float32).reshape(8, 12)
    step = run_both(mesh, {"x": P("data"), "scale": P()}, g, x, jnp.float32(3), 1.5, True)
    assert step.plan(x, jnp.float32(3), 1.5, True).out_specs[2] == P()


def test_int_and_bool_arrays_are_exact(mesh):
    def g(x, mask):
        return jnp.where(mask, x @ x.T, 0).sum(0), mask.any(1), (x * 3) // 2, ~mask

    x = (np.arange(64, dtype=np.int32).reshape(8, 8) % 7) - 3
    mask = x > 0
    step = jaxshard.auto_shard(mesh, {"x": P("data", "model"), "mask": P(None, "model")})(g)
    for got, want in zip(step(x, mask), jax.jit(g)(x, mask)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_fsdp_hint_on_the_batch_axis_is_a_storage_layout(mesh):
    """A weight dim on the axis the batch uses (FSDP) is where the weight is stored: the
    argument and its new value keep it, the weight is gathered for the matmul, the batch
    keeps "data", and the step matches unsharded."""

    def sgd(params, batch):
        grads = jax.grad(lambda p: jnp.tanh(batch["x"] @ p["w"]).sum())(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    w = np.linspace(-1, 1, 12 * 16, dtype=np.float32).reshape(12, 16)
    # a batch larger than the weight, as FSDP is for: gathering the batch instead would
    # move more bytes than gathering the weight (with a smaller batch the planner rightly
    # computes in the weight's layout)
    x = np.linspace(-2, 2, 64 * 12, dtype=np.float32).reshape(64, 12)
    hints = {"batch/x": P("data"), "params/w": P(None, "data")}
    step = jaxshard.auto_shard(mesh, hints)(sgd)
    plan = step.plan({"w": w}, {"x": x})
    assert plan.in_specs[0]["w"] == P(None, "data") == plan.out_specs["w"]
    moved = {c for r in plan.reshards for c in r.collectives}
    assert "all-gather over data" in moved and not any("all-to-all" in c for c in moved)
    assert_leaves_match(step({"w": w}, {"x": x}), jax.jit(sgd)({"w": w}, {"x": x}))


# --- pipeline parallelism (auto_shard(pipeline=...)) ----------------------------------


def test_no_qualifying_scan_names_each_scan_and_why(pipe_mesh):
    def loss(params, x):
        def layer(h, w):  # sums over the batch: rows are not independent
            h = jnp.tanh(h @ w)
            return h - h.mean(axis=0), None

        h, _ = jax.lax.scan(layer, x, params)
        return jnp.sum(h)

    params, x = jnp.ones((4, 8, 8)), jnp.ones((8, 8))
    piped = jaxshard.auto_shard(pipe_mesh, pipeline=Pipeline("stage", 2))(jax.grad(loss))
    with pytest.raises(ShardingError, match=r"no scan of the step qualifies") as e:
        piped.plan(params, x)
    assert "sums over the batch at reduce_sum" in str(e.value)
    assert "test_bad_input.py" in str(e.value)


def test_no_scan_at_all(pipe_mesh):
    piped = jaxshard.auto_shard(pipe_mesh, pipeline=Pipeline("stage", 2))(lambda x: x * 2)
    with pytest.raises(ShardingError, match=r"the step calls no jax.lax.scan"):
        piped.plan(jnp.ones((8, 4)))


@pytest.mark.parametrize(
    "layers, batch, microbatches, error",
    [
        (3, 8, 2, r"has 3 layers, which the 2 stages of mesh axis 'stage' do not divide"),
        (4, 6, 4, r"carries a batch of 6 rows, which 4 microbatches do not divide"),
    ],
)
def test_sizes_that_do_not_divide(pipe_mesh, layers, batch, microbatches, error):
    def loss(params, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params)
        return jnp.sum(h)

    piped = jaxshard.auto_shard(pipe_mesh, pipeline=Pipeline("stage", microbatches))
    with pytest.raises(ShardingError, match=error) as e:
        piped(jax.grad(loss)).plan(jnp.ones((layers, 8, 8)), jnp.ones((batch, 8)))
    assert "test_bad_input.py" in str(e.value)


@pytest.mark.parametrize(
    "layers, microbatches, repeats, error",
    [
        (4, 4, 4, r"has 4 layers, which 2 stages x 4 repeats \(circular schedule\) do not "
         r"divide; use a layer count divisible by 8, or repeats= a divisor of 2"),
        (6, 4, 2, r"has 6 layers, which 2 stages x 2 repeats \(circular schedule\) do not "
         r"divide; use a layer count divisible by 4, or repeats= a divisor of 3"),
        (4, 1, 2, r"on a circular schedule over 2 stages needs at least 2 microbatches .* got "
         r"microbatches=1"),
    ],
)  # fmt: skip
def test_circular_sizes_that_do_not_fit(pipe_mesh, layers, microbatches, repeats, error):
    def loss(params, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params)
        return jnp.sum(h)

    pipeline = Pipeline("stage", microbatches, schedule="circular", repeats=repeats)
    piped = jaxshard.auto_shard(pipe_mesh, pipeline=pipeline)
    with pytest.raises(ShardingError, match=error) as e:
        piped(jax.grad(loss)).plan(jnp.ones((layers, 8, 8)), jnp.ones((8, 8)))
    assert "test_bad_input.py" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"schedule": "1f1b", "replicate": True}, r"schedule='1f1b', replicate=True\): the 1F1B"),
        ({"schedule": "zigzag"}, r"schedule='zigzag'\): one of \('gpipe', '1f1b', 'circular'\)"),
        ({"repeats": 2}, r"repeats=2\) applies to schedule='circular' only"),
        ({"schedule": "1f1b", "repeats": 2}, r"repeats=2\) applies to schedule='circular' only"),
        ({"schedule": "circular", "repeats": 0}, r"repeats=0\): give a positive int"),
        ({"schedule": "circular", "repeats": 2.0}, r"repeats=2.0\): give a positive int"),
    ],
)
def test_bad_schedule(kwargs, error):
    with pytest.raises(ShardingError, match=error):
        Pipeline("stage", 4, **kwargs)


def test_1f1b_layers_the_stages_do_not_divide(pipe_mesh):
    def loss(params, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params)
        return jnp.mean(h)

    piped = jaxshard.auto_shard(pipe_mesh, pipeline=Pipeline("stage", 2, schedule="1f1b"))
    with pytest.raises(ShardingError, match=r"has 3 layers, which the 2 stages") as e:
        piped(jax.grad(loss)).plan(jnp.ones((3, 8, 8)), jnp.ones((8, 8)))
    assert "test_bad_input.py" in str(e.value)


def test_1f1b_head_that_mixes_rows_runs_gpipe_and_says_where(pipe_mesh):
    """A loss whose head mixes the batch's rows (here: each row minus the batch's mean)
    cannot run per microbatch: the step runs on the GPipe schedule and the plan names the
    equation."""

    def loss(params, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params)
        return jnp.mean((h - h.mean(axis=0)) ** 2)

    piped = jaxshard.auto_shard(pipe_mesh, pipeline=Pipeline("stage", 2, schedule="1f1b"))
    args = jnp.ones((2, 8, 8)), jnp.ones((8, 8))
    plan = piped(lambda *a: jax.grad(loss)(*a)).plan(*args)
    (loop,) = plan.pipelined
    assert loop.schedule == "gpipe"
    assert re.search(
        r"the loss is not a sum of per-example terms: sub at .*test_bad_input.py", loop.note
    ), loop.note
    assert loop.note in plan.explain()
    # a gradient function made before planning is not one 1F1B can run per microbatch
    (loop,) = piped(jax.grad(loss)).plan(*args).pipelined
    assert "not differentiated by jax.value_and_grad or jax.grad" in loop.note, loop.note


def test_pipeline_axis_missing_from_mesh(mesh):
    with pytest.raises(ShardingError, match=r"Pipeline\(axis='stage'\) is not an axis of the mesh"):
        jaxshard.auto_shard(mesh, pipeline=Pipeline("stage", 2))(lambda x: x)


def test_hint_on_the_layer_dim_disagrees_with_the_pipeline(pipe_mesh):
    def loss(params, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["w"])
        return jnp.sum(h)

    hints = {r"x": P("data"), r"params/w": P("model")}
    piped = jaxshard.auto_shard(pipe_mesh, hints, pipeline=Pipeline("stage", 2))
    error = (
        r"params/w: hint 'params/w': P\('model'\) puts 'model' on the layer dim, which the "
        r"pipeline splits over 'stage' \(the pipeline's stages \(scan at .*test_bad_input.py"
    )
    with pytest.raises(ShardingError, match=error):
        piped(jax.grad(loss)).plan({"w": jnp.ones((4, 8, 8))}, jnp.ones((8, 8)))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_microbatches(bad):
    with pytest.raises(ShardingError, match=r"microbatches=.* positive int"):
        Pipeline("stage", bad)


def test_bad_replicate():
    with pytest.raises(ShardingError, match=r"Pipeline\(replicate='yes'\): True or False"):
        Pipeline("stage", 2, replicate="yes")


def test_pipeline_option_takes_a_pipeline(pipe_mesh):
    with pytest.raises(ShardingError, match=r"pipeline= takes a jaxshard.Pipeline"):
        jaxshard.auto_shard(pipe_mesh, pipeline="stage")(lambda x: x)


# --- saved plans: untrusted input ------------------------------------------------------


def _program_step(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.sum((h @ params["w2"]) ** 2)


def _scanned(x, w):
    return jax.lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), x, w)[0]


_ARGS2 = (
    {
        "w1": jnp.linspace(-1, 1, 12 * 16).reshape(12, 16),
        "w2": jnp.linspace(1, -1, 16 * 8).reshape(16, 8),
    },
    {"x": jnp.linspace(-2, 2, 8 * 12).reshape(8, 12)},
)
_SCAN_ARGS = (
    jnp.linspace(-1, 1, 8 * 16).reshape(8, 16),
    jnp.linspace(-0.3, 0.3, 3 * 16 * 16).reshape(3, 16, 16),
)
PROGRAMS = {
    "matmuls": (
        jax.grad(_program_step),
        _ARGS2,
        {r"batch/.*": P("data"), r"params/w1": P(None, "model")},
    ),
    "scan": (_scanned, _SCAN_ARGS, {"x": P("data"), "w": P(None, None, "model")}),
}


@pytest.fixture(scope="module")
def saved_programs(mesh):
    """Per program: its saved plan (JSON text) and the unsharded result to compare with."""
    out = {}
    for name, (fn, args, hints) in PROGRAMS.items():
        text = jaxshard.auto_shard(mesh, hints)(fn).plan(*args).to_json()
        out[name] = (fn, args, text, jax.jit(fn)(*args))
    return out


def test_a_plan_saved_for_another_program_is_refused(mesh):
    # the same argument shapes, the same number of values, another program
    def first(x, w1, w2):
        return jnp.tanh(x @ w1) @ w2

    def second(x, w1, w2):
        return jnp.tanh(x @ w1 @ w2)

    args = (jnp.ones((8, 16)), jnp.ones((16, 16)), jnp.ones((16, 16)))
    text = jaxshard.auto_shard(mesh, {"x": P("data")})(first).plan(*args).to_json()
    step = jaxshard.auto_shard(mesh, plan=jaxshard.Plan.from_json(text))(second)
    with pytest.raises(
        ShardingError,
        match=r"(?s)does not match.*program: a different function \(equation 1 is 'tanh' in the "
        r"saved plan, 'dot_general' now\).*Plan again",
    ):
        step(*args)


def _json_paths(node, path=()):
    """Every path into a JSON document (the root excluded)."""
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in items:
        yield path + (key,)
        yield from _json_paths(child, path + (key,))


_REPLACEMENTS = [
    None,
    -1,
    0,
    10**12,
    1.5,
    True,
    "x",
    "data",
    [],
    {},
    [None],
    ["model"],
    [["data", "data"]],
]


@st.composite
def corrupted(draw, texts: dict):
    """A saved plan of one of ``texts``, corrupted: truncated, one character replaced, a
    value at a random JSON path replaced, a field dropped or one added."""
    import json

    name = draw(st.sampled_from(sorted(texts)))
    text = texts[name]
    how = draw(st.sampled_from(["truncate", "character", "value", "drop", "add"]))
    if how == "truncate":
        return name, text[: draw(st.integers(0, len(text) - 1))]
    if how == "character":
        i = draw(st.integers(0, len(text) - 1))
        return name, text[:i] + draw(st.sampled_from(list('0129-"[]{},:nxa '))) + text[i + 1 :]
    record = json.loads(text)
    paths = list(_json_paths(record))
    path = draw(st.sampled_from(paths))
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    if how == "value":
        parent[path[-1]] = draw(st.sampled_from(_REPLACEMENTS))
    elif how == "drop":
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    elif isinstance(parent, dict):
        parent["extra"] = draw(st.sampled_from(_REPLACEMENTS))
    else:
        parent.insert(path[-1], draw(st.sampled_from(_REPLACEMENTS)))
    return name, json.dumps(record)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_corrupted_saved_plan_is_refused_or_runs_right(mesh, saved_programs, data):
    texts = {name: entry[2] for name, entry in saved_programs.items()}
    name, text = data.draw(corrupted(texts))
    fn, args, _, expected = saved_programs[name]
    try:
        saved = jaxshard.Plan.from_json(text)
        got = jaxshard.auto_shard(mesh, plan=saved)(fn)(*args)
    except ShardingError:
        event("refused")
        return
    event("ran")
    assert_leaves_match(got, expected, rel=1e-5)
