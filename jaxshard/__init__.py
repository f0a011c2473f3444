"""jaxshard: semi-automatic sharding for JAX.

Decorate a step with `auto_shard(mesh, hints=...)`, pin a few arrays with partial
PartitionSpecs, and jaxshard traces the step, propagates shardings through every
primitive's rule, decides what is left, and runs it under `jax.jit` with a
NamedSharding on every argument, result and key intermediate.
"""

from jaxshard.annotate import hint
from jaxshard.api import AutoShard, auto_shard
from jaxshard.cost import CostModel
from jaxshard.errors import JaxshardBug, JaxshardWarning, ShardingError
from jaxshard.pipeline import Pipeline
from jaxshard.plan import Plan, Reshard, make_plan
from jaxshard.search import SearchResult, search_hints
from jaxshard.strategy import Candidate, Strategy, auto_parallel
from jaxshard.topology import Topology

__all__ = [
    "AutoShard",
    "Candidate",
    "CostModel",
    "JaxshardBug",
    "JaxshardWarning",
    "Pipeline",
    "Plan",
    "Reshard",
    "SearchResult",
    "ShardingError",
    "Strategy",
    "Topology",
    "auto_parallel",
    "auto_shard",
    "hint",
    "make_plan",
    "search_hints",
]
__version__ = "0.1.0"

import jaxshard.explain  # noqa: E402, F401 - registers Plan.explain
import jaxshard.rules  # noqa: E402, F401 - registers the rule catalogue with the engine
import jaxshard.verify  # noqa: E402, F401 - registers Plan.verify
from jaxshard.check import RuleCheckError, check_rule  # noqa: E402
from jaxshard.flax_meta import flax_hints, logical_to_spec  # noqa: E402
from jaxshard.kernels import with_rule  # noqa: E402

__all__ += ["RuleCheckError", "check_rule", "flax_hints", "logical_to_spec", "with_rule"]
