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
and stalls everyone on the loop. It also appends a chunked request's trailers to the
header list the application was given, without bound.

:func:`guarded` makes the protocol class uvicorn serves each connection with
(``uvicorn.Config(http=...)`` takes one). It is not a subclass of uvicorn's: it makes
uvicorn's own HTTP/1.1 protocol for the connection and hands it the bytes it receives,
once counted, and a transport whose ``close`` lingers. It bounds, per :class:`Limits`:

* **connections**: at most ``max_connections`` at once, at most ``per_peer`` from one
  peer address, and of those at most ``anonymous_per_peer`` that have not shown a
  credential yet (the application says when one has: :func:`authenticated`). A
  connection over a cap makes room by closing the oldest connection within that cap
  that has shown no credential, serves no request and is older than
  ``evict_after_s``; when there is none it is answered ``503`` and closed, lingering
  so that a caller that sent its request at once still reads the answer. Peers in
  ``exempt`` (a trusted proxy, which speaks for many) count toward the total only.
  The caps stay below the process's descriptor limit, raised at start
  (:mod:`netplumb.descriptors`, :meth:`Limits.within`);
* **a request head** (its first byte to the blank line that ends it, counted as raw
  bytes as they arrive): past ``head_bytes`` it is answered ``431``, and when it is not
  in within ``head_timeout_s`` of its first byte (or of the connection's opening)
  ``408``; either way the connection closes and the bytes are not handed on, so
  uvicorn's parser never holds more than ``head_bytes`` of a head however long it is
  (blank lines between requests are waiting for a head);
* **trailers** (the fields after a chunked body's last chunk) are dropped, never put
  in the application's headers; the bytes of a body that carry none of it (trailers,
  chunk framing) may take ``head_bytes`` in a row, past which the connection is cut;
* **an idle connection** between requests: uvicorn's keep-alive timeout (``idle_s``);
* **an answer sent before the request's body was read** (no token: 401; too large:
  413) that closes the connection closes it lingering, as nginx does: the answer goes,
  the sending side is shut, then at most :data:`LINGER_BYTES` of what the caller still
  sends are read and dropped for at most :data:`LINGER_S`, so the caller reads the
  answer instead of a reset. At most :data:`LINGERING_MOST` connections linger at once;
  past that they close at once.

Where each request begins and where its head ends comes from a second llhttp parser
(httptools' ``HttpRequestParser``) given only the callbacks for those boundaries (and
the body's pieces, which it counts and drops): without a header callback it keeps
nothing of a header. A read that holds the end of one request and the start of the
next (pipelining) counts toward the next head from the following read on: llhttp does
not say where in a read a request ends, so such a head may pass with up to one read (at
most 256 KiB) over the limit; none grows past it. Trailers that follow a piece of body
in the same read are likewise counted from the next read.

A refused head is answered once the answers under way on its connection have been
sent (a caller may send its next request before the last answer): the guard learns
that a request is done from :func:`serve_app`, the wrapper every application is served
in, which also lets an application end its connection without an answer
(:func:`hang_up`, a fault the Lambdo host plays for tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import itertools
import logging
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

from netplumb import descriptors

__all__ = [
    "LINGERING_MOST",
    "LINGER_BYTES",
    "LINGER_S",
    "BackgroundServer",
    "Limits",
    "authenticated",
    "bind",
    "guarded",
    "hang_up",
    "run",
    "serve_app",
    "start",
    "within_descriptors",
]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

CONNECTION = "netplumb.connection"  # where a request's scope["state"] holds its connection
LINGER_S = 1.0  # after an early answer, how long the caller's unread bytes are drained
# and how many at most: the rest of a refused request's body in flight, up to 1 MiB, is
# read through, so the connection ends with the answer and a FIN. Closed with bytes unread
# it ends in a reset, and a proxy relaying the body (HAProxy, the gateway's warm plane)
# may lose the answer with it: one 503 of a 300 KiB body reached its caller as nothing
# (64 KiB then; read and dropped, the bytes cost time, never memory).
LINGER_BYTES = 1024 * 1024
LINGERING_MOST = 64  # connections of one server lingering at once; past that, closed at once
EVICT_SCAN = 16  # connections looked at, oldest first, for one to make room
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
    per_peer: int = 48  # connections from one peer address
    anonymous_per_peer: int = 16  # of them, ones that have shown no credential yet
    descriptors: int = 1  # file descriptors a connection may cost (a proxy's: 2)
    reserve: int = 64  # descriptors kept for everything but connections
    exempt: tuple[Network, ...] = ()  # peers the per-peer caps do not apply to
    evict_after_s: float = 1.0  # an anonymous connection this old may make room for another

    def within(self, nofile: int) -> Limits:
        """These limits with the connection caps kept below ``nofile`` descriptors."""
        room = max(1, (nofile - self.reserve) // max(1, self.descriptors))
        most = min(self.max_connections, room)
        per_peer = min(self.per_peer, most)
        return dataclasses.replace(
            self,
            max_connections=most,
            per_peer=per_peer,
            anonymous_per_peer=min(self.anonymous_per_peer, per_peer),
        )


def _refusal(status: bytes, message: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: " + str(len(message)).encode() + b"\r\nconnection: close\r\n\r\n"
        b"" + message
    )


BUSY = _refusal(b"503 Service Unavailable", b"too many connections\n")
TIMED_OUT = _refusal(b"408 Request Timeout", b"request head not received in time\n")
TOO_LARGE = _refusal(b"431 Request Header Fields Too Large", b"request head too large\n")


class _Dropped(list[tuple[bytes, bytes]]):
    """Where uvicorn's protocol puts a request's trailers once its head is complete: nowhere."""

    def append(self, item: tuple[bytes, bytes]) -> None:
        """Drop a trailer."""


_TRAILERS = _Dropped()


class _Http(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, whose trailers never reach the application's headers."""

    def on_headers_complete(self) -> None:
        """The head is complete: what llhttp reports as a header from now on is a trailer."""
        super().on_headers_complete()
        self.headers = _TRAILERS


class _Peer:
    """The connections one peer address holds."""

    __slots__ = ("anonymous", "count")

    def __init__(self) -> None:
        self.count = 0
        self.anonymous: dict[Guarded, None] = {}  # oldest first


class _Server:
    """What one server's connections share: the counts the caps are kept by."""

    __slots__ = ("anonymous", "lingering", "peers", "serving")

    def __init__(self) -> None:
        self.serving: set[Guarded] = set()  # connections counted toward the caps
        self.anonymous: dict[Guarded, None] = {}  # of them, no credential shown; oldest first
        self.peers: dict[str, _Peer] = {}
        self.lingering = 0


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
    server: ClassVar[_Server] = _Server()  # per server class (guarded())

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
        self.http = _Http(config, server_state, state, self.loop)
        self.parser = httptools.HttpRequestParser(self)  # boundaries only: keeps nothing
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's
        self.transport: asyncio.Transport | None = None
        self.closing = False
        self.admitted = False  # uvicorn's protocol has the connection
        self.peer: _Peer | None = None  # its peer's counts (None: exempt, or not counted)
        self.address = ""
        self.anonymous = True  # no credential shown on it yet
        self.since = 0.0  # when it was made (the loop's clock)
        self.marks: list[int] = []  # boundaries met in the read being counted (below)
        self.pieces = 0  # pieces of body in that read
        self.in_head = False  # a request began and its head is not complete
        self.in_message = False  # a request began and its body is not complete
        self.head_bytes = 0  # of the head under way, counted in earlier reads
        self.tail = b""  # its last 3 bytes (its end may straddle two reads)
        self.bare = 0  # bytes after a head, in a row, that carried no body (trailers...)
        self.heads = 0  # heads handed on
        self.answered = 0  # requests the application finished with (serve_app)
        self.upgraded = False
        self.refusal: bytes | None = None  # the last answer, once the ones under way are sent
        self.linger_left = 0
        self.lingering = False
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

    def on_body(self, _body: bytes) -> None:
        """A piece of its body (uvicorn's parser keeps it; this one counts it)."""
        self.pieces += 1

    def on_message_complete(self) -> None:
        """Its body is complete."""
        self.marks.append(_DONE)
        self.in_message = False

    # -- asyncio's protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection within the caps, or turn it away; the head's clock on."""
        tcp = cast(asyncio.Transport, transport)
        self.transport = tcp
        sock = tcp.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peername = tcp.get_extra_info("peername")
        self.address = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        self.since = self.loop.time()
        if not self._admit():
            self.closing = True
            tcp.write(BUSY)
            self._linger_or_close(tcp)
            return
        self.admitted = True
        self.http.connection_made(cast(asyncio.Transport, _Transport(self, tcp)))
        self.timer = self.loop.call_later(self.limits.head_timeout_s, self.refuse, TIMED_OUT)

    def _admit(self) -> bool:
        """Count this connection within the caps, making room if it may; False if over one."""
        limits, server = self.limits, self.server
        exempt = self._exempt()
        peer = None if exempt else server.peers.get(self.address)
        if (
            peer is not None
            and (len(peer.anonymous) >= limits.anonymous_per_peer or peer.count >= limits.per_peer)
            and not self._evict(peer.anonymous)
        ):
            return False
        if len(server.serving) >= limits.max_connections and not self._evict(server.anonymous):
            return False
        if peer is None and not exempt:
            peer = server.peers[self.address] = _Peer()
        server.serving.add(self)
        server.anonymous[self] = None
        if peer is not None:
            peer.count += 1
            peer.anonymous[self] = None
        self.peer = peer
        return True

    def _exempt(self) -> bool:
        exempt = self.limits.exempt
        if not exempt or not self.address:
            return False
        try:
            address = ipaddress.ip_address(self.address)
        except ValueError:
            return False
        return any(address in network for network in exempt)

    def _evict(self, anonymous: dict[Guarded, None]) -> bool:
        """Close the oldest of ``anonymous`` that serves no request and is old enough."""
        old = self.loop.time() - self.limits.evict_after_s
        for connection in itertools.islice(anonymous, EVICT_SCAN):
            if connection.since > old:
                return False  # the rest are younger still
            if connection.heads == connection.answered and connection.refusal is None:
                connection._uncount()
                connection.refuse(BUSY)
                return True
        return False

    def _uncount(self) -> None:
        """Take this connection out of the caps' counts (it is closing)."""
        server = self.server
        if self not in server.serving:
            return
        server.serving.discard(self)
        server.anonymous.pop(self, None)
        peer, self.peer = self.peer, None
        if peer is not None:
            peer.anonymous.pop(self, None)
            peer.count -= 1
            if not peer.count:
                server.peers.pop(self.address, None)

    def credited(self) -> None:
        """The connection has shown a credential: no cap on anonymous ones counts it now."""
        self.anonymous = False
        self.server.anonymous.pop(self, None)
        if self.peer is not None:
            self.peer.anonymous.pop(self, None)

    def data_received(self, data: bytes) -> None:
        """Count a head's bytes, then hand them to uvicorn; or refuse the head."""
        if self.upgraded:  # bytes after an Upgrade request: nobody here speaks that protocol
            self.refuse(b"")
        if self.closing or self.refusal is not None:
            self._drop(len(data))
            return
        head_was_open = self.in_head
        marks = self.marks
        marks.clear()
        self.pieces = 0
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
        if (not marks and self.in_message and not self.in_head) or marks == [_DONE]:
            if self.pieces:  # a body's bytes, or trailers and framing (counted, in a row)
                self.bare = 0
            else:
                self.bare += len(data)
                if self.bare > self.limits.head_bytes:
                    self._cut()
                    return
        elif marks:
            self.bare = 0
        self.heads += marks.count(_HEAD)
        waiting = self.in_head or not (self.in_message or marks)  # blank lines: a head next
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
        """Stop the clock; free its place; tell uvicorn."""
        self._stop_clock()
        self._uncount()
        if self.lingering:
            self.lingering = False
            self.server.lingering -= 1
        if self.admitted:
            self.admitted = False
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
        self._uncount()
        if not self.in_message:
            self.transport.close()
        else:
            self._linger_or_close(self.transport)

    def _linger_or_close(self, transport: asyncio.Transport) -> None:
        """Shut the sending side, read and drop what the caller still sends for a while."""
        server = self.server
        if server.lingering >= LINGERING_MOST or not transport.can_write_eof():
            transport.close()
            return
        server.lingering += 1
        self.lingering = True
        transport.write_eof()
        transport.resume_reading()
        self.linger_left = LINGER_BYTES
        self.timer = self.loop.call_later(LINGER_S, transport.close)

    def _cut(self) -> None:
        """Close the connection now: what it sends breaks a bound no answer can be given to."""
        self.closing = True
        self._stop_clock()
        self._uncount()
        if self.transport is not None:
            self.transport.close()

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
    return type("Guarded", (Guarded,), {"limits": limits, "server": _Server()})


def authenticated(scope: Scope) -> None:
    """Say that the request's connection has shown a credential (the application checked it).

    Such a connection no longer counts toward the cap on anonymous connections, and is
    never closed to make room for another.
    """
    connection = scope.get("state", {}).get(CONNECTION)
    if connection is not None and connection.anonymous:
        connection.credited()


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


def within_descriptors(limits: Limits) -> Limits:
    """``limits`` kept below this process's descriptor limit (its soft limit raised first)."""
    nofile = descriptors.raise_limit()
    kept = limits.within(nofile)
    if kept.max_connections < limits.max_connections:
        log.warning(
            "%d connections at most, not %d: the descriptor limit is %d (raise `ulimit -Hn`)",
            kept.max_connections,
            limits.max_connections,
            nofile,
        )
    return kept


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
        serve_app(app),
        http=guarded(within_descriptors(limits)),
        timeout_keep_alive=limits.idle_s,
        **settings,
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


#: How long a server may take to start accepting, its app's start-up included (15 s was
#: once not enough for a gateway with HAProxy in a test suite at load 27 on 2 cores).
STARTUP_S = 60.0


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
        where = f"port {self.port}" if self.port else f"{sock.getsockname()!s}"
        deadline = time.monotonic() + STARTUP_S
        while not server.started:
            if not self.thread.is_alive():
                sock.close()
                raise OSError(f"{name} did not start on {where}: its start-up failed (logged)")
            if time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise OSError(f"{name} did not start on {where} within {STARTUP_S:g} s")
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
