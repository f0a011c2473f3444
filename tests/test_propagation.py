"""Propagation: forward, backward, fixed-point idempotence, and conflict policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.annotate import Pin
from jaxshard.plan import (
    Plan,
    decide,
    hint_pins,
    make_plan,
    mesh_axis_sizes,
    propagate_pins,
    split_storage,
    trace_graph,
)
from jaxshard.propagate import Propagator

X = jax.ShapeDtypeStruct((8, 16), jnp.float32)
W1 = jax.ShapeDtypeStruct((16, 32), jnp.float32)
W2 = jax.ShapeDtypeStruct((32, 8), jnp.float32)


def mlp2(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def test_forward_column_then_row_parallel(mesh):
    plan = make_plan(mlp2, (X, W1, W2), {}, mesh, {"x": P("data"), "w1": P(None, "model")})
    assert plan.in_specs == (P("data"), P(None, "model"), P("model"))
    assert plan.out_specs == P("data")
    (reduction,) = [r for r in plan.reshards if r.partial]
    assert reduction.partial == {"model"} and "all-reduce over model" in reduction.collectives


def test_backward_from_result_hint(mesh):
    plan = make_plan(lambda x, w: x @ w, (X, W1), {}, mesh, {"out": P("data", "model")})
    assert plan.in_specs == (P("data"), P(None, "model"))
    assert plan.reshards == ()


def test_hint_inside_function(mesh):
    def f(x, w1, w2):
        h = jaxshard.hint(jnp.tanh(x @ w1), P("data", "model"))
        return h @ w2

    plan = make_plan(f, (X, W1, W2), {}, mesh)
    assert plan.in_specs == (P("data"), P(None, "model"), P("model"))


def test_propagating_again_changes_nothing(mesh):
    plan = make_plan(mlp2, (X, W1, W2), {}, mesh, {"x": P("data"), "w1": P(None, "model")})
    prop = Propagator(plan.graph, plan.axis_sizes)
    prop.state.layouts = [list(row) for row in plan.layouts]
    prop._enqueue(range(len(plan.graph.apps)))
    prop.run()
    assert tuple(tuple(d) for d in prop.state.dims) == plan.dims


def test_conflict_keeps_hinted_layouts_and_reshards_the_loser(mesh):
    def f(x, y):
        return jnp.sin(x) + jnp.cos(y)

    plan = make_plan(f, (X, X), {}, mesh, {"x": P("data"), "out": P(None)})
    assert plan.conflicts, "two hints pulling one value apart must be recorded"
    assert all("bytes per device" in c.reason for c in plan.conflicts)
    assert plan.in_specs[0] == P("data") and plan.out_specs == P()
    (reshard,) = plan.reshards
    assert reshard.collectives == ("all-gather over data",)
    assert "cheapest reshard" in plan.explain()


def test_conflict_between_hints_takes_cheaper_reshard(mesh):
    big = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    mask = jax.ShapeDtypeStruct((8, 64), jnp.bool_)

    def f(m, a, b):
        return jax.lax.select(m, jnp.sin(a), jnp.cos(b))

    plan = make_plan(
        f, (mask, big, big), {}, mesh, {"m": P("data"), "a": P("model"), "b": P("model")}
    )
    # moving the 1-byte mask beats moving two f32 arrays, at every conflict
    assert plan.conflicts and all(c.chosen == ("model",) for c in plan.conflicts)
    assert all("cheapest reshard" in c.reason for c in plan.conflicts)
    assert "m" in {plan.graph.names.get(r.vid) for r in plan.reshards}


def test_conflict_under_a_cost_model_moves_less_over_the_slow_axis(mesh):
    # a sum of two arrays split over both axes the other way round: in bytes, gathering
    # over "data" (2 devices) then moving "model" is cheapest; with a slow "data" axis,
    # moving the other array without a gather wins (as XLA runs it: an all-to-all over
    # the minor half of "model", then a permute, `jaxshard.cost.collectives._transfer`).
    # (Two hints on one dim over the two axes are no such choice: XLA moves either side
    # with a collective-permute that crosses both axes, `..._permuted`.)
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    hints = {"a": P("data", "model"), "b": P("model", "data")}
    by_bytes = make_plan(lambda a, b: a + b, (x, x), {}, mesh, hints)
    assert by_bytes.out_specs == P("model")
    assert any("all-gather over data" in r.collectives for r in by_bytes.reshards)
    slow_data = jaxshard.CostModel(bandwidth={"data": 1e9})
    by_time = make_plan(lambda a, b: a + b, (x, x), {}, mesh, hints, cost_model=slow_data)
    assert by_time.out_specs == P("data", "model")
    (reshard,) = by_time.reshards
    assert reshard.collectives == (
        "all-to-all over model:(2)2",
        "collective-permute over data,model",
    )
    assert "cheapest reshard in time under the cost model" in by_time.explain()


def test_unsharded_numbers_unchanged_by_conflicting_plan(mesh):
    def f(x, y):
        return jnp.sin(x) + jnp.cos(y)

    step = jaxshard.auto_shard(mesh, {"x": P("data"), "y": P("model")})(f)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
    np.testing.assert_allclose(step(x, x), f(x, x), rtol=1e-6)


@pytest.mark.parametrize(
    "shape, spec", [((6, 12, 24, 48), P("data")), ((6, 12, 24, 48), P(None, "model"))]
)
def test_reshape_propagates_through_compound_dims(mesh, shape, spec):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    plan = make_plan(lambda a: a.reshape(72, 24, 6, 8), (x,), {}, mesh, {"a": spec})
    # data (2) divides the major factor 6 of the merged dim; model (4) on the minor
    # factor 12 cannot pass to dim 0 of the result and is reported as a reshard.
    if spec == P("data"):
        assert plan.out_specs == P("data") and plan.reshards == ()
    else:
        assert plan.out_specs == P()
        (r,) = plan.reshards
        assert r.collectives == ("all-gather over model",)


def test_shard_map_specs_are_fixed_annotations(mesh):
    inner = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))

    def f(x, w):
        return inner(x @ w)

    plan = make_plan(f, (X, W1), {}, mesh)
    assert plan.in_specs == (P("data"), P())
    step = jaxshard.auto_shard(mesh)(f)
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    np.testing.assert_allclose(step(x, w), f(x, w), rtol=1e-6)


def test_shard_map_disagreeing_with_a_hint_is_an_error(mesh):
    inner = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(
        jaxshard.ShardingError, match=r"shard_map at .*test_propagation.py.* disagree on dim 0"
    ):
        make_plan(lambda x: jaxshard.hint(inner(x), P("model")), (X,), {}, mesh)


def test_explain_lists_intermediates_on_request(mesh):
    plan = make_plan(mlp2, (X, W1, W2), {}, mesh, {"x": P("data"), "w1": P(None, "model")})
    table = plan.explain().split("\n\n")[1]  # the table of arguments and results
    assert "tanh at" not in table
    text = plan.explain(intermediates=True)
    assert "= tanh at" in text and "test_propagation.py" in text and "P('data', 'model')" in text


@pytest.mark.parametrize(
    "x_spec, want_src",
    [
        # only the first compound result dim (2*4) needs its minor factor dropped
        (P(None, "model"), ((), ("model",), (), ())),
        # the first needs a drop, the second (2*12) does too
        (P(None, "model", None, "data"), ((), ("model",), (), ("data",))),
    ],
    ids=["first-dim-only", "both-dims"],
)
def test_reshape_works_in_an_expressible_layout_for_every_compound_dim(mesh, x_spec, want_src):
    # (2, 4, 2, 12) -> (8, 24): result dims [a*b] and [c*d]; a sharded minor factor under
    # an unsharded major one cannot be expressed, so the reshape works on a gathered input.
    x = jax.ShapeDtypeStruct((2, 4, 2, 12), jnp.float32)
    plan = make_plan(lambda x: x.reshape(8, 24), (x,), {}, mesh, {"x": x_spec})
    assert plan.in_specs == (x_spec,)
    (reshard,) = plan.reshards
    assert (reshard.vid, reshard.src, reshard.dst) == (plan.graph.in_vids[0], want_src, ((),) * 4)


def test_a_returned_plan_does_not_change(mesh):
    plan0 = make_plan(mlp2, (X, W1, W2), {}, mesh, {"x": P("data"), "w1": P(None, "model")})
    prop = Propagator(plan0.graph, plan0.axis_sizes)
    prop.pin(plan0.graph.in_vids[0], Pin(((), ()), "test"))
    prop.run()
    plan = Plan(plan0.traced, plan0.graph, prop, mesh)
    dims, layouts, out_dims = plan.dims, plan.layouts, plan.out_dims
    # the propagator going on (as the search's retries do) must not reach into the plan
    prop.pin(plan0.graph.in_vids[1], Pin(((), ("model",)), "later"))
    prop.run()
    assert (plan.dims, plan.layouts, plan.out_dims) == (dims, layouts, out_dims)
    for table in (plan.dims, plan.layouts, plan.out_dims):
        with pytest.raises(TypeError):
            table[0] = None


def _projections(x, wq, wk, wv):
    x = jaxshard.hint(x, P("data", None, "model"))  # the residual stream: features split
    return jnp.sum((x @ wq) * (x @ wk) + x @ wv)


def test_one_activation_feeding_several_contractions_is_gathered_once(mesh):
    # the query, key and value projections of one input split on its features: gathering
    # the input once serves all three (XLA merges the equal gathers); summing each
    # projection's partial result costs each its own reduce-scatter
    x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32)  # one reduce-scatter is half a gather
    hints = {"wq": P(None, "model"), "wk": P(None, "model"), "wv": P(None, "model")}
    plan = make_plan(_projections, (x, w, w, w), {}, mesh, hints)
    dots = [r for r in plan.reshards if r.where.startswith("dot_general")]
    assert not [r for r in dots if r.partial], [str(r.collectives) for r in dots]
    gathers = {(r.vid, r.dst) for r in dots if "all-gather over model" in r.collectives}
    assert len(gathers) == 1, gathers  # one move of the input, shared by the three
    assert plan.verify().ok


def test_a_looped_weight_keeps_its_own_layout_against_an_activation_reaching_it_first(mesh):
    # the stacked weight's hint reaches each layer's slice through a transpose and the
    # loop; the activation's feature split reaches the slice sooner, through the
    # contraction over the features. The weight's own layout wins: it is not rearranged
    # in every iteration (the contraction sums partial results instead)
    def step(x, ws):
        def layer(h, w):
            h = jaxshard.hint(h, P("data", None, "model"))
            return h * jnp.tanh(jnp.sum(h @ w, axis=-1, keepdims=True)), None

        h, _ = jax.lax.scan(layer, x, jnp.swapaxes(ws, 0, 1))
        return jnp.sum(h)

    x = jax.ShapeDtypeStruct((2, 4, 32), jnp.float32)  # the weights larger than activations
    ws = jax.ShapeDtypeStruct((32, 3, 256), jnp.float32)  # layers in the middle, as MaxText
    plan = make_plan(jax.grad(step, argnums=1), (x, ws), {}, mesh, {"ws": P(None, None, "model")})
    moved = [
        (r.where, r.src, r.dst) for r in plan.reshards
        if tuple(plan.graph.shapes[r.vid]) == (32, 256) and "all-to-all" in " ".join(r.collectives)
    ]  # fmt: skip
    assert not moved, moved
    assert plan.in_specs[1] == P(None, None, "model")


def _sgd(loss):
    """The step of one SGD update of ``loss(params, x)``'s parameters."""

    def train(params, x):
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, x))

    return train


def _f32(**shapes):
    """Abstract float32 arrays by name."""
    return {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}


def test_an_axis_only_activations_use_stays_on_a_weights_computation(mesh):
    # the batch's axis on a weight is storage (FSDP); the other axis of its hint, which
    # only the step's own activation constraints use, shards the computation: the
    # logits are split over the vocabulary as the weight is
    def loss(params, x):
        h = jaxshard.hint(jnp.tanh(x @ params["emb"]), P("data", None, "model"))
        return jnp.sum(jax.nn.log_softmax(h @ params["head"]))

    train = _sgd(loss)

    params = _f32(emb=(32, 32), head=(32, 64))
    x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32)
    hints = {"x": P("data"), "params/.*": P("data", "model")}
    traced, graph = trace_graph(train, (params, x), {}, mesh)
    compute, storage = split_storage(hint_pins(traced, graph, hints, mesh_axis_sizes(mesh)), graph)
    head = graph.in_vids[traced.in_names.index("params/head")]
    assert storage[head].dims == (("data",), ("model",))
    assert compute[head].dims == (None, ("model",))
    plan = make_plan(train, (params, x), {}, mesh, hints)
    logits = [
        v for v, shape in enumerate(plan.graph.shapes)
        if tuple(shape) == (8, 16, 64) and plan.dims[v][2]
    ]  # fmt: skip
    assert logits and all(plan.dims[v][2] == ("model",) for v in logits)
    assert plan.out_specs == {"emb": P("data", "model"), "head": P("data", "model")}


def _split_features_mlp(params, x):
    """An MLP whose activations are split over their features on "model" between the
    matmuls (MaxText's activation_embed) and the hidden over its own (activation_mlp)."""
    x = jaxshard.hint(x, P("data", None, "model"))
    h = jaxshard.hint(jnp.tanh(x @ params["wi"]), P("data", None, "model"))
    y = jaxshard.hint(h @ params["wo"], P("data", None, "model"))
    return jnp.sum(y * y)


def test_a_contraction_result_moved_by_an_all_to_all_is_computed_as_planned(mesh):
    # the input weight's gradient is computed with the hidden's split and moved to the
    # input's by an all-to-all. Left to itself, XLA computed it in the final layout
    # instead, gathering the hidden's gradient (8x the bytes); the lowering pins the
    # working layout first
    train = _sgd(_split_features_mlp)

    params = _f32(wi=(64, 256), wo=(256, 64))
    x = jax.ShapeDtypeStruct((8, 32, 64), jnp.float32)
    hints = {"params/wi": P(None, "model"), "params/wo": P("model", None)}
    plan = make_plan(train, (params, x), {}, mesh, hints)
    moved = [r for r in plan.reshards if "all-to-all over model" in r.collectives]
    assert moved and all(r.vid in plan.graph.apps[r.app].results for r in moved)
    result = plan.verify()
    assert result.ok, result.surprises


def test_an_unhinted_weight_is_stored_as_its_use_settles_it(mesh):
    # the activations' feature split (MaxText's activation_embed) reaches the unhinted
    # input weight through the contraction one round before the hidden's constraint
    # reaches the contraction's other side, which then wins the axis for the hidden.
    # The weight waits for its use to settle: it is stored column-parallel, as used,
    # not split over the contraction and rearranged by an all-to-all in every step
    params = _f32(wi=(64, 256), wo=(256, 64))
    x = jax.ShapeDtypeStruct((8, 32, 64), jnp.float32)
    plan = make_plan(_split_features_mlp, (params, x), {}, mesh, {"x": P("data")})
    assert plan.in_specs[0] == {"wi": P(None, "model"), "wo": P("model")}
    weights = set(plan.graph.in_vids[:2])
    assert not [r.collectives for r in plan.reshards if r.vid in weights]


def _experts(params, x):
    """A mixture of experts' first layer computed densely (MaxText's dense matmul): each
    token through every expert, the activations split over their features on "model"."""
    x = jaxshard.hint(x, P("data", None, "model"))
    h = jnp.tanh(jnp.einsum("bsm,emh->bseh", x, params["w"]))
    return jnp.sum(h * h)


def test_an_unhinted_weight_takes_the_axis_on_its_output_where_summing_costs_more(mesh):
    # following the activations' feature split into the weight's contracted dim leaves
    # the per-expert hidden (8x the activations) a partial sum over "model" in every
    # step; gathering the activations and splitting the hidden's features instead moves
    # a fraction of that. Where the row layout is cheaper overall, the planner keeps it
    # (`plan_from_graph` plans both): the never-lose suite's conv nets
    train = _sgd(_experts)
    params = _f32(w=(4, 64, 128))
    x = jax.ShapeDtypeStruct((8, 32, 64), jnp.float32)
    hints = {"x": P("data")}
    plan = make_plan(train, (params, x), {}, mesh, hints)
    assert plan.in_specs[0] == {"w": P(None, None, "model")}

    traced, graph = trace_graph(train, (params, x), {}, mesh)
    sizes = mesh_axis_sizes(mesh)
    compute, storage = split_storage(hint_pins(traced, graph, hints, sizes), graph)
    rows = decide(
        traced, graph, propagate_pins(graph, sizes, compute, storage, free_factors=False), mesh
    )
    assert rows.in_specs[0] == {"w": P(None, "model")}
    assert plan.predicted_bytes < 0.5 * rows.predicted_bytes
    result = plan.verify()
    assert result.ok, result.surprises

    w = jax.random.normal(jax.random.key(0), (4, 64, 128)) / 8
    xs = jax.random.normal(jax.random.key(1), (8, 32, 64))
    sharded = jaxshard.auto_shard(mesh, hints)(train)({"w": w}, xs)
    np.testing.assert_allclose(sharded["w"], train({"w": w}, xs)["w"], rtol=1e-5, atol=1e-6)
