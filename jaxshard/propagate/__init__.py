"""Propagation: a worklist fixed point that moves shardings through every rule, both ways.

Visiting an application reads every factor's sharding from all its operands and
results, merges per factor, and writes the result back into dims that are still open
(forward, backward and sideways at once). A dim only ever goes from open to known, so
the worklist terminates. Two different known shardings meeting on one factor are a
conflict: recorded with both origins, decided by policy (a sharding that comes from a
user hint beats a default; otherwise the option whose reshards cost least wins: fewest
bytes per device, or with a `jaxshard.cost.CostModel` the least time over the mesh axes
they use), and never written over a known dim — the tensors that lose are resharded at
that equation.

Within one application a mesh axis shards at most one factor: when operands give one
axis to two factors (``x + y`` with ``x: P('x')``, ``y: P(None, 'x')``; a contracting
and a free dim of a matmul both on ``'x'``), that is a conflict decided by the same
policy, and the factors that lose keep their other axes.

The package holds one idea per module and this file only re-exports: `vocabulary`,
`projection` (tensor dims to factors), `conflicts` (the policy) and `worklist` (the
fixed point, `Propagator`).
"""

from jaxshard.propagate.conflicts import ConflictPolicy  # noqa: F401
from jaxshard.propagate.projection import Projection  # noqa: F401
from jaxshard.propagate.vocabulary import (  # noqa: F401
    _COPIES,
    _RANK_REASON,
    DEFAULT_RANK,
    HINT_RANK,
    NEED,
    OPEN_DIM,
    STORAGE_RANK,
    AxesView,
    Conflict,
    ConflictKey,
    DimState,
    OriginKind,
    Proposal,
    State,
    _axis_twice,
    _compile,
    _copies_operand,
)
from jaxshard.propagate.worklist import Propagator  # noqa: F401
