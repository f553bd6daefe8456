"""The gateway's listener refuses a request head before it costs anyone else (issue 29, item 2).

A header value that never ends used to be joined by the HTTP parser a read at a time,
each read copying all that came before, and the head's size was counted only once a
header was complete: one connection without a token made the gateway spend seconds of
CPU on it, and everyone's calls waited. Here ``corral gateway`` runs as an operator
runs it (its own process, a token set); two callers at a time, one after another, send
such a value while an authorised caller calls a warm function.

What is measured is what the gateway spends, not how long anything took: a busy machine
stretches every wall-clock time, but not the CPU the gateway burns per attack nor the
bytes it takes before it answers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import threading
import time

import httpx
import psutil

from testkit import httpcalls
from testkit.eventually import eventually
from tests.workers.gateway.conftest import Stack, gateway_process_on_port_0

TOKEN = "listener-t0ken"
MiB = 1024 * 1024


def _unterminated_value(port: int, cap: int = 64 * MiB) -> tuple[int, bytes]:
    """Send ``X-Long: aaaa…`` until the gateway stops taking it; (bytes sent, its answer)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(b"GET /function/hello HTTP/1.1\r\nHost: gw\r\nX-Long: ")
        chunk = b"a" * 65536
        with contextlib.suppress(OSError):
            for _ in range(cap // len(chunk)):
                sock.sendall(chunk)
                sent += len(chunk)
        answer = b""
        with contextlib.suppress(OSError):
            while piece := sock.recv(4096):
                answer += piece
    return sent, answer


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def test_an_unterminated_header_value_is_431_at_once_and_costs_the_gateway_little(
    stack: Stack,
) -> None:
    stack.deploy("hello")
    proc, url = gateway_process_on_port_0(
        stack.env.tmp / "gateway.log",
        {**os.environ, "CORRAL_GATEWAY_TOKEN": TOKEN, "CORRAL_GATEWAY_DATAPLANE": stack.dataplane},
    )
    port = int(url.rsplit(":", 1)[1])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    attacks: list[tuple[int, bytes]] = []
    stop = threading.Event()

    def attack() -> None:
        while not stop.is_set():
            attacks.append(_unterminated_value(port))

    try:
        with httpcalls.client(base_url=url, headers=auth, timeout=20) as client:
            eventually(lambda: _answers(client, "/healthz"), 60, "the gateway to listen")
            eventually(lambda: _answers(client, "/function/hello"), 60, "a warm replica")
            gateway = psutil.Process(proc.pid)
            cpu_before = _cpu_s(gateway)
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
            cpu_per_attack = (_cpu_s(gateway) - cpu_before) / max(1, len(attacks))
        assert attacks, "no attack was made"
        most = max(sent for sent, _ in attacks)
        answers = {answer[:12] for _, answer in attacks}
        seen = (
            f"{len(attacks)} attacks answered {answers} after at most {most / MiB:.1f} MiB; "
            f"the gateway's CPU per attack {cpu_per_attack * 1000:.1f} ms (with "
            f"{len(took)} authorised calls, all answered 200, p50 "
            f"{statistics.median(took) * 1000:.1f} ms)"
        )
        print(seen)
        # answered long before the attacker ran out of header to send (the loopback's
        # socket buffers hold a few MiB of what was sent before the gateway closed); HAProxy's
        # parser cannot tell a head past its buffer from a malformed one: 400
        refused = b"HTTP/1.1 400" if stack.haproxy else b"HTTP/1.1 431"
        assert answers == {refused} and most < 32 * MiB, seen
        # a head copied whole at every read cost seconds of CPU per attack
        assert cpu_per_attack < 0.05, seen
    finally:
        proc.terminate()
        proc.wait(15)


def _answers(client: httpx.Client, path: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return client.get(path).status_code == 200
    return False
