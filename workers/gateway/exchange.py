"""One answer of a replica as its caller takes it, and what it may cost the gateway.

:class:`workers.gateway.http1.Connection` parses a replica's answer and hands it to the
request's :class:`Exchange`: the status and headers once (:meth:`Exchange.head`), then
the body piece by piece (:meth:`Exchange.chunk`), read ahead of the caller so that an
answer that fits completes - and its environment goes back - whatever the caller does.

What that read-ahead holds is charged by what it costs in memory, not by its payload: a
body in 2-byte chunks is one Python object a chunk (some 50 bytes each), so a megabyte
of payload held that way was some 29 MiB. A piece costs its bytes and ``PIECE_COST``,
and small pieces join the last one kept (``JOIN``), so tiny chunks cost about their
bytes. One answer holds up to ``Limits.read_ahead``; all answers sharing a
:class:`Budget` (the gateway's) up to ``Budget.limit``: past it, an answer is read only
while its caller waits for more, so every caller that reads makes progress and one that
does not holds at most one read more. Beyond either, the connection stops reading (the
replica's sends then wait in the kernel).

:class:`Limits` also bounds the head (:mod:`workers.gateway.http1` counts it);
:class:`Broken` and :class:`Rejected` are how an exchange fails.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# A piece of body kept for the caller costs its bytes and this much more: the object's
# header, the allocator's rounding, a deque slot, a joined piece's spare room (below).
PIECE_COST = 256
JOIN = 1024  # a piece smaller than this joins the last one kept, if that one is too


@dataclass(frozen=True, slots=True)
class Limits:
    """What one answer may take before it is refused (the head) or waits (the body)."""

    head_bytes: int = 64 * 1024  # status line, headers, interim heads; trailers likewise
    head_lines: int = 100  # header lines, interim heads' included
    head_timeout_s: float = 10.0  # from a head's first byte to its end
    read_ahead: int = 1024 * 1024  # body held ahead of the caller, in memory


class Budget:
    """The body bytes all exchanges sharing it hold ahead of their callers, in memory."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int = sys.maxsize) -> None:
        self.limit = limit
        self.held = 0


class Broken(Exception):
    """The exchange failed: connection refused, reset or closed early, or not HTTP."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused  # the connection was never made


class Rejected(Broken):
    """The answer broke a limit (or switched protocols): refused, its connection closed."""

    def __init__(self, message: str, reason: str, status: int = 502) -> None:
        super().__init__(message)
        self.reason = reason  # the limit, for the metrics: head_bytes, head_lines, ...
        self.status = status  # what the caller is answered: 502, or 504 for a slow head


class Reader(Protocol):
    """The connection an exchange reads from: stopped, started again, or closed."""

    def pause(self) -> None:
        """Stop reading."""

    def resume(self) -> None:
        """Read again."""

    def close(self) -> None:
        """Close the connection."""


class Exchange:
    """One request's answer as it arrives: status and headers, then body chunks."""

    def __init__(
        self,
        conn: Reader,
        loop: asyncio.AbstractEventLoop,
        head_only: bool,
        limit: int,
        budget: Budget,
    ) -> None:
        self.conn = conn
        self.loop = loop
        self.head_only = head_only  # a HEAD request: the answer ends with its headers
        self.limit = limit  # read ahead of the caller, in memory
        self.budget = budget
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headed = False
        self.complete = False
        self.error: Broken | None = None
        self.on_complete: Callable[[], None] | None = None
        self._chunks: deque[bytes | bytearray] = deque()
        self._held = 0  # what the pieces kept cost, as charged to the budget
        self._waiter: asyncio.Future[None] | None = None

    # -- the connection's side -------------------------------------------------------------

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _headed(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.headers, self.headed = status, headers, True
        self._wake()

    def _body(self, data: bytes) -> None:
        chunks = self._chunks
        size = len(data)
        if size < JOIN and chunks and len(last := chunks[-1]) < JOIN:
            if type(last) is bytes:  # the second small piece in a row: join them
                last = chunks[-1] = bytearray(last)
            last += data
            cost = size
        else:
            chunks.append(data)
            cost = size + PIECE_COST
        self._held += cost
        budget = self.budget
        budget.held += cost
        if self._held > self.limit or (budget.held > budget.limit and self._waiter is None):
            self.conn.pause()
        self._wake()

    def _completed(self) -> None:
        self.complete = True
        self._wake()
        if self.on_complete is not None:
            done, self.on_complete = self.on_complete, None
            done()

    def _failed(self, error: Broken) -> None:
        self.error = error
        self._wake()

    # -- the caller's side -----------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = self.loop.create_future()
        await self._waiter

    async def head(self) -> None:
        """Wait for the status line and headers (:attr:`status`, :attr:`headers`)."""
        while not self.headed:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def chunk(self) -> bytes | None:
        """The next piece of the body, None at its end."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks.popleft()
                cost = len(data) + PIECE_COST
                self._held -= cost
                budget = self.budget
                budget.held -= cost
                if self._held <= self.limit and (budget.held <= budget.limit or not chunks):
                    self.conn.resume()
                return data if type(data) is bytes else bytes(data)
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self.conn.resume()  # nothing held: this one may always read (the budget aside)
            await self._wait()

    def when_complete(self, done: Callable[[], None]) -> None:
        """Run ``done`` once the whole answer has arrived (at once if it has)."""
        if self.complete:
            done()
        else:
            self.on_complete = done

    def abandon(self) -> None:
        """The caller stops here: what is held goes back; an unfinished answer closes."""
        self.on_complete = None
        self.budget.held -= self._held
        self._held = 0
        self._chunks.clear()
        if not self.complete:
            self.conn.close()
