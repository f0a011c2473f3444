"""The public entry point: `auto_shard`, a `jax.jit`-like wrapper that plans, then runs.

A wrapped function plans once per call signature, keyed like `jax.jit`'s cache: the
tree structure of the arguments, their shapes, dtypes and weak types, and the values of
the static arguments (the mesh is fixed per wrapper). It caches the plan and its compiled
program, so a second call traces nothing and plans nothing; on every call it places the
arguments in their planned layout, runs the program, and returns the results in their
planned layout (on the caller's mesh, Explicit axes included).

Static arguments (``static_argnums``/``static_argnames``) are closed over, not traced;
the other arguments keep their names from the signature. Donation
(``donate_argnums``/``donate_argnames``, or ``donate_state=True`` for every argument whose
new value the function returns) is off by default, as in `jax.jit`. Flax sharding
metadata on boxed arguments is read as hints (`jaxshard.flax_meta`), logical names go
through ``logical_axis_rules``, and `AutoShard.init_sharded` creates parameters and
optimizer state directly in their planned layout.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxshard.annotate import ExactPath, pin_from_spec
from jaxshard.errors import ShardingError
from jaxshard.filtering import Partitioned, partition, partition_outputs
from jaxshard.flax_meta import (
    check_rules,
    leaf_specs,
    quiet_linen_boxes,
    resolve_hint_specs,
    restore_linen_boxes,
)
from jaxshard.graph import updates
from jaxshard.lower import Lowered
from jaxshard.options import Options, fsdp_axes_on
from jaxshard.pipeline import intercepting, replica_axes
from jaxshard.plan import Plan, auto_view, make_plan, mesh_axis_sizes
from jaxshard.search import SearchResult, search_hints
from jaxshard.trace import abstractify, arg_names

# Metadata hints are exact paths with a regex comment, so explanations and errors say


class _Entry:
    """One cached call signature: its plan's program, run with the donated leaves."""

    def __init__(self, lowered: Lowered, donated: Sequence[int]):
        self.lowered, self.donated = lowered, tuple(sorted(donated))
        self.jitted = lowered.jitted
        self.out_static: Partitioned | None = None  # static results, with static_leaves
        if self.donated:
            self.jitted = jax.jit(
                lowered.jitted,
                in_shardings=lowered.in_shardings,
                out_shardings=lowered.out_shardings,
                donate_argnums=self.donated,
            )

    def __call__(self, flat: Sequence[Any]) -> Any:
        with jax.set_mesh(self.lowered.mesh):
            return self.jitted(*flat)

    def lower(self, flat: Sequence[Any]) -> jax.stages.Lowered:
        with jax.set_mesh(self.lowered.mesh):
            return self.jitted.lower(*flat)


class AutoShard:
    """A function planned and run sharded by jaxshard; made by `auto_shard`.

    Attributes: ``plans_made`` counts plans (one per new call signature), ``mesh``,
    ``hints``, ``logical_axis_rules``.
    """

    def __init__(
        self,
        fn: Callable,
        mesh: Mesh,
        hints: Mapping[str, PartitionSpec] | None = None,
        options: Options | None = None,
        **kwargs: Any,
    ):
        # the keyword options of `auto_shard`, given one by one or as checked `Options`
        if options is None:
            options = Options.of("AutoShard", kwargs)
        elif kwargs:
            raise TypeError(f"AutoShard: give options= or keywords, not both ({sorted(kwargs)})")
        if not isinstance(mesh, (Mesh, AbstractMesh)):
            raise ShardingError(
                f"auto_shard needs a jax.sharding.Mesh (or an AbstractMesh, to plan only), "
                f"got {type(mesh).__name__}"
            )
        if hints is not None and not isinstance(hints, Mapping):
            raise ShardingError(
                "hints must map path regexes to PartitionSpecs, e.g. {r'batch/.*': P('data')}; "
                f"got a {type(hints).__name__}: {hints!r}"
            )
        self.fn, self.mesh, self.hints = fn, mesh, dict(hints or {})
        self.logical_axis_rules = check_rules(options.logical_axis_rules)
        self.flax_metadata, self.donate_state = options.flax_metadata, options.donate_state
        self.saved_plan = options.plan
        self.search, self.memory_budget = options.search, options.memory_budget
        self.cost_model, self.search_time_limit = options.cost_model, options.search_time_limit
        self.calibrate_memory = options.calibrate_memory
        self._latest: Plan | None = None  # the plan made last, for `search_result`
        self.static_leaves = options.static_leaves
        self.pipeline = options.pipeline
        if self.pipeline is not None:
            self.pipeline.check_mesh(mesh.axis_names)
        self.fsdp_axes = fsdp_axes_on(options, mesh_axis_sizes(mesh))
        try:
            self._signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self._signature = None
        self._static_nums, self._static_names = _argnums_and_names(
            self._signature, options.static_argnums, options.static_argnames, "static", fn
        )
        self._donate_nums, self._donate_names = _argnums_and_names(
            self._signature, options.donate_argnums, options.donate_argnames, "donate", fn
        )
        both = (self._static_nums & self._donate_nums) | (self._static_names & self._donate_names)
        if both:
            raise ShardingError(
                f"argument {sorted(both, key=str)[0]!r} is both static and donated; a static "
                "argument is not an array and cannot be donated"
            )
        self._cache: dict[Any, _Entry] = {}
        self.plans_made = 0
        functools.update_wrapper(self, fn)

    # --- call signatures --------------------------------------------------------------

    def _split(self, args: tuple, kwargs: dict):
        """The dynamic arguments, the static ones (hashable) and the dynamic positions."""
        static_pos = tuple((i, a) for i, a in enumerate(args) if i in self._static_nums)
        static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_names))
        positions = tuple(i for i in range(len(args)) if i not in self._static_nums)
        dyn_args = tuple(args[i] for i in positions)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_names}
        static = (static_pos, static_kw)
        try:
            hash(static)
        except TypeError:
            bad = next(
                name
                for name, v in [*((f"argument {i}", v) for i, v in static_pos), *static_kw]
                if not _hashable(v)
            )
            raise ShardingError(
                f"static {bad} of {_fn_name(self.fn)} is not hashable; static values key the "
                "plan cache like jax.jit's. Make it hashable (a tuple, a frozen dataclass), or "
                "pass it as a traced argument."
            ) from None
        return dyn_args, dyn_kwargs, static, positions

    def _entry(self, args: tuple, kwargs: dict) -> tuple[_Entry, list[Any], tuple, dict]:
        dyn_args, dyn_kwargs, static, positions = self._split(args, kwargs)
        leaf_static = None
        if self.static_leaves:
            (dyn_args, dyn_kwargs), leaf_static = partition((dyn_args, dyn_kwargs))
        leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        try:
            # every call pays this per leaf (a train state has hundreds): one comprehension
            # of attribute reads when all leaves are arrays, the same key the loop makes
            signature = tuple([(x.shape, x.dtype, x.weak_type) for x in leaves])
        except AttributeError:  # a NumPy value, a Python scalar, a typed key
            signature = self._leaf_signature(leaves, static, dyn_args, dyn_kwargs)
        key = (tree, signature, static, leaf_static and _static_key(leaf_static, self.fn))
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(dyn_args, dyn_kwargs, static, positions, leaf_static)
            self._cache[key] = entry
        return entry, leaves, dyn_args, dyn_kwargs

    def _leaf_signature(self, leaves: list, static: tuple, dyn_args: tuple, dyn_kwargs: dict):
        """Shape, dtype and weak type of each leaf; a leaf that is not an array is an error
        naming its path."""
        signature = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, jax.Array):  # read without a new object
                signature.append((leaf.shape, leaf.dtype, bool(getattr(leaf, "weak_type", False))))
                continue
            try:
                a = abstractify(leaf, "")
            except ShardingError:
                names = arg_names(self._bind_static(static), dyn_args, dyn_kwargs)[0]
                abstractify(leaf, names[i])  # raises with the leaf's path
            signature.append((a.shape, a.dtype, a.weak_type))
        return tuple(signature)

    def _bind_static(
        self,
        static: tuple,
        leaf_static: Partitioned | None = None,
        sink: dict | None = None,
    ) -> Callable:
        """``fn`` with the static arguments closed over and the Linen boxes quieted; its
        signature lists the dynamic parameters only, so leaves keep their names. With
        ``leaf_static`` the non-array leaves are put back before ``fn`` runs and its
        non-array results are left out, kept in ``sink["out"]``."""
        fn, (static_pos, static_kw) = self.fn, static
        static_kwargs = dict(static_kw)

        def traced_fn(*dyn_args, **dyn_kwargs):
            if leaf_static is not None:
                dyn_args, dyn_kwargs = leaf_static.combine((dyn_args, dyn_kwargs))
            dyn_args, dyn_kwargs = quiet_linen_boxes((dyn_args, dyn_kwargs))
            full = list(dyn_args)
            for i, value in static_pos:
                full.insert(i, value)
            out = restore_linen_boxes(fn(*full, **dyn_kwargs, **static_kwargs))
            if leaf_static is not None:
                out, out_static = partition_outputs(out)
                if sink is not None:
                    sink["out"] = out_static
            return out

        traced_fn.__name__ = getattr(fn, "__name__", "fn")
        traced_fn.__wrapped__ = fn  # type: ignore[attr-defined]  # JAX's errors name fn's line
        if self._signature is not None:
            drop = {_param_name(self._signature, i) for i, _ in static_pos} | set(static_kwargs)
            params = [p for p in self._signature.parameters.values() if p.name not in drop]
            traced_fn.__signature__ = self._signature.replace(parameters=params)  # type: ignore[attr-defined]
        return traced_fn

    def _build(
        self,
        dyn_args: tuple,
        dyn_kwargs: dict,
        static: tuple,
        positions,
        leaf_static: Partitioned | None = None,
    ) -> _Entry:
        sink: dict = {}
        fn = self._bind_static(static, leaf_static, sink)
        hints = resolve_hint_specs(self.hints, self.mesh, self.logical_axis_rules)
        if self.flax_metadata:
            for key, spec in self._metadata_hints(fn, dyn_args, dyn_kwargs).items():
                hints[key] = spec
        saved = self.saved_plan.record.get("pipeline", []) if self.saved_plan else []
        replicas = tuple(dict.fromkeys(a for loop in saved for a in loop.get("replicas", ())))
        with intercepting(self.pipeline, self.mesh, replicas) as seen:
            plan = self._plan(fn, dyn_args, dyn_kwargs, hints)
        if seen is not None:
            seen.check()
            plan._attach(pipelined=tuple(dict.fromkeys(seen.loops)))
            if self.saved_plan is None:
                plan = self._replicated_pipeline(plan, fn, dyn_args, dyn_kwargs, hints)
        if self.saved_plan is not None and saved != [loop.to_json() for loop in plan.pipelined]:
            raise ShardingError(
                f"the saved plan's pipeline {saved} is not this step's "
                f"{[loop.to_json() for loop in plan.pipelined]} (pipeline={self.pipeline!r}); "
                "give auto_shard the pipeline= the plan was made with, or plan again"
            )
        self.plans_made += 1
        self._latest = plan
        donated = set()
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))[0]]
        for k, path in enumerate(paths):
            group, index = path[0].idx, path[1]
            if group == 0 and positions[index.idx] in self._donate_nums:
                donated.add(k)
            elif group == 1 and index.key in self._donate_names:
                donated.add(k)
        if self.donate_state:  # only the state the step returns a new value of
            uses = plan.graph.uses()
            donated.update(i for i, o in plan.graph.ties if updates(plan.graph, i, o, uses))
        entry = _Entry(Lowered(plan), donated)
        entry.out_static = sink.get("out")
        return entry

    def _replicated_pipeline(self, plan: Plan, fn, dyn_args, dyn_kwargs, hints) -> Plan:
        """Plan the pipeline again with each microbatch split over the axes the first plan
        put on its rows (data parallelism inside the pipeline): the weight gradients are
        then summed over those axes once per step, not once per iteration. The plan that
        moves fewer bytes is kept."""
        axes = replica_axes(plan, self.pipeline)
        if not axes:
            return plan
        with intercepting(self.pipeline, self.mesh, axes) as seen:
            again = self._plan(fn, dyn_args, dyn_kwargs, hints)
        seen.check()
        again._attach(pipelined=tuple(dict.fromkeys(seen.loops)))
        return again if again.predicted_bytes <= plan.predicted_bytes else plan

    def _plan(self, fn: Callable, dyn_args: tuple, dyn_kwargs: dict, hints: dict) -> Plan:
        """The plan for one call signature: searched, re-made from a saved plan, or
        propagated from the hints."""
        if self.search and self.saved_plan is None:
            result = search_hints(
                fn,
                dyn_args,
                dyn_kwargs,
                self.mesh,
                hints,
                memory_budget=self.memory_budget,
                time_limit=self.search_time_limit,
                cost_model=self.cost_model,
                calibrate_memory=self.calibrate_memory,
            )
            return result.plan
        return make_plan(
            fn,
            dyn_args,
            dyn_kwargs,
            self.mesh,
            hints,
            self.saved_plan,
            self.cost_model,
            self.fsdp_axes,
        )

    def _metadata_hints(self, fn: Callable, dyn_args: tuple, dyn_kwargs: dict) -> dict:
        """Exact-path hints from the Flax metadata of boxed arguments, validated here so
        an error names the metadata."""
        tree = (dyn_args, dyn_kwargs)
        names = arg_names(fn, dyn_args, dyn_kwargs)[0]
        specs = leaf_specs(tree, self.mesh, self.logical_axis_rules, names)
        if not any(specs):
            return {}
        sizes = mesh_axis_sizes(self.mesh)
        hints = {}
        for name, leaf, spec in zip(names, jax.tree_util.tree_leaves(tree), specs):
            if spec is None:
                continue
            try:
                pin_from_spec(spec[0], abstractify(leaf, name).shape, sizes, name, spec[1])
            except ShardingError as e:
                raise ShardingError(
                    f"{e} The spec {spec[0]} comes from the Flax metadata: fix the metadata or "
                    "the logical_axis_rules, or pass flax_metadata=False and hint it yourself."
                ) from None
            hints[ExactPath(name, "Flax metadata")] = spec[0]
        return hints

    # --- the public surface -----------------------------------------------------------

    @property
    def search_result(self) -> SearchResult | None:
        """The search of the plan made last (None before it or without ``search=True``);
        each call signature's own is ``step.plan(*args).search_result``.

        Example:
            >>> print(step.search_result)  # doctest: +SKIP
        """
        return None if self._latest is None else self._latest.search_result

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for these arguments (arrays or `jax.ShapeDtypeStruct`s); cached, so
        planning from abstract shapes first and calling with arrays later plans once.

        Example:
            >>> plan = step.plan(params, opt_state, batch)  # doctest: +SKIP
            >>> print(plan.explain())  # doctest: +SKIP
        """
        return self._entry(args, kwargs)[0].lowered.plan

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """`jax.stages.Lowered` of the planned program; ``.compile().as_text()`` shows the
        collectives XLA inserted.

        Example:
            >>> hlo = step.lower(params, opt_state, batch).compile().as_text()  # doctest: +SKIP
        """
        self._needs_devices("lower")
        entry, flat, _, _ = self._entry(args, kwargs)
        abstract = [
            jax.ShapeDtypeStruct(
                np.shape(x), jax.typeof(x).dtype, sharding=s, weak_type=jax.typeof(x).weak_type
            )
            if not isinstance(x, jax.ShapeDtypeStruct)
            else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type)
            for x, s in zip(flat, entry.lowered.in_shardings)
        ]
        return entry.lower(abstract)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._needs_devices("run")
        entry, flat, _, _ = self._entry(args, kwargs)
        shardings = entry.lowered.in_shardings
        try:
            # a leaf the previous step returned carries the planned sharding object itself:
            # an identity test per leaf instead of a comparison
            placed = [x if x.sharding is s else _place(x, s) for x, s in zip(flat, shardings)]
        except AttributeError:  # a host value among the leaves
            placed = [_place(x, s) for x, s in zip(flat, shardings)]
        outs = entry(placed)
        out = jax.tree_util.tree_unflatten(
            entry.lowered.plan.traced.out_tree, self._to_caller_mesh(outs)
        )
        return out if entry.out_static is None else entry.out_static.combine(out)

    def _needs_devices(self, what: str) -> None:
        if isinstance(self.mesh, AbstractMesh):
            raise ShardingError(
                f"cannot {what} a step planned on an AbstractMesh {dict(self.mesh.shape)} (a "
                "device count, no devices): plan(...) and its explain() work; to "
                f"{what} it, plan on a jax.sharding.Mesh of real devices (e.g. "
                "auto_parallel(..., devices=jax.devices()))"
            )

    def _to_caller_mesh(self, arrays: Sequence[Any]) -> list[Any]:
        """Arrays on the plan's Auto view handed back on the caller's (Explicit) mesh."""
        if auto_view(self.mesh) is self.mesh:
            return list(arrays)
        return [jax.device_put(a, NamedSharding(self.mesh, a.sharding.spec)) for a in arrays]

    def init_sharded(
        self,
        init_fn: Callable,
        *init_args: Any,
        rest: tuple = (),
        rest_kwargs: Mapping[str, Any] | None = None,
        **init_kwargs: Any,
    ) -> tuple:
        """Create the step's leading arguments directly in their planned layout.

        ``init_fn(*init_args, **init_kwargs)`` returns a tuple: the step's first positional
        arguments (``(params, opt_state)``). They are planned from abstract shapes
        (`jax.eval_shape`) together with ``rest``/``rest_kwargs``, the step's remaining
        arguments (arrays or `jax.ShapeDtypeStruct`s), then created by
        ``jax.jit(init_fn, out_shardings=<planned>)``: every device computes only its own
        shards and no device ever holds a replicated copy. The plan is cached, so the
        first step call with the real arguments plans nothing. With ``static_leaves`` the
        non-array leaves ``init_fn`` returns (an Equinox module's activation) come back
        as made.

        Example:
            >>> def init(key):
            ...     params = model_init(key)
            ...     return params, optimizer.init(params)
            >>> params, opt_state = step.init_sharded(init, key, rest=(batch,))  # doctest: +SKIP
        """
        self._needs_devices("initialize arrays for")
        sink: dict = {}
        make = _arrays_only(init_fn, sink) if self.static_leaves else init_fn
        with jax.set_mesh(auto_view(self.mesh)):  # Flax's eager sharding wants a mesh
            shapes = jax.eval_shape(make, *init_args, **init_kwargs)
        if type(shapes) is not tuple:
            raise ShardingError(
                f"init_sharded: {_fn_name(init_fn)} returned a {type(shapes).__name__}; return a "
                "tuple of the step's first positional arguments, e.g. (params, opt_state), or "
                "(params,) for one"
            )
        static = [i for i in self._static_nums if i < len(shapes)]
        if static:
            raise ShardingError(
                f"init_sharded: argument {static[0]} is static, but {_fn_name(init_fn)} returns "
                f"the first {len(shapes)} arguments; initialize only dynamic leading arguments"
            )
        full = sink["out"].combine(shapes) if self.static_leaves else shapes
        entry, _, _, _ = self._entry((*full, *rest), dict(rest_kwargs or {}))
        count = len(jax.tree_util.tree_leaves(shapes))
        shardings = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(shapes), entry.lowered.in_shardings[:count]
        )
        with jax.set_mesh(entry.lowered.mesh):
            made = jax.jit(make, out_shardings=shardings)(*init_args, **init_kwargs)
        leaves, tree = jax.tree_util.tree_flatten(made)
        made = jax.tree_util.tree_unflatten(tree, self._to_caller_mesh(leaves))
        return sink["out"].combine(made) if self.static_leaves else made


def _arrays_only(fn: Callable, sink: dict) -> Callable:
    """``fn`` returning its array results only, its static results kept in ``sink``."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out, sink["out"] = partition_outputs(fn(*args, **kwargs))
        return out

    return wrapped


def _place(x: Any, sharding: NamedSharding) -> Any:
    """An argument in its planned sharding. A host value (NumPy, a Python scalar) is
    placed too, not handed to the program as is: its type then carries the plan's mesh,
    as the abstract arguments of `AutoShard.lower` do, so a call after ``lower`` runs
    the program that was compiled instead of tracing and compiling it again. In a
    multi-process job an argument that is not already a global array is taken as the
    whole global value (the same on every process) and each process places its own
    shards of it. An array already laid out as planned, in an equivalent sharding, is
    passed as it is."""
    if isinstance(x, jax.Array):
        # an equivalent layout is the planned one (on one device, the array's own
        # SingleDeviceSharding): a device_put per leaf per step would cost a copy
        if x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if sharding.is_fully_addressable or not x.is_fully_addressable:
            return jax.device_put(x, sharding)
    elif sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _static_key(leaf_static: Partitioned, fn: Callable) -> tuple:
    """The static leaves' cache key; a static leaf whose ``__eq__`` cannot answer (an
    array-like that is not an array) is an error naming it."""
    key = leaf_static.key()
    try:
        hash(key)
    except TypeError as e:
        raise ShardingError(
            f"a static leaf of {_fn_name(fn)} cannot be hashed ({e}); with static_leaves=True "
            "every non-array leaf keys the plan cache. Make it hashable or an array."
        ) from None
    return key


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _param_name(signature: inspect.Signature, i: int) -> str | None:
    params = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return params[i].name if i < len(params) else None


def _argnums_and_names(
    signature: inspect.Signature | None,
    argnums: int | Sequence[int],
    argnames: str | Sequence[str],
    what: str,
    fn: Callable,
) -> tuple[frozenset[int], frozenset[str]]:
    """Both forms of an argument selection, each inferred from the other like jax.jit."""
    nums = {argnums} if isinstance(argnums, int) else set(argnums)
    names = {argnames} if isinstance(argnames, str) else set(argnames)
    if any(not isinstance(i, int) or i < 0 for i in nums):
        raise ShardingError(
            f"{what}_argnums of {_fn_name(fn)} must be non-negative ints, got {sorted(nums)}"
        )
    if signature is None:
        return frozenset(nums), frozenset(names)
    params = signature.parameters
    for name in names:
        if name not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise ShardingError(
                f"{what}_argnames has {name!r}, which is not a parameter of {_fn_name(fn)} "
                f"(parameters: {', '.join(params)})"
            )
    positional = [
        p.name for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    names |= {positional[i] for i in nums if i < len(positional)}
    nums |= {positional.index(n) for n in names if n in positional}
    return frozenset(nums), frozenset(names)


def auto_shard(
    mesh: Mesh, hints: Mapping[str, PartitionSpec] | None = None, **options: Any
) -> Callable[[Callable], AutoShard]:
    """Decorate a function so jaxshard plans its sharding on ``mesh`` and runs it sharded.

    ``hints`` maps regexes, fully matched against argument and result key paths
    (``params/layers/0/attn/wq``, ``batch/tok``, ``out/2``), to partial PartitionSpecs:
    an entry naming axes pins that dim, ``None`` pins it replicated, ``P.UNCONSTRAINED``
    and dims past the spec's end are left to the planner.

    ``logical_axis_rules`` (MaxText-style, ordered ``(logical name, mesh axes)`` pairs;
    the first whose mesh axes exist and are free wins) translate logical names in hints
    and in Flax metadata. With ``flax_metadata`` (default on) the sharding metadata of
    boxed Flax arguments (NNX Variables, Linen ``Partitioned``) pins their leaves, partial
    where the metadata is: see `jaxshard.flax_meta`.

    ``static_argnums``/``static_argnames`` are closed over instead of traced and key the
    cache by value (they must be hashable); ``donate_argnums``/``donate_argnames`` donate
    those arguments' buffers, and ``donate_state=True`` donates every argument the
    function returns a new value of (params, optimizer state). Nothing is donated by
    default, as in `jax.jit`.

    ``plan`` reuses a plan saved with ``Plan.to_json`` (read back with
    ``jaxshard.Plan.from_json``): nothing is propagated, the same layouts on every host
    of a multi-host job; a plan made for other shapes, dtypes or mesh is an error listing
    the differences.

    ``search=True`` chooses the layouts of every argument the hints leave free by an
    integer program (`jaxshard.search.search_hints`): least estimated communication time
    per step under ``cost_model`` (a `jaxshard.CostModel`; per mesh axis bandwidth and
    latency), with per-device memory at most ``memory_budget`` bytes when given (a budget
    no layout meets is an error naming the smallest footprint). The budget is compared with
    jaxshard's estimate of memory, a few percent off XLA's either way; with
    ``calibrate_memory=True`` the search compiles its plan and searches again with the
    budget rescaled by the compiled program's memory over the estimate (up to four
    compiles while planning), so that the budget holds in the compiled program and is not
    wasted. The search stops after
    ``search_time_limit`` seconds with the best layout found and a warning; long searches
    print progress to stderr. Each plan's ``search_result`` explains its search (the
    wrapper's ``search_result`` is the latest plan's).
    Without search, ``cost_model`` still prices propagation's conflicts.

    ``fsdp_axes`` (a mesh axis name or a tuple of them) stores the step's state over
    those axes (FSDP, ZeRO-3): every floating parameter and optimizer-state leaf of at
    least 4 KiB is split over them between steps on its largest dim the plan leaves
    whole and no hint pins, gathered at its uses, its update computed on its shards;
    kept where the memory estimate falls (more collective bytes, much less memory). By
    default it is the mesh's axis named ``"fsdp"`` (MaxText's and Flax's name for the
    batch axis the parameters are stored over), when not searching; ``fsdp_axes=()``
    keeps the state where the computation uses it.

    ``static_leaves=True`` takes arguments the way ``eqx.filter_jit`` does: array leaves
    (`jax.Array`, NumPy arrays, `jax.ShapeDtypeStruct`) are planned and traced, named by
    their paths (``model/layers/0/weight``); every other leaf (activation functions, ints,
    callables inside an Equinox module) is static: hashed into the cache key (unhashable
    ones by identity, so mutating one in place is not seen), and non-array results are
    returned as they were made while tracing. Works on any pytree; see `jaxshard.filtering`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> @auto_shard(mesh, hints={"x": P("batch"), "w": P(None, "mlp")},
        ...             logical_axis_rules=[("batch", "data"), ("mlp", "model")])
        ... def f(x, w):
        ...     return jnp.tanh(x @ w)
        >>> f.plan(jnp.ones((8, 4)), jnp.ones((4, 16))).out_specs
        P('data', 'model')
    """
    checked = Options.of("auto_shard", options)  # a bad option fails here, before any fn

    def wrap(fn: Callable) -> AutoShard:
        return AutoShard(fn, mesh, hints, checked)

    return wrap


def _keyword_signature(fn: Callable, keep: int) -> inspect.Signature:
    """``fn``'s signature with its ``**options`` spelled out as `Options`' fields, for
    ``help()`` and editors."""
    sig = inspect.signature(fn)
    kept = list(sig.parameters.values())[:keep]
    spelled = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in fields(Options)
    ]
    return sig.replace(parameters=[*kept, *spelled])


auto_shard.__signature__ = _keyword_signature(auto_shard, 2)  # type: ignore[attr-defined]
