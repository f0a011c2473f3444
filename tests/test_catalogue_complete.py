"""Every primitive JAX registers has a rule (or region, boundary, annotation) or a
justified entry below: a JAX upgrade that adds a primitive fails here, naming it.

The primitives are found by importing every module under ``jax._src`` (in a child
process, so the imports cannot change the rest of the session) and collecting the
`jax.core.Primitive` instances they define.
"""

from __future__ import annotations

import jaxshard.rules  # noqa: F401 - registers the catalogue

from jaxshard.jax_compat import registered_primitives
from jaxshard.rule import covered_primitives

# Collectives and manual-axis casts: valid only inside `shard_map`, whose body jaxshard
# leaves to the user (a boundary with fixed in/out specs). psum, pmax and pmin have a rule
# for the form `vmap` makes of them outside it: over positional axes.
SHARD_MAP_ONLY = """
    all_gather all_gather_done all_gather_invariant all_gather_reduced
    all_gather_reduced_start all_gather_start all_to_all all_to_all_done all_to_all_start
    axis_index pbroadcast pbroadcast_done pbroadcast_start ppermute ppermute_done
    ppermute_start precv preduced psend psum_done psum_invariant psum_invariant_start
    psum_start pvary ragged_all_to_all reduce_scatter reduce_scatter_done
    reduce_scatter_start reduced_vary_cast reduced_vary_cast_p unreduced_pmax unreduced_pmin
    unreduced_psum unreduced_psum_start unreduced_reduce_scatter
    unreduced_reduce_scatter_start vary_unreduced_cast vary_unreduced_cast_p
    pbroadcast_dynamic
""".split()
# Ordering tokens: no array data to shard.
TOKENS = ["after_all", "create_token"]
# Mutable refs (`jax.new_ref`, `run_state`): discharged into plain values before a
# program is lowered; planning them would need an alias analysis jaxshard does not do.
REFS = """
    accum_grad_in_ref addupdate broadcast_to create_linear empty_ref free_ref freeze get
    new_ref pin run_state swap unpin
""".split()
# Experimental high-level types (hijax boxes and logs) and high-level primitives (JAX
# 0.12's `jnp.searchsorted`): tracing expands them into the primitives they lower to
# (`jaxshard.jax_compat.low_level`), as `jit` does before lowering.
HIJAX = """
    box_get box_set call_hi_primitive call_hi_primitive_linearized log_extend log_read
    new_box new_log stage
""".split()
# JAX's own transformation plumbing: appear mid-transformation, not in a jaxpr that
# `make_jaxpr` of a train step returns.
INTERNAL = """
    call custom_jvp_call_jaxpr custom_lin dce_sink empty empty2 eval_jaxpr from_edtype tie
    to_edtype unreachable zeros_like
""".split()
# Shape polymorphism and `jax.export`: symbolic dims, not arrays to shard.
EXPORT = ["call_exported", "dim_as_value", "dimension_size", "shape_assertion"]
# Foreign or opaque code jaxshard cannot see into: the unknown-primitive boundary (a
# warning naming what stays unsharded) is the honest treatment; `jaxshard.with_rule`
# gives such a call a rule.
OPAQUE = """
    buffer_callback check compute_on core_map cudnn_fusion ffi_call
    inspect_sharding io_callback pallas_call pure_callback shard_alike tpu_custom_call
    xla_metadata_value
""".split()
# Pallas's memory-space hint (`with_memory_space_constraint`, on kernel operands) and the
# relayout of JAX 0.12's private `explicit_layout` (Pallas layout modes): kernel plumbing
# with no public entry point outside a kernel.
KERNEL_PLUMBING = ["relayout", "with_memory_space_constraint"]
# Not covered yet (they do occur in user programs; the unknown-primitive warning fires):
# cuDNN's fp8 attention and scaled matmul (GPU-only, with amax and scale operands) need
# rules validated on a GPU.
NOT_YET = """
    dot_product_attention_fp8_bwd dot_product_attention_fp8_bwd_wrapper
    dot_product_attention_fp8_fwd dot_product_attention_fp8_fwd_wrapper scaled_matmul
    scaled_matmul_wrapper
""".split()
EXCLUDED = {
    name: group
    for group, names in [
        ("shard_map only", SHARD_MAP_ONLY),
        ("token", TOKENS),
        ("mutable ref", REFS),
        ("hijax", HIJAX),
        ("transformation internal", INTERNAL),
        ("export", EXPORT),
        ("opaque", OPAQUE),
        ("kernel plumbing", KERNEL_PLUMBING),
        ("not yet", NOT_YET),
    ]
    for name in names
}
# Pallas's kernel language (loads, DMAs, barriers, MMAs) and the thunk language of JAX
# 0.12's GPU kernel runtime (`jax._src.thunky`: thunks, async collectives, PTX kernels):
# only inside a kernel body, which is opaque (`pallas_call` above).
KERNEL_MODULES = ("jax._src.pallas.", "jax._src.thunky.")

REGISTERED = registered_primitives()


def test_every_registered_primitive_is_covered_or_excluded():
    covered = set(covered_primitives())
    missing = sorted(
        name
        for name, modules in REGISTERED.items()
        if name not in covered
        and name not in EXCLUDED
        and not all(m.startswith(KERNEL_MODULES) for m in modules)
    )
    assert not missing, (
        f"JAX registers primitives with no sharding rule and no exclusion: {missing} "
        f"(defined in {[REGISTERED[n] for n in missing]}); add a rule in rules/ or a "
        "justified entry in tests/test_catalogue_complete.py"
    )


# Excluded names that only some supported JAX releases register, or that name another
# primitive in another release (0.12 calls `closed_call` "eval_jaxpr"); CI runs the
# oldest and the newest release, and neither alone can call these stale.
SOME_RELEASES = """
    box_get box_set call core_map eval_jaxpr log_extend log_read new_box new_log
    pbroadcast_done pbroadcast_dynamic pbroadcast_start psum_start reduced_vary_cast
    reduced_vary_cast_p relayout shard_alike unreduced_pmax unreduced_pmin
    unreduced_psum_start unreduced_reduce_scatter_start vary_unreduced_cast
    vary_unreduced_cast_p with_memory_space_constraint
""".split()


def test_exclusions_are_current():
    covered = set(covered_primitives())
    stale = sorted(
        n for n in EXCLUDED if (n in covered or n not in REGISTERED) and n not in SOME_RELEASES
    )
    assert not stale, f"excluded primitives that now have a rule or no longer exist: {stale}"


def test_walk_finds_the_catalogue():
    """The walk itself works: it sees the primitives the catalogue is built on."""
    assert {"dot_general", "stack", "cholesky", "fft", "scatter-sub"} <= set(REGISTERED)


def test_a_primitive_is_registered_once():
    # a second function for a primitive would silently decide which one the engine
    # reads: the registry refuses it, naming both; the same function again is allowed
    import pytest
    from jax.extend.core import primitives as p

    from jaxshard.errors import JaxshardBug
    from jaxshard.rule import region_fn_for, register_region, register_rule, rule_fn_for

    held = rule_fn_for(p.neg_p)

    def neg_again(eqn):
        return None

    with pytest.raises(JaxshardBug, match=r"'neg' already has the rule .*elementwise.*"):
        register_rule(p.neg_p)(neg_again)
    with pytest.raises(JaxshardBug, match=r"neg_again cannot be registered as its region"):
        register_region(p.neg_p)(neg_again)
    assert register_rule(p.neg_p)(held) is held
    assert rule_fn_for(p.neg_p) is held and region_fn_for(p.neg_p) is None
