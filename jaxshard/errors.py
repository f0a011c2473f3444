"""Errors and warnings jaxshard raises.

Every user-facing failure is a `ShardingError` (a `ValueError`) whose message names the
culprit (key path, hint key, primitive or source line) and says the fix. A broken
internal invariant is a `JaxshardBug`, which says so and asks for a report. Warnings are
`JaxshardWarning`, so tests (and users) can filter or escalate exactly ours.
"""

from __future__ import annotations


class ShardingError(ValueError):
    """Bad input to jaxshard: a hint, a mesh or an argument it cannot plan for.

    Example:
        >>> raise ShardingError("hint 'params/w' names mesh axis 'x'; the mesh has: data")
        Traceback (most recent call last):
        ...
        jaxshard.errors.ShardingError: hint 'params/w' names mesh axis 'x'; the mesh has: data
    """


class JaxshardBug(AssertionError):
    """An internal invariant failed: a bug in jaxshard, not in the user's program.

    Example:
        >>> raise JaxshardBug("rule has 2 operands, equation has 3")
        Traceback (most recent call last):
        ...
        jaxshard.errors.JaxshardBug: jaxshard bug: rule has 2 operands, equation has 3...
    """

    def __init__(self, message: str):
        super().__init__(
            f"jaxshard bug: {message}. Please report it with the function and arguments "
            "that triggered it (jaxshard.plan(...).explain() output helps)."
        )


class JaxshardWarning(UserWarning):
    """Something jaxshard noticed and worked around, e.g. a hint that matched nothing.

    Example:
        >>> import warnings
        >>> warnings.warn("hint 'x' matched nothing", JaxshardWarning)  # doctest: +SKIP
    """
