"""A gateway short of file descriptors blames itself, not its replicas (issue 36, item 7).

``corral gateway`` runs as a process of its own at ``ulimit -n 256``, in front of
replicas the worker started (the gateway has never connected to them). First callers
from eight loopback addresses open 400 connections: the gateway's caps, kept below its
descriptor limit, leave it the descriptors its forwarding needs, and a caller's request
goes through. Then the test takes the process's descriptors away for real (its soft
limit lowered below what it has open, ``prlimit``): a request whose replica needs a new
connection is the gateway's own 503 - the replica is not retired as a suspect; so is one
whose store call needs a new connection (cis647: PostgreSQL's pool opened one) - and once
the limit is back the same replica answers and a cold start (the process's first) works.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import resource
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from testkit import httpcalls
from testkit.eventually import eventually
from tests.helpers import spawn_ok
from tests.workers.gateway.conftest import Stack, gateway_process_on_port_0
from workers.store.models import LIVE_STATES

TOKEN = "t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}
NOFILE = 256


def _limited(soft: int, hard: int) -> list[str]:
    """The command prefix that runs a program with these descriptor limits (``ulimit -n``).

    util-linux's ``prlimit``, not a ``preexec_fn``: Python run between fork and exec in a
    process with gRPC threads can die before the exec.
    """
    return ["prlimit", f"--nofile={soft}:{hard}", "--"]


def _started(port: int) -> None:
    """Wait for the gateway on ``port`` to serve (a loaded machine imports slowly)."""

    def healthy() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpcalls.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        return False

    eventually(healthy, 120, "the gateway to start", poll=0.1)


def _open(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes, str]:
    """One request on a kept-alive connection: status, body, the replica's vmid if said."""
    conn.request("GET", path, headers=AUTH)
    answer = conn.getresponse()
    return answer.status, answer.read(), answer.getheader("x-reflect-vmid") or ""


def _settled(pid: int) -> Callable[[], bool]:
    """A check that holds once the process's open descriptors stay the same for 0.3 s."""

    def check() -> bool:
        before = _open(pid)
        time.sleep(0.3)
        return _open(pid) == before

    return check


def test_a_gateway_at_256_descriptors_retires_no_replica_and_cold_starts_again(
    stack: Stack, tmp_path: Path
) -> None:
    stack.deploy("reflect", image="examples.reflect")
    stack.deploy("other", image="examples.reflect")
    stack.deploy("cold", image="examples.hello")
    spawn_ok("reflect", 1)  # by the worker: the gateway has no connection to them yet
    spawn_ok("other", 1)
    (reflect,) = stack.replicas("reflect")
    (other,) = stack.replicas("other")
    proc, url = gateway_process_on_port_0(
        tmp_path / "gateway.log",
        {**os.environ, "CORRAL_GATEWAY_TOKEN": TOKEN, "CORRAL_GATEWAY_COLD_START_TIMEOUT_S": "5"},
        prefix=tuple(_limited(NOFILE, NOFILE)),
    )
    port = int(url.rsplit(":", 1)[1])
    flood: list[socket.socket] = []
    try:
        _started(port)
        caller = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        assert _get(caller, "/metrics")[0] == 200  # kept alive, its token shown

        for peer in range(2, 10):  # 400 connections from 8 addresses, half-sent heads
            for _ in range(50):
                with contextlib.suppress(OSError):
                    sock = socket.create_connection(
                        ("127.0.0.1", port), 1, source_address=(f"127.0.0.{peer}", 0)
                    )
                    flood.append(sock)
                    sock.sendall(b"GET /function/reflect HTTP/1.1\r\nHost: gw\r\n")
        eventually(_settled(proc.pid), 30, "the gateway to take the connections in")
        status, body, vmid = _get(caller, "/function/reflect")  # a new connection to it
        assert status == 200, body
        assert vmid == reflect.vmid
        for sock in flood:
            sock.close()
        eventually(_settled(proc.pid), 30, "the gateway to close them")

        # Now no descriptor at all: the soft limit below what the process has open (a
        # few may close meanwhile: an idle connection to a replica, swept).
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (_open(proc.pid) - 8, NOFILE))
        status, body, _ = _get(caller, "/function/other")
        assert status == 503 and b"no file descriptor free" in body, body
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

        caller = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        status, body, vmid = _get(caller, "/function/other")
        assert status == 200 and vmid == other.vmid, body  # the same replica: not retired
        # A cold start, the process's first (each try waits out the gateway's 5 s cold-start
        # timeout at most: a loaded machine may take longer to start a replica).
        status, body = 0, b""

        def cold_start() -> bool:
            nonlocal status, body
            status, body, _ = _get(caller, "/function/cold")
            return status == 200

        eventually(cold_start, 120, "a cold start after descriptors ran out", poll=0)
        assert body == b"hello from corral\n", body
        assert {r.id for r in stack.replicas("reflect") if r.status in LIVE_STATES} == {reflect.id}
        assert {r.id for r in stack.replicas("other") if r.status in LIVE_STATES} == {other.id}
        log = (tmp_path / "gateway.log").read_text()
        assert "suspect" not in log, log
    finally:
        for sock in flood:
            sock.close()
        proc.terminate()
        proc.wait(15)


def test_a_gateway_raises_its_soft_descriptor_limit_to_the_hard_one(stack: Stack) -> None:
    proc, url = gateway_process_on_port_0(
        stack.env.tmp / "gateway.log", prefix=tuple(_limited(256, 1024))
    )
    try:
        _started(int(url.rsplit(":", 1)[1]))
        assert _soft_limit(proc.pid) == 1024
    finally:
        proc.terminate()
        proc.wait(15)


def _soft_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    return 0
