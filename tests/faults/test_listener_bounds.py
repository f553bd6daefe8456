"""Work before authentication is bounded on every listener corral runs.

Each listener below is started as its own process (as an operator runs it, with a token
set) and attacked without a token: connections that send half a request and wait,
headers or bodies far past any limit, connections that send nothing, and floods of
unauthenticated calls. While the attack holds, the server's memory (``VmRSS``) and
thread count (``/proc/PID/status``, sampled every 20 ms: the peak counts) must stay
within a fixed bound over its idle figures, and once the attackers go the server must
answer a real (authorised) call.

To cover another listener, add a :class:`Listener` to :data:`LISTENERS` (the gateway's
is there too, on each data plane: with HAProxy in front of it, HAProxy is attacked, and
counted with the gateway: a listener's figures are its process and its children's):
how to start it, how to ask it something real, and which attacks apply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest
from google.protobuf import empty_pb2

from agents import lambdo
from netplumb.addresses import split_hostport
from protos import fcdaemon_grpc, fcdaemon_pb2, gpuresc_grpc, resmngr_grpc, resmngr_pb2
from testkit import httpcalls
from testkit.eventually import eventually
from testkit.processes import start_listening
from tests.dataplanes import DATAPLANES, need

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "bounds-t0ken"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
CONNECTIONS = 150  # as in the issue: 150 half-sent requests


def _status(pid: int) -> tuple[float, int]:
    """(resident MB, threads) of a process and its children (the gateway's HAProxy)."""
    rss, threads = 0.0, 0
    for one in [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]:
        with contextlib.suppress(OSError):
            fields = dict(
                line.split(":", 1)
                for line in Path(f"/proc/{one}/status").read_text().splitlines()
                if ":" in line
            )
            rss += int(fields["VmRSS"].split()[0]) / 1024
            threads += int(fields["Threads"])
    return rss, threads


@contextlib.contextmanager
def _peak(pid: int) -> Iterator[list[float]]:
    """Sample a process's memory and threads every 20 ms; yields [peak MB, peak threads]."""
    peak = [0.0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError, KeyError, psutil.Error):
                rss, threads = _status(pid)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], threads)
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


def _settled(peak: list[float]) -> Callable[[], bool]:
    """A check that holds once ``peak`` stays the same for 0.2 s (the server took it all in)."""

    def check() -> bool:
        before = list(peak)
        time.sleep(0.2)
        return list(peak) == before

    return check


def _answers(listener: Listener, port: int) -> Callable[[], bool]:
    """A check that holds once ``listener`` answers its real call."""

    def check() -> bool:
        try:
            listener.healthy(port)
        except Exception:
            return False
        return True

    return check


# -- attacks ---------------------------------------------------------------------------------


def _connect(port: int) -> socket.socket | None:
    # The kernel completes a loopback handshake at once while the server's accept queue has
    # room; when it is full the SYN is dropped, and such a connection is one the server
    # refused: waiting out SYN retransmits for it (1 s, 3 s...) only made the test slow.
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=0.1)
    except OSError:
        return None
    sock.settimeout(5)
    return sock


def _send(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


def http_half_sent(port: int, held: list[socket.socket], path: bytes = b"/spawn") -> None:
    """Requests with a 1 MiB body announced, 64 KiB of it sent, then silence."""
    head = (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1048576\r\n\r\n"
    )
    for _ in range(CONNECTIONS):
        if (sock := _connect(port)) is not None:
            _send(sock, head + b"{" * 65536)
            held.append(sock)


def http_endless_headers(port: int, held: list[socket.socket], path: bytes = b"/vms") -> None:
    """Request heads that never end: 60 KiB header lines, one after another."""
    for _ in range(CONNECTIONS):
        if (sock := _connect(port)) is not None:
            _send(
                sock, b"GET " + path + b" HTTP/1.1\r\n" + (b"X-Pad: " + b"a" * 60000 + b"\r\n") * 4
            )
            held.append(sock)


def idle(port: int, held: list[socket.socket]) -> None:
    """Connections that send nothing at all."""
    for _ in range(CONNECTIONS):
        if (sock := _connect(port)) is not None:
            held.append(sock)


def http_oversized(port: int, held: list[socket.socket], path: bytes = b"/spawn") -> None:
    """Bodies of 64 MiB pushed as fast as the server takes them, 20 at once."""

    def push() -> None:
        sock = _connect(port)
        if sock is None:
            return
        held.append(sock)
        _send(sock, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n")
        chunk = b"x" * 65536
        with contextlib.suppress(OSError):
            for _ in range(1024):
                sock.sendall(chunk)

    threads = [threading.Thread(target=push, daemon=True) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)


def aimed(attack: Callable[..., None], path: bytes) -> Callable[[int, list[socket.socket]], None]:
    """An HTTP attack sent to ``path`` instead of its own."""

    def at(port: int, held: list[socket.socket]) -> None:
        attack(port, held, path=path)

    at.__name__ = attack.__name__
    return at


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    # "literal header field without indexing, new name", no Huffman; lengths < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def grpc_half_sent(method: str) -> Callable[[int, list[socket.socket]], None]:
    """HTTP/2 connections, each opening a call that announces a 4 MB message and sends 16 KB."""
    headers = b"".join(
        _hpack_literal(k, v)
        for k, v in (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", method.encode()),
            (b":authority", b"x"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
    )
    message = b"\x00" + (4_000_000).to_bytes(4, "big") + b"x" * 16000
    data = (
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + _h2_frame(4, 0, 0, b"")
        + _h2_frame(1, 4, 1, headers)
        + _h2_frame(0, 0, 1, message)
    )

    def attack(port: int, held: list[socket.socket]) -> None:
        for _ in range(CONNECTIONS):
            if (sock := _connect(port)) is not None:
                _send(sock, data)
                held.append(sock)

    attack.__name__ = "grpc_half_sent"
    return attack


def grpc_oversized(
    call: Callable[[grpc.Channel, bytes], object],
) -> Callable[[int, list[socket.socket]], None]:
    """120 unauthenticated calls at once, each carrying a 3.9 MB field."""

    def attack(port: int, held: list[socket.socket]) -> None:
        big = b"v" * 3_900_000

        def one() -> None:
            options = [("grpc.max_send_message_length", 8 << 20)]
            with (
                grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel,
                contextlib.suppress(grpc.RpcError),
            ):
                call(channel, big)

        threads = [threading.Thread(target=one, daemon=True) for _ in range(120)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    attack.__name__ = "grpc_oversized"
    return attack


def grpc_flood(method: str) -> Callable[[int, list[socket.socket]], None]:
    """1,000 unauthenticated calls in flight at once on one channel."""

    def attack(port: int, held: list[socket.socket]) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method)
            futures = [stub.future(b"\x0a\x02vm", timeout=20) for _ in range(1000)]
            for f in futures:
                with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError):
                    f.result()

    attack.__name__ = "grpc_flood"
    return attack


# -- listeners -------------------------------------------------------------------------------

Attack = Callable[[int, list[socket.socket]], None]


@dataclass
class Listener:
    """A server to attack: how to start it, a real call that must work, the attacks that apply.

    ``argv`` listens on port 0 and the server says where (``listening on``); ``env`` gets
    ``{tmp}`` filled in; ``store``: it starts on
    a migrated store (:data:`STORE`'s SQLite file, a copy of the session's migrated
    template); ``healthy(port)`` is one authorised call that must succeed once the attack
    is over.
    """

    name: str
    argv: list[str]
    healthy: Callable[[int], object]
    attacks: list[Attack]
    env: dict[str, str] = field(default_factory=dict)
    store: bool = False
    max_rss_growth_mb: float = 30.0
    max_new_threads: int = 40


def _http_ok(path: str) -> Callable[[int], object]:
    def healthy(port: int) -> object:
        resp = httpcalls.get(
            f"http://127.0.0.1:{port}{path}",
            timeout=10,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert resp.status_code == 200, resp.text
        return resp

    return healthy


def _registry_ok(port: int) -> object:
    stub = resmngr_grpc.ResMngrServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    return stub.UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(
            vmid="nobody", status=resmngr_pb2.StatusUpdateRequest.READY
        ),
        timeout=10,
        metadata=AUTH,
    )


def _fcdaemon_ok(port: int) -> object:
    stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    return stub.ListReplicas(empty_pb2.Empty(), timeout=10, metadata=AUTH)


def _gpus_ok(port: int) -> object:
    stub = gpuresc_grpc.GPURescStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    return stub.GetGPUResource(empty_pb2.Empty(), timeout=10, metadata=AUTH)


def _update_status(channel: grpc.Channel, vmid: bytes) -> object:
    stub = resmngr_grpc.ResMngrServiceStub(channel)
    return stub.UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(
            vmid=vmid.decode(), status=resmngr_pb2.StatusUpdateRequest.READY
        ),
        timeout=20,
    )


def _create(channel: grpc.Channel, blob: bytes) -> object:
    return fcdaemon_grpc.FcServiceStub(channel).CreateReplica(
        fcdaemon_pb2.CreateRequest(imageName="examples.hello", kernelArgs=blob.decode()), timeout=20
    )


STORE = {
    "CORRAL_DATABASE_URL": "sqlite:///{tmp}/corral.sqlite",
    "CORRAL_BROKER_URL": "redis://127.0.0.1:1/0",
}
# 120 oversized calls push about 470 MB at a server; gRPC core takes in each stream's
# flow-control window before it refuses the call. With BDP probing off (SERVER_OPTIONS)
# a window stays 64 KiB: 6-8 MB at the peak here (17-34 MB, 86 once under load, with it on)
GRPC_MB = 30.0
HTTP_ATTACKS: list[Attack] = [http_half_sent, http_endless_headers, idle, http_oversized]
# the HTTP servers serve every connection on one event loop: an attack starts no thread
HTTP_THREADS = 2
# nor do the gRPC servers: a call reaches a handler thread only with its credential and message
GRPC_THREADS = 2

LISTENERS = [
    Listener(
        "lambdo",
        [
            sys.executable,
            "-m",
            "agents.lambdo",
            "--listen",
            "127.0.0.1:0",
            "--driver",
            "memory",
            "--token",
            TOKEN,
        ],
        _http_ok("/vms"),
        HTTP_ATTACKS,
        max_new_threads=HTTP_THREADS,
    ),
    Listener(
        "metrics",
        [sys.executable, "-m", "corral.cli", "metrics", "--listen", "127.0.0.1:0"],
        _http_ok("/metrics"),
        HTTP_ATTACKS,
        max_new_threads=HTTP_THREADS,
        env={**STORE, "CORRAL_METRICS_TOKEN": TOKEN},
        store=True,
    ),
    Listener(
        "registry",
        [sys.executable, "-m", "corral.cli", "registry", "--listen", "127.0.0.1:0"],
        _registry_ok,
        [
            grpc_half_sent("/resmngr.ResMngrService/UpdateStatus"),
            idle,
            grpc_oversized(_update_status),
            grpc_flood("/resmngr.ResMngrService/UpdateStatus"),
        ],
        env={**STORE, "CORRAL_REGISTRY_TOKEN": TOKEN},
        store=True,
        max_rss_growth_mb=GRPC_MB,
        max_new_threads=GRPC_THREADS,
    ),
    Listener(
        "fcdaemon",
        [
            sys.executable,
            "-m",
            "agents.fcdaemon",
            "--listen",
            "127.0.0.1:0",
            "--driver",
            "memory",
            "--require-token",
            TOKEN,
        ],
        _fcdaemon_ok,
        [
            grpc_half_sent("/fcdaemon.FcService/CreateReplica"),
            idle,
            grpc_oversized(_create),
            grpc_flood("/fcdaemon.FcService/CreateReplica"),
        ],
        max_rss_growth_mb=GRPC_MB,
        max_new_threads=GRPC_THREADS,
    ),
    Listener(
        "gpus",
        [
            sys.executable,
            "-m",
            "agents.gpus",
            "--listen",
            "127.0.0.1:0",
            "--gpus",
            "GPU-1:1000",
            "--require-token",
            TOKEN,
        ],
        _gpus_ok,
        [grpc_half_sent("/gpuresc.GPUResc/GetGPUResource"), idle],
        max_rss_growth_mb=GRPC_MB,
        max_new_threads=GRPC_THREADS,
    ),
    *(
        Listener(
            f"gateway-{plane}",
            [sys.executable, "-m", "corral.cli", "gateway", "--listen", "127.0.0.1:0"],
            _http_ok("/metrics"),
            [
                aimed(http_half_sent, b"/function/hello"),
                aimed(http_endless_headers, b"/function/hello"),
                idle,
                aimed(http_oversized, b"/function/hello"),
            ],
            env={**STORE, "CORRAL_GATEWAY_TOKEN": TOKEN, "CORRAL_GATEWAY_DATAPLANE": plane},
            store=True,
            max_new_threads=HTTP_THREADS,
        )
        for plane in DATAPLANES
    ),
]


@dataclass
class Server:
    """A listener's process and its port."""

    proc: subprocess.Popen[bytes]
    port: int


@contextlib.contextmanager
def _running(listener: Listener, tmp_path: Path, template: Path) -> Iterator[Server]:
    """``listener`` started as its own process; stopped on the way out."""
    need(listener.env.get("CORRAL_GATEWAY_DATAPLANE", "python"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    env.update({k: v.format(tmp=tmp_path) for k, v in listener.env.items()})
    env["CORRAL_STATE_DIR"] = str(tmp_path / "state")
    if listener.store:
        shutil.copyfile(template, tmp_path / "corral.sqlite")
    # port 0 and the server's own words: a port found free a moment before may be another
    # test's by the time the server binds it (cis662)
    log = tmp_path / "listener.log"
    proc, address = start_listening(listener.argv, cwd=tmp_path, env=env, log_path=log)
    _, port = split_hostport(address)  # (the gateway says a URL: its port ends it too)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")
            try:
                listener.healthy(port)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield Server(proc, port)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(params=LISTENERS, ids=[listener.name for listener in LISTENERS])
def server(
    request: pytest.FixtureRequest, tmp_path: Path, sqlite_template: Path
) -> Iterator[tuple[Listener, Server]]:
    listener: Listener = request.param
    with _running(listener, tmp_path, sqlite_template) as running:
        yield listener, running


def test_unauthenticated_work_stays_bounded(server: tuple[Listener, Server]) -> None:
    listener, srv = server
    for _ in range(3):  # warm: pools, threads and caches a real call makes
        listener.healthy(srv.port)
    base_rss, base_threads = _status(srv.proc.pid)
    report = []
    for attack in listener.attacks:
        held: list[socket.socket] = []
        try:
            with _peak(srv.proc.pid) as peak:
                attack(srv.port, held)
                # the server takes in what was sent: until its peaks stop growing
                eventually(_settled(peak), 30, "the server's memory and threads to settle")
            rss, threads = peak
            report.append(
                f"{attack.__name__}: +{rss - base_rss:.0f} MB, {threads - base_threads:+d} threads"
            )
            assert srv.proc.poll() is None, "the server died"
            assert rss - base_rss <= listener.max_rss_growth_mb, report
            assert threads - base_threads <= listener.max_new_threads, report
        finally:
            for sock in held:
                with contextlib.suppress(OSError):
                    sock.close()
        eventually(_answers(listener, srv.port), 30, f"{listener.name} to serve its callers")
        listener.healthy(srv.port)  # still serves its real callers
    print(f"{listener.name}: idle {base_rss:.0f} MB, {base_threads} threads; " + "; ".join(report))


def test_a_slow_drip_is_cut_off_at_the_request_deadline() -> None:
    """A caller that sends a byte now and then (never idle long enough for the socket
    timeout) still loses its connection when its request is not in by the deadline."""
    limits = dataclasses.replace(lambdo.LIMITS, head_timeout_s=1.0)
    running = lambdo.serve_lambdo("127.0.0.1:0", token=TOKEN, limits=limits)
    try:
        sock = socket.create_connection(("127.0.0.1", running.port), timeout=5)
        started = time.monotonic()
        closed = False
        with sock:
            for byte in b"GET /vms HTTP/1.1\r\nX-Slow: " + b"a" * 100:
                try:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.1)
                except OSError:
                    closed = True
                    break
            else:
                sock.settimeout(5)
                with contextlib.suppress(OSError):
                    closed = sock.recv(1) == b""
        assert closed and time.monotonic() - started < 5
        _http_ok("/vms")(running.port)  # everyone else is still served
    finally:
        running.stop()


# -- one peer's connections ------------------------------------------------------------------

# The gateway's caps, made small enough for a test to reach (its defaults: 4,096 in all,
# 1,024 a peer, 256 of them anonymous); the Lambdo host's and the exporter's are their own.
SMALL_GATEWAY = {
    "CORRAL_GATEWAY_MAX_CONNECTIONS": "64",
    "CORRAL_GATEWAY_MAX_CONNECTIONS_PER_PEER": "48",
    "CORRAL_GATEWAY_ANONYMOUS_PER_PEER": "16",
}
HEALTHY_PATH = {
    "lambdo": b"/vms",
    "metrics": b"/metrics",
    "gateway-python": b"/metrics",
    "gateway-haproxy": b"/metrics",
}


def _from(address: str, port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), 2, source_address=(address, 0))
    except OSError:
        return None


PER_PEER = [listener for listener in LISTENERS if listener.name in HEALTHY_PATH]


@pytest.fixture(params=PER_PEER, ids=[listener.name for listener in PER_PEER])
def http_server(
    request: pytest.FixtureRequest, tmp_path: Path, sqlite_template: Path
) -> Iterator[tuple[Listener, Server]]:
    listener: Listener = request.param
    if listener.name.startswith("gateway"):
        listener = dataclasses.replace(listener, env={**listener.env, **SMALL_GATEWAY})
    with _running(listener, tmp_path, sqlite_template) as running:
        yield listener, running


def test_one_peer_holding_every_connection_it_may_leaves_another_peer_served(
    http_server: tuple[Listener, Server],
) -> None:
    listener, srv = http_server
    path = HEALTHY_PATH[listener.name]
    request = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
    held: list[socket.socket] = []
    try:
        for _ in range(100):  # kept-alive connections that showed the token, all it may hold
            if (sock := _from("127.0.0.2", srv.port)) is None:
                continue
            held.append(sock)
            with contextlib.suppress(OSError):
                sock.sendall(request + b"\r\n\r\n")
                sock.recv(65536)  # its answer (a 503 past the peer's cap)
        for _ in range(100):  # and half-sent heads, no credential shown
            if (sock := _from("127.0.0.2", srv.port)) is not None:
                held.append(sock)
                _send(sock, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # another peer (127.0.0.1) is served all the while
            listener.healthy(srv.port)
    finally:
        for sock in held:
            sock.close()
