"""The search problem built from the traced graph: dim classes (the (value, dim) pairs
one rule factor ties together), argument groups (repeated layers share one decision),
the decisions and their candidates, and the joint terms whose costs the integer program
weighs (memory: `jaxshard.search.memory`). See the package docstring for the outline."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

from jax.sharding import PartitionSpec

from jaxshard.annotate import ExactPath
from jaxshard.cost import (
    Liveness,
    copies_transposed_operands,
    liveness,
    nbytes,
    recomputes_remat,
    step_bytes,
)
from jaxshard.graph import AppKind, view_dims
from jaxshard.lattice import Axes, spec_entry, to_spec
from jaxshard.plan import (
    dead_apps,
    mesh_axis_sizes,
)
from jaxshard.plan.pins import SEARCH_ORIGIN
from jaxshard.search.decisions import (  # noqa: F401 (MEMORY_TIEBREAK, US, Extra, Scope, followers, group_key re-exported)
    MEMORY_TIEBREAK,
    US,
    DimClasses,
    Extra,
    Scope,
    followers,
    group_key,
)
from jaxshard.search.memory import MemoryModel, fused_liveness
from jaxshard.search.refs import UNSPLIT, Fixed, Follow, Ref
from jaxshard.search.terms import Term, Terms, term_index


class Problem(DimClasses, Terms, MemoryModel):
    """The coarsened problem of one traced function: dim classes, groups, decisions and
    joint terms, and the integer program over them."""

    def __init__(self, traced, graph, mesh, hints, cost_model, memory_budget):
        self.traced, self.graph, self.mesh = traced, graph, mesh
        self.sizes = mesh_axis_sizes(mesh)
        self.cost_model, self.budget = cost_model, memory_budget
        self.dead = dead_apps(graph)
        # buffers as XLA's fusion leaves them: the budget is compared with what the
        # compiled program allocates
        live = liveness(graph, self.dead, remat_barriers=recomputes_remat(mesh))
        cpu = copies_transposed_operands(mesh)
        self.live: Liveness = fused_liveness(graph, live, matmul_epilogues=cpu)
        self.user_budget = memory_budget
        self._pins(hints)
        # whole choices the integer program may not take (`jaxshard.search._repriced`)
        self.excluded: list[dict[int, int]] = []
        # equations whose memory rows a solve needed: every later solve starts with them
        # (a row bounds the model's memory at one equation, true at any budget)
        self.memory_points: list[int] = []
        self._activation_rows: dict[int, tuple] = {}  # `activation_row`, per equation
        self._readers: dict[int, list[int]] = {}
        # a value -> the values that are it moved or converted (a transpose, a cast), each
        # with, per its dim, the value's dim: MaxText moves a stack's layer dim to the
        # front before its scan; the uses of such a view are the value's uses
        self._views: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        self._alias_memo: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # `_aliases`
        # a stacked argument -> the per-layer values scans slice it into (their uses are
        # its uses, once per iteration)
        self._layers: dict[int, list[int]] = {}
        for a, app in enumerate(graph.apps):
            if a in self.dead:
                continue
            if app.kind is AppKind.EQN:
                dims = view_dims(app)
                if dims is not None:
                    self._views.setdefault(app.operands[0], []).append((app.results[0], dims))
                    continue
                for u in app.operands:
                    self._readers.setdefault(u, []).append(a)
            elif app.kind is AppKind.LINK and len(app.operands) == 1:
                (o,), (r,) = app.operands, app.results
                if len(graph.shapes[o]) == len(graph.shapes[r]) + 1:
                    self._layers.setdefault(o, []).append(r)
        self._classes()
        self._groups()
        self._decide()
        self.value_refs = [self._refs(v) for v in range(len(graph.shapes))]
        self.terms: dict[tuple[int, ...], Term] = {}
        self.constant_time = self.constant_bytes = 0.0  # collectives no decision changes
        self._value_terms()
        self._app_terms()
        self._group_terms()
        self._stack_terms()
        self._moved_terms()
        self.static = self._static_memory()

    def _leaf_bytes(self, i: int) -> int:
        v = self.graph.in_vids[i]
        return nbytes(self.graph.shapes[v], self.graph.dtypes[v]) * (2 if i in self.tied else 1)

    def leaf_layout(self, i: int, choice: Mapping[int, int]) -> list[Axes] | None:
        """The stored layout of argument leaf ``i`` under a choice: its classes' axes, its
        group's extra axis, the user's pins; None if the extra axis clashes."""
        v = self.graph.in_vids[i]
        lay = self._once([self.axes(r, choice) for r in self.refs(v)], v)
        k = self.leaf_group.get(i)
        extra_dec = None if k is None else self.groups[k].extra
        if extra_dec is not None:
            extra = self.decisions[extra_dec].candidates[choice[extra_dec]]
            if extra is not None and (extra.scope is Scope.ALL or i in self.followers):
                d, axes = extra.dim, extra.axes
                if lay[d] or any(a in x for x in lay for a in axes):
                    return None
                lay[d] = axes
        pin = self.stored.get(v, self.owner_pin.get(i))
        if pin is not None:
            lay = [p if p is not None else x for p, x in zip(pin, lay)]
        return lay

    def _once(self, lay: list[Axes], v: int) -> list[Axes]:
        """A layout with every mesh axis on one dim only. Pins inside the program can
        give an argument's dims one axis twice (MaxText's activation constraints put
        "tensor" on both the embed and the MLP dims a weight joins); the dim of the
        smaller class keeps it (the weight's own dim, not the residual stream's, which
        spans every layer), as the search hints it."""
        used = [a for x in lay for a in x]
        if len(used) == len(set(used)):
            return lay
        members = self.__dict__.get("_members")
        if members is None:
            members = self.__dict__["_members"] = Counter(self.root)
        seen: set[str] = set()
        out = list(lay)
        for d in sorted(range(len(lay)), key=lambda d: members[self._key(v, d)]):
            out[d] = tuple(a for a in lay[d] if a not in seen)
            seen.update(lay[d])
        return out

    def gathered_bytes(self, i: int, choice: Mapping[int, int]) -> float:
        """Per-device bytes of parameter ``i`` gathered to its compute layout when the
        choice stores it apart (FSDP), else 0."""
        if not self.stored_apart(i, choice):
            return 0.0
        v = self.graph.in_vids[i]
        lay = self._once([self.axes(r, choice) for r in self.refs(v)], v)
        pin = self.pins.get(v)
        if pin is not None:
            lay = [p if p is not None else x for p, x in zip(pin, lay)]
        shards = math.prod(self.sizes[a] for x in lay for a in x)
        whole = nbytes(self.graph.shapes[v], self.graph.dtypes[v]) / shards
        k = self.leaf_group[i]
        extra = self.decisions[self.groups[k].extra].candidates[choice[self.groups[k].extra]]
        layer = self._stack_dim(v)
        if layer is not None and extra.dim != layer:  # one layer gathered at a time
            return whole / self.graph.shapes[v][0]
        return whole

    def stored_apart(self, i: int, choice: Mapping[int, int]) -> bool:
        """Whether argument leaf ``i`` is stored on an extra axis its computation does not
        use (a parameter under FSDP, gathered at its uses, and its optimizer state);
        optimizer state alone on an extra axis (ZeRO-1) is the update's layout."""
        k = self.leaf_group.get(i)
        dec = None if k is None else self.groups[k].extra
        if dec is None:
            return False
        extra = self.decisions[dec].candidates[choice[dec]]
        # under FSDP the optimizer state lives and is updated like its parameter
        return extra is not None and extra.scope is Scope.ALL

    def storage_axes(self, i: int, choice: Mapping[int, int]) -> tuple[Axes, ...] | None:
        """Per dim of argument leaf ``i``, the mesh axes the choice stores it on apart
        from its computation (gathered at its uses); None when it is not stored apart."""
        if not self.stored_apart(i, choice):
            return None
        dec = self.groups[self.leaf_group[i]].extra
        extra = self.decisions[dec].candidates[choice[dec]]
        dims = range(len(self.graph.shapes[self.graph.in_vids[i]]))
        return tuple(extra.axes if d == extra.dim else () for d in dims)

    def refs(self, v: int) -> tuple[Ref, ...]:
        """Per dim of value ``v``: its decision (an index) or the axes pins fix (`Fixed`)."""
        return self.value_refs[v]

    def _refs(self, v: int) -> tuple[Ref, ...]:
        return tuple(
            self.ref[self._key(v, d)] if s > 1 else UNSPLIT
            for d, s in enumerate(self.graph.shapes[v])
        )

    def axes(self, ref: Ref, choice: Mapping[int, int]) -> Axes:
        """The axes of a class reference under a choice of candidate per decision."""
        if type(ref) is Fixed:
            return ref.axes
        if type(ref) is Follow:
            if ref.dec not in choice:  # the memory model prices it unsplit
                return ()
            axes = self.decisions[ref.dec].candidates[choice[ref.dec]]
            return axes if ref.size % math.prod(self.sizes[a] for a in axes) == 0 else ()
        return self.decisions[ref].candidates[choice[ref]]

    def baseline(self) -> dict[int, int]:
        return {d: 0 for d in range(len(self.decisions))}

    def comm(self, choice) -> tuple[float, float]:
        """Estimated (µs, bytes) of communication per step under a choice."""
        t, b = self.constant_time, self.constant_bytes
        for term in self.terms.values():
            n = term_index(term, choice)
            t += term.time[n]
            b += term.bytes[n]
        return t, b

    def hints_for(self, choice) -> dict[str, PartitionSpec]:
        """Exact-path hints for every grouped argument leaf: `layouts_for` as a hints
        dict, which a user can read, save or pass to `auto_shard` again."""
        return {
            ExactPath(self.traced.in_names[i], SEARCH_ORIGIN): spec
            for i, spec in self.layouts_for(choice).items()
        }

    def layouts_for(self, choice) -> dict[int, PartitionSpec]:
        """Per grouped argument leaf (its index among the arguments), the full spec the
        choice gives it: what the search hands to propagation (`plan_from_graph`'s
        ``chosen``)."""
        out = {}
        for i in sorted(self.leaf_group):
            lay = self.leaf_layout(i, choice) or []
            # a full spec: a shorter one would leave its trailing dims to propagation
            entries: list = list(map(spec_entry, lay))
            refs = self.refs(self.graph.in_vids[i])
            used = [a for x in lay for a in x]
            if len(used) != len(set(used)):
                # the leaf's own pin gives an axis a dim fixed by pins elsewhere also has
                # (`_once` settles the dims pins elsewhere fix alone): those dims are left
                # to propagation, whose conflict policy decides them
                for d, r in enumerate(refs):
                    if type(r) is Fixed and lay[d]:
                        entries[d] = PartitionSpec.UNCONSTRAINED
            out[i] = PartitionSpec(*entries)
        return out

    def explain(self, choice, plan, memory, optimal, status, seconds) -> str:
        est_time, est_bytes = self.comm(choice)
        base_time, base_bytes = self.comm(self.baseline())
        g = self.graph
        what = "communication + compute" if self.cost_model.flops else "communication"
        lines = [
            f"search: {len(self.groups)} argument groups, {len(self.decisions)} decisions, "
            f"{len(self.terms)} joint terms over {len(g.apps)} equations; "
            + ("optimal" if optimal else "NOT proven optimal")
            + f" ({status}); {seconds:.1f} s",
            f"estimated {what} per step: {est_time / 1e3:.3f} ms, collectives "
            f"{est_bytes / 2**20:.2f} MiB per device (everything replicated: "
            f"{base_time / 1e3:.3f} ms, {base_bytes / 2**20:.2f} MiB)",
            f"after propagation: {step_bytes(plan) / 2**20:.2f} MiB of collectives per "
            f"device; memory {memory.total / 2**20:.2f} MiB per device (arguments "
            f"{memory.arguments / 2**20:.2f}, results {memory.results / 2**20:.2f}, peak "
            f"activations {memory.activations / 2**20:.2f})"
            + (f", budget {self.user_budget / 2**20:.2f} MiB" if self.user_budget else ""),
            "",
            f"{'group (layers share one row)':<40} {'leaves':>6} {'spec':<22} "
            f"{'optimizer state':<22} per device",
        ]
        for grp in self.groups:
            leaves = (*grp.owners, *grp.followers)
            layouts = [self.leaf_layout(j, choice) or [] for j in leaves]
            dev = sum(
                self._leaf_bytes(j) / math.prod(self.sizes[a] for x in lay for a in x)
                for j, lay in zip(leaves, layouts)
            )
            state = str(to_spec(layouts[len(grp.owners)])) if grp.followers else "-"
            lines.append(
                f"{grp.key:<40} {len(leaves):>6} {str(to_spec(layouts[0])):<22} {state:<22} "
                f"{dev / 2**20:.2f} MiB"
            )
        lines.append("(per device: the group's arguments, their results and optimizer state)")
        return "\n".join(lines)
