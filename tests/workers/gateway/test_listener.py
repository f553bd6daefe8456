"""The gateway's listener refuses a request head before it costs anyone else (issue 29, item 2).

A header value that never ends used to be joined by the HTTP parser a read at a time,
each read copying all that came before, and the head's size was counted only once a
header was complete: one connection without a token made the gateway spend seconds of
CPU on it, and everyone's calls waited. Here ``corral gateway`` runs as an operator
runs it (its own process, a token set); two callers at a time, one after another, send
such a value while an authorised caller calls a warm function.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

from tests.eventually import eventually
from tests.workers.gateway.conftest import Stack

TOKEN = "listener-t0ken"
MiB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _unterminated_value(port: int, cap: int = 64 * MiB) -> tuple[float, bytes]:
    """Send ``X-Long: aaaa…`` until the gateway stops taking it; (seconds, what it answered)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(b"GET /function/hello HTTP/1.1\r\nHost: gw\r\nX-Long: ")
        chunk = b"a" * 65536
        with contextlib.suppress(OSError):
            for _ in range(cap // len(chunk)):
                sock.sendall(chunk)
        answer = b""
        with contextlib.suppress(OSError):
            while piece := sock.recv(4096):
                answer += piece
    return time.monotonic() - started, answer


def test_an_unterminated_header_value_is_431_within_a_second_and_stalls_nobody(
    stack: Stack,
) -> None:
    stack.deploy("hello")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.cli", "gateway", "--listen", f"127.0.0.1:{port}"],
        env={
            **os.environ,
            "CORRAL_GATEWAY_TOKEN": TOKEN,
            "CORRAL_GATEWAY_DATAPLANE": stack.dataplane,
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    attacks: list[tuple[float, bytes]] = []
    stop = threading.Event()

    def attack() -> None:
        while not stop.is_set():
            attacks.append(_unterminated_value(port))

    try:
        with httpx.Client(base_url=url, headers=auth, timeout=20) as client:
            eventually(lambda: _answers(client, "/healthz"), 60, "the gateway to listen")
            eventually(lambda: _answers(client, "/function/hello"), 60, "a warm replica")
            attackers = [threading.Thread(target=attack, daemon=True) for _ in range(2)]
            for attacker in attackers:
                attacker.start()
            try:
                took: list[float] = []  # calls for 3 s of attack (at most 10 s)
                begun = time.monotonic()
                while time.monotonic() - begun < (3 if len(took) >= 20 else 10):
                    started = time.perf_counter()
                    assert client.get("/function/hello").status_code == 200
                    took.append(time.perf_counter() - started)
            finally:
                stop.set()
                for attacker in attackers:
                    attacker.join(60)
        assert attacks, "no attack was made"
        slowest = max(seconds for seconds, _ in attacks)
        answers = {answer[:12] for _, answer in attacks}
        p50 = statistics.median(took)
        seen = (
            f"{len(attacks)} attacks answered {answers}, the slowest in {slowest:.2f}s; "
            f"authorised calls' p50 {p50 * 1000:.1f} ms over {len(took)} calls"
        )
        print(seen)
        # (HAProxy's parser cannot tell a head past its buffer from a malformed one: 400)
        refused = b"HTTP/1.1 400" if stack.haproxy else b"HTTP/1.1 431"
        assert answers == {refused} and slowest < 1.0, seen
        assert p50 < 0.050, seen
    finally:
        proc.terminate()
        proc.wait(15)


def _answers(client: httpx.Client, path: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return client.get(path).status_code == 200
    return False
