"""What the gateway tells of its requests: their spans, and a cold start's stages.

With tracing on (:mod:`workers.observability.tracing`) each ``/function/...`` request is a SERVER
span (:func:`incoming` continues a caller's trace from its ``traceparent`` header), and
a request that waits for a claim from the store has a ``claim`` span under it
(:meth:`workers.gateway.ledger.Ledger.acquire`).

A request whose claim found nothing Idle waits for a replica to be made
(:mod:`workers.replicas.claims`). The gateway times three of the cold start's stages
(:mod:`workers.observability.stages` names them all):

* ``ask`` - from the claim finding nothing in the gateway's pool to its spawn being
  asked for (the operation written and its task sent), when this request asked;
* ``claim`` - from the new replica being ready (its ``ready_at``, the store's clock) to
  this request's claim being served: how long the gateway took to learn of it;
* ``first_byte`` - from the request holding its claim to the first byte of the
  replica's answer being passed on (connecting, a server still starting, the answer).

The ledger notes each claim its cold starts made (:class:`ColdStart`, by claim id); the
request that first uses such a claim watches its answer's first byte
(:meth:`ColdStart.watch`) and, when it is over, :meth:`ColdStart.done` observes the
stages in ``corral_cold_start_stage_seconds`` and, with tracing on, records the
``upstream.first_byte`` span under the request's. A warm request costs one test of an
empty dict.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from workers.base.clock import now
from workers.gateway.asgi import Message, Scope, Send
from workers.observability import tracing
from workers.store.db import Database
from workers.store.models import Replica

if TYPE_CHECKING:
    from opentelemetry.context import Context


def incoming(scope: Scope) -> Context | None:
    """The trace context a caller sent (``traceparent``), to continue; None if it sent none."""
    carried = {
        key.decode("latin-1"): value.decode("latin-1")
        for key, value in scope.get("headers", ())
        if key in (b"traceparent", b"tracestate")
    }
    return tracing.context_of(carried) if carried else None


def request_attributes(scope: Scope) -> dict[str, Any]:
    """A request span's attributes (OpenTelemetry's HTTP conventions)."""
    return {
        "http.request.method": scope["method"],
        "url.path": scope["path"],
        "http.route": "/function/{name}",
    }


@dataclass
class ColdStart:
    """One claim a cold start brought: when it began, asked, and was served."""

    function: str
    replica_id: str
    began: float  # time.monotonic(): the claim found nothing in the pool
    began_at: datetime  # the same moment on the store's clock
    asked: float | None  # time.monotonic(): this request's spawn was asked for (or None)
    claimed_at: datetime = field(default_factory=now)  # the claim served (store's clock)
    served: float = 0.0  # time.monotonic(): a request took the claim
    served_ns: int = 0
    first_byte: float | None = None
    first_byte_ns: int = 0
    parent: Any = None  # the request's span context (tracing on)

    def watch(self, send: Send) -> Send:
        """``send``, noting when the answer's first byte goes out; the request holds the claim."""
        self.served, self.served_ns = time.monotonic(), time.time_ns()
        self.parent = tracing.current()

        async def watched(message: Message) -> None:
            if self.first_byte is None and message["type"] == "http.response.start":
                self.first_byte, self.first_byte_ns = time.monotonic(), time.time_ns()
            await send(message)

        return watched

    def done(self, db: Database, observe: Callable[[str, float], None]) -> None:
        """Observe the stages this request saw (reads the replica's ``ready_at``: a thread)."""
        if self.asked is not None:
            observe("ask", self.asked - self.began)
        with db.read() as s:
            ready_at = s.scalar(select(Replica.ready_at).where(Replica.id == self.replica_id))
        if ready_at is not None and ready_at >= self.began_at:  # made for this wait
            observe("claim", max(0.0, (self.claimed_at - ready_at).total_seconds()))
        if self.first_byte is None:
            return
        observe("first_byte", self.first_byte - self.served)
        tracing.record_between(
            "upstream.first_byte",
            self.served_ns,
            self.first_byte_ns,
            parent=self.parent,
            kind="client",
            attributes={"corral.function": self.function, "corral.replica_id": self.replica_id},
        )
