"""Errors corral raises, split by what a caller should do about them.

* :class:`InputError` - the request itself is wrong (unknown function, bad count,
  malformed label). Nothing was changed; retrying will not help.
* :class:`BackendError` - a node agent or Lambdo host failed. ``retryable`` says
  whether the same call may succeed later (transport trouble, overload) or not
  (the agent refused the request). :class:`VmGone` is the "no such VM" answer,
  which a delete treats as success.
"""

from __future__ import annotations

from collections.abc import Callable


class SchemaError(Exception):
    """The database is not at the schema this code expects."""


class CorralError(Exception):
    """Base of corral's own errors."""


class InputError(CorralError, ValueError):
    """A request that is malformed or names something that does not exist."""


class NotFound(InputError):
    """The named function, node, replica or operation does not exist."""


class CapacityError(CorralError):
    """No node or GPU has room for the replica."""


class BackendError(CorralError):
    """A call to a node agent or Lambdo host failed."""

    retryable = False
    #: Whether the failure proves the call changed nothing on the node (an answer from the
    #: agent, or a connection refused before the request went out); False when the request
    #: may have been carried out all the same (a timeout, a connection lost mid-call).
    nothing_done = True

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        code: str | None = None,
        nothing_done: bool | None = None,
    ) -> None:
        self.node = node
        self.code = code
        if nothing_done is not None:
            self.nothing_done = nothing_done
        where = f"node {node}: " if node else ""
        super().__init__(f"{where}{message}")


class TransientBackendError(BackendError):
    """The call may succeed if tried again (unreachable, timed out, overloaded)."""

    retryable = True
    nothing_done = False


class PermanentBackendError(BackendError):
    """The agent refused the request; trying again will not help."""


class VmGone(PermanentBackendError):
    """The agent does not know the VM (already released)."""


class Unsupported(PermanentBackendError):
    """The agent lacks an optional extension (UNIMPLEMENTED / 404)."""


class BrokerError(CorralError):
    """The broker did not take the task."""


def check_seconds(
    value: object, what: str, within: Callable[[float], bool], span: str
) -> float | None:
    """``value`` as a number of seconds ``within`` its range (None stays None), else
    :class:`InputError` naming ``what`` and the range (``span``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"{what} must be a number of seconds, got {value!r}")
    if not within(value):
        raise InputError(f"{what} must be {span}, got {value!r}")
    return float(value)
