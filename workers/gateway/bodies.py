"""Request bodies: read before anything is claimed, bounded in time, in size and in all.

The gateway reads a request's body whole before it claims an environment (a slow
upload holds no environment, and an idempotent request can be sent to a second
replica if the first fails). What that costs is bounded three ways:

* **Per request**: over ``CORRAL_GATEWAY_MAX_BODY`` bytes, announced or counted -> 413.
* **In all**: the bodies held at once may add up to ``CORRAL_GATEWAY_BODY_BUDGET``
  bytes. A body takes its announced length from the budget before its first byte is
  read (a chunked one, as it arrives) and gives it back when its request ends; one
  that does not fit -> 503 with ``Retry-After``, at once.
* **In time**: each piece must arrive within ``CORRAL_GATEWAY_READ_TIMEOUT_S`` of the
  last -> 408.

Each of these answers closes the connection (the rest of the body is never read).
"""

from __future__ import annotations

import asyncio

from workers.gateway.asgi import RETRY_AFTER_S, Answer, ClientGone, Receive, Scope, header

CLOSE = {"connection": "close"}


class Bodies:
    """The request bodies this gateway holds, against their per-request and total limits."""

    def __init__(self, max_body: int, budget: int, read_timeout_s: float) -> None:
        self.max_body = max_body
        self.budget = budget
        self.read_timeout_s = read_timeout_s
        self.held = 0  # bytes reserved by the bodies being read or forwarded now

    def read(self, scope: Scope, receive: Receive) -> Reading:
        """The request's body, held (and counted against the budget) inside ``async with``."""
        return Reading(self, scope, receive)

    async def _take(self, reading: Reading) -> bytes:
        """Read a body whole, its bytes reserved on ``reading`` (given back on any error)."""
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
        try:
            reading.reserved = self._reserve(size, 0)
            chunks: list[bytes] = []
            got = 0
            while True:
                try:
                    async with asyncio.timeout(self.read_timeout_s):
                        message = await receive()
                except TimeoutError:
                    raise Answer(
                        408, f"request body not received within {self.read_timeout_s:g}s", CLOSE
                    ) from None
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                got += len(chunk)
                if got > self.max_body:
                    raise Answer(413, f"request body over {self.max_body} bytes", CLOSE)
                reading.reserved = self._reserve(got, reading.reserved)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except BaseException:
            reading.release()
            raise

    def _reserve(self, size: int, reserved: int) -> int:
        """Grow a body's reservation to ``size`` bytes; the new reservation."""
        more = size - reserved
        if more <= 0:
            return reserved
        if self.held + more > self.budget:
            raise Answer(
                503,
                "the gateway holds as many request bodies as it may: try again",
                {"retry-after": str(RETRY_AFTER_S), **CLOSE},
            )
        self.held += more
        return size


class Reading:
    """One request's body while its request runs: ``async with bodies.read(...) as body``.

    A class rather than a generator-based context manager: every request enters one.
    """

    __slots__ = ("bodies", "receive", "reserved", "scope")

    def __init__(self, bodies: Bodies, scope: Scope, receive: Receive) -> None:
        self.bodies = bodies
        self.scope = scope
        self.receive = receive
        self.reserved = 0  # bytes of the budget this body holds

    async def __aenter__(self) -> bytes:
        return await self.bodies._take(self)

    async def __aexit__(self, *_exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Give the body's bytes back to the budget."""
        self.bodies.held -= self.reserved
        self.reserved = 0
