"""Scripted faults for the reference agents, so tests can make a real server misbehave.

A test queues faults per operation (an RPC method name for the node agent, a path
kind for the Lambdo host); each incoming call of that operation consumes the next
fault in order, and calls find the queue empty behave normally again::

    agent.inject("CreateReplica", Fault.abort(grpc.StatusCode.UNAVAILABLE, "down"),
                 Fault.delay(0.5))
    lambdo.agent.inject("spawn", Fault.abort(500, "disk full"),
                        Fault.reply(200, "not json", "text/plain"))

The same :class:`Fault` serves both protocols; what its fields mean depends on the
server that consumes it:

* ``Fault.abort(code, message)`` - gRPC: ``context.abort(code, message)`` with a
  ``grpc.StatusCode``; HTTP: answer status ``code`` with a plain-text body.
* ``Fault.delay(seconds)`` - sleep, then handle the call normally;
  ``Fault.delay(seconds, until=event)`` - wait until the test sets ``event`` (at most
  ``seconds``), then handle it: a call held in flight until something else happened.
* ``Fault.reply(message)`` - gRPC: answer this message instead of doing the work;
  ``Fault.reply(status, body, content_type)`` - HTTP: answer this response instead.
* ``Fault.hangup()`` - HTTP only: close the connection without any response.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MAX_CALLS", "Fault", "FaultHooks", "FaultKind", "FaultPlan", "record_call"]

FaultKind = Literal["abort", "delay", "reply", "hangup"]

#: How many calls an agent's ``calls`` log keeps (oldest dropped), so a long-running
#: agent does not grow without bound.
MAX_CALLS = 10_000

_CALLS_LOCK = threading.Lock()


def record_call(
    calls: list[tuple[str, object]], name: str, payload: object, limit: int = MAX_CALLS
) -> None:
    """Append ``(name, payload)`` to an agent's call log, dropping the oldest beyond ``limit``."""
    with _CALLS_LOCK:
        calls.append((name, payload))
        if len(calls) > limit:
            del calls[: len(calls) - limit]


@dataclass(frozen=True)
class Fault:
    """One scripted misbehaviour, consumed by exactly one call."""

    kind: FaultKind
    code: Any = None
    message: str = ""
    seconds: float = 0.0
    value: Any = None
    content_type: str = "text/plain; charset=utf-8"
    until: threading.Event | None = None

    @classmethod
    def abort(cls, code: Any, message: str = "") -> Fault:
        """Fail the call: a gRPC ``StatusCode`` plus details, or an HTTP status plus text body."""
        return cls(kind="abort", code=code, message=message)

    @classmethod
    def delay(cls, seconds: float, until: threading.Event | None = None) -> Fault:
        """Sleep ``seconds`` (or until ``until`` is set, at most that) before handling the call."""
        if seconds < 0:
            raise ValueError("delay must not be negative")
        return cls(kind="delay", seconds=float(seconds), until=until)

    def wait(self) -> None:
        """A delay's wait, in this thread."""
        if self.until is None:
            time.sleep(self.seconds)
        else:
            self.until.wait(self.seconds)

    @classmethod
    def reply(
        cls,
        value: Any,
        body: str | bytes | None = None,
        content_type: str = "application/json",
    ) -> Fault:
        """Answer without doing the work: ``reply(message)`` or ``reply(status, body, ctype)``."""
        if isinstance(value, int) and not isinstance(value, bool):
            raw = body.encode() if isinstance(body, str) else (body or b"")
            return cls(kind="reply", code=value, value=raw, content_type=content_type)
        if body is not None:
            raise TypeError("a gRPC reply fault takes only the reply message")
        return cls(kind="reply", value=value)

    @classmethod
    def hangup(cls) -> Fault:
        """Close the connection without answering (HTTP servers only)."""
        return cls(kind="hangup")


class FaultPlan:
    """Per-operation FIFO queues of faults; thread-safe."""

    def __init__(self, operations: Iterable[str]) -> None:
        """Accept faults only for the named ``operations`` (catches typos in tests)."""
        self._queues: dict[str, deque[Fault]] = {op: deque() for op in operations}
        self._lock = threading.Lock()

    @property
    def operations(self) -> tuple[str, ...]:
        """The operation names faults may be injected for."""
        return tuple(self._queues)

    def inject(self, operation: str, *faults: Fault) -> None:
        """Queue ``faults`` for the next calls of ``operation``, in order."""
        if operation not in self._queues:
            known = ", ".join(self._queues)
            raise ValueError(f"unknown operation {operation!r}; expected one of: {known}")
        for fault in faults:
            if not isinstance(fault, Fault):
                raise TypeError(f"expected Fault, got {type(fault).__name__}")
        with self._lock:
            self._queues[operation].extend(faults)

    def take(self, operation: str) -> Fault | None:
        """Pop the next fault queued for ``operation``, or ``None``."""
        with self._lock:
            queue = self._queues.get(operation)
            return queue.popleft() if queue else None

    def pending(self, operation: str | None = None) -> int:
        """How many faults are still queued (for one operation, or in all)."""
        with self._lock:
            if operation is not None:
                return len(self._queues.get(operation, ()))
            return sum(len(q) for q in self._queues.values())

    def clear(self) -> None:
        """Drop every queued fault."""
        with self._lock:
            for queue in self._queues.values():
                queue.clear()


class FaultHooks:
    """The test hooks every agent has: a log of the calls received and scripted faults."""

    def __init__(self, operations: Iterable[str]) -> None:
        """Record calls and accept faults for the named ``operations``."""
        #: Every call received, in order: (operation name, request payload).
        self.calls: list[tuple[str, object]] = []
        self.faults = FaultPlan(operations)

    def inject(self, operation: str, *faults: Fault) -> None:
        """Make the next calls of ``operation`` misbehave, one fault per call, in order."""
        self.faults.inject(operation, *faults)

    def calls_of(self, operation: str) -> list[Any]:
        """The recorded payloads of one operation, in order."""
        return [payload for name, payload in list(self.calls) if name == operation]
