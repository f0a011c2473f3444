"""Hand-written expert layouts: functions from a params pytree to a pytree of PartitionSpec.

These are what a practitioner writes by hand today (MaxText-style rules), the baselines
jaxshard's plans are compared with. Each function takes the params pytree (arrays or
`jax.ShapeDtypeStruct`s) and the mesh's axis sizes, and returns PartitionSpecs shaped like
the params. The batch is data parallel in every layout; the AdamW state follows its
parameter (`opt_state_specs`).

- ``megatron``: Megatron-LM tensor parallelism on "model" — attention and MLP input
  projections column parallel, output projections row parallel, vocabulary-parallel
  embedding and head; for the conv net, the first conv of each block column parallel
  (output channels) and the second row parallel (input channels). Without a "model"
  axis (the 8 (data) mesh) every weight is replicated: plain data parallelism.
- ``fsdp(megatron)``: Megatron plus ZeRO-3/FSDP: every weight of rank >= 2 is also split
  on "data" along its largest dim that is still unsharded and divisible (never the
  stacked layer dim of a scanned model).
- ``zero3``: ZeRO-3 over the given axes (all of them: the whole mesh): every leaf of
  rank >= 1 split on its largest dim the axes' product divides (never a scanned layer
  dim), the batch over the same axes; nothing tensor parallel.
- ``expert_parallel``: for the MoE, the experts dim of the expert weights on "model"
  (on "data" when the mesh has no "model" axis, GShard-style), the rest replicated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import PartitionSpec as P

from jaxshard.plan import mesh_axis_sizes
from jaxshard.trace import arg_names

if TYPE_CHECKING:
    from benchmarks.workloads import Workload

BATCH = {r"batch/.*": P("data")}

Specs = Any  # a pytree of PartitionSpec shaped like the params
Layout = Callable[[Any, Mapping[str, int]], Specs]


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def by_rules(params: Any, rules: list[tuple[str, P]]) -> Specs:
    """Specs from ``(regex, spec)`` rules fully matched against each leaf's key path
    (``layers/0/attn/wq``); the first matching rule wins, no match means replicated.

    Example:
        >>> by_rules({"w": jax.ShapeDtypeStruct((4, 8), "float32")}, [("w", P(None, "model"))])
        {'w': P(None, 'model')}
    """

    def spec(path, leaf):
        name = _path(path)
        for pattern, s in rules:
            if re.fullmatch(pattern, name):
                return s
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


# --- Megatron tensor parallel + data parallel -----------------------------------------

_COL, _ROW = P(None, "model"), P("model", None)
_STACKED_COL, _STACKED_ROW = P(None, None, "model"), P(None, "model", None)

MEGATRON_RULES: dict[str, list[tuple[str, P]]] = {
    "gpt": [
        (r"wte", _ROW),  # vocab-parallel embedding
        (r"head", _COL),  # vocab-parallel logits
        (r"layers/\d+/attn/w[qkv]", _COL),
        (r"layers/\d+/attn/wo", _ROW),
        (r"layers/\d+/mlp/w1", _COL),
        (r"layers/\d+/mlp/b1", P("model")),
        (r"layers/\d+/mlp/w2", _ROW),
    ],
    "llama": [
        (r"embed", _ROW),
        (r"head", _COL),
        (r"layers/(wq|wk|wv|w_gate|w_up)", _STACKED_COL),
        (r"layers/(wo|w_down)", _STACKED_ROW),
    ],
    "moe": [  # tensor parallel inside every expert (the F dim), not expert parallel
        (r"embed", _ROW),
        (r"head", _COL),
        (r"experts/w_in", _STACKED_COL),
        (r"experts/w_out", _STACKED_ROW),
    ],
    "conv": [
        (r"blocks/\d+/conv1", P(None, None, None, "model")),  # output channels
        (r"blocks/\d+/norm1/(scale|bias)", P("model")),
        (r"blocks/\d+/conv2", P(None, None, "model", None)),  # input channels
    ],
}

# Leading dims that are scanned over (never sharded by FSDP).
STACKED = {"llama": r"layers/.*"}


def megatron(model: str) -> Layout:
    """Megatron tensor parallel + data parallel for ``model`` ("gpt", "llama", "moe",
    "conv"); plain data parallel (all weights replicated) on a mesh without "model".

    Example:
        >>> params = {"head": jax.ShapeDtypeStruct((8, 16), "float32")}
        >>> megatron("gpt")(params, {"data": 2, "model": 4})
        {'head': P(None, 'model')}
        >>> megatron("gpt")(params, {"data": 8})
        {'head': P()}
    """

    def layout(params: Any, axis_sizes: Mapping[str, int]) -> Specs:
        if "model" not in axis_sizes:
            return jax.tree.map(lambda _: P(), params)
        return by_rules(params, MEGATRON_RULES[model])

    return layout


def expert_parallel(params: Any, axis_sizes: Mapping[str, int]) -> Specs:
    """The MoE's experts dim on "model" (on "data" without a "model" axis), rest replicated.

    Example:
        >>> w = {"experts": {"w_in": jax.ShapeDtypeStruct((8, 4, 16), "float32")}}
        >>> expert_parallel(w, {"data": 8})
        {'experts': {'w_in': P('data',)}}
    """
    axis = "model" if "model" in axis_sizes else "data"
    return by_rules(params, [(r"experts/w_(in|out)", P(axis))])


def fsdp(base: Layout, model: str) -> Layout:
    """``base`` plus FSDP: each weight of rank >= 2 also split on "data" along its largest
    dim that ``base`` left unsharded and "data" divides (never a scanned layer dim).

    Example:
        >>> params = {"head": jax.ShapeDtypeStruct((8, 16), "float32")}
        >>> fsdp(megatron("gpt"), "gpt")(params, {"data": 2, "model": 4})
        {'head': P('data', 'model')}
    """
    stacked = STACKED.get(model)

    def layout(params: Any, axis_sizes: Mapping[str, int]) -> Specs:
        n = axis_sizes["data"]
        base_specs = base(params, axis_sizes)

        def add(path, leaf, spec):
            shape = leaf.shape
            if len(shape) < 2:
                return spec
            entries = list(spec) + [None] * (len(shape) - len(spec))
            skip = {0} if stacked and re.fullmatch(stacked, _path(path)) else set()
            free = [
                d for d in range(len(shape))
                if d not in skip and entries[d] is None and shape[d] % n == 0
            ]  # fmt: skip
            if not free:
                return spec
            entries[max(free, key=lambda d: shape[d])] = "data"
            return P(*entries)

        return jax.tree_util.tree_map_with_path(add, params, base_specs)

    return layout


def zero3(model: str, axes: tuple[str, ...] | None = None) -> Layout:
    """ZeRO-3 over ``axes`` (default: every mesh axis, major to minor): each leaf split
    on its largest dim (never a scanned layer dim) that the axes' product divides; a leaf
    with no such dim stays replicated. Use with the batch on the same axes.

    Example:
        >>> params = {"head": jax.ShapeDtypeStruct((8, 16), "float32"),
        ...           "b": jax.ShapeDtypeStruct((3,), "float32")}
        >>> zero3("gpt")(params, {"data": 2, "model": 4})
        {'b': P(), 'head': P(None, ('data', 'model'))}
    """
    stacked = STACKED.get(model)

    def layout(params: Any, axis_sizes: Mapping[str, int]) -> Specs:
        over = tuple(axes or axis_sizes)
        n = 1
        for a in over:
            n *= axis_sizes[a]

        def spec(path, leaf):
            shape = leaf.shape
            skip = {0} if stacked and re.fullmatch(stacked, _path(path)) else set()
            free = [d for d in range(len(shape)) if d not in skip and shape[d] % n == 0]
            if not free:
                return P()
            entries: list[Any] = [None] * len(shape)
            entries[max(free, key=lambda d: shape[d])] = over if len(over) > 1 else over[0]
            return P(*entries)

        return jax.tree_util.tree_map_with_path(spec, params)

    return layout


def opt_state_specs(opt_state: Any, params: Any, param_specs: Specs) -> Specs:
    """Specs for an optax state: a leaf whose key path ends with a parameter's key path
    and has its shape (AdamW's ``mu``/``nu``) takes that parameter's spec; the rest
    (step counts) is replicated.

    Example:
        >>> import optax
        >>> params = {"w": jax.ShapeDtypeStruct((4, 8), "float32")}
        >>> state = jax.eval_shape(optax.adam(1e-3).init, params)
        >>> opt_state_specs(state, params, {"w": P(None, "model")})[0].mu
        {'w': P(None, 'model')}
    """
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_specs = jax.tree_util.tree_leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
    by_path = {
        tuple(_path(p).split("/")): (leaf.shape, s)
        for (p, leaf), s in zip(flat_params, flat_specs, strict=True)
    }

    def spec(path, leaf):
        parts = tuple(_path(path).split("/"))
        for i in range(len(parts)):
            hit = by_path.get(parts[i:])
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(spec, opt_state)


def reference_hints(w: Workload, layout: Layout, mesh) -> dict[str, P]:
    """Exact-path hints for every parameter in ``layout``, plus the batch."""
    params = w.args[0]
    specs = jax.tree.leaves(
        layout(params, mesh_axis_sizes(mesh)), is_leaf=lambda x: isinstance(x, P)
    )
    names = [n for n in arg_names(w.step, w.args, {})[0] if n.startswith("params/")]
    return {**BATCH, **{re.escape(n): s for n, s in zip(names, specs, strict=True)}}
