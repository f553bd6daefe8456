"""Bounded HTTP serving: the one server stack of the gateway, the Lambdo host and the exporter.

The model
---------
Each of corral's HTTP servers is an ASGI application served by uvicorn (HTTP/1.1
parsed by httptools, i.e. llhttp) on one asyncio loop. uvicorn bounds what a request's
body costs (it buffers 64 KiB of it, and only once the application asks for it, so an
application that checks the token first reads no body for a caller without one), but
not what a caller can make it do before the application runs: it accepts any number
of connections, waits for a request head as long as the caller takes, and its parser
grows a header until the header ends - a value that never ends is joined a read at a
time, each read copying all that came before, so one such caller costs quadratic CPU
and stalls everyone on the loop.

:func:`guarded` makes the protocol class uvicorn serves each connection with
(``uvicorn.Config(http=...)`` takes one). It is not a subclass of uvicorn's: it makes
uvicorn's own HTTP/1.1 protocol for the connection and hands it the bytes it receives,
once counted, and a transport whose ``close`` lingers. It bounds, per :class:`Limits`:

* **connections**: at most ``max_connections`` at once; one more is answered ``503``
  and closed at once;
* **a request head** (its first byte to the blank line that ends it, counted as raw
  bytes as they arrive): past ``head_bytes`` it is answered ``431``, and when it is not
  in within ``head_timeout_s`` of its first byte (or of the connection's opening)
  ``408``; either way the connection closes and the bytes are not handed on, so
  uvicorn's parser never holds more than ``head_bytes`` of a head however long it is
  (blank lines between requests are waiting for a head);
* **an idle connection** between requests: uvicorn's keep-alive timeout (``idle_s``);
* **an answer sent before the request's body was read** (no token: 401; too large:
  413) that closes the connection closes it lingering, as nginx does: the answer goes,
  the sending side is shut, then at most :data:`LINGER_BYTES` of what the caller still
  sends are read and dropped for at most :data:`LINGER_S`, so the caller reads the
  answer instead of a reset.

Where each request begins and where its head ends comes from a second llhttp parser
(httptools' ``HttpRequestParser``) given only the callbacks for those boundaries:
without a header callback it keeps nothing of a header. A read that holds the end of
one request and the start of the next (pipelining) counts toward the next head from
the following read on: llhttp does not say where in a read a request ends, so such a
head may pass with up to one read (at most 256 KiB) over the limit; none grows past it.

A refused head is answered once the answers under way on its connection have been
sent (a caller may send its next request before the last answer): the guard learns
that a request is done from :func:`serve_app`, the wrapper every application is served
in, which also lets an application end its connection without an answer
(:func:`hang_up`, a fault the Lambdo host plays for tests).
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = [
    "LINGER_BYTES",
    "LINGER_S",
    "BackgroundServer",
    "Limits",
    "bind",
    "guarded",
    "hang_up",
    "run",
    "serve_app",
    "start",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

CONNECTION = "netplumb.connection"  # where a request's scope["state"] holds its connection
LINGER_S = 1.0  # after an early answer, how long the caller's unread bytes are drained
LINGER_BYTES = 64 * 1024  # and how many at most
_REQUEST_START = re.compile(rb"[^\r\n]")  # llhttp skips blank lines before a request
_HEAD_END = b"\r\n\r\n"  # llhttp accepts no other (a bare LF is a parse error)
_BEGIN, _HEAD, _DONE = 1, 2, 3  # the boundaries the second parser reports


@dataclass(frozen=True)
class Limits:
    """What one server allows a caller before its application runs."""

    max_connections: int = 64
    head_bytes: int = 32 * 1024  # request line and headers (nginx: 4 x 8 KiB + the line)
    head_timeout_s: float = 10.0
    idle_s: int = 10  # a kept-alive connection's wait for its next request


def _refusal(status: bytes, message: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: " + str(len(message)).encode() + b"\r\nconnection: close\r\n\r\n"
        b"" + message
    )


BUSY = _refusal(b"503 Service Unavailable", b"too many connections\n")
TIMED_OUT = _refusal(b"408 Request Timeout", b"request head not received in time\n")
TOO_LARGE = _refusal(b"431 Request Header Fields Too Large", b"request head too large\n")


class _Transport:
    """The transport uvicorn's protocol is given: the connection's, with a lingering close."""

    def __init__(self, guard: Guarded, transport: asyncio.Transport) -> None:
        self._guard = guard
        self._transport = transport

    def write(self, data: bytes) -> None:
        """Write, unless the connection is closing (its sending side may be shut)."""
        if not self._guard.closing:
            self._transport.write(data)

    def close(self) -> None:
        """Close as the guard does: lingering while the caller may still be sending."""
        self._guard.close()

    def is_closing(self) -> bool:
        """True once either side closed the connection."""
        return self._guard.closing or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Guarded(asyncio.Protocol):
    """One connection: uvicorn's HTTP/1.1 protocol behind a guard on the request head."""

    limits: ClassVar[Limits] = Limits()
    serving: ClassVar[set[Guarded]] = set()  # this server's connections (per server class)

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Make uvicorn's protocol for this connection; its requests' state names this guard."""
        self.loop = _loop or asyncio.get_event_loop()
        state = {**app_state, CONNECTION: self}
        self.http = HttpToolsProtocol(config, server_state, state, self.loop)
        self.parser = httptools.HttpRequestParser(self)  # boundaries only: keeps nothing
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's
        self.transport: asyncio.Transport | None = None
        self.closing = False
        self.marks: list[int] = []  # boundaries met in the read being counted (below)
        self.in_head = False  # a request began and its head is not complete
        self.in_message = False  # a request began and its body is not complete
        self.head_bytes = 0  # of the head under way, counted in earlier reads
        self.tail = b""  # its last 3 bytes (its end may straddle two reads)
        self.heads = 0  # heads handed on
        self.answered = 0  # requests the application finished with (serve_app)
        self.upgraded = False
        self.refusal: bytes | None = None  # the last answer, once the ones under way are sent
        self.linger_left = 0
        self.timer: asyncio.TimerHandle | None = None

    # -- llhttp's callbacks (the second parser's): where requests begin and heads end --

    def on_message_begin(self) -> None:
        """A request begins."""
        self.marks.append(_BEGIN)
        self.in_head = self.in_message = True

    def on_headers_complete(self) -> None:
        """Its head is complete."""
        self.marks.append(_HEAD)
        self.in_head = False

    def on_message_complete(self) -> None:
        """Its body is complete."""
        self.marks.append(_DONE)
        self.in_message = False

    # -- asyncio's protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Refuse one connection over the limit; else hand it to uvicorn, the head's clock on."""
        tcp = cast(asyncio.Transport, transport)
        self.transport = tcp
        sock = tcp.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self.serving) >= self.limits.max_connections:
            self.closing = True
            tcp.write(BUSY)
            tcp.close()
            return
        self.serving.add(self)
        self.http.connection_made(cast(asyncio.Transport, _Transport(self, tcp)))
        self.timer = self.loop.call_later(self.limits.head_timeout_s, self.refuse, TIMED_OUT)

    def data_received(self, data: bytes) -> None:
        """Count a head's bytes, then hand them to uvicorn; or refuse the head."""
        if self.upgraded:  # bytes after an Upgrade request: nobody here speaks that protocol
            self.refuse(b"")
        if self.closing or self.refusal is not None:
            self._drop(len(data))
            return
        head_was_open = self.in_head
        self.marks.clear()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.upgraded = True  # none of corral's servers upgrades: this request is the last
        except httptools.HttpParserError:
            self.http.data_received(data)  # uvicorn answers 400 and closes
            return
        if self._too_large(data, head_was_open):
            self.refuse(TOO_LARGE)
            return
        self.heads += self.marks.count(_HEAD)
        waiting = self.in_head or not (self.in_message or self.marks)  # blank lines: a head next
        if waiting and self.timer is None:
            self.timer = self.loop.call_later(self.limits.head_timeout_s, self.refuse, TIMED_OUT)
        elif not waiting:
            self._stop_clock()
        self.http.data_received(data)

    def _too_large(self, data: bytes, head_was_open: bool) -> bool:
        """Whether the head under way in this read, where its start is known, is too large."""
        marks = self.marks
        if marks[:1] == [_BEGIN]:  # a head begins in this read, before anything else ends
            found = _REQUEST_START.search(data)
            start, self.head_bytes, self.tail = (found.start() if found else 0), 0, b""
        elif head_was_open:
            start = 0
        else:  # none begins, or one begins behind another's end: counted from the next read
            self.head_bytes, self.tail = 0, b""
            return False
        if _HEAD not in marks:  # the head goes on past this read
            self.head_bytes += len(data) - start
            self.tail = (self.tail + data[-3:])[-3:]
            return self.head_bytes > self.limits.head_bytes
        straddling = (self.tail + data[:3]).find(_HEAD_END)
        if straddling >= 0:
            end = straddling + len(_HEAD_END) - len(self.tail)
        else:
            found_end = data.find(_HEAD_END, start)
            end = found_end + len(_HEAD_END) if found_end >= 0 else len(data)
        size = self.head_bytes + end - start
        self.head_bytes, self.tail = 0, b""  # a head begun behind it: from the next read
        return size > self.limits.head_bytes

    def eof_received(self) -> bool | None:
        """The caller stopped sending: the connection closes (as uvicorn has it)."""
        if not self.closing:
            self.http.eof_received()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the clock; tell uvicorn."""
        self._stop_clock()
        if self in self.serving:
            self.serving.discard(self)
            self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        """The caller reads slower than the answer comes: uvicorn waits."""
        self.http.pause_writing()

    def resume_writing(self) -> None:
        """The caller caught up."""
        self.http.resume_writing()

    # -- ending a connection ------------------------------------------------------------

    def refuse(self, answer: bytes) -> None:
        """Take no more requests: once the answers under way are sent, send ``answer``, close."""
        if self.closing or self.transport is None or self.refusal is not None:
            return
        self._stop_clock()
        self.refusal = answer
        if self.heads == self.answered:
            self.finished(0)
        else:
            self.transport.pause_reading()

    def finished(self, requests: int = 1) -> None:
        """The application is done with a request (:func:`serve_app`): a refusal may go now."""
        self.answered += requests
        if self.refusal is not None and self.heads == self.answered and self.transport:
            self.transport.write(self.refusal)
            self.close()

    def close(self) -> None:
        """Close the connection, lingering while a request of it is not all in."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        self._stop_clock()
        transport = self.transport
        if not self.in_message or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        transport.resume_reading()
        self.linger_left = LINGER_BYTES
        self.timer = self.loop.call_later(LINGER_S, transport.close)

    def _drop(self, size: int) -> None:
        """Bytes after the connection's last request: dropped; lingering, up to a bound."""
        self.linger_left -= size
        if self.closing and self.linger_left < 0 and self.transport is not None:
            self.transport.close()

    def _stop_clock(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def guarded(limits: Limits) -> type[Guarded]:
    """The protocol class for one uvicorn server (``Config(http=...)``), with these limits."""
    return type("Guarded", (Guarded,), {"limits": limits, "serving": set()})


def serve_app(app: App) -> App:
    """``app`` as a guarded server serves it: each request's end is told to its connection."""

    async def served(scope: Scope, receive: Receive, send: Send) -> None:
        connection = scope.get("state", {}).get(CONNECTION) if scope["type"] == "http" else None
        try:
            await app(scope, receive, send)
        finally:
            if connection is not None:
                connection.finished()

    return served


async def hang_up(scope: Scope, receive: Receive) -> None:
    """Close the request's connection without an answer; returns once it is gone."""
    connection: Guarded = scope["state"][CONNECTION]
    if connection.transport is not None:
        connection.closing = True
        connection.transport.abort()
    while (await receive())["type"] != "http.disconnect":
        pass


# -- running a server --------------------------------------------------------------------


def config(app: App, limits: Limits, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for a guarded server of ``app`` (``options``: uvicorn's own)."""
    settings: dict[str, Any] = {
        "log_config": None,  # the process's logging, as configured, carries uvicorn's
        "log_level": "warning",
        "access_log": False,
        "lifespan": "off",
        "ws": "none",
        "proxy_headers": False,  # X-Forwarded-* are the application's to judge
        "server_header": False,
        "date_header": False,
        **options,
    }
    return uvicorn.Config(
        serve_app(app), http=guarded(limits), timeout_keep_alive=limits.idle_s, **settings
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (a host with ``:`` is IPv6); OSError if not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class BackgroundServer:
    """A guarded server on a loop of its own, in a thread; :meth:`stop` ends it."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, name: str) -> None:
        """Start serving ``sock``; returns once the server accepts connections."""
        self.server = server
        self.port = int(sock.getsockname()[1]) if sock.family != socket.AF_UNIX else 0
        self.thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 15
        while not server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise OSError(f"{name} did not start on port {self.port}")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let the requests under way finish (up to ``timeout``), close."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)


def start(
    app: App, sock: socket.socket, limits: Limits, *, name: str, **options: Any
) -> BackgroundServer:
    """Serve ``app`` on the bound ``sock`` in a background thread."""
    return BackgroundServer(uvicorn.Server(config(app, limits, **options)), sock, name)


def run(app: App, sock: socket.socket, limits: Limits, **options: Any) -> None:
    """Serve ``app`` on the bound ``sock`` in this thread until SIGINT or SIGTERM."""
    uvicorn.Server(config(app, limits, **options)).run(sockets=[sock])
