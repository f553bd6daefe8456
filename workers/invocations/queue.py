"""Where calls are sent: the :class:`CallQueue` port.

The gateway (a call accepted), the invocation tasks (a retry, a callback) and the
calls' sweep (a lost message) ask a :class:`CallQueue` they are handed to send a call's
message; :class:`tasks.invocations.CeleryCalls` sends Celery messages on the
``corral.invocations`` queue. A message carries only the call's id.
"""

from __future__ import annotations

from typing import Protocol


class CallQueue(Protocol):
    """Where the messages of calls and their callbacks are sent."""

    def send(self, call_id: str, countdown: float = 0.0) -> None:
        """Send the message that runs an attempt of the call (after ``countdown`` seconds)."""

    def send_callback(self, call_id: str, countdown: float = 0.0) -> None:
        """Send the message that delivers the call's callback (after ``countdown`` seconds)."""

    def backlog(self) -> int | None:
        """Messages waiting in the calls' queue now (None: cannot tell)."""
