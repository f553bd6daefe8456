"""A small HTTP/1.1 client for the gateway's hot path: kept-alive connections, sent as given.

The gateway forwards a request as its caller sent it, so the client must add nothing
and change nothing: the request target goes out byte for byte (``%2F`` stays ``%2F``,
``%3F`` is not a query), and no header is added - no ``Accept-Encoding``, no
``User-Agent``, no cookies. A general-purpose client (httpx) normalizes the URL and
adds its own defaults; it also costs several times more per request than this one
(measured: docs/benchmarks.md, bench.clients).

* :class:`Pool` - the idle connections to one replica address, last used first. A
  connection idle for ``IDLE_S`` is closed (servers close idle connections too - Node
  after 5 s - and a request sent on a connection the server is closing is lost). A
  connection whose server hung up while it was idle is never reused. The pools of a
  gateway share :class:`Sockets`: the connections they hold open in all, kept within
  what the gateway's descriptors allow (a new one first closes an idle one, of any
  replica, when they are at their cap).
* :class:`Connection` - one TCP connection (``TCP_NODELAY``), an ``asyncio.Protocol``
  whose bytes go to an ``httptools`` (llhttp) response parser, one exchange at a time.
* :class:`Exchange` (:mod:`workers.gateway.exchange`) - one request's answer as its
  caller takes it, the body read ahead of the caller within its memory limits.

**The answer is a replica's, and a replica is a tenant's code: an attacker.** Whatever
of it the client keeps is bounded (:class:`Limits`) before it is kept:

* *The head* - status line, header lines, every interim (1xx) head before the final
  one - is counted as raw bytes as they are fed to the parser (not as headers once
  assembled: llhttp hands a header over only when it is complete, and httptools joins
  its pieces meanwhile), and may take ``head_bytes`` in all and ``head_lines`` header
  lines; each head must be complete within ``head_timeout_s`` of its first byte.
* *After the head*, bytes that carry no body (chunk framing, chunk extensions,
  trailers) may take ``head_bytes`` in a row; trailers are dropped, never kept.
* *The body* is fed to the parser about ``PIECES_A_TURN`` pieces at a turn of the
  loop (a body of tiny chunks costs a callback each: a whole read at once would hold
  every other request back), and read ahead of the caller by the exchange's rules.

An answer over a limit fails its exchange with :class:`Rejected` and closes the
connection. So does a ``101`` (the gateway forwards no upgrade), and bytes that follow
a complete answer never reach the next request: the connection is closed, not reused.

Errors: :class:`Broken` - the connection failed, or the replica sent what is not HTTP;
:class:`Rejected` (a :class:`Broken`) - the answer broke a limit; :class:`Exhausted` -
the gateway had no file descriptor free to connect with (EMFILE, ENFILE): its own
trouble, never the replica's.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from typing import cast

import httptools

from netplumb.addresses import parse_url
from netplumb.descriptors import exhausted
from workers.gateway.exchange import Broken, Budget, Exchange, Limits, Rejected

__all__ = [
    "Broken",
    "Budget",
    "Connection",
    "Exchange",
    "Exhausted",
    "Limits",
    "Pool",
    "Rejected",
    "Sockets",
]

IDLE_S = 4.0  # a kept-alive connection unused this long is closed, not reused
MAX_IDLE = 64  # idle connections kept per replica address
NO_BODY_STATUS = frozenset({204, 304})
SMALL_BODY = 64 * 1024  # a body up to this size goes out in the same write as the head
# The body's pieces (parser callbacks) fed at one turn of the loop, about: the rest of a
# read waits for the next turn, other connections' work going between. A piece costs
# about 1 us; in 2-byte chunks a whole read (256 KiB) is 37,000 of them, some 35 ms.
# Each connection learns how many bytes that is from its last feed, from FEED_FIRST
# bytes (a plain body is one piece a read, so its reads soon go whole again).
PIECES_A_TURN = 256
FEED_FIRST, FEED_LEAST, FEED_MOST = 16 * 1024, 1024, 1024 * 1024


class _Stop(Exception):
    """Raised in a parser callback to stop the parse (the connection is done)."""


class Exhausted(Exception):
    """No file descriptor was free to connect with: the gateway's trouble, not the replica's."""


class Sockets:
    """The connections all pools sharing it hold open, and how many they may."""

    __slots__ = ("limit", "open", "pools")

    def __init__(self, limit: int = sys.maxsize) -> None:
        self.limit = limit
        self.open = 0
        self.pools: dict[Pool, None] = {}

    def make_room(self) -> None:
        """At the cap: close one idle connection (the oldest of a pool that has one)."""
        if self.open < self.limit:
            return
        for pool in self.pools:
            if pool.idle:
                pool.idle[0].close()
                return


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
        self._paused = False  # the exchange's read-ahead, or the budget, is full
        self._backlog: memoryview | None = None  # read, not yet fed (see PIECES_A_TURN)
        self._feed_size = FEED_FIRST  # bytes of body fed at one turn of the loop
        self._reading = True  # the transport reads: not paused and no backlog
        # The heads (interim ones, then the final one) being read, against the limits:
        self._heading = False  # from the request's sending to the end of the final head
        self._head_room = 0  # raw bytes the heads may still take
        self._lines = 0  # header lines they may still have
        self._begun = False  # a head's first byte arrived: its deadline runs
        self._deadline: asyncio.TimerHandle | None = None
        # After the head: bytes fed in a row with no body in them (framing, trailers).
        self._bare = 0
        self._pieces = 0  # pieces of body the last feed carried

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport (counted open); Nagle off (one write per request already)."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.pool.sockets.open += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        """Feed the parser, counting what the limits bound; bytes while idle close it."""
        parser = self._parser
        if parser is None or self.exchange is None:
            self.close()  # nobody asked: a server that talks out of turn is not reused
            return
        if self._backlog is not None:  # (not while reading is paused; but should it be)
            self._backlog = memoryview(self._backlog.tobytes() + data)
            return
        self._feed(parser, data)

    def _feed(self, parser: httptools.HttpResponseParser, data: bytes | memoryview) -> None:
        try:
            if self._heading:
                self._feed_head(parser, data)
            else:
                self._feed_body(parser, data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            # a callback's _Stop (a limit, or bytes past the answer's end), or not HTTP
            self._fail(f"the replica's answer is not HTTP/1.1: {exc}")

    def _feed_head(self, parser: httptools.HttpResponseParser, data: bytes | memoryview) -> None:
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
        """Feed bytes after the head, a turn's worth; too many without body refuse the answer."""
        size = self._feed_size
        if len(data) > size:  # the rest at the loop's next turn, reading stopped meanwhile
            view = memoryview(data)
            data, self._backlog = view[:size], view[size:]
            self._sync_reading()
            self.loop.call_soon(self._feed_backlog)
        self._pieces = 0
        parser.feed_data(data)
        pieces = self._pieces
        if pieces > PIECES_A_TURN:
            self._feed_size = max(FEED_LEAST, len(data) * PIECES_A_TURN // pieces)
        elif pieces < PIECES_A_TURN // 2 and size < FEED_MOST and len(data) == size:
            self._feed_size = size * 2
        if self.exchange is None and self._backlog is not None:
            self.close()  # the answer ended: the rest of the read is no one's
        elif pieces:
            self._bare = 0
        elif self.exchange is not None:
            self._bare += len(data)
            if self._bare > self.pool.limits.head_bytes:
                limit = self.pool.limits.head_bytes
                self._reject(
                    f"the replica sent over {limit} bytes of trailers or chunk framing", "trailers"
                )

    def _feed_backlog(self) -> None:
        """Feed the next part of a read (unless the exchange's read-ahead is full)."""
        parser = self._parser
        if self._backlog is None or self._paused or parser is None or self.closed:
            return  # fed already, or the caller's turn first (resume), or done
        rest, self._backlog = self._backlog, None
        self._feed(parser, rest)
        self._sync_reading()

    def _sync_reading(self) -> None:
        """Read while the exchange wants more and no read waits to be fed; else not."""
        want = not self._paused and self._backlog is None
        if want != self._reading and self.transport is not None and not self.closed:
            self._reading = want
            if want:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def eof_received(self) -> bool:
        """The server closed its side: close ours."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """End or fail the exchange in progress; never reuse this connection."""
        self.closed = True
        self.pool.forget(self)
        self.pool.sockets.open -= 1
        self._stop_deadline()
        while self._backlog is not None and self._parser and self.exchange is not None:
            rest, self._backlog = self._backlog, None  # what was read comes first
            self._feed(self._parser, rest)
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
        self._pieces += 1
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
        self.exchange = Exchange(self, self.loop, head_only, limits.read_ahead, self.pool.budget)
        # llhttp starts on the next message by itself after a complete one: the parser of
        # an answer that ended cleanly serves the next request (not one after a HEAD,
        # whose parser still expects the body its headers announced).
        self._parser, self._spare = self._spare or httptools.HttpResponseParser(self), None
        self._headers, self._framed, self._interim = [], False, False
        self._heading, self._head_room, self._lines = True, limits.head_bytes, limits.head_lines
        self._begun, self._bare, self._feed_size = False, 0, FEED_FIRST
        if self._paused:  # paused by the last exchange, which has all it needs
            self._paused = False
            self._sync_reading()
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
        if not self._paused:
            self._paused = True
            self._sync_reading()

    def resume(self) -> None:
        """Read again (what was read and not fed yet, first)."""
        if self._paused:
            self._paused = False
            if self._backlog is not None:
                self.loop.call_soon(self._feed_backlog)
            else:
                self._sync_reading()

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
        sockets: Sockets | None = None,
    ) -> None:
        url = parse_url(address, {"http": 80}, "replica address to forward to")
        self.host = url.host
        self.port = url.port
        self.netloc = url.hostport.encode("ascii")
        self.connect_timeout = connect_timeout
        self.limits = limits or Limits()
        self.budget = budget or Budget()
        self.sockets = sockets or Sockets()
        self.sockets.pools[self] = None
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
        self.sockets.make_room()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, loop), self.host, self.port
                )
        except TimeoutError:
            raise Broken(f"no connection within {self.connect_timeout:g}s", refused=True) from None
        except OSError as exc:
            if exhausted(exc):
                raise Exhausted(f"no file descriptor free to connect with: {exc}") from None
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
        """Close every idle connection; the pool is not used again."""
        self.sockets.pools.pop(self, None)
        for conn in list(self.idle):
            conn.close()
        self.idle = []
