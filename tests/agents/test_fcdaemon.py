"""The reference node agent over real gRPC: replicas, idempotency, registry, hogs, faults."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agents import Fault, MemoryDriver, ProcessDriver, RunningAgent, serve_fcdaemon
from agents.drivers import VMSpec
from agents.fcdaemon import RegistryReporter, main
from protos import fcdaemon_grpc, fcdaemon_pb2, resmngr_pb2
from testkit.eventually import eventually
from testkit.processes import start_listening
from testkit.services import free_port
from tests.agents.conftest import stub_for
from tests.agents.helpers import (
    MeetingDriver,
    RecordingRegistry,
    children_of,
    descendants_of,
    http_get,
    is_alive,
    listening_on,
    same_bucket_ids,
    start_registry,
)

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
READY = resmngr_pb2.StatusUpdateRequest.READY


def create(stub: fcdaemon_grpc.FcServiceStub, **fields: Any) -> Any:
    """CreateReplica with defaults for an examples.hello replica."""
    fields.setdefault("imageName", "examples.hello")
    return stub.CreateReplica(fcdaemon_pb2.CreateRequest(**fields), timeout=10)


def pid_of(running: RunningAgent, vmid: str) -> int:
    """The process id of a replica, from the agent's driver."""
    (vm,) = [vm for vm in running.driver.list() if vm.vmid == vmid]
    assert vm.pid is not None
    return vm.pid


def test_create_replica_runs_a_process_that_serves_http(
    process_agent: RunningAgent, process_stub: fcdaemon_grpc.FcServiceStub
) -> None:
    reply = create(process_stub, kernelArgs="--env=GREETING=hi", cpu=1, mem=128)
    assert re.fullmatch(r"[0-9a-f]{32}", reply.vmid)
    assert reply.ip == "127.0.0.1"
    assert 20000 <= reply.port <= 29999
    answer = eventually(lambda: http_get(reply.ip, reply.port), what="replica HTTP")
    assert answer == (200, b"hello from corral\n")
    assert is_alive(pid_of(process_agent, reply.vmid))


def test_release_stops_the_process_and_unknown_vmid_is_not_found(
    process_agent: RunningAgent, process_stub: fcdaemon_grpc.FcServiceStub
) -> None:
    reply = create(process_stub)
    pid = pid_of(process_agent, reply.vmid)
    eventually(lambda: http_get(reply.ip, reply.port), what="replica HTTP")
    assert listening_on(descendants_of(os.getpid()), reply.port) == {"127.0.0.1"}

    process_stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=reply.vmid), timeout=10)

    assert not is_alive(pid)
    # nothing of ours listens there (asking the port could reach another test's server)
    assert listening_on(descendants_of(os.getpid()), reply.port) == set()
    assert process_stub.ListReplicas(empty_pb2.Empty()).replicas == []
    with pytest.raises(grpc.RpcError) as err:
        process_stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=reply.vmid), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_list_replicas_sets_request_id_only_when_a_create_gave_one(
    memory_stub: fcdaemon_grpc.FcServiceStub,
) -> None:
    keyed = create(memory_stub, requestId="req-listed")
    bare = create(memory_stub)
    listed = {r.vmid: r for r in memory_stub.ListReplicas(empty_pb2.Empty()).replicas}
    assert listed[keyed.vmid].HasField("requestId")
    assert listed[keyed.vmid].requestId == "req-listed"
    assert not listed[bare.vmid].HasField("requestId")  # absent, not ""
    assert (listed[bare.vmid].ip, listed[bare.vmid].port) == (bare.ip, bare.port)


def test_request_id_makes_create_idempotent_even_when_concurrent(
    memory_agent: RunningAgent, memory_stub: fcdaemon_grpc.FcServiceStub
) -> None:
    first = create(memory_stub, requestId="req-1")
    again = create(memory_stub, requestId="req-1")
    other = create(memory_stub, requestId="req-2")
    assert again.vmid == first.vmid
    assert other.vmid != first.vmid

    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(create(memory_stub, requestId="r3").vmid))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert len(memory_agent.driver.list()) == 3


def test_creates_of_different_request_ids_run_side_by_side() -> None:
    # Ids whose crc32 fall in one of 64 buckets: the agent once held one lock per bucket
    # across the whole create, so slow creates of unrelated requests queued behind each other.
    same = same_bucket_ids(4)
    running = serve_fcdaemon(driver=MeetingDriver(len(same)))
    try:
        stub = stub_for(running)
        with concurrent.futures.ThreadPoolExecutor(len(same)) as pool:
            replies = list(pool.map(lambda rid: create(stub, requestId=rid), same))
        assert len({r.vmid for r in replies}) == len(same)
    finally:
        running.stop()


def test_request_id_of_a_released_vm_creates_a_new_one(
    memory_stub: fcdaemon_grpc.FcServiceStub,
) -> None:
    first = create(memory_stub, requestId="req-x")
    memory_stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=first.vmid))
    assert create(memory_stub, requestId="req-x").vmid != first.vmid


def test_list_replicas_reports_every_live_vm(
    memory_stub: fcdaemon_grpc.FcServiceStub,
) -> None:
    a = create(memory_stub, requestId="a", guestPort=9000)
    b = create(memory_stub)
    listed = {r.vmid: r for r in memory_stub.ListReplicas(empty_pb2.Empty()).replicas}
    assert set(listed) == {a.vmid, b.vmid}
    assert listed[a.vmid].requestId == "a"
    assert listed[a.vmid].port == a.port and listed[b.vmid].port == b.port != a.port
    assert listed[a.vmid].createdUnix <= listed[b.vmid].createdUnix <= time.time()


def test_dead_replica_disappears_from_list(
    process_agent: RunningAgent, process_stub: fcdaemon_grpc.FcServiceStub
) -> None:
    reply = create(process_stub, requestId="dies")
    os.kill(pid_of(process_agent, reply.vmid), signal.SIGKILL)
    eventually(
        lambda: not process_stub.ListReplicas(empty_pb2.Empty()).replicas, what="dead VM dropped"
    )
    # The request id no longer points at a live VM, so a retry makes a new one.
    assert create(process_stub, requestId="dies").vmid != reply.vmid


def test_bad_requests_get_clear_errors(process_stub: fcdaemon_grpc.FcServiceStub) -> None:
    cases: list[tuple[dict[str, Any], grpc.StatusCode]] = [
        ({"imageName": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"imageName": "no-such-image-or-binary-xyz"}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"cpu": -1}, grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for fields, code in cases:
        with pytest.raises(grpc.RpcError) as err:
            create(process_stub, **fields)
        assert err.value.code() == code, fields
        assert err.value.details()
    assert process_stub.ListReplicas(empty_pb2.Empty()).replicas == []


def test_ready_is_reported_after_the_replica_answers_http(
    registry: tuple[str, RecordingRegistry],
) -> None:
    address, servicer = registry
    running = serve_fcdaemon(
        driver=ProcessDriver(), registry=address, node_id="node-a", token="s3cret"
    )
    try:
        ((register, md),) = eventually(lambda: servicer.of("RegisterNode"), what="RegisterNode")
        assert (register.ip, register.port, register.node_id) == (
            "127.0.0.1",
            running.port,
            "node-a",
        )
        assert md.get("authorization") == "Bearer s3cret"

        reply = create(stub_for(running))
        ((status, md),) = eventually(lambda: servicer.of("UpdateStatus"), what="READY")
        assert (status.vmid, status.status) == (reply.vmid, READY)
        assert md.get("authorization") == "Bearer s3cret"
        # READY means the function answers.
        assert http_get(reply.ip, reply.port) == (200, b"hello from corral\n")
    finally:
        running.stop()


@pytest.mark.parametrize(
    "action",
    [resmngr_pb2.StatusUpdateReply.DESTROY, resmngr_pb2.StatusUpdateReply.KEEP_ALIVE],
    ids=["destroy_releases_the_vm", "keep_alive_keeps_it"],
)
def test_the_answer_to_ready(
    registry: tuple[str, RecordingRegistry],
    action: resmngr_pb2.StatusUpdateReply.Action.ValueType,
) -> None:
    address, servicer = registry
    servicer.action = action
    with serve_fcdaemon(driver=MemoryDriver(), registry=address) as running:
        reply = create(stub_for(running))
        eventually(lambda: servicer.of("UpdateStatus"), what="READY")
        if action == resmngr_pb2.StatusUpdateReply.DESTROY:
            eventually(lambda: not running.driver.list(), what="VM released")
            assert not any(vm.vmid == reply.vmid for vm in running.driver.list())
        else:
            time.sleep(0.2)
            assert [vm.vmid for vm in running.driver.list()] == [reply.vmid]


def test_ready_is_retried_on_transient_errors_only(
    registry: tuple[str, RecordingRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    address, servicer = registry
    servicer.failures = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    with serve_fcdaemon(driver=MemoryDriver(), registry=address) as running:
        stub = stub_for(running)
        first = create(stub)
        eventually(lambda: len(servicer.of("UpdateStatus")) == 3, what="READY retried twice")
        assert {r.vmid for r, _ in servicer.of("UpdateStatus")} == {first.vmid}

        servicer.failures = [grpc.StatusCode.UNAUTHENTICATED]
        second = create(stub)
        eventually(lambda: len(servicer.of("UpdateStatus")) == 4, what="READY of second VM")
        given_up = f"READY of {second.vmid} not delivered"
        eventually(lambda: given_up in caplog.text, what="the agent giving the READY up")
        assert len(servicer.of("UpdateStatus")) == 4  # not retried: it cannot succeed


def test_ready_is_retried_past_the_ready_timeout_while_the_vm_lives(
    registry: tuple[str, RecordingRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    """A registry cut off for longer than the probe's timeout still hears the READY."""
    address, servicer = registry
    servicer.failures = [grpc.StatusCode.UNAVAILABLE] * 8  # ~1 s of back-off at 0.2 s at most
    driver = MemoryDriver()
    vm = driver.start(VMSpec(image="examples.hello"))
    reporter = RegistryReporter(
        address, node_ip="127.0.0.1", node_port=1, node_id="n",
        is_live=lambda v: driver.get(v) is not None, ready_timeout=0.3, max_backoff=0.2,
    )  # fmt: skip
    try:
        reporter.report_ready(vm, probe=False)
        eventually(lambda: len(servicer.of("UpdateStatus")) == 9, what="READY delivered at last")
        driver.stop(vm.vmid)
        servicer.failures = [grpc.StatusCode.UNAVAILABLE] * 1000
        gone = driver.start(VMSpec(image="examples.hello"))
        driver.stop(gone.vmid)
        reporter.report_ready(gone, probe=False)  # a VM that is gone is not reported for ever
        given_up = f"READY of {gone.vmid} not delivered"
        eventually(lambda: given_up in caplog.text, what="the agent giving the gone VM up")
        assert len(servicer.of("UpdateStatus")) == 10
    finally:
        reporter.close()


def test_register_node_is_retried_until_a_late_registry_comes_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    started = time.monotonic()
    running = serve_fcdaemon(registry=f"127.0.0.1:{port}", node_id="late")
    # waiting, it would wait until the registry below comes up: never (1 s was a bound the
    # machine could miss with two suites side by side)
    assert time.monotonic() - started < 10, "start must not wait for the registry"
    server = None
    try:
        eventually(lambda: "attempt 1); retrying" in caplog.text, what="a failed attempt")
        assert running.reporter is not None
        assert not running.reporter.registered.is_set()
        server, _, servicer = start_registry(f"127.0.0.1:{port}")
        ((req, _md),) = eventually(
            lambda: servicer.of("RegisterNode")[:1],
            timeout=8,
            what="RegisterNode after the registry came up",
        )
        assert req.node_id == "late" and req.port == running.port
    finally:
        running.stop()
        if server is not None:
            server.stop(0)


def test_cpu_hogs_are_real_processes_started_and_stopped(
    process_agent: RunningAgent, process_stub: fcdaemon_grpc.FcServiceStub
) -> None:
    process_stub.CreateCPUHogs(fcdaemon_pb2.CpuHogs(n=2), timeout=10)
    pids = process_agent.agent.hogs.pids
    assert len(pids) == 2 and all(is_alive(p) for p in pids)
    assert set(pids) <= set(children_of(os.getpid()))

    process_stub.StopCPUHogs(fcdaemon_pb2.CpuHogs(n=1), timeout=10)
    assert process_agent.agent.hogs.count == 1
    assert sum(is_alive(p) for p in pids) == 1

    process_stub.StopCPUHogs(fcdaemon_pb2.CpuHogs(n=5), timeout=10)  # "up to n"
    assert process_agent.agent.hogs.count == 0
    assert not any(is_alive(p) for p in pids)

    with pytest.raises(grpc.RpcError) as err:
        process_stub.CreateCPUHogs(fcdaemon_pb2.CpuHogs(n=-1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        process_stub.CreateCPUHogs(fcdaemon_pb2.CpuHogs(n=10_000))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_stop_leaves_no_replica_or_hog() -> None:
    running = serve_fcdaemon(driver=ProcessDriver())
    stub = stub_for(running)
    reply = create(stub)
    stub.CreateCPUHogs(fcdaemon_pb2.CpuHogs(n=1))
    pids = [pid_of(running, reply.vmid), *running.agent.hogs.pids]
    running.stop()
    assert not any(is_alive(p) for p in pids)


def test_faults_abort_delay_and_reply_in_order(
    memory_agent: RunningAgent, memory_stub: fcdaemon_grpc.FcServiceStub
) -> None:
    memory_agent.agent.inject(
        "CreateReplica",
        Fault.abort(grpc.StatusCode.UNAVAILABLE, "node busy"),
        Fault.delay(0.3),
        Fault.reply(fcdaemon_pb2.CreateReply(ip="127.0.0.9", vmid="")),
    )
    with pytest.raises(grpc.RpcError) as err:
        create(memory_stub)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "node busy"

    t0 = time.monotonic()
    delayed = create(memory_stub)
    assert time.monotonic() - t0 >= 0.3
    assert delayed.vmid

    canned = create(memory_stub)
    assert (canned.vmid, canned.ip) == ("", "127.0.0.9")

    normal = create(memory_stub)
    assert normal.vmid and normal.vmid != delayed.vmid
    assert {vm.vmid for vm in memory_agent.driver.list()} == {delayed.vmid, normal.vmid}
    assert [name for name, _ in memory_agent.agent.calls] == ["CreateReplica"] * 4

    memory_agent.agent.inject("ReleaseVMSetup", Fault.abort(grpc.StatusCode.INTERNAL, "x"))
    with pytest.raises(grpc.RpcError) as err:
        memory_stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=normal.vmid))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert any(vm.vmid == normal.vmid for vm in memory_agent.driver.list())

    with pytest.raises(ValueError, match="unknown operation 'CreateReplicas'"):
        memory_agent.agent.inject("CreateReplicas", Fault.delay(0))


def test_calls_record_requests_and_aws_secrets_are_never_logged(
    memory_agent: RunningAgent,
    memory_stub: fcdaemon_grpc.FcServiceStub,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    reply = create(
        memory_stub,
        awsAccessKeyID="AKIA-TEST-KEY",
        awsSecretAccessKey="SECRET-VALUE-123",
        requestId="logged",
    )
    memory_stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=reply.vmid))
    assert reply.vmid in caplog.text  # the agent does log its work...
    assert "SECRET-VALUE-123" not in caplog.text  # ...but never the keys
    assert "AKIA-TEST-KEY" not in caplog.text
    (name, req), (name2, rel) = memory_agent.agent.calls
    assert isinstance(req, fcdaemon_pb2.CreateRequest)
    assert isinstance(rel, fcdaemon_pb2.ReleaseRequest)
    assert (name, req.requestId, name2, rel.vmid) == (
        "CreateReplica",
        "logged",
        "ReleaseVMSetup",
        reply.vmid,
    )


def test_a_seed_agent_makes_a_vm_per_create_and_logs_the_request_id_it_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What lets a log reader (the partition run's checker) see a create sent twice."""
    caplog.set_level(logging.INFO, logger="agents.fcdaemon")
    with serve_fcdaemon(driver=MemoryDriver(), seed_only=True) as running:
        stub = stub_for(running)
        first, again = create(stub, requestId="op.0.0"), create(stub, requestId="op.0.0")
    assert first.vmid != again.vmid  # the seed protocol does not deduplicate
    logged = re.findall(r"requestId=(\S+) \(ignored: seed protocol\): (\w+) at", caplog.text)
    assert logged == [("op.0.0", first.vmid), ("op.0.0", again.vmid)]


def test_health_service_reports_serving(memory_agent: RunningAgent) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(memory_agent.address))
    for service in ("", "fcdaemon.FcService"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def _start_agent_process(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    log_path = tmp_path / "agent.log"
    proc, found = start_listening(
        [
            sys.executable,
            "-m",
            "agents.fcdaemon",
            "--listen",
            "127.0.0.1:0",
            "--driver",
            "process",
            *extra,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        log_path=log_path,
        timeout=10,
    )
    return proc, found, log_path


def _replica_and_hog(address: str, agent_pid: int) -> list[int]:
    stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(address))
    reply = stub.CreateReplica(fcdaemon_pb2.CreateRequest(imageName="hello"), timeout=10)
    stub.CreateCPUHogs(fcdaemon_pb2.CpuHogs(n=1), timeout=10)
    eventually(lambda: http_get("127.0.0.1", reply.port), what="replica HTTP")
    kids = children_of(agent_pid)
    assert len(kids) == 2, kids
    return kids


@pytest.mark.timeout(40)
def test_replicas_get_and_listen_on_the_replica_ip(tmp_path: Path) -> None:
    """``--replica-ip``: a replica network's address of the host, not the agent's own."""
    proc, address, _ = _start_agent_process(tmp_path, "--replica-ip", "127.0.0.2")
    try:
        assert address.startswith("127.0.0.1:")
        stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(address))
        reply = create(stub)
        assert reply.ip == "127.0.0.2"
        listed = stub.ListReplicas(empty_pb2.Empty(), timeout=10).replicas
        assert [(r.vmid, r.ip) for r in listed] == [(reply.vmid, "127.0.0.2")]
        eventually(lambda: http_get("127.0.0.2", reply.port), what="replica on 127.0.0.2")
        # bound to the replica IP only (asking 127.0.0.1 could reach another test's server)
        assert listening_on(descendants_of(proc.pid), reply.port) == {"127.0.0.2"}
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(40)
def test_sigkill_of_the_agent_leaves_no_replica(tmp_path: Path) -> None:
    proc, address, _ = _start_agent_process(tmp_path)
    try:
        kids = _replica_and_hog(address, proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        eventually(
            lambda: not any(is_alive(k) for k in kids),
            timeout=5,
            what="replica and hog to die with the agent",
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(40)
def test_sigterm_stops_the_agent_cleanly(tmp_path: Path) -> None:
    proc, address, log_path = _start_agent_process(tmp_path)
    try:
        kids = _replica_and_hog(address, proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log_path.read_text()
        assert not any(is_alive(k) for k in kids)
        assert "stopped" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_main_rejects_a_bad_listen_address(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--listen", "nonsense", "--driver", "memory"])
    assert exc.value.code == 2
    assert "HOST:PORT" in capsys.readouterr().err
