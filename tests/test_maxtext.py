"""MaxText as a client: its own train step, config, model and optimizer planned by
jaxshard. Runs where MaxText is installed (Python 3.12+, JAX 0.10.2: the README says
how) and skips elsewhere."""

import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed (see the README)")

import maxtext_llama  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    m = maxtext_llama.build("llama2", scan=True)
    return m, maxtext_llama.maxtext_row(m)


def test_maxtexts_rules_give_its_layouts_and_its_loss(llama):
    import jax

    m, reference = llama
    row = maxtext_llama.jaxshard_row(m, "rules")
    assert row.loss == pytest.approx(reference.loss, rel=1e-5)
    for got, want in zip(
        jax.tree.leaves(row.plan.in_shardings[0]), jax.tree.leaves(m.in_shardings[0])
    ):
        assert got.is_equivalent_to(want, len(got.spec) or 1), (got.spec, want.spec)


def test_maxtexts_rules_move_no_more_bytes_than_maxtext(llama):
    m, reference = llama
    row = maxtext_llama.jaxshard_row(m, "rules")
    assert row.bytes <= 1.05 * reference.bytes


@pytest.mark.xfail(
    strict=True,
    reason="1.10x MaxText's memory: XLA keeps one more relayout copy of a layer's MLP "
    "weight alive at the peak and packs the temporaries less tightly; verify reports 6 "
    "moves XLA runs otherwise (all-to-alls over part of 'tensor')",
)
def test_maxtexts_rules_cost_no_more_memory_than_maxtext(llama):
    m, reference = llama
    row = maxtext_llama.jaxshard_row(m, "rules")
    assert row.memory <= 1.02 * reference.memory
    assert row.surprises == 0


def test_the_batch_hint_alone_plans_maxtext_and_matches_its_loss(llama):
    m, reference = llama
    row = maxtext_llama.jaxshard_row(m, "batch")
    assert row.loss == pytest.approx(reference.loss, rel=1e-5)
    assert row.bytes <= 1.05 * reference.bytes


def test_the_batch_hint_alone_gathers_the_tokens_for_the_expert_matmuls():
    # the expert matmuls take "tensor" on the weights' hidden dim (column layout):
    # summing each one's product over "tensor" moved 1.6x MaxText's bytes
    m = maxtext_llama.build("mixtral", scan=True)
    reference = maxtext_llama.maxtext_row(m)
    row = maxtext_llama.jaxshard_row(m, "batch")
    assert row.loss == pytest.approx(reference.loss, rel=1e-5)
    assert row.bytes <= 1.05 * reference.bytes
    assert "column layout for" in row.plan.explain()
