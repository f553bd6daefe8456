"""Work the gateway does for a caller is bounded: in time, in bytes, in all (issue 20, item 5).

Each test reproduces one way a caller could hold the gateway's memory, connections or
environments for as long as it liked: a request head never finished, a head of any
size, a body that stops arriving, bodies buffered whole with no cap across requests, a
body read for a function that does not exist, and an answer the caller never reads.
The last test runs ``corral gateway`` in a process of its own and watches its memory
while callers without a token, with half-sent heads and with half-sent 10 MiB bodies
hold their connections open.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx
import psutil

from tests.eventually import eventually
from tests.workers.gateway.conftest import Stack, free_port, wait_healthy

MiB = 1024 * 1024


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1" and parts.port
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def _answer(sock: socket.socket, within: float) -> bytes:
    """Everything the gateway sends until it closes the connection (``within`` seconds)."""
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {within:g}s; got {data[:200]!r}") from None
    except ConnectionResetError:
        pass
    return data


def _post_head(path: str, length: int, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: gw\r\n{auth}Content-Length: {length}\r\n\r\n").encode()


def test_a_request_head_that_never_ends_is_408_and_closed(stack: Stack) -> None:
    gw = stack.gateway(gateway_read_timeout_s=1.0)
    with _connect(gw.url) as silent, _connect(gw.url) as half:
        half.sendall(b"GET /function/hello HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
        started = time.monotonic()
        assert _answer(half, 5).startswith(b"HTTP/1.1 408 ")
        assert _answer(silent, 5).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - started < 4


def test_a_request_head_over_64_kib_is_431_and_closed(stack: Stack) -> None:
    gw = stack.gateway()
    with _connect(gw.url) as sock:
        headers = "".join(f"X-Filler-{i}: {'y' * 1000}\r\n" for i in range(80))
        sock.sendall(f"GET /function/ghost HTTP/1.1\r\nHost: gw\r\n{headers}\r\n".encode())
        # HAProxy's parser cannot tell a head past its buffer from a malformed one: 400
        status = b"400" if stack.haproxy else b"431"
        assert _answer(sock, 5).startswith(b"HTTP/1.1 " + status + b" ")


def test_a_body_that_stops_arriving_is_408_and_claims_nothing(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo")
    gw = stack.gateway(gateway_read_timeout_s=1.0)
    assert httpx.get(f"{gw.url}/function/echo", timeout=60).status_code == 200  # known
    stack.settled()
    with _connect(gw.url) as sock:
        sock.sendall(_post_head("/function/echo", 1000) + b"only ten b")
        answer = _answer(sock, 5)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer
    assert stack.claims() == 0


def test_an_unknown_function_is_404_before_its_body_is_read(stack: Stack) -> None:
    gw = stack.gateway()
    with _connect(gw.url) as sock:
        sock.sendall(_post_head("/function/ghost", 5 * MiB))  # and no byte of the body
        answer = _answer(sock, 5)
    assert answer.startswith(b"HTTP/1.1 404 ") and b"connection: close" in answer


def test_request_bodies_held_at_once_are_capped_in_all(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo")
    gw = stack.gateway(gateway_body_budget=1 * MiB, gateway_read_timeout_s=30.0)
    assert httpx.get(f"{gw.url}/function/echo", timeout=60).status_code == 200  # known
    with _connect(gw.url) as first, _connect(gw.url) as second:
        first.sendall(_post_head("/function/echo", 600 * 1024) + b"a" * 100_000)
        eventually(  # its 600 KiB are taken from the budget before it has arrived
            lambda: gw.app.gateway.bodies.held >= 600 * 1024, 10, "the first body's reservation"
        )
        second.sendall(_post_head("/function/echo", 600 * 1024))
        refused = _answer(second, 5)
        assert refused.startswith(b"HTTP/1.1 503 ") and b"retry-after: 5" in refused
        first.sendall(b"a" * (600 * 1024 - 100_000))  # the rest: answered, budget returned
        first.settimeout(30)
        assert first.recv(100).startswith(b"HTTP/1.1 200 ")
    again = httpx.post(f"{gw.url}/function/echo", content=b"b" * 600 * 1024, timeout=60)
    assert again.status_code == 200 and len(again.content) == 600 * 1024
    stack.settled()


def test_a_caller_that_never_reads_its_answer_holds_no_environment(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway(gateway_keep_s=0.0, gateway_send_timeout_s=1.0, gateway_timeout_s=60.0)
    assert httpx.get(f"{gw.url}/function/reflect", timeout=60).status_code == 200  # warm
    stack.settled()
    with _connect(gw.url) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /function/reflect?pad=67108864 HTTP/1.1\r\nHost: gw\r\n\r\n")
        # the replica is answering, 64 MiB that nobody reads: its claim is taken...
        eventually(lambda: stack.claims() > 0, 10, "the unread call's claim")
        # ...and given back after the send timeout (the call timeout, 60 s, is not what frees it)
        eventually(lambda: stack.claims() == 0, 8, "the claim of a caller that never reads")
    answer = httpx.get(f"{gw.url}/function/reflect", timeout=60)  # the replica serves again
    assert answer.status_code == 200
    assert len(stack.replicas("reflect")) == 1
    stack.settled()


def _rss_mib(pid: int) -> float:
    """A process's resident memory and its children's (a gateway's HAProxy)."""
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return sum(float(p.memory_info().rss) for p in procs) / MiB


def test_a_gateway_process_keeps_its_memory_under_unauthenticated_half_sent_and_large(
    stack: Stack,
) -> None:
    stack.deploy("echo", image="examples.echo")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.cli", "gateway", "--listen", f"127.0.0.1:{port}"],
        env={
            **os.environ,
            "CORRAL_GATEWAY_TOKEN": "t0ken",
            "CORRAL_GATEWAY_DATAPLANE": stack.dataplane,
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    held: list[socket.socket] = []
    try:
        wait_healthy(url)
        base = _rss_mib(proc.pid)
        body = b"z" * (10 * MiB - 1)
        for _ in range(50):  # without the token: refused before a byte of body is read
            sock = _connect(url)
            sock.sendall(_post_head("/function/echo", 1024 * MiB))
            held.append(sock)
        for _ in range(100):  # half-sent heads
            sock = _connect(url)
            sock.sendall(b"POST /function/echo HTTP/1.1\r\nHost: gw\r\nX-A: ")
            held.append(sock)
        for _ in range(25):  # with the token: 10 MiB bodies but their last byte
            sock = _connect(url)
            sock.sendall(_post_head("/function/echo", 10 * MiB, "t0ken"))
            with contextlib.suppress(OSError):  # refused early: the budget is full
                sock.sendall(body)
            held.append(sock)
        eventually(_settled(proc.pid), 30, "the gateway's memory to settle")
        grown = _rss_mib(proc.pid) - base
        assert grown < 128, f"the gateway grew {grown:.0f} MiB"  # 64 MiB budget + buffers
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        proc.wait(15)


def _settled(pid: int) -> Callable[[], bool]:
    """A check that holds once the process's memory stays within 1 MiB for 0.2 s (it has
    taken in what was sent)."""

    def check() -> bool:
        before = _rss_mib(pid)
        time.sleep(0.2)
        return abs(_rss_mib(pid) - before) < 1

    return check
