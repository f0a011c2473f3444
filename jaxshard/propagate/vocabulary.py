"""The words of propagation: a dim's layout state (`DimState`: its axes, where they came
from, `OriginKind`, and their rank), a conflict and its key, the per-value `State`, a
round's `Proposal`, and a rule indexed for the hot path (`_compile`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from jaxshard.lattice import Axes, DimSharding
from jaxshard.rule import FactorKind

NEED = FactorKind.NEED_REPLICATION


# A round's proposed write to one (value, dim): (axes proposed, the application proposing
# them, the value and dim they came from (-1, -1: none), quiet: the proposer need not be
# visited again after this write, see `_apply`). A plain tuple, unpacked by these names
# where read: the hot loop makes one per written dim, and a NamedTuple costs 5x to build.
Proposal = tuple[Axes, int, int, int, bool]


# Conflict priorities of a dim's origin, highest first. A storage layout is a hint on a
# parameter or optimizer state that uses a mesh axis the computation spends on something
# else (FSDP: a weight dim on the batch's axis): where it meets a layout derived from the
# other hints, the other hints win and the stored value is resharded at its use.
HINT_RANK, STORAGE_RANK, DEFAULT_RANK = 2, 1, 0


class ConflictKey(NamedTuple):
    """Where a conflict was decided, so one decision is recorded once: a factor of an
    application (``axis`` set when the conflict is over one mesh axis given to several
    factors), or a dim of a value reached differently in one round (``app`` is None)."""

    app: int | None
    factor: int = -1  # the rule's factor index (for an application)
    axis: str = ""
    value: int = -1  # for a value: its id...
    dim: int = -1  # ...and the dim


class OriginKind(StrEnum):
    """Where a dim's sharding came from."""

    OPEN = "open"  # nothing has reached it yet
    HINT = "hint"  # a pin: a hint, an annotation, a storage layout
    PROPAGATED = "propagated"  # through an application, from another value's dim
    DEFAULT = "default"  # nothing reached it: replicated (or a size-1 dim)


class DimState(NamedTuple):
    """One dim's layout state: its mesh axes (``None`` while open), why it has them (a
    hint, propagation through an application from another value's dim, or a default),
    and their priority when they meet another layout in a conflict. Frozen: a write puts
    a new record in the dim's place, so a trial's journal keeps the old one whole. (A
    named tuple: one is made per propagated dim, so it must be cheap to create.)

    Example:
        >>> s = DimState(("data",), OriginKind.HINT, "batch", rank=HINT_RANK)
        >>> s.open, OPEN_DIM.open, s._replace(axes=()).rank
        (False, True, 2)
    """

    axes: DimSharding = None
    kind: OriginKind = OriginKind.OPEN
    text: str = ""
    app: int = -1  # for "propagated": the application it came through
    source: int = -1  # for "propagated": the value it came from
    source_dim: int = -1  # ... and that value's dim
    rank: int = DEFAULT_RANK  # priority in conflicts: DEFAULT_RANK, STORAGE_RANK or HINT_RANK

    @property
    def open(self) -> bool:
        """Whether nothing has reached this dim yet."""
        return self.axes is None


OPEN_DIM = DimState()


@dataclass
class Conflict:
    """Two or more known shardings of one factor at one application, and the decision."""

    app: int
    factor: str
    options: dict[Axes, list[tuple[int, int]]]  # sharding -> [(value, dim)] holding it
    chosen: Axes
    reason: str


@dataclass
class State:
    """Per value, per dim: its layout state (`DimState`); the conflicts decided on the
    way, and how many visits it took."""

    layouts: list[list[DimState]]
    conflicts: dict[ConflictKey, Conflict] = field(default_factory=dict)
    visits: int = 0

    @property
    def dims(self) -> AxesView:
        """The axes of every value's dims (``None``: open), read-only: a write goes
        through `layouts`, with its origin."""
        return AxesView(self.layouts)


class AxesView(Sequence):
    """``view[v]``: the axes of value ``v``'s dims, a tuple made from its layout states
    on each read (read-only; the hot paths read `State.layouts` directly).

    Example:
        >>> AxesView([[OPEN_DIM, DimState(("x",), OriginKind.HINT)]])[0]
        (None, ('x',))
    """

    __slots__ = ("_layouts",)

    def __init__(self, layouts: Sequence[Sequence[DimState]]):
        self._layouts = layouts

    def __getitem__(self, v):
        return tuple([s.axes for s in self._layouts[v]])

    def __len__(self) -> int:
        return len(self._layouts)


def _compile(rule) -> tuple:
    """Index a rule for the hot path: (single-factor dims, compound dims, all dims, and
    for `Propagator.settled` the reduction factors, or None when the rule has compound
    dims, need-replication or windowed factors), each entry naming the tensor by its position
    among operands then results."""
    sizes = [f.size for f in rule.factors]
    need = [f.kind is NEED for f in rule.factors]
    single, compound, writable = [], [], []
    for t, tdims in enumerate((*rule.operands, *rule.results)):
        for d, fl in enumerate(tdims):
            if not fl:
                continue
            fsizes = tuple(sizes[f] for f in fl)
            writable.append((t, d, fl, fsizes))
            if len(fl) == 1 and rule.factors[fl[0]].window is None:
                if not need[fl[0]]:
                    single.append((t, d, fl[0]))
            else:  # a windowed dim too: its size may be a multiple of the factor's
                compound.append((t, d, fl, fsizes, tuple(need[f] for f in fl)))
    reductions = None
    windowed = any(f.window is not None for f in rule.factors)
    if not compound and not any(need) and not windowed:
        reductions = tuple(i for i, f in enumerate(rule.factors) if f.kind is FactorKind.REDUCTION)
    return tuple(single), tuple(compound), tuple(writable), reductions


_RANK_REASON = "a hinted sharding beats a default, and another hint beats a storage layout"


_COPIES = frozenset({"sharding_constraint", "copy", "copy_p", "name"})


def _copies_operand(app) -> bool:
    """Whether an application's result is its first operand unchanged (a sharding
    constraint, a copy, a checkpoint name)."""
    return app.eqn is not None and app.eqn.primitive.name in _COPIES


def _axis_twice(shardings: Iterable[Axes]) -> bool:
    """True when one mesh axis appears in two of the shardings (or twice in one).

    Example:
        >>> _axis_twice([("x",), (), ("y",)]), _axis_twice([("x",), ("y", "x")])
        (False, True)
    """
    seen: set[str] = set()
    for axes in shardings:
        for axis in axes:
            if axis in seen:
                return True
            seen.add(axis)
    return False
