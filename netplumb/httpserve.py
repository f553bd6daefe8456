"""Bounded HTTP serving for corral's stdlib servers: the Lambdo host and the metrics exporter.

``http.server`` gives each connection a thread, waits forever for bytes that may never
come, and reads headers of up to 100 lines of 64 KiB each. Before a caller has shown a
token that is work anyone can make a server do. The two mixins here bound it:

* :class:`BoundedServer` (mix in before ``ThreadingHTTPServer`` / ``WSGIServer``): at
  most :attr:`~BoundedServer.max_connections` connections are served at once (so at
  most that many handler threads); one more is answered ``503`` and closed at once.
  A sweeper thread closes any connection that has not delivered its request (line,
  headers and, once allowed, its body) within :attr:`~BoundedServer.request_deadline_s`,
  however slowly it drips bytes.
* :class:`BoundedHandler` (mix in before ``BaseHTTPRequestHandler``): every socket
  read and write waits at most :attr:`~BoundedHandler.timeout` seconds (an idle
  kept-alive connection is closed after that too), and the request line and headers
  together may hold :attr:`~BoundedHandler.header_bytes`; reading past that sees the
  end of the stream, which ``http.server`` answers as a malformed request. A body is
  readable only after :meth:`~BoundedHandler.allow_body` - called once the caller is
  authorised, for at most the server's body limit.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

__all__ = ["BoundedHandler", "BoundedServer"]

log = logging.getLogger(__name__)

LINGER_S = 1.0  # after an early answer, how long the caller's unread bytes are drained
LINGER_BYTES = 64 * 1024  # and how many at most

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 22\r\nConnection: close\r\n\r\ntoo many connections\r\n"
)


class _Budget:
    """A binary reader that sees end-of-stream once ``budget`` bytes were read."""

    def __init__(self, inner: BinaryIO) -> None:
        self._inner = inner
        self.budget = 0

    def _cap(self, size: int) -> int:
        return self.budget if size is None or size < 0 else min(size, self.budget)

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(self._cap(size)) if self.budget > 0 else b""
        self.budget -= len(data)
        return data

    def readline(self, size: int = -1) -> bytes:
        data = self._inner.readline(self._cap(size)) if self.budget > 0 else b""
        self.budget -= len(data)
        return data

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class BoundedServer:
    """Mix-in for a threading ``socketserver`` server: bounded connections and request time."""

    max_connections = 64
    request_deadline_s = 30.0
    daemon_threads = True
    block_on_close = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Bind as the server class does, and start the deadline sweeper."""
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._deadlines: dict[socket.socket, float] = {}
        self._deadline_lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._sweep, name="http-deadlines", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread if a slot is free; else answer 503 and close it."""
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(_BUSY)
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        try:
            super().process_request(request, client_address)  # type: ignore[misc]
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Handle one connection, then give its slot back."""
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self.disarm(request)
            self._slots.release()

    def arm(self, sock: socket.socket, seconds: float) -> None:
        """Close ``sock`` unless :meth:`disarm` comes within ``seconds``."""
        with self._deadline_lock:
            self._deadlines[sock] = time.monotonic() + seconds

    def disarm(self, sock: socket.socket) -> None:
        """Cancel ``sock``'s deadline."""
        with self._deadline_lock:
            self._deadlines.pop(sock, None)

    def _sweep(self) -> None:
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._deadline_lock:
                late = [s for s, at in self._deadlines.items() if at <= now]
                for sock in late:
                    del self._deadlines[sock]
            for sock in late:
                log.info(
                    "closing a connection that did not send its request in %.0fs",
                    self.request_deadline_s,
                )
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def server_close(self) -> None:
        """Stop the sweeper and close the listening socket."""
        self._closed.set()
        super().server_close()  # type: ignore[misc]


class BoundedHandler:
    """Mix-in for a ``BaseHTTPRequestHandler``: socket timeouts and a header byte budget."""

    timeout: float | None = 10.0
    header_bytes = 32 * 1024
    server: Any
    connection: socket.socket
    rfile: Any

    def setup(self) -> None:
        """Wrap the connection's reader in a byte budget."""
        super().setup()  # type: ignore[misc]
        self._budget = _Budget(self.rfile)
        self.rfile = self._budget

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Read one request within the header budget and the server's request deadline."""
        self._budget.budget = self.header_bytes
        self.server.arm(self.connection, self.server.request_deadline_s)
        try:
            yield
        finally:
            self.server.disarm(self.connection)

    def handle_one_request(self) -> None:
        """One request of a kept-alive connection, read within its bounds."""
        with self.reading():
            super().handle_one_request()  # type: ignore[misc]

    def request_read(self) -> None:
        """The request (or its head, when a body is yet to come) is in: stop its deadline."""
        self.server.disarm(self.connection)

    def linger(self, wfile: Any) -> None:
        """Close after an answer sent before the body was read, as nginx's lingering close.

        The answer is flushed and the write side shut; then what the caller still sends
        (at most :data:`LINGER_BYTES`, for at most :data:`LINGER_S`) is read and dropped,
        so the caller reads the answer instead of a connection reset by unread bytes.
        """
        with contextlib.suppress(OSError):
            wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            left = LINGER_BYTES
            while left > 0:
                chunk = self.connection.recv(min(left, 16 * 1024))
                if not chunk:
                    break
                left -= len(chunk)

    def allow_body(self, length: int) -> None:
        """Let the next ``length`` bytes be read, within the server's request deadline."""
        self._budget.budget = length
        self.server.arm(self.connection, self.server.request_deadline_s)
