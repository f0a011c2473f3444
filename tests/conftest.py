"""Shared test set-up: 8 simulated CPU devices (set before JAX is imported), the example
models and the benchmarks' layouts on the path, and meshes and models shared across tests to keep compiles few."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))
if _ROOT not in sys.path:  # the benchmarks' hand-written layouts are reference points
    sys.path.append(_ROOT)

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402


@pytest.fixture(scope="session")
def mesh():
    """A 2x4 (data, model) mesh with Auto axes."""
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="session")
def pipe_mesh():
    """A (stage=2, data=2, model=2) mesh for pipeline parallelism."""
    return jax.make_mesh((2, 2, 2), ("stage", "data", "model"))


@pytest.fixture(scope="session")
def explicit_mesh():
    """The same mesh with `jax.make_mesh`'s default Explicit axes."""
    return jax.make_mesh((2, 4), ("data", "model"))
