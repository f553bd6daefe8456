"""What a handler's creates came to: an outcome per request, and the work left for other tasks.

A spawn handler (:mod:`workers.replicas.creates`, :mod:`workers.replicas.spawn`) returns a
:class:`Next`: what became of each request it handled (an :class:`Outcome`: the state
its row reached, or what happens to it next), and the work it leaves to other tasks -
requests to try alone after a backoff (:class:`Retry`), requests moved or replaced and
not yet tried, and those left unsent for want of time (:class:`Request`). The handler
(:mod:`workers.replicas.handlers`) has that work sent as the messages
:func:`workers.replicas.plan.follow_ups` makes of it, and returns the tally of outcomes,
by their values, as its task's result.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field

from workers.base.errors import BackendError
from workers.store.states import ReplicaState


class Outcome(enum.StrEnum):
    """What became of a request in a handler's creates (a task's result shows the value)."""

    # the row's state, when an answer recorded its VM or found the row moved on
    IDLE = ReplicaState.IDLE.label
    ALLOCATED = ReplicaState.ALLOCATED.label
    CREATING = ReplicaState.CREATING.label
    STARTING = ReplicaState.STARTING.label
    STARTING_LIMIT = ReplicaState.STARTING_LIMIT.label
    DELETING = ReplicaState.DELETING.label
    DELETED = ReplicaState.DELETED.label
    DEAD = ReplicaState.DEAD.label
    MAYBE = ReplicaState.MAYBE.label
    GONE = "gone"  # its row is gone
    OWNED_ELSEWHERE = "owned elsewhere"  # another live handler sends it
    RETRYING = "retrying"  # tried alone again after a backoff (Next.retry)
    MOVED = "moved"  # to another node (sent in a later round, or Next.again)
    MOVED_ALREADY = "moved already"  # a give-up found it moved off the node it failed on
    NOT_SENT = "not sent yet"  # out of time before it went out (Next.rest)
    CUT_OFF = "cut off, sent again later"  # cut mid-call where the node deduplicates
    MAYBE_REPLACED = "maybe, replaced"
    MAYBE_UNREPLACED = "maybe, not replaced"
    MAYBE_ADOPTED = "maybe, adopted"  # its VM came late and was adopted
    MAYBE_RELEASED = "maybe, released"  # its VM came late and was released
    SETTLED = "settled"  # nothing left to do for it here

    @classmethod
    def of(cls, state: ReplicaState) -> Outcome:
        """The outcome that names a row's state."""
        return cls(ReplicaState(state).label)


@dataclass(frozen=True)
class Request:
    """A request of an operation that another task is to send."""

    operation_id: str | None
    request_id: str


@dataclass(frozen=True)
class Retry(Request):
    """A request to try alone again after a backoff: the error, and the node it failed on."""

    error: BackendError
    node_id: str


@dataclass
class Next:
    """What a handler's creates came to, and the work it leaves for other tasks."""

    states: dict[str, Outcome] = field(default_factory=dict)  # request id -> what became of it
    retry: list[Retry] = field(default_factory=list)  # try alone again after a backoff
    again: list[Request] = field(default_factory=list)  # moved or replaced, not yet tried
    rest: list[Request] = field(default_factory=list)  # unsent: out of time
    tried: dict[str, list[str]] = field(default_factory=dict)  # request id -> nodes failed
    maybes: list[str] = field(default_factory=list)  # rows made maybes (replica ids)
    cut: bool = False  # a round was cut short by the task's time: no further round starts

    def state(self, request_id: str) -> Outcome:
        """What became of one request (settled, when this handler had nothing to do for it)."""
        return self.states.get(request_id, Outcome.SETTLED)

    def retry_of(self, request_id: str) -> Retry | None:
        """The lone retry this handler left for ``request_id``, if any."""
        return next((r for r in self.retry if r.request_id == request_id), None)

    def tally(self) -> dict[str, int]:
        """How many requests ended in each state (and how many maybes were made)."""
        out: dict[str, int] = defaultdict(int)
        for state in self.states.values():
            out[state.value] += 1
        if self.maybes:
            out["maybes made"] = len(self.maybes)
        return dict(out)
