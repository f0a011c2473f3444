"""Everything jaxshard needs from JAX beyond its public API, adapted to the installed version.

jaxshard rewrites jaxprs, builds `jit` equations, binds private primitives and reads
source lines, and JAX keeps those in ``jax._src``, whose names and parameters change from
release to release (``jit``'s ``inline`` became an enum in 0.11; cuDNN attention gained
``score_mod`` operands in 0.12). This module is the only one in the package, its rule
catalogue and its tests that imports ``jax._src``: each private name is looked up here,
once, and where releases differ the difference is settled here, so a new JAX release is
this file's work. Supported: JAX 0.10.2 up to the newest release the package index serves
(`SUPPORTED`).

Example:
    >>> from jaxshard import jax_compat
    >>> jax_compat.JAX_VERSION >= (0, 10, 2)
    True
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as _public_core
from jax._src import api_util as _api_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import custom_batching as _custom_batching
from jax._src import custom_derivatives as _custom_derivatives
from jax._src import debugging as _debugging
from jax._src import dispatch as _dispatch
from jax._src import pjit as _pjit
from jax._src import shard_map as _shard_map
from jax._src import source_info_util
from jax._src import xla_bridge as _xla_bridge
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
from jax._src.custom_partitioning_sharding_rule import str_to_sdy_sharding_rule
from jax._src.interpreters import batching, mlir
from jax._src.interpreters import partial_eval as _partial_eval
from jax._src.lax import lax as _lax_internal
from jax._src.lax import linalg as lax_linalg
from jax._src.lax import slicing as _slicing
from jax._src.lax.control_flow import platform_index_p
from jax._src.lax.scaled_dot import scaled_dot_p
from jax._src.lax.windowed_reductions import _select_and_scatter as select_and_scatter
from jax._src.named_sharding import UNSPECIFIED
from jax._src.random import core as random_core
from jax._src.random import philox2x32, philox4x32, prng, threefry4x32

__all__ = [
    "CPU_COPIES_RESULT_TRANSPOSES",
    "CPU_RECOMPUTES_REMAT",
    "JAX_VERSION",
    "SUPPORTED",
    "UNSPECIFIED",
    "batching",
    "bind_with_source",
    "caller_line",
    "consts_as_inputs",
    "context_on_mesh",
    "cudnn_attention",
    "cudnn_attention_params",
    "drop_var",
    "is_drop_var",
    "jit_equation_params",
    "jit_p",
    "lax_linalg",
    "low_level",
    "layout_constraint_p",
    "linear_call_p",
    "mlir",
    "new_eqn",
    "new_var",
    "philox2x32",
    "philox4x32",
    "platform_branch",
    "platform_index_p",
    "lowering_platform",
    "optional_primitive",
    "optional_primitives",
    "prng",
    "random_core",
    "random_primitives",
    "registered_primitives",
    "remat_opt_p",
    "custom_vmap_p",
    "require_devices_while_lowering",
    "scaled_dot_p",
    "scan_counts",
    "scatter_sub_p",
    "select_and_scatter",
    "set_debug_info",
    "shardy_enabled",
    "source_info_util",
    "source_summary",
    "str_to_sdy_sharding_rule",
    "threefry4x32",
    "MultipleResultsPrimitive",
]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


JAX_VERSION = _version(jax.__version__)
# The JAX releases the package is tested on, oldest and newest (CI runs both).
SUPPORTED = ((0, 10, 2), (0, 12, 0))
# Whether XLA's CPU compiler recomputes a rematerialized region (`jax.checkpoint`) outside
# a loop. jaxlib 0.10 removes the optimization barrier JAX puts before the recomputation
# before it merges common subexpressions, so the recomputation merges with the forward
# and the forward's values stay alive until the backward; 0.11 keeps the barrier.
# Measured: 0.10.2 compiles a four-layer checkpointed MLP to the memory of the same step
# without checkpoint, 0.11.2 and 0.12.0.1 to 0.39x of it.
CPU_RECOMPUTES_REMAT = JAX_VERSION >= (0, 11)
# Whether XLA's CPU compiler writes a transpose that only relabels dims into a buffer of
# its own before copying it into a result of a step with several results. jaxlib 0.10
# makes it a bitcast of its operand; 0.11 wraps it in a fusion of its own first. Measured:
# a gradient all-reduced, then transposed into one of the step's results holds two
# buffers of its size on 0.11.2 and 0.12.0.1, one on 0.10.2.
CPU_COPIES_RESULT_TRANSPOSES = JAX_VERSION >= (0, 11)

jit_p = _pjit.jit_p
layout_constraint_p = _pjit.layout_constraint_p
linear_call_p = _custom_derivatives.linear_call_p
remat_opt_p = _custom_derivatives.remat_opt_p
custom_vmap_p = _custom_batching.custom_vmap_p
scatter_sub_p = _slicing.scatter_sub_p
random_primitives = (threefry4x32.threefry4x32_p, philox2x32.philox2x32_p, philox4x32.philox4x32_p)
MultipleResultsPrimitive = _core.Primitive  # a Primitive whose multiple_results is settable


def _optional_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# Where releases define primitives that neither jax.extend nor jax.lax exports; modules
# a release lacks are None (program_order and xla_metadata_call arrived in 0.11).
_PRIVATE_MODULES = (
    _lax_internal,
    _shard_map,
    _pjit,
    _debugging,
    _optional_module("jax._src.program_order"),
    _optional_module("jax._src.xla_metadata"),
)


def optional_primitive(name: str) -> Any:
    """The primitive named ``name`` in this JAX release, or None where the release has
    none: looked up in ``jax.extend``, ``jax.lax`` and the private modules that define
    the rest, so rules register what exists and a newer release's primitives join.

    Example:
        >>> optional_primitive("shard_map").name
        'shard_map'
        >>> optional_primitive("no_such_thing") is None
        True
    """
    from jax.extend.core import primitives

    for module in (primitives, jax.lax, *_PRIVATE_MODULES):
        found = getattr(module, f"{name}_p", None) if module is not None else None
        if found is not None:
            return found
    return None


def optional_primitives(*names: str) -> list:
    """The primitives of ``names`` this release has, in order (see `optional_primitive`)."""
    found = [optional_primitive(n) for n in names]
    return [prim for prim in found if prim is not None]


# --- jaxpr surgery ---------------------------------------------------------------------


def new_var(aval: Any) -> Any:
    """A fresh jaxpr variable of type ``aval``."""
    return _public_core.Var(aval)


def drop_var(aval: Any) -> Any:
    """An unused result variable (``_``) of type ``aval``."""
    return _public_core.DropVar(aval)


def is_drop_var(var: Any) -> bool:
    """Whether ``var`` is an unused result (``_``)."""
    return isinstance(var, _public_core.DropVar)


def new_eqn(invars, outvars, primitive, params, like) -> Any:
    """A jaxpr equation with the source line and context of the equation ``like``."""
    return _public_core.new_jaxpr_eqn(
        list(invars), list(outvars), primitive, params, _public_core.no_effects,
        like.source_info, like.ctx,
    )  # fmt: skip


def scan_counts(params: dict) -> tuple[int, int]:
    """``(constants, carries)`` of a `scan` equation: leading operands before the
    scanned ones (JAX 0.12 keeps them as the flat trees ``ft_in``, earlier releases as
    ``num_consts``/``num_carry``).

    Example:
        >>> f = lambda c, xs: jax.lax.scan(lambda c, x: (c + x, c * x), c, xs)
        >>> eqn = jax.make_jaxpr(f)(1.0, jax.numpy.ones(3)).eqns[0]
        >>> scan_counts(eqn.params)
        (0, 1)
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def mesh_context(mesh: Any) -> Any:
    """The context that makes ``mesh`` current while tracing: ``jax.set_mesh`` for a
    `Mesh`, ``use_abstract_mesh`` for an `AbstractMesh` (planning for devices this
    process does not have)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return jax.sharding.use_abstract_mesh(mesh)
    return jax.set_mesh(mesh)


def context_on_mesh(ctx: Any, mesh: Any) -> Any:
    """An equation context like ``ctx`` (compute type, RNG mode, XLA metadata, ...)
    whose current abstract mesh is ``mesh``: made the way JAX makes one, from the
    settings ``ctx`` enters, so fields a release adds come along."""
    with ctx.manager, jax.sharding.use_abstract_mesh(mesh):
        return type(ctx)()


def consts_as_inputs(jaxpr: Any) -> Any:
    """``jaxpr`` with its constants turned into leading inputs."""
    return _partial_eval.convert_constvars_jaxpr(jaxpr)


def low_level(closed: Any) -> Any:
    """``closed`` with JAX's high-level primitives expanded into the primitives they lower
    to, as `jax.jit` does before lowering: since 0.12 ``jnp.searchsorted`` (and other
    functions JAX writes as "hijax" primitives) traces to a ``call_hi_primitive``
    equation whose body is not a parameter, so nothing could be planned inside it.
    Unchanged where the release has no such primitives or the program uses none.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda e, v: jnp.searchsorted(e, v)
        >>> closed = low_level(jax.make_jaxpr(f)(jnp.arange(4.0), jnp.ones(3)))
        >>> getattr(closed.jaxpr, "is_high", False)
        False
    """
    if not getattr(closed.jaxpr, "is_high", False) or not hasattr(_partial_eval, "lower_jaxpr2"):
        return closed
    n = len(closed.jaxpr.constvars)  # the expansion takes constants as leading inputs
    lowered = _partial_eval.lower_jaxpr2(consts_as_inputs(closed.jaxpr) if n else closed.jaxpr)
    if n:
        lowered = lowered.replace(constvars=lowered.invars[:n], invars=lowered.invars[n:])
    return _public_core.ClosedJaxpr(lowered, list(closed.consts))


def without_dead_code(closed: Any) -> Any:
    """``closed`` (a ClosedJaxpr) without the equations none of its outputs needs, its
    inputs kept (a `jax.vjp` whose primal result is dropped computes it all the same).

    Example:
        >>> closed = jax.make_jaxpr(lambda x: [x * 2, jax.numpy.sin(x)][0])(1.0)
        >>> [e.primitive.name for e in without_dead_code(closed).jaxpr.eqns]
        ['mul']
    """
    jaxpr, _ = _partial_eval.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), True)
    return _public_core.ClosedJaxpr(jaxpr, closed.consts)


@functools.cache
def _jit_template() -> dict:
    """The parameters JAX itself gives a `jit` equation (inner ``jax.jit`` of the
    identity), so a parameter a release adds or retypes comes with its default."""

    def outer(x):
        return jax.jit(lambda y: y)(x)

    eqn = jax.make_jaxpr(outer)(jax.ShapeDtypeStruct((), "float32")).eqns[0]
    if eqn.primitive is not jit_p:
        raise RuntimeError(f"jaxshard: jax {jax.__version__} traces jax.jit to {eqn.primitive}")
    return dict(eqn.params)


def jit_equation_params(jaxpr: Any, n_in: int, n_out: int, ctx_mesh: Any, name: str) -> dict:
    """Parameters binding ``jaxpr`` as one `jit` equation: no shardings, layouts or
    donation of its own (the enclosing ``jax.jit`` carries them), not inlined, the rest
    as this JAX release sets them.

    Example:
        >>> closed = jax.make_jaxpr(lambda x: x + 1)(1.0)
        >>> params = jit_equation_params(closed, 1, 1, jax.sharding.AbstractMesh((), ()), "f")
        >>> params["name"], params["donated_invars"]
        ('f', (False,))
    """
    params = dict(_jit_template())
    params.update(
        jaxpr=jaxpr,
        in_shardings=(UNSPECIFIED,) * n_in,
        out_shardings=(UNSPECIFIED,) * n_out,
        in_layouts=(None,) * n_in,
        out_layouts=(None,) * n_out,
        donated_invars=(False,) * n_in,
        ctx_mesh=ctx_mesh,
        name=name,
        keep_unused=False,
    )
    return params


def lowering_platform(mesh: Any) -> str:
    """The platform a program for ``mesh`` is lowered for, as JAX names it in
    platform-dependent code (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``): its devices'
    platform, or for an abstract mesh the platform it names, else the default backend's.

    Example:
        >>> lowering_platform(jax.make_mesh((1,), ("data",)))
        'cpu'
    """
    if isinstance(mesh, jax.sharding.AbstractMesh):  # it has no devices to ask
        device = getattr(mesh, "abstract_device", None)
        platform = getattr(device, "platform", None) or jax.default_backend()
    else:
        platform = mesh.devices.flat[0].platform
    return _xla_bridge.canonicalize_platform(platform)


def platform_branch(eqn: Any, platform: str) -> Any:
    """``eqn`` as JAX lowers it for ``platform`` where it is a platform-dependent `cond`
    (``jax.lax.platform_dependent``, ``jnp.diagonal``): a call of the one branch lowering
    keeps (the first listing ``platform``, else the default), on the cond's operands
    after its index; None for any other equation. Planned as a cond, the branches for
    other platforms (a Pallas kernel's masked sum) were priced although never run.

    Example:
        >>> f = lambda x: jax.lax.platform_dependent(x, cpu=jax.numpy.sin, default=jax.numpy.cos)
        >>> eqn = jax.make_jaxpr(f)(1.0).eqns[-1]
        >>> [e.primitive.name for e in platform_branch(eqn, "cpu").params["call_jaxpr"].eqns]
        ['sin']
    """
    chosen = eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
    if chosen is None:
        return None
    for branch, platforms in zip(eqn.params["branches"], chosen):
        if platforms is None or platform in platforms:
            return eqn.replace(
                primitive=_public_core.primitives.closed_call_p,
                invars=eqn.invars[1:],
                params={"call_jaxpr": branch},
            )
    return None


# --- source lines and debug info ---------------------------------------------------------


def source_summary(source_info: Any) -> str:
    """``file.py:42 (function)`` of an equation's source info ("" inside JAX)."""
    return source_info_util.summarize(source_info)


def caller_line() -> str:
    """The user's source line being traced now, or "an unknown line"."""
    return source_info_util.summarize(source_info_util.current()) or "an unknown line"


def bind_with_source(eqn: Any, ins: Sequence[Any], params: dict) -> list:
    """``eqn``'s primitive applied to ``ins`` with ``params``, under its source line and
    context (as `jax.core.eval_jaxpr` does)."""
    bind_params = eqn.primitive.get_bind_params(params)
    with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
        out = eqn.primitive.bind(*ins, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def user_context(eqn: Any):
    """A context in which new equations get ``eqn``'s source line."""
    return source_info_util.user_context(eqn.source_info.traceback)


def exclude_from_tracebacks(directory: str) -> None:
    """Frames from files under ``directory`` are never reported as the user's line."""
    source_info_util.register_exclusion(directory)


def set_debug_info(flat_fn: Callable, fn: Callable, arg_names: Sequence[str], kind: str) -> None:
    """Give ``flat_fn`` JAX's debug info for ``fn`` with ``arg_names``, so JAX's own tracing
    errors name the user's function and arguments."""
    info = _public_core.DebugInfo(kind, _api_util.fun_sourceinfo(fn), tuple(arg_names), None)
    _api_util.save_wrapped_fun_debug_info(flat_fn, info)


# --- lowering hooks ----------------------------------------------------------------------


def shardy_enabled() -> bool:
    """Whether XLA partitions with Shardy (the default since JAX 0.7)."""
    return bool(_config.use_shardy_partitioner.value)


def require_devices_while_lowering(primitive: Any) -> None:
    """Lower ``primitive`` with the devices known (custom_partitioning needs them)."""
    _dispatch.prim_requires_devices_during_lowering.add(primitive)


# --- the primitives JAX registers ---------------------------------------------------------

_WALK = """
import importlib, json, pkgutil, jax._src
from jax._src import core
found = {}
for info in pkgutil.walk_packages(jax._src.__path__, "jax._src."):
    try:
        module = importlib.import_module(info.name)
    except Exception:  # optional backends (mosaic GPU, ...) that are not installed
        continue
    for value in list(vars(module).values()):
        if isinstance(value, core.Primitive):
            found.setdefault(value.name, []).append(info.name)
print(json.dumps(found))
"""


def registered_primitives() -> dict[str, list[str]]:
    """Every primitive this JAX defines, by name, with the modules defining it: found by
    importing every module of JAX in a child process (this one's imports stay as they
    are). Pallas's kernel-language primitives live under ``jax._src.pallas.``.

    Example:
        >>> "dot_general" in registered_primitives()  # doctest: +SKIP
        True
    """
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _WALK], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- cuDNN attention -------------------------------------------------------------------

_FWD_PARAMS = inspect.signature(cudnn_attention._dot_product_attention_fwd_impl).parameters
# JAX 0.12 added flex attention: a score_mod callable and its operands after the others
HAS_SCORE_MOD = "score_mod" in _FWD_PARAMS


def cudnn_attention_params(**params: Any) -> dict:
    """Parameters of the cuDNN attention primitives for this release: ``params`` plus
    ``score_mod=None`` where the release has flex attention.

    Example:
        >>> "scale" in cudnn_attention_params(scale=0.5)
        True
    """
    return {**params, "score_mod": None} if HAS_SCORE_MOD else dict(params)


def cudnn_attention_impl(forward: bool, *operands: Any, **params: Any) -> Any:
    """Call the cuDNN attention implementation (what its wrapper primitives lower to)
    with ``operands`` (the forward's ten, or the backward's thirteen) and no score_mod."""
    name = "fwd" if forward else "bwd"
    fn = getattr(cudnn_attention, f"_dot_product_attention_{name}_impl")
    if HAS_SCORE_MOD:
        return fn(*operands, (), **cudnn_attention_params(**params))
    return fn(*operands, **params)
