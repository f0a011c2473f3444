"""Random small JAX programs, meshes and partial hints for the property tests (test_fuzz.py).

A drawn `Case` is Python source: its ``repr`` is a self-contained reproducer (the
function, the argument shapes, the mesh and the hints), so a failure hypothesis reports
can be pasted into a file and run. Programs are built from primitives that have rules:
elementwise ops with broadcasting (size-1 dims, rank-0 arguments, Python scalars),
comparisons and selects, `dot_general` with random batch/contracting/free dims,
reductions (with and without keepdims), reshapes (merge, split, arbitrary
refactorization), transposes, slices, pads, reverses, window sums and maxima, 1-D
convolutions, concatenations, broadcasts, gathers (embedding
lookups, `take` along any axis, indices computed in the program), scans over a stacked
leading dim (elementwise and matmul bodies), collectives over `vmap`'s named axis, while
loops whose predicate reduces the carry, and `jaxshard.hint` on intermediates. Half
the programs also return a new value of their argument, as a train step returns new
parameters: the arguments are then the step's state, and a hint on them that uses a mesh
axis the other hints spend on the computation is a storage layout (FSDP).

Shapes stay small (dims 1..16, at most 4096 elements, rank at most 4) so compiles stay
cheap. Values that are bit-for-bit reproducible under any sharding ("exact": arguments,
integer and boolean math, data movement) are tracked so that float comparisons are only
taken of them: a comparison of a reordered float sum could flip and make an honest
plan look wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxshard

# Dims are drawn from this list; hypothesis shrinks towards its first entry.
SIZES = (4, 2, 8, 6, 3, 16, 12, 1)
MAX_ELEMS = 4096
MAX_RANK = 4

# (shape, axis names, number of devices used, axis types)
MESHES = {
    "x8": ((8,), ("x",), 8, "auto"),
    "data2_model4": ((2, 4), ("data", "model"), 8, "auto"),
    "a4_b2": ((4, 2), ("a", "b"), 8, "auto"),
    "x2_y2_z2": ((2, 2, 2), ("x", "y", "z"), 8, "auto"),
    "one1_eight8": ((1, 8), ("one", "eight"), 8, "auto"),
    "r2_c2_of4": ((2, 2), ("r", "c"), 4, "auto"),
    "data2_model4_explicit": ((2, 4), ("data", "model"), 8, "explicit"),
}
_MESH_CACHE: dict[str, Mesh] = {}


def get_mesh(key: str) -> Mesh:
    """The mesh named ``key`` in `MESHES` (built once)."""
    if key not in _MESH_CACHE:
        shape, names, n, types = MESHES[key]
        kind = AxisType.Auto if types == "auto" else AxisType.Explicit
        devices = np.array(jax.devices()[:n]).reshape(shape)
        _MESH_CACHE[key] = Mesh(devices, names, axis_types=(kind,) * len(names))
    return _MESH_CACHE[key]


def axis_sizes(key: str) -> dict[str, int]:
    shape, names, _, _ = MESHES[key]
    return dict(zip(names, shape))


@dataclass(frozen=True)
class Arg:
    """One argument leaf ``p[name]``; index arrays have values in ``[0, high)``."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32" | "int32" | "bool"
    high: int = 0


@dataclass
class Value:
    expr: str
    shape: tuple[int, ...]
    dtype: str
    exact: bool  # bit-for-bit the same under any sharding
    hinted: bool = False
    is_arg: bool = False


def spec_text(spec: P) -> str:
    """Source text of a PartitionSpec, e.g. ``P('data', P.UNCONSTRAINED, None)``."""
    entries = [("P.UNCONSTRAINED" if e is P.UNCONSTRAINED else repr(e)) for e in spec]
    return "P(" + ", ".join(entries) + ")"


@dataclass
class Case:
    """A drawn program with its mesh and hints; ``repr`` is a runnable reproducer."""

    mesh_key: str
    args: tuple[Arg, ...]
    body: tuple[str, ...]
    outs: tuple[str, ...]
    hints: dict[str, P] = field(default_factory=dict)
    n_ops: int = 0
    state: bool = False  # also return a new value of ``p``: its leaves are the step's state

    def source(self) -> str:
        lines = ["def f(p):", *("    " + line for line in self.body)]
        outs = ", ".join(self.outs)
        if self.state:  # like a train step's new parameters: the same tree as ``p``
            lines.append(
                "    new = {k: v * 2 if v.dtype == jnp.float32 else v for k, v in p.items()}"
            )
            outs += ", new"
        lines.append(f"    return ({outs},)")
        return "\n".join(lines)

    def fn(self):
        namespace = {"jax": jax, "jnp": jnp, "jaxshard": jaxshard, "P": P}
        exec(compile(self.source(), "<fuzz program>", "exec"), namespace)
        return namespace["f"]

    def abstract_args(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {a.name: jax.ShapeDtypeStruct(a.shape, jnp.dtype(a.dtype)) for a in self.args}

    def inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        out = {}
        for a in self.args:
            if a.high:
                out[a.name] = rng.integers(0, a.high, a.shape).astype(np.int32)
            elif a.dtype == "float32":
                out[a.name] = rng.standard_normal(a.shape).astype(np.float32)
            elif a.dtype == "int32":
                out[a.name] = rng.integers(-3, 4, a.shape).astype(np.int32)
            else:
                out[a.name] = rng.random(a.shape) < 0.5
        return out

    def mesh(self) -> Mesh:
        return get_mesh(self.mesh_key)

    def _repr_pretty_(self, printer, cycle) -> None:  # how hypothesis prints a failing case
        printer.text(repr(self))

    def __repr__(self) -> str:
        shape, names, n, types = MESHES[self.mesh_key]
        kind = "Auto" if types == "auto" else "Explicit"
        hints = ", ".join(f"{k!r}: {spec_text(v)}" for k, v in self.hints.items())
        args = ", ".join(
            f"{a.name!r}: jax.ShapeDtypeStruct({a.shape}, jnp.{a.dtype})"
            + (f"  # ints in [0, {a.high})" if a.high else "")
            for a in self.args
        )
        return (
            f"\n{self.source()}\n"
            f"args = {{{args}}}\n"
            f"mesh = Mesh(np.array(jax.devices()[:{n}]).reshape({shape}), {names}, "
            f"axis_types=(AxisType.{kind},) * {len(names)})\n"
            f"hints = {{{hints}}}\n"
            f"plan = jaxshard.make_plan(f, (args,), {{}}, mesh, hints)\n"
        )


def draw_spec(draw, shape: tuple[int, ...], sizes: dict[str, int]) -> P:
    """A valid partial spec for ``shape``: UNCONSTRAINED, None, one or two axes per entry,
    every axis used at most once and dividing its dim."""
    free = list(sizes)
    entries = []
    for d in range(draw(st.integers(0, len(shape)))):
        kind = draw(st.integers(0, 3))  # 0 unconstrained, 1 replicated, 2-3 that many axes
        if kind == 0:
            entries.append(P.UNCONSTRAINED)
            continue
        chosen: list[str] = []
        for _ in range(kind - 1):
            used = math.prod(sizes[a] for a in chosen)
            cand = [a for a in free if shape[d] % (used * sizes[a]) == 0]
            if not cand:
                break
            axis = draw(st.sampled_from(cand))
            chosen.append(axis)
            free.remove(axis)
        entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*entries)


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n) if n % d == 0]


class _Builder:
    """Grows a program one operation at a time over a pool of values."""

    def __init__(self, draw, sizes: dict[str, int], allow_hints: bool):
        self.draw, self.sizes, self.allow_hints = draw, sizes, allow_hints
        self.args: list[Arg] = []
        self.pool: list[Value] = []
        self.body: list[str] = []
        self.counter = 0

    # --- values ----------------------------------------------------------------------

    def shape(self, min_rank=0, max_rank=3) -> tuple[int, ...]:
        dims = self.draw(st.lists(st.sampled_from(SIZES), min_size=min_rank, max_size=max_rank))
        return tuple(dims)

    def new_arg(self, shape, dtype, high=0) -> Value:
        name = f"a{len(self.args)}"
        self.args.append(Arg(name, tuple(shape), dtype, high))
        v = Value(f"p[{name!r}]", tuple(shape), dtype, exact=True, is_arg=True)
        self.pool.append(v)
        return v

    def emit(self, expr, shape, dtype, exact=False, pre=(), check=True) -> Value | None:
        shape = tuple(int(s) for s in shape)
        if check and (math.prod(shape) > MAX_ELEMS or len(shape) > MAX_RANK):
            return None
        name = f"v{self.counter}"
        self.counter += 1
        self.body.extend(pre)
        self.body.append(f"{name} = {expr}")
        v = Value(name, shape, dtype, exact)
        self.pool.append(v)
        return v

    def pick(self, where=lambda v: True) -> Value | None:
        """A pool value, most recent first (hypothesis shrinks towards the latest)."""
        cands = [v for v in reversed(self.pool) if where(v)]
        if not cands:
            return None
        return cands[self.draw(st.integers(0, len(cands) - 1))]

    # --- operations (each returns the new value, or None when it does not apply) -----

    def unary(self):
        v = self.pick()
        if v.dtype == "bool":
            return self.emit(f"~{v.expr}", v.shape, "bool", v.exact)
        ops = ["-{}", "jnp.abs({})", "{0} * {0}"]
        if v.dtype == "float32":
            ops += ["jnp.tanh({})", "jnp.sin({})"]
        op = self.draw(st.sampled_from(ops))
        exact = v.exact and (v.dtype != "float32" or op in ("-{}", "jnp.abs({})"))
        return self.emit(op.format(v.expr), v.shape, v.dtype, exact)

    def partner(self, v: Value) -> Value | str:
        """A second operand broadcast-compatible with ``v``: a pool value of the same
        shape, a new argument with some dims 1 or dropped (or an extra leading dim, or
        a full size where ``v`` has 1), a rank-0 argument, or a Python scalar."""
        kind = self.draw(st.sampled_from(["broadcast", "same", "literal", "scalar_arg"]))
        if kind == "same":
            same = self.pick(lambda u: u.shape == v.shape and u.dtype == v.dtype)
            if same is not None:
                return same
            kind = "broadcast"
        if kind == "literal":
            return {"float32": "1.5", "int32": "2", "bool": "True"}[v.dtype]
        if kind == "scalar_arg":
            return self.new_arg((), v.dtype)
        shape = []
        for s in v.shape:
            choice = self.draw(st.integers(0, 2))  # 0 keep, 1 size 1, 2 grow a size-1 dim
            if s == 1 and choice == 2:
                shape.append(self.draw(st.sampled_from(SIZES[:-1])))
            else:
                shape.append(1 if choice == 1 else s)
        drop = self.draw(st.integers(0, len(shape)))
        shape = shape[drop:]
        if drop == 0 and len(v.shape) < MAX_RANK and self.draw(st.booleans()):
            shape = [self.draw(st.sampled_from(SIZES))] + shape
        return self.new_arg(tuple(shape), v.dtype)

    def binary(self):
        v = self.pick()
        other = self.partner(v)
        o_expr = other if isinstance(other, str) else other.expr
        o_shape = () if isinstance(other, str) else other.shape
        o_exact = True if isinstance(other, str) else other.exact
        if v.dtype == "bool":
            op = self.draw(st.sampled_from(["{} & {}", "{} | {}", "{} ^ {}"]))
        else:
            op = self.draw(
                st.sampled_from(
                    ["{} + {}", "{} - {}", "{} * {}", "jnp.maximum({}, {})", "jnp.minimum({}, {})"]
                )
            )
        a, b = (v.expr, o_expr) if self.draw(st.booleans()) else (o_expr, v.expr)
        shape = np.broadcast_shapes(v.shape, o_shape)
        exact = v.exact and o_exact and (v.dtype != "float32" or "jnp.m" in op)
        return self.emit(op.format(a, b), shape, v.dtype, exact)

    def compare(self):
        v = self.pick(lambda u: u.exact and u.dtype != "bool")
        if v is None:
            return None
        other = self.pick(lambda u: u.exact and u.dtype == v.dtype and u.shape == v.shape)
        rhs = other.expr if other is not None and self.draw(st.booleans()) else "0"
        op = self.draw(st.sampled_from([">", ">=", "<", "=="]))
        return self.emit(f"{v.expr} {op} {rhs}", v.shape, "bool", True)

    def where(self):
        c = self.pick(lambda u: u.dtype == "bool")
        if c is None:
            return None
        x = self.pick(lambda u: u.dtype != "bool" and u.shape == c.shape)
        if x is None:
            x = self.new_arg(c.shape, "float32")
        y = self.draw(st.sampled_from([f"{x.expr} * 0", f"-{x.expr}"]))
        # jax.lax.select, not jnp.where: jnp.where traced under the planning mesh can emit
        # a `reshard` equation, which has no rule yet (test_fuzz.py pins that bug)
        return self.emit(f"jax.lax.select({c.expr}, {x.expr}, {y})", c.shape, x.dtype, x.exact)

    def dot(self):
        v = self.pick(lambda u: u.dtype != "bool" and len(u.shape) >= 1)
        if v is None:
            return None
        roles = [self.draw(st.sampled_from(["free", "contract", "batch"])) for _ in v.shape]
        lb = [d for d, r in enumerate(roles) if r == "batch"]
        lc = [d for d, r in enumerate(roles) if r == "contract"]
        lf = [d for d, r in enumerate(roles) if r == "free"]
        if not lc and not lb and self.draw(st.booleans()):
            return None  # an outer product now and then, not always
        if self.draw(st.integers(0, 3)) == 0:  # the value against itself (a Gram matrix)
            rhs, rb, rc, rf = v, lb, lc, lf
        else:
            n_free = self.draw(st.integers(0, 2))
            dims = [("b", i) for i in range(len(lb))] + [("c", i) for i in range(len(lc))]
            dims += [("f", self.draw(st.sampled_from(SIZES))) for _ in range(n_free)]
            order = self.draw(st.permutations(range(len(dims))))
            dims = [dims[i] for i in order]
            shape, rb, rc, rf = [], [0] * len(lb), [0] * len(lc), []
            for pos, (kind, x) in enumerate(dims):
                if kind == "b":
                    rb[x] = pos
                    shape.append(v.shape[lb[x]])
                elif kind == "c":
                    rc[x] = pos
                    shape.append(v.shape[lc[x]])
                else:
                    rf.append(pos)
                    shape.append(x)
            if math.prod(shape) > MAX_ELEMS:
                return None
            rhs = self.new_arg(tuple(shape), v.dtype)
        out = [v.shape[d] for d in lb] + [v.shape[d] for d in lf] + [rhs.shape[d] for d in rf]
        t = lambda xs: "(" + "".join(f"{x}, " for x in xs) + ")"  # noqa: E731
        dn = f"(({t(lc)}, {t(rc)}), ({t(lb)}, {t(rb)}))"
        expr = f"jax.lax.dot_general({v.expr}, {rhs.expr}, {dn})"
        return self.emit(expr, out, v.dtype, v.dtype != "float32" and v.exact and rhs.exact)

    def reduce(self):
        v = self.pick(lambda u: len(u.shape) >= 1)
        if v is None:
            return None
        axes = self.draw(
            st.lists(st.integers(0, len(v.shape) - 1), min_size=1, max_size=len(v.shape))
        )
        axes = tuple(sorted(set(axes)))
        keep = self.draw(st.booleans())
        names = {"bool": ["any", "all"], "int32": ["sum", "max"], "float32": ["sum", "max", "min"]}
        op = self.draw(st.sampled_from(names[v.dtype]))
        shape = [1 if d in axes else s for d, s in enumerate(v.shape) if keep or d not in axes]
        exact = v.exact and (v.dtype != "float32" or op != "sum")
        expr = f"jnp.{op}({v.expr}, axis={axes}, keepdims={keep})"
        return self.emit(expr, shape, v.dtype, exact)

    def collective(self):
        """A collective over ``vmap``'s named axis: a reduction over the mapped dim."""
        v = self.pick(lambda u: u.dtype != "bool" and len(u.shape) >= 1)
        if v is None:
            return None
        axis = self.draw(st.integers(0, len(v.shape) - 1))
        op = self.draw(st.sampled_from(["psum", "pmax", "pmin"]))
        shape = [s for d, s in enumerate(v.shape) if d != axis]
        exact = v.exact and (v.dtype != "float32" or op != "psum")
        expr = (
            f"jax.vmap(lambda r: jax.lax.{op}(r, 'i'), in_axes={axis}, out_axes=None, "
            f"axis_name='i')({v.expr})"
        )
        return self.emit(expr, shape, v.dtype, exact)

    def loop(self):
        """A while loop whose predicate reduces the carry (all-reduced per iteration)."""
        v = self.pick(lambda u: u.dtype == "float32")
        if v is None:
            return None
        expr = (
            f"jax.lax.while_loop(lambda c: (c[0] < 3) & (jnp.max(jnp.abs(c[1])) > 0.5), "
            f"lambda c: (c[0] + 1, c[1] * 0.5), (0, {v.expr}))[1]"
        )
        return self.emit(expr, v.shape, v.dtype, v.exact)

    def reshape(self):
        v = self.pick(lambda u: math.prod(u.shape) > 1)
        if v is None:
            return None
        mode = self.draw(st.sampled_from(["merge", "split", "any"]))
        shape = list(v.shape)
        if mode == "merge" and len(shape) >= 2:
            i = self.draw(st.integers(0, len(shape) - 2))
            j = self.draw(st.integers(i + 1, len(shape) - 1))
            shape[i : j + 1] = [math.prod(shape[i : j + 1])]
        elif mode == "split" and any(_divisors(s) for s in shape):
            d = self.draw(st.sampled_from([d for d, s in enumerate(shape) if _divisors(s)]))
            a = self.draw(st.sampled_from(_divisors(shape[d])))
            shape[d : d + 1] = [a, shape[d] // a]
        else:  # any factorization of the element count, size-1 dims included
            left, shape = math.prod(v.shape), []
            while left > 1 and len(shape) < MAX_RANK - 1:
                choices = _divisors(left) + [left, 1]
                shape.append(self.draw(st.sampled_from(choices)))
                left //= shape[-1]
            if left > 1:
                shape.append(left)
        if tuple(shape) == v.shape or len(shape) > MAX_RANK:
            return None
        return self.emit(f"{v.expr}.reshape({tuple(shape)})", shape, v.dtype, v.exact)

    def transpose(self):
        v = self.pick(lambda u: len(u.shape) >= 2)
        if v is None:
            return None
        perm = tuple(self.draw(st.permutations(range(len(v.shape)))))
        if perm == tuple(range(len(v.shape))):
            return None
        shape = [v.shape[d] for d in perm]
        return self.emit(f"jnp.transpose({v.expr}, {perm})", shape, v.dtype, v.exact)

    def gather(self):
        v = self.pick(lambda u: len(u.shape) >= 1)
        if v is None:
            return None
        axis = self.draw(st.integers(0, len(v.shape) - 1)) if self.draw(st.booleans()) else 0
        n = v.shape[axis]
        source = self.pick(lambda u: u.dtype == "int32" and not u.is_arg and len(u.shape) <= 2)
        if source is not None and self.draw(st.booleans()):  # indices computed in the program
            ids_expr, ids_shape = f"jnp.abs({source.expr}) % {n}", source.shape
        else:
            ids_shape = self.shape(1, 2)
            ids_expr = self.new_arg(ids_shape, "int32", high=n).expr
        shape = v.shape[:axis] + ids_shape + v.shape[axis + 1 :]
        if axis == 0 and self.draw(st.booleans()):
            expr = f"{v.expr}[{ids_expr}]"  # an embedding lookup
        else:
            expr = f"jnp.take({v.expr}, {ids_expr}, axis={axis})"
        return self.emit(expr, shape, v.dtype, v.exact)

    def slice(self):
        v = self.pick(lambda u: any(s > 1 for s in u.shape))
        if v is None:
            return None
        axis = self.draw(st.sampled_from([d for d, s in enumerate(v.shape) if s > 1]))
        start = self.draw(st.integers(0, v.shape[axis] - 1))
        stop = self.draw(st.integers(start + 1, v.shape[axis]))
        if (start, stop) == (0, v.shape[axis]):
            return None
        shape = list(v.shape)
        shape[axis] = stop - start
        expr = f"jax.lax.slice_in_dim({v.expr}, {start}, {stop}, axis={axis})"
        return self.emit(expr, shape, v.dtype, v.exact)

    def window(self):
        """A windowed op along one dim (split, it exchanges halos): a pad (a shift when
        cropped, interior padding), a reverse, a window sum or max, a 1-D convolution or
        its kernel's gradient (a sum over the dim read through the window)."""
        v = self.pick(lambda u: u.dtype == "float32" and any(s > 1 for s in u.shape))
        if v is None:
            return None
        axis = self.draw(st.sampled_from([d for d, s in enumerate(v.shape) if s > 1]))
        n, shape = v.shape[axis], list(v.shape)
        kind = self.draw(st.sampled_from(["pad", "rev", "sum", "max", "conv", "kernel_grad"]))
        if kind == "rev":
            return self.emit(f"jnp.flip({v.expr}, {axis})", shape, v.dtype, v.exact)
        if kind == "pad":
            low, high = self.draw(st.integers(-1, 2)), self.draw(st.integers(-1, 2))
            interior = self.draw(st.integers(0, 1))
            shape[axis] = low + high + n + (n - 1) * interior
            if shape[axis] < 1:
                return None
            config = [(0, 0, 0)] * len(shape)
            config[axis] = (low, high, interior)
            return self.emit(f"jax.lax.pad({v.expr}, 0.0, {config})", shape, v.dtype, v.exact)
        extent, stride = self.draw(st.integers(1, 3)), self.draw(st.integers(1, 2))
        low, high = self.draw(st.integers(0, extent - 1)), self.draw(st.integers(0, extent - 1))
        out = (n + low + high - extent) // stride + 1
        if out < 1:
            return None
        if kind in ("conv", "kernel_grad"):  # the dim as a 1-D convolution's width
            if len(shape) > 3:
                return None
            rows = math.prod(shape) // n
            w = self.new_arg((extent, 1, 1), "float32")
            shape[axis] = out
            moved = f"jnp.moveaxis({v.expr}, {axis}, -1).reshape({rows}, {n}, 1)"
            conv = (
                f"jax.lax.conv_general_dilated({moved}, {{}}, ({stride},), (({low}, {high}),), "
                "dimension_numbers=('NWC', 'WIO', 'NWC'))"
            )
            if kind == "kernel_grad":  # the kernel's gradient: a windowed sum over the dim
                grad = f"jax.grad(lambda k: jnp.sum({conv.format('k')} ** 2))({w.expr})"
                return self.emit(grad, [extent, 1, 1], v.dtype)
            expr = (
                f"jnp.moveaxis({conv.format(w.expr)}"
                f".reshape({[*shape[:axis], *shape[axis + 1 :], out]}), -1, {axis})"
            )
            return self.emit(expr, shape, v.dtype)
        dims, strides, padding = [1] * len(shape), [1] * len(shape), [(0, 0)] * len(shape)
        dims[axis], strides[axis], padding[axis] = extent, stride, (low, high)
        shape[axis] = out
        op, init = ("jax.lax.add", "0.0") if kind == "sum" else ("jax.lax.max", "-jnp.inf")
        expr = (
            f"jax.lax.reduce_window({v.expr}, {init}, {op}, {tuple(dims)}, {tuple(strides)}, "
            f"{padding})"
        )
        return self.emit(expr, shape, v.dtype, v.exact and kind == "max")

    def concat(self):
        v = self.pick(lambda u: len(u.shape) >= 1)
        if v is None:
            return None
        axis = self.draw(st.integers(0, len(v.shape) - 1))
        other = self.pick(lambda u: u.shape == v.shape and u.dtype == v.dtype)
        shape = list(v.shape)
        shape[axis] *= 2
        expr = f"jnp.concatenate([{v.expr}, {other.expr}], axis={axis})"
        return self.emit(expr, shape, v.dtype, v.exact and other.exact)

    def broadcast(self):
        v = self.pick(lambda u: len(u.shape) < MAX_RANK)
        lead = self.draw(st.sampled_from(SIZES[:-1]))
        shape = (lead, *v.shape)
        return self.emit(f"jnp.broadcast_to({v.expr}, {shape})", shape, v.dtype, v.exact)

    def scan(self):
        v = self.pick(lambda u: u.dtype != "bool" and len(u.shape) >= 1)
        if v is None:
            return None
        name = f"body{self.counter}"
        if v.dtype == "float32" and self.draw(st.booleans()):
            # carry v (..., k) times a stacked (L, k, k) weight, like scanned layers
            k = v.shape[-1]
            length = self.draw(st.sampled_from(SIZES[:-1]))
            if length * k * k > MAX_ELEMS:
                return None
            xs = self.new_arg((length, k, k), "float32")
            pre = (
                f"def {name}(c, w):",
                f"    c = jnp.tanh(c @ w * {0.5 / k})",  # contracting: errors do not grow
                "    return c, jnp.sum(c, axis=-1)",
            )
            carry, ys = v, (length, *v.shape[:-1])
        else:
            if len(v.shape) >= 2 and self.draw(st.booleans()):  # v is the stacked xs
                xs, carry = v, self.new_arg(v.shape[1:], v.dtype)
            else:
                length = self.draw(st.sampled_from(SIZES[:-1]))
                carry, xs = v, self.new_arg((length, *v.shape), v.dtype)
            update = "jnp.tanh(c + x)" if v.dtype == "float32" else "c + x"
            pre = (f"def {name}(c, x):", f"    c = {update}", "    return c, c * x")
            ys = xs.shape
        if math.prod(ys) > MAX_ELEMS:
            return None
        out = f"v{self.counter}"
        self.counter += 1
        self.body.extend(pre)
        self.body.append(f"{out}, {out}_ys = jax.lax.scan({name}, {carry.expr}, {xs.expr})")
        self.pool.append(Value(f"{out}_ys", tuple(ys), v.dtype, exact=False))
        result = Value(out, carry.shape, v.dtype, exact=False)
        self.pool.append(result)
        return result

    def hint(self):
        v = self.pick(lambda u: not u.is_arg and not u.hinted)
        if v is None or not self.allow_hints:
            return None
        spec = draw_spec(self.draw, v.shape, self.sizes)
        self.body.append(f"{v.expr} = jaxshard.hint({v.expr}, {spec_text(spec)})")
        v.hinted = True
        return v


OPS = (
    "binary",
    "dot",
    "reduce",
    "reshape",
    "transpose",
    "gather",
    "scan",
    "unary",
    "compare",
    "where",
    "slice",
    "concat",
    "broadcast",
    "hint",
    "window",
    "collective",
    "loop",
)


@st.composite
def cases(draw, max_ops: int = 6, meshes: tuple[str, ...] = tuple(MESHES)) -> Case:
    """A random program, mesh and set of valid partial hints on arguments and results."""
    mesh_key = draw(st.sampled_from(meshes))
    sizes = axis_sizes(mesh_key)
    b = _Builder(draw, sizes, allow_hints=True)
    for _ in range(draw(st.integers(1, 2))):
        dtype = draw(st.sampled_from(["float32", "float32", "int32", "bool"]))
        b.new_arg(b.shape(0, 3), dtype)
    n_ops = draw(st.integers(1, max_ops))
    done = 0
    for _ in range(n_ops):
        op = draw(st.sampled_from(OPS))
        if getattr(b, op)() is not None:
            done += 1
    # results: the latest value plus up to two others, distinct and never an argument
    # (two hints on one array that disagree are a user error, not what we test here)
    emitted = [v for v in b.pool if not v.is_arg] or [
        b.emit(f"{b.pool[-1].expr} & True", b.pool[-1].shape, "bool", check=False)
        if b.pool[-1].dtype == "bool"
        else b.emit(f"{b.pool[-1].expr} * 1", b.pool[-1].shape, b.pool[-1].dtype, check=False)
    ]
    extra = draw(st.lists(st.sampled_from(emitted), max_size=2, unique_by=lambda v: v.expr))
    outs = [emitted[-1]] + [v for v in extra if v is not emitted[-1]]
    hints: dict[str, P] = {}
    for arg in b.args:
        if draw(st.integers(0, 2)):
            hints[f"p/{arg.name}"] = draw_spec(draw, arg.shape, sizes)
    for i, v in enumerate(outs):
        if not v.hinted and draw(st.integers(0, 3)) == 0:
            hints[f"out/{i}"] = draw_spec(draw, v.shape, sizes)
    state = draw(st.booleans())  # the arguments' hints may then be storage layouts (FSDP)
    outs_text = tuple(v.expr for v in outs)
    return Case(mesh_key, tuple(b.args), tuple(b.body), outs_text, hints, done, state)


# --- pipelined layer stacks -----------------------------------------------------------

# layer-body statements on the carry ``h`` (batch first, features last, ``d`` wide) and
# one layer's parameters ``w``: all keep each row to itself, several fix the batch size
# in their shapes (as model code does), which the pipeline must rewrite per microbatch
PIPE_OPS = (
    "h = jnp.tanh(h @ w['a'])",
    "h = h + jnp.sin(h) * w['b']",
    "h = h * jax.nn.sigmoid(h @ w['a'])",
    "h = h - h.mean(-1, keepdims=True)",
    "h = (h.reshape({shape_merged}) * 0.5).reshape({shape})",
    "h = jnp.concatenate([h[..., : {half}], -h[..., {half} :]], axis=-1)",
    "h = h + jnp.broadcast_to(w['b'], ({shape}))",
    "h = h * mask.reshape({mask_shape})",
)


# the loss after the layer stack: two sums over the rows (1F1B runs them per
# microbatch) and one that is not (1F1B falls back to GPipe)
PIPE_HEADS = (
    "jnp.mean(h ** 2)",
    "jnp.sum(jnp.tanh(h) * mask.reshape({mask_shape})) / {batch}",
    "jnp.sqrt(jnp.mean(h ** 2))",
)


@dataclass
class PipeCase:
    """A loss over a scanned layer stack, pipelined over ``stage`` of a (stage=2, data=2,
    model=2) mesh with ``microbatches``; ``repr`` is a runnable reproducer."""

    layers: int
    batch: int
    seq: int  # 0: the carry is (batch, d); else (batch, seq, d)
    body: tuple[str, ...]
    remat: bool
    microbatches: int
    hints: dict[str, P] = field(default_factory=dict)
    replicate: bool = False
    d: int = 8
    repeats: int = 1  # above 1: the circular schedule with this many chunks per stage
    one_f_one_b: bool = False  # the 1F1B schedule (repeats 1, replicate False)
    head: str = PIPE_HEADS[0]

    def pipeline(self):
        """The `jaxshard.Pipeline` over the (stage=2, ...) mesh this case runs with."""
        schedule = "circular" if self.repeats > 1 else "1f1b" if self.one_f_one_b else "gpipe"
        return jaxshard.Pipeline(
            "stage", self.microbatches, self.replicate, schedule=schedule, repeats=self.repeats
        )

    def source(self) -> str:
        shape = (self.batch, self.seq, self.d) if self.seq else (self.batch, self.d)
        merged = (self.batch, self.seq * self.d) if self.seq else (self.batch * self.d,)
        fill = {
            "shape": ", ".join(map(str, shape)),
            "shape_merged": ", ".join(map(str, merged)),
            "half": self.d // 2,
            "mask_shape": f"{self.batch}, 1, 1" if self.seq else f"{self.batch}, 1",
            "batch": self.batch,
        }
        lines = ["def loss(p, x, mask):"]
        if self.remat:
            lines.append("    @jax.checkpoint")
        lines.append("    def layer(h, w):")
        lines += [f"        {op.format(**fill)}" for op in self.body]
        lines.append("        return h, None")
        lines.append("    h, _ = jax.lax.scan(layer, x, p)")
        lines.append(f"    return {self.head.format(**fill)}")
        return "\n".join(lines)

    def fn(self):
        """The step: the loss's value and gradients (taken inside, as a train step does)."""
        namespace = {"jax": jax, "jnp": jnp}
        exec(compile(self.source(), "<fuzz pipeline>", "exec"), namespace)
        loss = namespace["loss"]
        return lambda p, x, mask: jax.value_and_grad(loss)(p, x, mask)

    def inputs(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        d = self.d
        p = {
            "a": (rng.standard_normal((self.layers, d, d)) * 0.4).astype(np.float32),
            "b": rng.standard_normal((self.layers, d)).astype(np.float32),
        }
        shape = (self.batch, self.seq, d) if self.seq else (self.batch, d)
        x = rng.standard_normal(shape).astype(np.float32)
        mask = (rng.random(self.batch) < 0.7).astype(np.float32)
        return p, x, mask

    def __repr__(self) -> str:
        hints = ", ".join(f"{k!r}: {spec_text(v)}" for k, v in self.hints.items())
        return (
            f"{self.source()}\n# layers={self.layers} batch={self.batch} seq={self.seq} "
            f"microbatches={self.microbatches} replicate={self.replicate} "
            f"repeats={self.repeats} one_f_one_b={self.one_f_one_b} hints={{{hints}}}"
        )


@st.composite
def pipe_cases(draw) -> PipeCase:
    """A random layer stack that a 2-stage pipeline must run like the plain step, on
    the GPipe, 1F1B or circular schedule."""
    layers = draw(st.sampled_from((2, 4, 6)))
    microbatches = draw(st.sampled_from((1, 2, 4)))
    # circular: chunks of the 2 stages' layers, at least 2 microbatches
    repeats = [v for v in (2, 3) if layers % (2 * v) == 0 and microbatches >= 2]
    repeats = draw(st.sampled_from([1] + repeats))
    batch = microbatches * draw(st.sampled_from((2, 4)))
    seq = draw(st.sampled_from((0, 4)))
    body = tuple(draw(st.lists(st.sampled_from(PIPE_OPS), min_size=1, max_size=4)))
    hints = {}
    if draw(st.booleans()):
        hints[r"x"] = P("data") if (batch // microbatches) % 2 == 0 else P()
    if draw(st.booleans()):
        hints[r"p/a"] = P(None, None, "model")
    remat, replicate = draw(st.booleans()), draw(st.booleans())
    one_f_one_b = repeats == 1 and not replicate and draw(st.booleans())
    head = draw(st.sampled_from(PIPE_HEADS))
    return PipeCase(layers, batch, seq, body, remat, microbatches, hints, replicate, 8, repeats,
                    one_f_one_b, head)  # fmt: skip
