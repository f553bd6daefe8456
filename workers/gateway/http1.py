"""A small HTTP/1.1 client for the gateway's hot path: kept-alive connections, sent as given.

The gateway forwards a request as its caller sent it, so the client must add nothing
and change nothing: the request target goes out byte for byte (``%2F`` stays ``%2F``,
``%3F`` is not a query), and no header is added - no ``Accept-Encoding``, no
``User-Agent``, no cookies. A general-purpose client (httpx) normalizes the URL and
adds its own defaults; it also costs several times more per request than this one
(measured: docs/benchmarks.md, "Why the gateway has its own client").

* :class:`Pool` - the idle connections to one replica address, last used first. A
  connection idle for ``IDLE_S`` is closed (servers close idle connections too - Node
  after 5 s - and a request sent on a connection the server is closing is lost). A
  connection whose server hung up while it was idle is never reused.
* :class:`Connection` - one TCP connection (``TCP_NODELAY``), an ``asyncio.Protocol``
  whose bytes go to an ``httptools`` (llhttp) response parser, one exchange at a time.
* :class:`Exchange` - one request's answer: :meth:`Exchange.head` waits for the status
  and headers, :meth:`Exchange.chunk` hands out the body as it arrives. ``on_complete``
  runs the moment the whole answer has arrived; the connection then goes back to its
  pool (if the answer allows keep-alive).

**The answer is a replica's, and a replica is a tenant's code: an attacker.** Whatever
of it the client keeps is bounded (:class:`Limits`) before it is kept:

* *The head* - status line, header lines, every interim (1xx) head before the final
  one - is counted as raw bytes as they are fed to the parser (not as headers once
  assembled: llhttp hands a header over only when it is complete, and httptools joins
  its pieces meanwhile), and may take ``head_bytes`` in all and ``head_lines`` header
  lines; each head must be complete within ``head_timeout_s`` of its first byte.
* *After the head*, bytes that carry no body (chunk framing, chunk extensions,
  trailers) may take ``head_bytes`` in a row; trailers are dropped, never kept.
* *The body* is read up to ``read_ahead`` bytes ahead of the caller, charged by what it
  costs in memory (``PIECE_COST`` for each piece kept, small pieces joined), and all
  exchanges together may hold ``Budget.limit`` bytes: past it, a connection reads only
  while its caller waits for more. Beyond either, the connection stops reading, so an
  answer that fits completes - and its environment can go back - whatever the gateway's
  own caller does with it.

An answer over a limit fails its exchange with :class:`Rejected` and closes the
connection. So does a ``101`` (the gateway forwards no upgrade), and bytes that follow
a complete answer never reach the next request: the connection is closed, not reused.

Errors: :class:`Broken` - the connection failed, or the replica sent what is not HTTP;
:class:`Rejected` (a :class:`Broken`) - the answer broke a limit.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

IDLE_S = 4.0  # a kept-alive connection unused this long is closed, not reused
MAX_IDLE = 64  # idle connections kept per replica address
NO_BODY_STATUS = frozenset({204, 304})
SMALL_BODY = 64 * 1024  # a body up to this size goes out in the same write as the head
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


class _Stop(Exception):
    """Raised in a parser callback to stop the parse (the connection is done)."""


class Exchange:
    """One request's answer as it arrives: status and headers, then body chunks."""

    def __init__(self, conn: Connection, head_only: bool) -> None:
        self.conn = conn
        self.head_only = head_only  # a HEAD request: the answer ends with its headers
        self.limit = conn.pool.limits.read_ahead
        self.budget = conn.pool.budget
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
        self._waiter = self.conn.loop.create_future()
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


class Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection to a replica; one exchange at a time."""

    def __init__(self, pool: Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None  # while an exchange runs
        self._spare: httptools.HttpResponseParser | None = None  # the last one, reusable
        self._headers: list[tuple[bytes, bytes]] = []
        self._framed = False  # Content-Length or chunked: the answer does not end at EOF
        self._interim = False  # a 1xx answer, skipped
        self._paused = False
        # The heads (interim ones, then the final one) being read, against the limits:
        self._heading = False  # from the request's sending to the end of the final head
        self._head_room = 0  # raw bytes the heads may still take
        self._lines = 0  # header lines they may still have
        self._begun = False  # a head's first byte arrived: its deadline runs
        self._deadline: asyncio.TimerHandle | None = None
        # After the head: bytes fed in a row with no body in them (framing, trailers).
        self._bare = 0
        self._moved = False  # the last feed carried body

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport; Nagle off (one write per request already)."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        """Feed the parser, counting what the limits bound; bytes while idle close it."""
        parser = self._parser
        if parser is None or self.exchange is None:
            self.close()  # nobody asked: a server that talks out of turn is not reused
            return
        try:
            if self._heading:
                self._feed_head(parser, data)
            else:
                self._feed_body(parser, data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            # a callback's _Stop (a limit, or bytes past the answer's end), or not HTTP
            self._fail(f"the replica's answer is not HTTP/1.1: {exc}")

    def _feed_head(self, parser: httptools.HttpResponseParser, data: bytes) -> None:
        """Feed bytes of a head (and what follows it), refusing a head past its bytes."""
        room = self._head_room
        if len(data) <= room:
            self._head_room = room - len(data)
            parser.feed_data(data)
        else:  # the head must end within the room left: feed that much, then see
            view = memoryview(data)
            self._head_room = 0
            parser.feed_data(view[:room])
            if self._heading:
                limit = self.pool.limits.head_bytes
                self._reject(
                    f"the head of the replica's answer is over {limit} bytes", "head_bytes"
                )
                return
            if self._parser is parser and self.exchange is not None:
                self._feed_body(parser, view[room:])
            else:
                self.close()  # the answer ended already: what follows is no one's
            return
        if self._heading and self._begun and self._deadline is None:
            self._deadline = self.loop.call_later(self.pool.limits.head_timeout_s, self._late)

    def _feed_body(self, parser: httptools.HttpResponseParser, data: bytes | memoryview) -> None:
        """Feed bytes after the head; too many in a row without body refuse the answer."""
        self._moved = False
        parser.feed_data(data)
        if self._moved:
            self._bare = 0
        elif self.exchange is not None:
            self._bare += len(data)
            if self._bare > self.pool.limits.head_bytes:
                limit = self.pool.limits.head_bytes
                self._reject(
                    f"the replica sent over {limit} bytes of trailers or chunk framing", "trailers"
                )

    def eof_received(self) -> bool:
        """The server closed its side: close ours."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """End or fail the exchange in progress; never reuse this connection."""
        self.closed = True
        self.pool.forget(self)
        self._stop_deadline()
        exchange = self.exchange
        if exchange is None or exchange.complete:
            return
        if exchange.headed and not self._framed:
            self._finish()  # an answer delimited by the end of the connection
            return
        why = f": {exc}" if exc else ""
        self._fail(f"the replica closed the connection before the end of its answer{why}")

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        """A head's first byte: its deadline starts (after a complete answer: extra bytes)."""
        if self.exchange is None:
            raise _Stop("bytes after the end of the answer")
        self._begun = True

    def on_header(self, name: bytes, value: bytes) -> None:
        """One header line of a head (kept, up to the limit), or a trailer (dropped)."""
        if self._heading:
            self._lines -= 1
            if self._lines < 0:
                limit = self.pool.limits.head_lines
                self._reject(f"the replica's answer has over {limit} header lines", "head_lines")
                raise _Stop("too many header lines")
            self._headers.append((name, value))
        elif self.exchange is None:
            raise _Stop("bytes after the end of the answer")

    def on_headers_complete(self) -> None:
        """Status and headers are in: tell the exchange (a 1xx answer is skipped)."""
        parser, exchange = self._parser, self.exchange
        if parser is None or exchange is None:
            raise _Stop("bytes after the end of the answer")
        status = parser.get_status_code()
        headers, self._headers = self._headers, []
        self._begun = False
        self._stop_deadline()
        if 100 <= status < 200:
            if status == 101:
                self._reject("the replica switched protocols (101), which no one asked", "upgrade")
                raise _Stop("switched protocols")
            self._interim = True  # dropped: the final head follows
            return
        self._heading = False
        self._framed = any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers
        )
        exchange._headed(status, headers)
        if exchange.head_only or status in NO_BODY_STATUS:
            self._framed = True
            self._finish()

    def on_body(self, body: bytes) -> None:
        """A piece of the body."""
        if self.exchange is None:
            raise _Stop("bytes after the end of the answer")
        self._moved = True
        self.exchange._body(body)

    def on_message_complete(self) -> None:
        """The answer is complete (a 1xx: the real one follows)."""
        if self._interim:
            self._interim = False
            return
        if self.exchange is not None and not self.exchange.complete:
            self._finish()

    # -- the pool's side -------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, head_only: bool) -> Exchange:
        """Write one request (one write, unless its body is large) and return its exchange."""
        assert self.transport is not None  # noqa: S101 - narrows for mypy after a check made above
        limits = self.pool.limits
        self.exchange = Exchange(self, head_only)
        # llhttp starts on the next message by itself after a complete one: the parser of
        # an answer that ended cleanly serves the next request (not one after a HEAD,
        # whose parser still expects the body its headers announced).
        self._parser, self._spare = self._spare or httptools.HttpResponseParser(self), None
        self._headers, self._framed, self._interim = [], False, False
        self._heading, self._head_room, self._lines = True, limits.head_bytes, limits.head_lines
        self._begun, self._bare = False, 0
        if self._paused:  # paused by the last exchange, which has all it needs
            self._paused = False
            self.transport.resume_reading()
        if len(body) <= SMALL_BODY:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))  # no copy of a large body
        return self.exchange

    def _finish(self) -> None:
        assert self.exchange is not None and self._parser is not None  # noqa: S101 - narrows for mypy after a check made above
        exchange = self.exchange
        # A HEAD answer ends with its headers (llhttp would wait for its announced body;
        # the next request gets a parser of its own).
        reusable = not self.closed and self._framed and self._parser.should_keep_alive()
        if reusable and not exchange.head_only and exchange.status not in NO_BODY_STATUS:
            self._spare = self._parser
        self.exchange = None
        self._parser = None
        if reusable:
            self.idle_since = time.monotonic()
            self.pool.put(self)
        else:
            self.close()
        exchange._completed()

    def _late(self) -> None:
        """A head's deadline passed."""
        self._deadline = None
        limit = self.pool.limits.head_timeout_s
        self._reject(f"the head of the replica's answer took over {limit:g}s", "head_timeout", 504)

    def _reject(self, message: str, reason: str, status: int = 502) -> None:
        """Refuse the answer: the exchange fails with :class:`Rejected`, the connection closes."""
        self._fail(message, Rejected(message, reason, status))

    def _fail(self, message: str, error: Broken | None = None) -> None:
        exchange, self.exchange = self.exchange, None
        self._heading = False
        self.close()
        if exchange is not None:
            exchange._failed(error or Broken(message))

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def pause(self) -> None:
        """Stop reading (the exchange's buffer, or the budget, is full)."""
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read again."""
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        """Close the connection (its exchange, if any, fails)."""
        self.closed = True
        self._stop_deadline()
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.close()


class Pool:
    """The kept-alive connections to one replica address."""

    def __init__(
        self,
        address: str,
        connect_timeout: float,
        limits: Limits | None = None,
        budget: Budget | None = None,
    ) -> None:
        parts = urlsplit(address)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"cannot forward to {address!r}: only http://HOST:PORT")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.netloc = parts.netloc.encode("ascii")
        self.connect_timeout = connect_timeout
        self.limits = limits or Limits()
        self.budget = budget or Budget()
        self.idle: list[Connection] = []
        self.users = 0
        self.last_used = time.monotonic()

    async def send(self, head: bytes, body: bytes, *, head_only: bool) -> Exchange:
        """Send one request on an idle connection, else a new one; its exchange."""
        self.last_used = time.monotonic()
        too_old = self.last_used - IDLE_S
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and conn.idle_since >= too_old:
                return conn.send(head, body, head_only)
            conn.close()
        conn = await self._connect()
        return conn.send(head, body, head_only)

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, loop), self.host, self.port
                )
        except TimeoutError:
            raise Broken(f"no connection within {self.connect_timeout:g}s", refused=True) from None
        except OSError as exc:
            raise Broken(f"cannot connect: {exc}", refused=True) from None
        return conn

    def put(self, conn: Connection) -> None:
        """A connection whose exchange ended cleanly: keep it for the next request."""
        if len(self.idle) < MAX_IDLE:
            self.idle.append(conn)
        else:
            conn.close()

    def forget(self, conn: Connection) -> None:
        """A connection that closed: never hand it out."""
        if conn in self.idle:
            self.idle.remove(conn)

    def sweep(self) -> None:
        """Close the connections idle for longer than ``IDLE_S``."""
        too_old = time.monotonic() - IDLE_S
        for conn in [c for c in self.idle if c.idle_since < too_old]:
            conn.close()

    def close(self) -> None:
        """Close every idle connection."""
        for conn in list(self.idle):
            conn.close()
        self.idle = []
