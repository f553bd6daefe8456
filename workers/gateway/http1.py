"""A small HTTP/1.1 client for the gateway's hot path: kept-alive connections, sent as given.

The gateway forwards a request as its caller sent it, so the client must add nothing
and change nothing: the request target goes out byte for byte (``%2F`` stays ``%2F``,
``%3F`` is not a query), and no header is added - no ``Accept-Encoding``, no
``User-Agent``, no cookies. A general-purpose client (httpx) normalizes the URL and
adds its own defaults; it also costs several times more per request than this one.

* :class:`Pool` - the idle connections to one replica address, last used first. A
  connection idle for ``IDLE_S`` is closed (servers close idle connections too - Node
  after 5 s - and a request sent on a connection the server is closing is lost). A
  connection whose server hung up while it was idle is never reused.
* :class:`Connection` - one TCP connection (``TCP_NODELAY``), an ``asyncio.Protocol``
  whose bytes go to an ``httptools`` (llhttp) response parser, one exchange at a time.
* :class:`Exchange` - one request's answer: :meth:`Exchange.head` waits for the status
  and headers, :meth:`Exchange.chunk` hands out the body as it arrives. Up to
  ``buffer`` bytes of body are read ahead of the caller (beyond that the connection
  stops reading), so a replica's answer that fits completes - and its environment can
  go back - whatever the gateway's own caller does with it. ``on_complete`` runs the
  moment the whole answer has arrived; the connection then goes back to its pool (if
  the answer allows keep-alive).

Errors: :class:`Broken` - the connection failed, or the replica sent what is not HTTP;
``sent_nothing`` says whether any byte of an answer had arrived.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

IDLE_S = 4.0  # a kept-alive connection unused this long is closed, not reused
MAX_IDLE = 64  # idle connections kept per replica address
NO_BODY_STATUS = frozenset({204, 304})
SMALL_BODY = 64 * 1024  # a body up to this size goes out in the same write as the head


class Broken(Exception):
    """The exchange failed: connection refused, reset or closed early, or not HTTP."""

    def __init__(self, message: str, *, refused: bool = False, answered: bool = False) -> None:
        super().__init__(message)
        self.refused = refused  # the connection was never made
        self.answered = answered  # part of an answer had arrived


class Exchange:
    """One request's answer as it arrives: status and headers, then body chunks."""

    def __init__(self, conn: Connection, head_only: bool, buffer: int) -> None:
        self.conn = conn
        self.head_only = head_only  # a HEAD request: the answer ends with its headers
        self.buffer = buffer
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headed = False
        self.complete = False
        self.error: Broken | None = None
        self.on_complete: Callable[[], None] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
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
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > self.buffer:
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
        self._waiter = asyncio.get_running_loop().create_future()
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
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._buffered <= self.buffer:
                    self.conn.resume()
                return data
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self._wait()

    def when_complete(self, done: Callable[[], None]) -> None:
        """Run ``done`` once the whole answer has arrived (at once if it has)."""
        if self.complete:
            done()
        else:
            self.on_complete = done

    def abandon(self) -> None:
        """The caller stops here: an answer not read to its end closes the connection."""
        self.on_complete = None
        if not self.complete:
            self.conn.close()


class Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection to a replica; one exchange at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
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

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport; Nagle off (one write per request already)."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; bytes while idle are a protocol error."""
        if self._parser is None or self.exchange is None:
            self.close()  # nobody asked: a server that talks out of turn is not reused
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"the replica's answer is not HTTP/1.1: {exc}")

    def eof_received(self) -> bool:
        """The server closed its side: close ours."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """End or fail the exchange in progress; never reuse this connection."""
        self.closed = True
        self.pool.forget(self)
        exchange = self.exchange
        if exchange is None or exchange.complete:
            return
        if exchange.headed and not self._framed:
            self._finish()  # an answer delimited by the end of the connection
            return
        why = f": {exc}" if exc else ""
        self._fail(f"the replica closed the connection before the end of its answer{why}")

    # -- httptools callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        """One header line of the answer."""
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        """Status and headers are in: tell the exchange (a 1xx answer is skipped)."""
        assert self._parser is not None and self.exchange is not None  # noqa: S101 - narrows for mypy after a check made above
        status = self._parser.get_status_code()
        headers, self._headers = self._headers, []
        if 100 <= status < 200:
            if status == 101:
                self._fail("the replica switched protocols, which was not asked for")
            self._interim = True
            return
        self._framed = any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers
        )
        self.exchange._headed(status, headers)
        if self.exchange.head_only or status in NO_BODY_STATUS:
            self._framed = True
            self._finish()

    def on_body(self, body: bytes) -> None:
        """A piece of the body."""
        if self.exchange is not None and not self.exchange.complete:
            self.exchange._body(body)

    def on_message_complete(self) -> None:
        """The answer is complete (a 1xx: the real one follows)."""
        if self._interim:
            self._interim = False
            return
        if self.exchange is not None and not self.exchange.complete:
            self._finish()

    # -- the pool's side -------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, head_only: bool, buffer: int) -> Exchange:
        """Write one request (one write, unless its body is large) and return its exchange."""
        assert self.transport is not None  # noqa: S101 - narrows for mypy after a check made above
        self.exchange = Exchange(self, head_only, buffer)
        # llhttp starts on the next message by itself after a complete one: the parser of
        # an answer that ended cleanly serves the next request (not one after a HEAD,
        # whose parser still expects the body its headers announced).
        self._parser, self._spare = self._spare or httptools.HttpResponseParser(self), None
        self._headers, self._framed, self._interim = [], False, False
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

    def _fail(self, message: str) -> None:
        exchange, self.exchange = self.exchange, None
        self.close()
        if exchange is not None:
            exchange._failed(Broken(message, answered=exchange.headed))

    def pause(self) -> None:
        """Stop reading (the exchange's buffer is full)."""
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
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.close()


class Pool:
    """The kept-alive connections to one replica address."""

    def __init__(self, address: str, connect_timeout: float) -> None:
        parts = urlsplit(address)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"cannot forward to {address!r}: only http://HOST:PORT")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.netloc = parts.netloc.encode("ascii")
        self.connect_timeout = connect_timeout
        self.idle: list[Connection] = []
        self.users = 0
        self.last_used = time.monotonic()

    async def send(self, head: bytes, body: bytes, *, head_only: bool, buffer: int) -> Exchange:
        """Send one request on an idle connection, else a new one; its exchange."""
        self.last_used = time.monotonic()
        too_old = self.last_used - IDLE_S
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and conn.idle_since >= too_old:
                return conn.send(head, body, head_only, buffer)
            conn.close()
        conn = await self._connect()
        return conn.send(head, body, head_only, buffer)

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self), self.host, self.port
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
