"""The checks on what a producer asks of replicas, shared by the producer and the tasks.

A count or a target is checked where the request is written (``workers.replicas.requests``,
in the producer's transaction) and again by the task that carries it out (a message can be
written by hand, or the function changed meanwhile): both call these, so the two can never
disagree about what is valid.
"""

from __future__ import annotations

from workers.base.errors import InputError
from workers.functions import MAX_REPLICAS
from workers.store.models import Function


def check_count(count: object, what: str = "count") -> int:
    """``count`` as an int in 1..10,000, or a clear :class:`InputError`."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise InputError(f"{what} must be an integer, got {count!r}")
    if count < 1 or count > MAX_REPLICAS:
        raise InputError(f"{what} must be between 1 and {MAX_REPLICAS}, got {count}")
    return count


def check_target(fn: Function, target: object) -> int:
    """``target`` as an int within the function's [min, max], or a clear :class:`InputError`."""
    if isinstance(target, bool) or not isinstance(target, int):
        raise InputError(f"target must be an integer, got {target!r}")
    if target < 0:
        raise InputError(f"target must not be negative, got {target}")
    if target < fn.min_replicas or target > fn.max_replicas:
        raise InputError(
            f"target {target} is outside {fn.name}'s range [{fn.min_replicas}, {fn.max_replicas}]"
        )
    return target
