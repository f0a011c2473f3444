"""How the search refers to a dim class: the decision that lays it out, the axes pins fix,
or a decision it follows where that decision's axes divide it. Shared by the integer
program (`jaxshard.search.problem`) and its tests."""

from __future__ import annotations

from typing import NamedTuple

from jaxshard.lattice import Axes


class Fixed(NamedTuple):
    """A dim class the pins lay out (``axes``), which no decision chooses."""

    axes: Axes


class Follow(NamedTuple):
    """A dim class an equation cut from its factor because fewer mesh axes divide it
    (`jaxshard.search.problem.Problem._classes`), and which nothing else lays out (8 key
    heads behind a 1024-wide projection): it takes the axes decision ``dec`` chooses for
    the factor's class where they divide its ``size``, as propagation lays it out, else
    none. The memory model prices it unsplit (an over-estimate that keeps its rows as
    small as the decisions that lay out arguments make them)."""

    dec: int
    size: int


# a dim class's reference: its decision's index, the axes pins fix, or a decision it
# follows
Ref = int | Fixed | Follow
UNSPLIT = Fixed(())  # a dim of size 1, or a class nothing lays out


def decision_of(ref: Ref) -> int | None:
    """The decision a class reference depends on (None for fixed axes).

    Example:
        >>> decision_of(3), decision_of(Follow(3, 8)), decision_of(UNSPLIT)
        (3, 3, None)
    """
    if type(ref) is int:
        return ref
    return ref.dec if type(ref) is Follow else None
