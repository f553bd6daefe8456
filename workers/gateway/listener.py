"""What the gateway's listening socket refuses before a request reaches the application.

uvicorn's HTTP/1.1 protocol (httptools) waits for a request head as long as a client
cares to take, and keeps every header it is sent. :func:`guarded_http` makes the
protocol the gateway serves with, which also:

* sets ``TCP_NODELAY`` on every connection (asyncio does by default; the gateway
  answers in few writes and must not wait on the caller's delayed ACKs);
* closes a connection whose request head (request line and headers) has not arrived
  within ``CORRAL_GATEWAY_READ_TIMEOUT_S`` of its first byte - or of the connection's
  opening - with a ``408`` (between requests, uvicorn's keep-alive timeout applies);
* answers ``431`` and closes when a request head grows past ``MAX_HEAD`` bytes;
* writes a response's head together with its first body bytes (uvicorn writes each in
  a send of its own: one system call and one TCP segment more per request).

A request body is the application's to bound (:mod:`workers.gateway.bodies`): uvicorn
buffers at most 64 KiB of it per connection before it stops reading.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD = 64 * 1024  # bytes of request line and headers accepted (nginx: 4 x 8 KiB + line)


def _refusal(status: bytes, message: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: "
        + str(len(message)).encode()
        + b"\r\nconnection: close\r\n\r\n"
        + message
    )


TIMED_OUT = _refusal(b"408 Request Timeout", b"request head not received in time\n")
TOO_LARGE = _refusal(b"431 Request Header Fields Too Large", b"request head too large\n")


class HeldHead:
    """A connection's transport that holds a response's head until its first body bytes.

    The head goes out with the next write, or when the response completes (an answer
    to HEAD, a 204) or the connection closes; anything written before the response
    started (``100 Continue``) goes out at once.
    """

    def __init__(self, transport: asyncio.Transport, cycle: Any) -> None:
        self.transport = transport
        self.cycle = cycle
        self.held: bytes | None = None
        self.head_seen = False

    def write(self, data: bytes) -> None:
        """Write, holding the response's head."""
        if self.held is not None:
            data, self.held = self.held + data, None
        elif not self.head_seen and self.cycle.response_started:
            self.head_seen = True
            self.held = data
            return
        self.transport.write(data)

    def flush(self) -> None:
        """Write a held head."""
        if self.held is not None:
            held, self.held = self.held, None
            self.transport.write(held)

    def close(self) -> None:
        """Write a held head, then close."""
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        """As the transport says."""
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with a deadline and a size limit on each request head."""

    read_timeout_s = 15.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Nagle off; the first request head must come in time."""
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the head timer."""
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        """A request starts: its head must come in time."""
        super().on_message_begin()
        self._head_bytes = 0
        self._arm()

    def on_url(self, url: bytes) -> None:
        """Count the request line against the head's limit."""
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        """Count each header against the head's limit."""
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """The head is in: no deadline on it any more; the answer's head is held."""
        self._disarm()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and not isinstance(cycle.transport, HeldHead):
            held = HeldHead(self.transport, cycle)
            cycle.transport = held  # type: ignore[assignment]
            completed = cycle.on_response

            def on_response() -> None:  # an answer without body bytes: its head goes now
                held.flush()
                completed()

            cycle.on_response = on_response

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD:
            self._refuse(TOO_LARGE)
            raise ValueError("request head too large")  # stops the parser

    def send_400_response(self, msg: str) -> None:
        """Answer a malformed request, unless it was refused (and answered) already."""
        if not self.transport.is_closing():
            super().send_400_response(msg)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.read_timeout_s, self._refuse, TIMED_OUT)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, answer: bytes) -> None:
        self._disarm()
        if not self.transport.is_closing():
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(answer)
            self.transport.close()


def guarded_http(read_timeout_s: float) -> type[GuardedHttp]:
    """The protocol class for uvicorn, with this head deadline."""
    return type("GuardedHttp", (GuardedHttp,), {"read_timeout_s": read_timeout_s})
