"""Promises a plan makes hold: budgets under a time limit, immutable plans, predictions on
a small MoE, kernels' rules read as Shardy reads them, donation only of what the step says
is new state, one propagation per storage hint, and the pipeline's scan interception
local to the thread that plans."""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_leaves_match
from jax.sharding import PartitionSpec as P
from test_search import BATCH, MEGATRON, abstract_step, exact_hints

import jaxshard
from jaxshard.annotate import Pin
from jaxshard.baseline import compiled_memory
from jaxshard.graph import build_graph
from jaxshard.propagate import Propagator
from jaxshard.trace import trace


@pytest.fixture(scope="module")
def gpt():
    return abstract_step("gpt")


@pytest.mark.parametrize("share", [0.85, 1.2])
def test_a_budget_holds_when_the_time_limit_stops_the_solver(gpt, mesh, share):
    # the solver is stopped before it finds any layout: what comes back fits the budget
    # (the smallest-memory layout, 1.2x), or the error names the smallest footprint
    step, args = gpt
    megatron = jaxshard.make_plan(step, args, {}, mesh, exact_hints(step, args, MEGATRON))
    budget = share * compiled_memory(jaxshard.lower.Lowered(megatron).lower().compile())
    searched = jaxshard.auto_shard(
        mesh, BATCH, search=True, memory_budget=budget, search_time_limit=1e-4
    )(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = searched.plan(*args)
        except jaxshard.ShardingError as e:
            assert share < 1 and "the smallest footprint jaxshard finds" in str(e)
            return
    assert any("did not prove its layout optimal" in str(w.message) for w in caught)
    assert plan.search_result.memory_bytes <= budget
    assert compiled_memory(searched.lower(*args).compile()) <= budget


def test_plans_are_immutable(mesh):
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    plan = jaxshard.make_plan(lambda x, w: x @ w, (x, w), {}, mesh, {"x": P("data")})
    for name in ("dims", "out_dims", "layouts", "reshards", "search_result", "graph"):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(plan, name, None)
    assert isinstance(plan.dims, tuple) and isinstance(plan.dims[0], tuple)
    for name in ("reshards", "slices", "repeats", "moved_again", "conflicts", "written"):
        assert isinstance(getattr(plan, name), tuple), name
    with pytest.raises(TypeError):
        plan.partial[0] = frozenset()


def test_a_fork_inside_a_trial_keeps_its_writes_out_of_the_parents_journal():
    t = trace(lambda x, w: jnp.tanh(x @ w), (jnp.ones((8, 4)), jnp.ones((4, 16))), {})
    sizes = {"data": 2, "model": 4}
    g = build_graph(t, sizes)
    prop = Propagator(g, sizes)
    with prop.trying() as written:
        trial = prop.fork()
        trial.pin(g.in_vids[1], Pin((None, ("model",)), "hint"))
        trial.run()
        assert written == []  # the fork's writes are its own
    assert prop.state.dims[g.out_vids[0]] == (None, None)


def test_a_trial_that_reaches_a_stop_value_ends_there_and_is_undone():
    t = trace(lambda x, w: jnp.tanh(x @ w), (jnp.ones((8, 4)), jnp.ones((4, 16))), {})
    sizes = {"data": 2, "model": 4}
    g = build_graph(t, sizes)
    prop = Propagator(g, sizes)
    out, product = g.out_vids[0], g.producers()
    matmul = g.apps[product[g.apps[product[out]].operands[0]]]
    reached = None
    with prop.trying(stop={out}) as written:
        prop.pin(g.in_vids[0], Pin((("data",), None), "hint"))
        prop.run()
        reached = "the rest of the block"
    assert reached is None  # the batch split reached the result: the block ended there
    assert written[-1][0] == out and written[-1][1] == 0
    assert all(prop.state.dims[v] == (None, None) for v in (*matmul.results, out))
    assert prop.state.conflicts == {} and prop.hinted == set()
    with prop.trying(stop={g.in_vids[1]}):  # the weight's dims stay open: it goes on
        prop.pin(g.in_vids[0], Pin((("data",), None), "hint"))
        prop.run()
        assert prop.state.dims[out] == (("data",), None)
        reached = "the rest of the block"
    assert reached == "the rest of the block"
    prop.pin(g.in_vids[0], Pin((("data",), None), "hint"))
    prop.run()  # after a stopped trial, propagation runs as if it never happened
    assert prop.state.dims[out] == (("data",), None)


def _moe_step(opt=None):
    """Top-2 routing with einsum dispatch and combine over 4 experts."""
    e, d, f, b, s = 4, 16, 32, 8, 4

    def loss(params, batch):
        x = batch["x"]  # (b, s, d)
        probs = jax.nn.softmax(x @ params["router"])
        _, idx = jax.lax.top_k(probs, 2)
        mask = jax.nn.one_hot(idx, e).sum(-2)  # (b, s, e)
        gates = probs * mask
        dispatched = jnp.einsum("bse,bsd->ebd", mask, x)
        h = jax.nn.relu(jnp.einsum("ebd,edf->ebf", dispatched, params["w1"]))
        out = jnp.einsum("ebf,efd->ebd", h, params["w2"])
        y = jnp.einsum("ebd,bse->bsd", out, gates)
        return jnp.mean((y - batch["y"]) ** 2)

    opt = opt or optax.sgd(0.1)
    rng = np.random.default_rng(0)
    params = {
        "router": jnp.asarray(rng.normal(size=(d, e)), jnp.float32),
        "w1": jnp.asarray(rng.normal(size=(e, d, f)) * 0.1, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(e, f, d)) * 0.1, jnp.float32),
    }
    batch = {
        "x": jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32),
    }

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, opt.init(params), batch)


def test_a_small_moe_verifies_with_no_surprise(mesh):
    step, args = _moe_step()
    hints = {r"batch/.*": P("data"), r"params/w[12]": P("model")}
    sharded = jaxshard.auto_shard(mesh, hints)(step)
    result = sharded.plan(*args).verify()
    assert result.ok, result.surprises
    got, want = sharded(*args), jax.jit(step)(*args)
    assert_leaves_match(got, want)


def test_donate_state_donates_only_what_the_step_returns_as_new_state(mesh):
    # (loss, grads): grads have the parameters' structure, shapes and dtypes, but are not
    # their new value; nothing may be donated
    params = {"w": jnp.ones((16, 32))}
    x = jnp.ones((8, 16))

    def grads_of(params, x):
        return jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(params)

    step = jaxshard.auto_shard(mesh, {"x": P("data")}, donate_state=True)(grads_of)
    # placed as planned, so the step's program gets these very buffers
    shardings = step.plan(params, x).in_shardings
    params, x = jax.device_put(params, shardings[0]), jax.device_put(x, shardings[1])
    loss, grads = step(params, x)
    assert not params["w"].is_deleted()
    assert not x.is_deleted()
    np.testing.assert_allclose(loss, grads_of(params, x)[0], rtol=1e-5)


def test_flax_fsdp_metadata_plans_each_storage_layout_once_per_hint(mesh):
    # every kernel stored on "data" (FSDP) by its own metadata: the storage pins of one
    # metadata spec are tried on the computation together, not once per leaf
    import jaxshard.plan.make as plan_module  # the pipeline calls propagate_pins from here

    nnx = pytest.importorskip("flax.nnx")

    class Stack(nnx.Module):
        def __init__(self, n, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", None))
            self.layers = nnx.List(
                [nnx.Linear(16, 16, kernel_init=init, rngs=rngs) for _ in range(n)]
            )

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    with nnx.use_eager_sharding(False):
        model = Stack(6, nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def step(state, x, graphdef):
        model = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, nnx.state(grads))

    calls = []
    original = plan_module.propagate_pins

    def counting(*a, **k):
        calls.append(1)
        return original(*a, **k)

    plan_module.propagate_pins = counting
    try:
        sharded = jaxshard.auto_shard(mesh, {"x": P("data")}, static_argnames="graphdef")(step)
        sharded.plan(state, jnp.ones((8, 16)), graphdef=graphdef)
    finally:
        plan_module.propagate_pins = original
    assert len(calls) <= 3, f"{len(calls)} propagations for one metadata spec"


def test_two_threads_planning_pipelines_keep_jax_lax_scan(pipe_mesh):
    # thread 1 starts intercepting, thread 2 starts, thread 1 ends: thread 2 still
    # intercepts; other threads' scans pass through; the last to end restores the original
    from jaxshard.pipeline import intercepting

    original = jax.lax.scan
    pipeline = jaxshard.Pipeline("stage", 2)
    entered, left, done = threading.Event(), threading.Event(), threading.Event()
    seen_by_second = []

    def second():
        with intercepting(pipeline, pipe_mesh):
            entered.set()
            left.wait(10)
            seen_by_second.append(jax.lax.scan is not original)
        done.set()

    thread = threading.Thread(target=second)
    with intercepting(pipeline, pipe_mesh):
        thread.start()
        entered.wait(10)
    left.set()
    done.wait(10)
    thread.join()
    assert seen_by_second == [True]  # thread 1 ending did not restore it under thread 2
    assert jax.lax.scan is original
    # a thread that plans nothing runs the ordinary scan while another one intercepts
    with intercepting(pipeline, pipe_mesh):
        out = []
        other = threading.Thread(
            target=lambda: out.append(jax.lax.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(3))[0])
        )
        other.start()
        other.join()
    assert float(out[0]) == 3.0


def test_a_custom_partitioning_factor_only_in_operands_is_sharded_as_shardy_does(mesh):
    # "i j, j k -> i k" without reduction_factors: the partition callback sums over j
    from jax.experimental.custom_partitioning import custom_partitioning
    from kernels import _matmul_partition

    cp = custom_partitioning(lambda a, b: a @ b)
    cp.def_partition(partition=_matmul_partition, sharding_rule="i j, j k -> i k")

    def step(x, w1, w2):
        return cp(jnp.tanh(x @ w1), w2)

    args = (jnp.ones((8, 16)), jnp.linspace(0, 1, 16 * 32).reshape(16, 32), jnp.ones((32, 8)))
    hints = {"x": P("data"), "w1": P(None, "model")}
    plan = jaxshard.make_plan(step, args, {}, mesh, hints)
    builtin = jaxshard.make_plan(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2, args, {}, mesh, hints)
    assert plan.in_specs[2] == builtin.in_specs[2] == P("model")  # w2's rows follow w1's split
    result = plan.verify()
    assert result.ok, result.surprises
    got = jaxshard.auto_shard(mesh, hints)(step)(*args)
    np.testing.assert_allclose(got, jax.jit(step)(*args), rtol=1e-5)


def test_a_reduction_computed_twice_is_predicted_twice(mesh):
    # XLA merges the two softmaxes but not their all-reduces (collectives are never
    # common subexpressions): one tuple all-reduce of the same operand, counted twice
    def f(x, w):
        logits = x @ w
        return jnp.sum(jax.nn.softmax(logits) * jax.nn.softmax(logits))

    args = (jnp.linspace(0, 1, 8 * 16).reshape(8, 16), jnp.ones((16, 8)))
    plan = jaxshard.make_plan(jax.grad(f), args, {}, mesh, {"x": P("data"), "w": P(None, "model")})
    result = plan.verify()
    assert result.ok, result.surprises


def test_internal_records_say_what_they_are(mesh):
    # kinds are enums, places are named records, ring volumes are called ring_bytes
    from jaxshard.cost import CostModel
    from jaxshard.graph import AppKind
    from jaxshard.propagate import OriginKind
    from jaxshard.rule import Port, Side
    from jaxshard.search import search_hints
    from jaxshard.search.problem import Extra, Problem, Scope
    from jaxshard.search.refs import Fixed, Follow

    def f(ws, x):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0].sum()

    args = (jnp.ones((2, 16, 16)), jnp.ones((8, 16)))
    plan = jaxshard.make_plan(jax.grad(f), args, {}, mesh, {"x": P("data")})
    g = plan.graph
    assert {type(app.kind) for app in g.apps} == {AppKind}
    assert {app.kind for app in g.apps} >= {AppKind.EQN, AppKind.LINK}
    assert {type(s.kind) for row in plan.layouts for s in row} == {OriginKind}
    assert all(not s.open for row in plan.layouts for s in row)  # a plan leaves nothing open
    from jaxshard.rule import region_fn_for

    scan = next(
        app.eqn for app in g.apps if app.eqn is not None and app.eqn.primitive.name == "scan"
    )
    (region,) = region_fn_for(scan.primitive)(scan)
    assert all(type(link.outer) is Port and type(link.outer.side) is Side for link in region.links)
    assert all(hasattr(r, "ring_bytes") and not hasattr(r, "bytes") for r in plan.reshards)
    assert all(hasattr(s, "ring_bytes") for r in plan.reshards for s in r.steps)
    from jaxshard.plan import trace_graph

    traced, graph = trace_graph(jax.grad(f), args, {}, mesh)
    problem = Problem(traced, graph, mesh, {"x": P("data")}, CostModel(), 2**20)
    refs = [r for v in range(len(graph.shapes)) for r in problem.refs(v)]
    assert all(type(r) in (int, Fixed, Follow) for r in refs)
    extras = [c for d in problem.decisions for c in d.candidates if isinstance(c, Extra)]
    assert all(type(c.scope) is Scope for c in extras)
    result = search_hints(jax.grad(f), args, {}, mesh, {"x": P("data")}, memory_budget=2**20)
    assert result.plan is not None
