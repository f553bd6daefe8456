"""Request bodies: read before anything is claimed, bounded in time, in size, per peer and in all.

The gateway reads a request's body whole before it claims an environment (a slow
upload holds no environment, and an idempotent request can be sent to a second
replica if the first fails). What that costs is bounded four ways:

* **Per request**: over ``CORRAL_GATEWAY_MAX_BODY`` bytes, announced or counted -> 413.
* **In all**: the bodies held at once may add up to ``CORRAL_GATEWAY_BODY_BUDGET``
  bytes, charged as they arrive (an announced length is only a claim: a caller that
  announces 10 MiB and sends a byte holds a byte) and given back when the request
  ends; a piece that does not fit -> 503 with ``Retry-After``, at once.
* **Per peer**: of the budget, the bodies of one peer address may hold
  ``CORRAL_GATEWAY_BODY_PER_PEER`` (a proxy in ``CORRAL_GATEWAY_TRUSTED_PROXIES``
  speaks for many callers: only the total bounds it) -> 503 with ``Retry-After``.
* **In time**: each piece must arrive within ``CORRAL_GATEWAY_READ_TIMEOUT_S`` of the
  last, and once ``CORRAL_GATEWAY_BODY_GRACE_S`` have passed the body must have come
  at ``CORRAL_GATEWAY_BODY_MIN_RATE`` bytes a second on average (Apache's
  ``mod_reqtimeout``: each ``MinRate`` bytes buys a second more) -> 408. A caller
  that drips a byte now and then is cut off after the grace, not held forever.

Each of these answers closes the connection (the rest of the body is never read).
"""

from __future__ import annotations

import asyncio
import time

from workers.gateway.asgi import (
    RETRY_AFTER_S,
    Answer,
    ClientGone,
    Message,
    Receive,
    Scope,
    header,
)
from workers.gateway.headers import Trusted

CLOSE = {"connection": "close"}


class Bodies:
    """The request bodies this gateway holds, against their limits per request, peer and in all."""

    def __init__(  # noqa: PLR0913 - the limits, by name
        self,
        max_body: int,
        budget: int,
        read_timeout_s: float,
        *,
        per_peer: int | None = None,
        min_rate: int = 4096,
        grace_s: float = 10.0,
        trusted: Trusted | None = None,
    ) -> None:
        self.max_body = max_body
        self.budget = budget
        self.read_timeout_s = read_timeout_s
        self.per_peer = budget if per_peer is None else per_peer
        self.min_rate = min_rate
        self.grace_s = grace_s
        self.trusted = trusted or Trusted("")
        self.held = 0  # bytes held by the bodies being read or forwarded now
        self.peers: dict[str, int] = {}  # of them, each peer's (trusted proxies': not kept)

    def read(self, scope: Scope, receive: Receive) -> Reading:
        """The request's body, held (and counted against the budget) inside ``async with``."""
        return Reading(self, scope, receive)

    async def _take(self, reading: Reading) -> bytes:
        """Read a body whole, its bytes charged to ``reading`` (given back on any error)."""
        scope, receive = reading.scope, reading.receive
        announced = header(scope, b"content-length")
        size = int(announced) if announced is not None and announced.isdigit() else 0
        if size > self.max_body:
            raise Answer(413, f"request body over {self.max_body} bytes", CLOSE)
        if announced is None and header(scope, b"transfer-encoding") is None:
            message = await receive()  # no body: uvicorn has the (empty) answer ready
            if message["type"] == "http.disconnect":
                raise ClientGone
            return bytes(message.get("body", b""))
        peer = scope.get("client")
        address = str(peer[0]) if peer else ""
        reading.peer = None if address in self.trusted else address
        try:
            chunks: list[bytes] = []
            got = 0
            started = time.monotonic()
            while True:
                message = await self._next(receive, started, got)
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                got += len(chunk)
                if got > self.max_body:
                    raise Answer(413, f"request body over {self.max_body} bytes", CLOSE)
                self._charge(reading, len(chunk))
                chunks.append(chunk)
                if not message.get("more_body"):  # (ASGI: absent is False)
                    break
            # (not mutated: joining one chunk gives the same bytes, a copy the 'if' saves)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # pragma: no mutate
        except BaseException:
            reading.release()
            raise

    async def _next(self, receive: Receive, started: float, got: int) -> Message:
        """The next piece, within the read timeout and the body's minimum rate; else 408."""
        due = started + self.grace_s + got / self.min_rate  # each min_rate bytes: a second more
        wait = min(self.read_timeout_s, due - time.monotonic())
        try:
            # (not mutated: '<' differs only at exactly 0.0, which asyncio.timeout cuts off too)
            if wait <= 0:  # pragma: no mutate
                raise TimeoutError
            async with asyncio.timeout(wait):
                return await receive()
        except TimeoutError:
            if wait < self.read_timeout_s:
                raise Answer(
                    408, f"request body slower than {self.min_rate} bytes a second", CLOSE
                ) from None
            raise Answer(
                408, f"request body not received within {self.read_timeout_s:g}s", CLOSE
            ) from None

    def _charge(self, reading: Reading, size: int) -> None:
        """Take ``size`` more bytes for a body, from its peer's share and the budget; 503 if not."""
        if not size:
            return
        peer = reading.peer
        if self.held + size > self.budget:
            self._full("the gateway holds as many request bodies as it may")
        if peer is not None:
            mine = self.peers.get(peer, 0) + size
            if mine > self.per_peer:
                self._full("the gateway holds as many request bodies of this caller as it may")
            self.peers[peer] = mine
        self.held += size
        reading.held += size

    @staticmethod
    def _full(why: str) -> None:
        raise Answer(503, f"{why}: try again", {"retry-after": str(RETRY_AFTER_S), **CLOSE})

    def _release(self, reading: Reading) -> None:
        held, reading.held = reading.held, 0
        if not held:
            return
        self.held -= held
        peer = reading.peer
        if peer is not None:
            left = self.peers[peer] - held  # charged in _charge, so it is there
            if left > 0:
                self.peers[peer] = left
            else:
                del self.peers[peer]


class Reading:
    """One request's body while its request runs: ``async with bodies.read(...) as body``.

    A class rather than a generator-based context manager: every request enters one.
    """

    __slots__ = ("bodies", "held", "peer", "receive", "scope")

    def __init__(self, bodies: Bodies, scope: Scope, receive: Receive) -> None:
        self.bodies = bodies
        self.scope = scope
        self.receive = receive
        self.held = 0  # bytes of the budget this body holds
        # whose share it is charged to (None: none); (not mutated: _take sets it before
        # it charges anything, and nothing reads it before)
        self.peer: str | None = None  # pragma: no mutate

    async def __aenter__(self) -> bytes:
        return await self.bodies._take(self)

    async def __aexit__(self, *_exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Give the body's bytes back to the budget and its peer's share."""
        if self.held:
            self.bodies._release(self)
