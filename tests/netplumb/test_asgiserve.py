"""The bounds of corral's one HTTP server stack, each shown on a real server on loopback.

A guarded uvicorn server (:mod:`netplumb.asgiserve`) serves a small application that
checks a token before it reads a body, as the gateway, the Lambdo host and the
exporter do. Each test attacks one bound: connections, a head's deadline and its size,
an idle kept-alive connection, an early answer to a caller still sending, a pipelined
head refused behind an answer under way. The last test feeds one connection its bytes
split at every place near the end of a head, which a socket cannot be made to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from netplumb import asgiserve
from netplumb.asgiserve import Limits, Receive, Scope, Send

TOKEN = b"Bearer t0ken"
LIMITS = Limits(max_connections=8, head_bytes=4096, head_timeout_s=0.5, idle_s=1)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """200 with the body's length; 401 (closing, the body unread) without the token."""
    if scope["type"] != "http":
        return
    if (b"authorization", TOKEN) not in scope["headers"]:
        await _answer(send, 401, b"token\n", close=True)
        return
    asgiserve.authenticated(scope)
    if scope["path"] == "/slow":
        await asyncio.sleep(0.2)  # an answer under way while the next request comes
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    if scope["path"] == "/headers":  # the header names the application was given
        names = b",".join(name for name, _ in scope["headers"])
        await _answer(send, 200, b"%d %s\n" % (size, names))
        return
    await _answer(send, 200, f"{size}\n".encode())


async def _answer(send: Send, status: int, body: bytes, close: bool = False) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def served(limits: Limits = LIMITS) -> Iterator[int]:
    """A guarded server of :func:`app` on a free loopback port (the port)."""
    server = asgiserve.start(app, asgiserve.bind("127.0.0.1", 0), limits, name="test-server")
    try:
        yield server.port
    finally:
        server.stop()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _get(path: str = "/", extra: bytes = b"", token: bytes = TOKEN) -> bytes:
    return (
        b"GET "
        + path.encode()
        + b" HTTP/1.1\r\nHost: t\r\nAuthorization: "
        + token
        + (b"\r\n" + extra + b"\r\n")
    )


def _whole(sock: socket.socket) -> tuple[int, bytes]:
    """One whole answer on ``sock``: its status and body (a ``recv`` of its head alone left
    the body behind, to be read as what came next, when it came in a segment of its own)."""
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    return answer.status, answer.read()


def _until_closed(sock: socket.socket, within: float = 5.0) -> bytes:
    """Everything the server sends until it closes (a reset ends it too)."""
    sock.settimeout(within)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while piece := sock.recv(65536):
            data += piece
    return data


def test_one_connection_over_the_limit_is_503_at_once_and_a_freed_place_is_served() -> None:
    with served(Limits(max_connections=2)) as port:
        first, second = _connect(port), _connect(port)
        with first, second, _connect(port) as third:
            assert _until_closed(third).startswith(b"HTTP/1.1 503 ")
            first.sendall(_get())
            assert first.recv(100).startswith(b"HTTP/1.1 200 ")  # the two are served
        with _connect(port) as again:  # the places are free again
            again.sendall(_get())
            assert again.recv(100).startswith(b"HTTP/1.1 200 ")


def test_a_head_not_in_by_its_deadline_is_408_however_slowly_it_drips() -> None:
    with (
        served() as port,
        _connect(port) as silent,
        _connect(port) as head,
        _connect(port) as blank,
    ):
        blank.sendall(_get())
        assert _whole(blank)[0] == 200  # all of it: its body is not part of what comes next
        stop = threading.Event()

        def drip(sock: socket.socket, data: bytes) -> None:  # a byte every 50 ms
            for byte in data:
                if stop.wait(0.05):
                    return
                with contextlib.suppress(OSError):
                    sock.send(bytes([byte]))

        drippers = [
            threading.Thread(target=drip, args=(head, _get()[:-2] + b"X-Slow: " + b"a" * 999)),
            threading.Thread(target=drip, args=(blank, b"\r\n" * 500)),  # between requests
        ]
        for dripper in drippers:
            dripper.start()
        try:
            assert _until_closed(silent).startswith(b"HTTP/1.1 408 ")
            assert _until_closed(head).startswith(b"HTTP/1.1 408 ")
            assert _until_closed(blank).startswith(b"HTTP/1.1 408 ")
            assert all(d.is_alive() for d in drippers)  # cut off long before they were done
        finally:
            stop.set()


@pytest.mark.parametrize("shape", ["many headers", "one value that never ends"])
def test_a_head_over_its_limit_is_431(shape: str) -> None:
    with served() as port, _connect(port) as sock:
        if shape == "many headers":
            sock.sendall(_get(extra=b"".join(b"X-%d: %s\r\n" % (i, b"y" * 90) for i in range(50))))
        else:
            sock.sendall(_get()[:-2] + b"X-Long: ")
            with contextlib.suppress(OSError):
                for _ in range(256):  # 16 MiB, as fast as the server takes them
                    sock.sendall(b"a" * 65536)
        assert _until_closed(sock).startswith(b"HTTP/1.1 431 ")


def test_a_kept_alive_connection_idle_past_its_limit_is_closed() -> None:
    with served() as port, _connect(port) as sock:
        sock.sendall(_get())
        assert _whole(sock)[0] == 200
        assert _until_closed(sock) == b""  # idle_s=1: closed, nothing more said


def test_an_answer_before_the_body_is_read_reaches_a_caller_still_sending() -> None:
    with served() as port, _connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 67108864\r\n\r\n")
        sent = [0]

        def push() -> None:  # 64 MiB the server never asked for
            with contextlib.suppress(OSError):
                for _ in range(1024):
                    sent[0] += sock.send(b"z" * 65536)

        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        answer = _until_closed(sock)
        pusher.join(10)
    assert answer.startswith(b"HTTP/1.1 401 ") and answer.endswith(b"token\n"), answer
    assert sent[0] < 16 * 1024 * 1024  # cut off after the lingering, not read whole


def test_a_pipelined_head_over_the_limit_is_refused_after_the_answer_under_way() -> None:
    with served() as port, _connect(port) as sock:
        sock.sendall(_get("/slow") + _get()[:-2] + b"X-Long: ")  # then a value without end
        with contextlib.suppress(OSError):
            for _ in range(64):
                sock.sendall(b"a" * 65536)
        answers = _until_closed(sock)
    assert answers.startswith(b"HTTP/1.1 200 ") and b"\r\n\r\n0\n" in answers, answers
    assert answers.index(b"HTTP/1.1 431 ") > answers.index(b"0\n"), answers


def test_bytes_after_an_upgrade_request_end_the_connection_after_its_answer() -> None:
    with served() as port, _connect(port) as sock:
        sock.sendall(_get(extra=b"Connection: Upgrade\r\nUpgrade: websocket\r\n"))
        assert _whole(sock)[0] == 200
        sock.sendall(b"\x81\x05hello")  # a websocket frame: nobody here speaks it
        assert _until_closed(sock) == b""


# -- trailers ------------------------------------------------------------------------------


def _chunked(path: bytes = b"/headers") -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: t\r\nAuthorization: " + TOKEN + b"\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
    )


def test_trailers_never_reach_the_application() -> None:
    with served() as port, _connect(port) as sock:
        sock.sendall(_chunked() + b"0\r\nCookie: stolen=1\r\nAuthorization: x\r\n\r\n")
        answer = _whole(sock)
    assert answer == (200, b"3 host,authorization,transfer-encoding\n"), answer


def test_trailers_past_the_head_limit_cut_the_connection() -> None:
    with served() as port, _connect(port) as sock:
        sock.sendall(_chunked() + b"0\r\n")
        sent = 0
        with contextlib.suppress(OSError):
            for _ in range(256):  # 16 MiB of trailer lines, as fast as the server takes them
                sent += sock.send(b"X-Trailer: b\r\n" * 4096)
        answer = _until_closed(sock)
    assert not answer.startswith(b"HTTP/1.1 200 "), answer
    assert sent < 8 * 1024 * 1024  # cut off near the head's limit, not read whole


# -- connections per peer -------------------------------------------------------------------


def _from(address: str, port: int) -> socket.socket:
    """A connection from ``address`` (on loopback, any of 127.0.0.0/8 tells peers apart)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(address, 0))


def _served(sock: socket.socket) -> bool:
    """Whether a request on ``sock`` is answered 200; the whole answer is read, so that the
    next request's answer is read from its start (one ``recv`` of the head alone left the
    body behind when it came in a segment of its own, as on a loaded machine)."""
    sock.sendall(_get())
    try:
        return _whole(sock)[0] == 200
    except (http.client.HTTPException, OSError):
        return False


def test_one_peer_holding_every_connection_it_may_leaves_another_peer_served() -> None:
    limits = Limits(max_connections=10, per_peer=4, anonymous_per_peer=2, evict_after_s=60)
    with served(limits) as port, contextlib.ExitStack() as held:
        for _ in range(2):  # connections that showed the token
            assert _served(held.enter_context(_from("127.0.0.2", port)))
        for _ in range(2):  # and half-sent ones, no credential shown: its sub-cap
            quiet = held.enter_context(_from("127.0.0.2", port))
            quiet.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n")
        with _from("127.0.0.2", port) as fifth:  # over its caps, its request sent at once
            fifth.sendall(_get())
            assert _until_closed(fifth).startswith(b"HTTP/1.1 503 ")
        with _from("127.0.0.3", port) as other:  # another peer: served
            assert _served(other)
        for _ in range(4):  # a peer whose every connection showed the token: up to its cap
            assert _served(held.enter_context(_from("127.0.0.4", port)))
        with _from("127.0.0.4", port) as over:
            over.sendall(_get())
            assert _until_closed(over).startswith(b"HTTP/1.1 503 ")
        with _from("127.0.0.3", port) as other:
            assert _served(other)


def test_an_anonymous_connection_makes_room_for_one_that_may_show_a_credential() -> None:
    limits = Limits(max_connections=4, per_peer=4, anonymous_per_peer=2, evict_after_s=0.0)
    with served(limits) as port, contextlib.ExitStack() as held:
        quiet = [held.enter_context(_from("127.0.0.2", port)) for _ in range(2)]
        caller = held.enter_context(_from("127.0.0.2", port))
        assert _served(caller)  # its peer's oldest quiet connection made room
        assert _until_closed(quiet[0]).startswith(b"HTTP/1.1 503 ")
        authed = [held.enter_context(_from("127.0.0.3", port)) for _ in range(2)]
        assert all(_served(sock) for sock in authed)
        newcomer = held.enter_context(_from("127.0.0.4", port))
        assert _served(newcomer)  # the server was full: the oldest quiet connection went
        assert _until_closed(quiet[1]).startswith(b"HTTP/1.1 503 ")
        with _from("127.0.0.3", port) as third:  # one over the cap, none quiet: refused
            third.sendall(_get())
            assert _until_closed(third).startswith(b"HTTP/1.1 503 ")
        assert all(_served(sock) for sock in [caller, *authed])  # never closed for another


def test_a_refused_connection_is_answered_503_that_its_caller_reads() -> None:
    limits = Limits(max_connections=1, evict_after_s=60)
    with served(limits) as port, _from("127.0.0.2", port):
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport, timeout=10) as client:
            statuses = set()
            for _ in range(20):  # a request sent at once, a 1 MiB body with it
                answer = client.post(
                    f"http://127.0.0.1:{port}/",
                    content=b"z" * (1 << 20),
                    headers={"authorization": TOKEN.decode()},
                )
                statuses.add(answer.status_code)
    assert statuses == {503}


def test_caps_stay_below_the_descriptor_limit() -> None:
    limits = Limits(max_connections=4096, per_peer=1024, anonymous_per_peer=256)
    kept = dataclasses.replace(limits, descriptors=2, reserve=128).within(256)
    assert (kept.max_connections, kept.per_peer, kept.anonymous_per_peer) == (64, 64, 64)
    assert limits.within(1 << 20) == limits


# -- a head's size, whatever the reads -------------------------------------------------------


class _Wire(asyncio.Transport):
    """The connection's socket, in memory: what the server wrote and whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _answer_to(reads: list[bytes], limits: Limits, answers: int = 1) -> bytes:
    """What a guarded connection answers to requests arriving in ``reads``."""
    config = uvicorn.Config(asgiserve.serve_app(app), log_config=None)
    config.load()
    connection = asgiserve.guarded(limits)(config, ServerState(), {})
    wire = _Wire()
    connection.connection_made(wire)
    for read in reads:
        connection.data_received(read)
    for _ in range(100):  # the application's task runs on this loop
        if wire.closed or (wire.out.count(b"HTTP/1.1 ") == answers and wire.out.endswith(b"\n")):
            break
        await asyncio.sleep(0)
    connection.connection_lost(None)
    return bytes(wire.out)


def _head_of(size: int) -> bytes:
    """A request head of exactly ``size`` bytes, its blank line included."""
    head = _get(extra=b"X-Pad: ")
    pad = size - len(head) - 2
    return head[:-2] + b"p" * pad + b"\r\n\r\n"


def test_a_head_is_measured_exactly_however_the_reads_split_it() -> None:
    limit = LIMITS.head_bytes
    for size, status in ((limit, b"200"), (limit + 1, b"431")):
        head = _head_of(size)
        assert len(head) == size
        splits: list[list[bytes]] = [[head], [b"\r\n" + head]]  # a blank line first is skipped
        splits += [[head[:at], head[at:]] for at in range(size - 8, size)]  # end split up
        splits += [[head[:100], head[100:at], head[at:]] for at in range(size - 4, size)]
        splits += [
            [head[:at], head[at : at + 1], head[at + 1 :]] for at in range(size - 5, size - 1)
        ]
        for reads in splits:
            answer = asyncio.run(_answer_to(reads, LIMITS))
            assert answer.startswith(b"HTTP/1.1 " + status), ([len(r) for r in reads], answer)


def test_a_head_behind_another_request_in_one_read_is_counted_from_its_next_read() -> None:
    first = _get()
    second = _head_of(LIMITS.head_bytes + 1)
    answer = asyncio.run(_answer_to([first + second[:100], second[100:]], LIMITS, answers=2))
    assert answer.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 200 " in answer[10:], answer
    answer = asyncio.run(
        _answer_to([first + second[:100], second[100:-4], b"p" * 200, second[-4:]], LIMITS)
    )
    assert b"HTTP/1.1 431 " in answer, answer  # counted from its second read on: 4,197 bytes
