"""The gRPC guard and server: what a caller can make a server hold, over real gRPC on loopback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import grpc
import pytest
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from netplumb.addresses import peer_ip, split_hostport
from netplumb.grpcserve import GuardedServer, Limits
from protos import fcdaemon_grpc, fcdaemon_pb2
from testkit.eventually import eventually
from tests.grpc_calls import code_of, half_sent

TOKEN = "guard-t0ken"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
LIST = "/fcdaemon.FcService/ListReplicas"
CHECK = "/grpc.health.v1.Health/Check"


def _report(bearer: str) -> str | None:
    """The registry's rule in small: ``vm.<name>`` is a report token for VM ``<name>``."""
    return bearer[3:] if bearer.startswith("vm.") else None


class Gated(fcdaemon_grpc.FcServiceServicer):
    """ListReplicas waits at a gate (open unless closed); ReleaseVMSetup aborts."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.seen: list[tuple[str, str | None]] = []
        self.running = 0
        self._lock = threading.Lock()

    def ListReplicas(
        self, request: object, context: grpc.ServicerContext
    ) -> fcdaemon_pb2.ReplicaList:
        """Note who asked, then wait for the gate."""
        with self._lock:
            self.running += 1
        self.seen.append(
            (str(dict(context.invocation_metadata()).get("authorization")), peer_ip(context.peer()))
        )
        try:
            self.gate.wait(30)
            return fcdaemon_pb2.ReplicaList()
        finally:
            with self._lock:
                self.running -= 1

    def ReleaseVMSetup(
        self, request: fcdaemon_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> empty_pb2.Empty:
        """Refuse, as a handler does."""
        context.abort(grpc.StatusCode.NOT_FOUND, f"unknown vmid {request.vmid}")


def _serve(servicer: Gated, *, workers: int = 4, **limits: float) -> tuple[GuardedServer, str]:
    server = GuardedServer(
        "test",
        workers=workers,
        max_message=1 << 16,
        token=TOKEN,
        report=_report,
        limits=Limits(**limits),  # type: ignore[arg-type]
    )
    server.add(fcdaemon_grpc.add_FcServiceServicer_to_server, servicer)
    port = server.bind("127.0.0.1:0")
    server.start("fcdaemon.FcService")
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def gated() -> Iterator[Gated]:
    servicer = Gated()  # type: ignore[abstract]  # two methods are enough
    yield servicer
    servicer.gate.set()


Metadata = tuple[tuple[str, str], ...]


def _list(address: str, metadata: Metadata = AUTH, timeout: float = 10) -> object:
    stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(address))
    return stub.ListReplicas(empty_pb2.Empty(), timeout=timeout, metadata=metadata)


def _health(address: str, metadata: Metadata = ()) -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10, metadata=metadata)
    return int(reply.status)


def _refused(calls: Sequence[grpc.Future[Any]], count: int) -> bool:
    return sum(code_of(c) is not None for c in calls) == count


def _busy(servicer: Gated, address: str, calls: int) -> list[Any]:
    """``calls`` authorised calls held at the gate (each on a handler thread)."""
    servicer.gate.clear()
    stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(address))
    held = [
        stub.ListReplicas.future(empty_pb2.Empty(), timeout=30, metadata=AUTH) for _ in range(calls)
    ]
    eventually(lambda: servicer.running == calls, 10, f"{calls} handlers running")
    return held


def test_a_call_without_the_token_is_refused_on_its_headers_while_every_thread_is_busy(
    gated: Gated,
) -> None:
    server, address = _serve(gated, workers=1)
    try:
        _busy(gated, address, 1)  # the one handler thread
        with half_sent(address, LIST, 50, (("authorization", "Bearer nope"),)) as calls:
            eventually(lambda: all(code_of(c) for c in calls), 10, "every call refused")
            assert {code_of(c) for c in calls} == {grpc.StatusCode.UNAUTHENTICATED}
        # health is answered on the loop: no thread needed
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING
        assert _health(address, AUTH) == health_pb2.HealthCheckResponse.SERVING
    finally:
        gated.gate.set()
        server.stop(0)


def test_a_call_whose_message_never_comes_is_refused_at_the_deadline(gated: Gated) -> None:
    server, address = _serve(gated, message_timeout_s=0.3)
    try:
        with half_sent(address, LIST, 3, AUTH) as calls:
            eventually(lambda: all(code_of(c) for c in calls), 10, "the deadline")
            assert {code_of(c) for c in calls} == {grpc.StatusCode.DEADLINE_EXCEEDED}
            error = calls[0].exception()
            assert isinstance(error, grpc.Call)
            assert "no request message within 0.3 s" in str(error.details())
        eventually(lambda: not server.guard.held, 5, "every place given back")
        assert gated.seen == []  # no handler ran
        _list(address)
    finally:
        server.stop(0)


def test_each_kind_of_caller_has_its_caps(gated: Gated) -> None:
    server, address = _serve(
        gated,
        message_timeout_s=120,  # the held calls wait for the whole test
        calls_per_peer=3,
        report_calls=3,
        report_calls_per_token=2,
        open_calls=10,
        open_calls_per_peer=2,
    )
    try:

        def vm(name: str) -> tuple[tuple[str, str], ...]:
            return (("authorization", f"Bearer vm.{name}"),)

        with (
            half_sent(address, LIST, 4, AUTH) as trusted,
            half_sent(address, LIST, 3, vm("a")) as guest_a,
            half_sent(address, CHECK, 3) as anonymous,
        ):
            for calls in (trusted, guest_a, anonymous):  # each: its cap held, one refused
                eventually(partial(_refused, calls, 1), 10, "caps")
                assert {code_of(x) for x in calls} == {None, grpc.StatusCode.RESOURCE_EXHAUSTED}
            with half_sent(address, LIST, 2, vm("b")) as guest_b:  # 3 guests' calls in all
                eventually(partial(_refused, guest_b, 1), 10, "the guests' cap in all")
            with pytest.raises(grpc.RpcError) as err:
                _health(address)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        eventually(lambda: not server.guard.held, 5, "every place given back")
        # health with the token is a trusted call, whatever anonymous callers hold
        with half_sent(address, CHECK, 3) as anonymous:
            eventually(partial(_refused, anonymous, 1), 10, "anonymous callers' cap")
            assert _health(address, AUTH) == health_pb2.HealthCheckResponse.SERVING
        eventually(lambda: not server.guard.held, 5, "every place given back")
    finally:
        server.stop(0)


def test_a_place_is_held_until_its_thread_is_done(gated: Gated) -> None:
    """A caller that gives up on a slow call cannot start another while the thread works."""
    server, address = _serve(gated, calls_per_peer=1)
    try:
        (slow,) = _busy(gated, address, 1)
        slow.cancel()  # the caller gives up; the handler's thread still works
        assert code_of(slow) == grpc.StatusCode.CANCELLED and gated.running == 1
        with pytest.raises(grpc.RpcError) as err:
            _list(address)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        gated.gate.set()
        eventually(lambda: not server.guard.held, 5, "the place given back")
        _list(address)
    finally:
        server.stop(0)


def test_a_call_whose_deadline_passed_while_it_waited_for_a_thread_is_never_begun(
    gated: Gated,
) -> None:
    """Its client has given up (and may have sent another in its place): nothing is done.

    The server's loop is held meanwhile, as a starved process's is: it cannot hear the
    client give up, so the call is still queued for the thread when the thread frees.
    """
    server, address = _serve(gated, workers=1)
    try:
        (slow,) = _busy(gated, address, 1)  # the one thread, held at the gate
        stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(address))
        late = stub.ListReplicas.future(empty_pb2.Empty(), timeout=0.5, metadata=AUTH)
        eventually(lambda: sum(server.guard.held.values()) == 2, 10, "the late call queued")
        loop_held, release = threading.Event(), threading.Event()

        def hold_the_loop() -> None:  # the fault: the loop runs nothing else until released
            loop_held.set()
            release.wait(30)

        server._loop.call_soon_threadsafe(hold_the_loop)
        try:
            loop_held.wait(10)
            # the client gives up on its own clock; the server's loop cannot hear it
            assert eventually(lambda: code_of(late), 10, "the late call to end") == (
                grpc.StatusCode.DEADLINE_EXCEEDED
            )
            gated.gate.set()  # the thread is free, and the late call is still queued for it
            # the pool's one thread takes its queue in order: past this, the late call's turn
            server.pool.submit(lambda: None).result(10)
        finally:
            release.set()
        eventually(lambda: not server.guard.held, 10, "both places given back")
        assert len(gated.seen) == 1  # the late call's handler never ran
        assert slow.result(10) is not None
        _list(address)  # and the next call is served
        assert len(gated.seen) == 2
    finally:
        server.stop(0)


def test_handlers_see_the_call_and_their_aborts_reach_the_client(gated: Gated) -> None:
    server, address = _serve(gated)
    try:
        _list(address)
        assert gated.seen == [(f"Bearer {TOKEN}", "127.0.0.1")]
        stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(address))
        with pytest.raises(grpc.RpcError) as err:
            stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid="vm-9"), timeout=10, metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == "unknown vmid vm-9"
        with pytest.raises(grpc.RpcError) as err:
            _list(address, metadata=())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == "missing or invalid agent token"
    finally:
        server.stop(0)


def test_stop_says_not_serving_and_ends_the_servers_threads(gated: Gated) -> None:
    before = set(threading.enumerate())
    server, address = _serve(gated)
    _list(address)
    assert server.stop(0).is_set()
    server.stop(0)  # again: nothing to do
    assert server.wait_for_termination(0)
    eventually(lambda: set(threading.enumerate()) <= before, 10, "the server's threads gone")
    with socket.socket() as taken:  # a server that cannot bind ends its threads too
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        unbound = GuardedServer("test", workers=1, max_message=1024, token=TOKEN)
        with pytest.raises(OSError, match="cannot listen"):
            unbound.bind(f"127.0.0.1:{taken.getsockname()[1]}")
    assert unbound.wait_for_termination(0)
    eventually(lambda: set(threading.enumerate()) <= before, 10, "its threads gone")


def _server_settings(port: int) -> dict[int, int]:
    """The HTTP/2 SETTINGS a server sends a new connection (id -> value)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        data = b""
        while True:
            while len(data) < 9:
                data += sock.recv(65536)
            length, kind, flags = int.from_bytes(data[:3], "big"), data[3], data[4]
            while len(data) < 9 + length:
                data += sock.recv(65536)
            payload, data = data[9 : 9 + length], data[9 + length :]
            if kind == 4 and not flags & 1:  # SETTINGS, not an ACK
                return {
                    int.from_bytes(payload[i : i + 2], "big"): int.from_bytes(
                        payload[i + 2 : i + 6], "big"
                    )
                    for i in range(0, len(payload), 6)
                }


def test_a_connection_may_carry_at_most_1024_calls_at_once(gated: Gated) -> None:
    server, address = _serve(gated)
    try:
        max_concurrent_streams = 3  # RFC 9113's SETTINGS_MAX_CONCURRENT_STREAMS
        assert _server_settings(split_hostport(address)[1])[max_concurrent_streams] == 1024
    finally:
        server.stop(0)
