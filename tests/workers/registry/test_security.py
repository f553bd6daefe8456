"""The registry trusts nobody by default: node identity and guest reports, over real gRPC."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import select

from agents.drivers import ProcessDriver
from agents.fcdaemon import serve_fcdaemon
from corral.cli import main
from netplumb.grpcserve import report_token
from protos import (
    fcdaemon_grpc,
    fcdaemon_pb2,
    mngrinfo_grpc,
    mngrinfo_pb2,
    resmngr_grpc,
    resmngr_pb2,
)
from tasks.maintenance import QUEUE
from testkit.eventually import eventually
from tests.fixtures import Env
from tests.grpc_calls import code_of, half_sent
from tests.helpers import creating, record_vm
from workers.backends import Vm
from workers.base import clock
from workers.fleet.health import check_health
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.registry import service
from workers.registry.identity import Caller, NotThatNode, StillHealthy
from workers.registry.service import RunningRegistry, serve_registry
from workers.replicas.owners import Pending
from workers.store.models import Function, Lease, Node, Replica, ReplicaState

TOKEN = (("authorization", "Bearer reg-t0ken"),)
READY = resmngr_pb2.StatusUpdateRequest.READY
FINISHED = resmngr_pb2.StatusUpdateRequest.FINISHED
Reply = resmngr_pb2.StatusUpdateReply


@pytest.fixture
def store(corral_env: Env) -> Env:
    """The store on SQLite and on PostgreSQL (``corral_env`` runs on both)."""
    return corral_env


@pytest.fixture
def registry(store: Env) -> Iterator[RunningRegistry]:
    settings = store.set(registry_token="reg-t0ken", ready_grace_s="5", health_misses="1")
    running = serve_registry(settings, "127.0.0.1:0", queue=QUEUE)
    yield running
    running.stop(0)


def _stub(running: RunningRegistry) -> resmngr_grpc.ResMngrServiceStub:
    return resmngr_grpc.ResMngrServiceStub(grpc.insecure_channel(running.address))


def _register(  # noqa: PLR0913 - RegisterNode's fields, and the caller's
    stub: resmngr_grpc.ResMngrServiceStub,
    ip: str,
    port: int,
    node_id: str,
    metadata: tuple[tuple[str, str], ...] = TOKEN,
    credential: str | None = None,
) -> str:
    reply = stub.RegisterNode(
        resmngr_pb2.RegisterNodeRequest(ip=ip, port=port, node_id=node_id, credential=credential),
        timeout=10,
        metadata=metadata,
    )
    return str(reply.credential)


def _nodes(env: Env) -> dict[str, str]:
    with env.db.read() as s:
        return {n.external_id or n.name: n.address for n in s.scalars(select(Node))}


def _wait_registered(env: Env, node_id: str) -> Node:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with env.db.read() as s:
            node = s.scalars(select(Node).where(Node.external_id == node_id)).first()
            if node is not None and node.credential_hash is not None:
                return node
        time.sleep(0.05)
    raise AssertionError(f"{node_id} never registered with a credential")


def test_an_attacker_with_the_token_cannot_divert_a_healthy_node(
    store: Env, registry: RunningRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's reproduction: RegisterNode with a registered node's id, its host and
    another port, or another host claimed as its ip, while the node is healthy."""
    caplog.set_level(logging.WARNING, logger="workers.registry")
    agent = serve_fcdaemon(
        "127.0.0.1:0", registry=registry.address, node_id="node-a", token="reg-t0ken"
    )
    stub = _stub(registry)
    # without the token: refused, nothing written
    with pytest.raises(grpc.RpcError) as err:
        _register(stub, "127.0.0.66", 50051, "evil", metadata=())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    try:
        _wait_registered(store, "node-a")  # the agent asked for a credential and got one
        for ip, port, code in (
            ("127.0.0.1", 6666, grpc.StatusCode.PERMISSION_DENIED),  # its host, another port
            ("127.0.0.66", 6666, grpc.StatusCode.PERMISSION_DENIED),  # a claim, not the peer
        ):
            for credential in (None, "", "guessed"):
                with pytest.raises(grpc.RpcError) as err:
                    stub.RegisterNode(
                        resmngr_pb2.RegisterNodeRequest(
                            ip=ip, port=port, node_id="node-a", credential=credential
                        ),
                        timeout=10,
                        metadata=TOKEN,
                    )
                assert err.value.code() == code, (ip, credential, err.value.details())
        assert _nodes(store) == {"node-a": agent.address}
        assert "calls from 127.0.0.1" in caplog.text and "present it" in caplog.text
        # the agent's own heartbeat, with its credential, still refreshes it
        assert agent.reporter is not None
        _register(stub, "127.0.0.1", agent.port, "node-a", credential=agent.reporter.credential)
    finally:
        agent.stop(grace=0)
    assert _nodes(store) == {"node-a": agent.address}


def test_a_seed_only_agent_registers_without_the_credential_field_and_stays_registered(
    store: Env, registry: RunningRegistry
) -> None:
    agent = serve_fcdaemon(
        "127.0.0.1:0",
        registry=registry.address,
        node_id="seed-a",
        token="reg-t0ken",
        heartbeat=0.1,
        seed_only=True,
    )
    try:
        assert agent.reporter is not None
        assert agent.reporter.registered.wait(20)
        beats = agent.reporter.registrations
        deadline = time.monotonic() + 10
        while agent.reporter.registrations < beats + 3:  # its heartbeats are accepted
            assert time.monotonic() < deadline, "heartbeats stopped"
            time.sleep(0.05)
        with store.db.read() as s:
            node = s.scalars(select(Node).where(Node.external_id == "seed-a")).one()
        assert node.credential_hash is None  # pinned to its host, as the seed protocol is
        assert agent.reporter.credential == ""
    finally:
        agent.stop(grace=0)


def test_who_may_refresh_or_move_a_node(
    store: Env,
    registry: RunningRegistry,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The identity rules, one registration at a time (nothing listens on these addresses,
    so one health pass marks a node unhealthy: CORRAL_HEALTH_MISSES is 1 here)."""
    caplog.set_level(logging.WARNING, logger="workers.registry")
    reg = registry.registry

    def register(
        ip: str, port: int, node_id: str, peer: str, credential: str | None = None
    ) -> str | None:
        return reg.register_node(ip, port, node_id, Caller(peer, credential))[1]

    # a seed agent (no credential field): pinned to the host it registered from
    assert register("127.0.0.5", 1001, "seed", "127.0.0.5") is None
    register("127.0.0.5", 1001, "seed", "127.0.0.5")  # its heartbeat
    with pytest.raises(NotThatNode):
        register("127.0.0.6", 1001, "seed", "127.0.0.6")
    with pytest.raises(StillHealthy):  # restarted on another port: not while healthy
        register("127.0.0.5", 1002, "seed", "127.0.0.5")
    # an agent that asks gets a credential; later registrations must show it
    credential = register("127.0.0.7", 2001, "aware", "127.0.0.7", credential="")
    assert credential
    with pytest.raises(NotThatNode):
        register("127.0.0.7", 2001, "aware", "127.0.0.7", credential="wrong")
    with pytest.raises(NotThatNode):  # another host, no credential
        register("127.0.0.8", 2001, "aware", "127.0.0.8", credential="")
    with pytest.raises(StillHealthy):  # even with it: a healthy node is never re-pointed
        register("127.0.0.8", 2001, "aware", "127.0.0.8", credential=credential)
    assert _nodes(store) == {"seed": "127.0.0.5:1001", "aware": "127.0.0.7:2001"}
    assert "re-pointed from" not in caplog.text
    # both fail their health checks: now each may move, its own way, with a WARNING
    assert sorted(check_health(store.db, store.settings).became_unhealthy) == ["aware", "seed"]
    with pytest.raises(NotThatNode):  # a seed node never moves to another host
        register("127.0.0.6", 1001, "seed", "127.0.0.6")
    register("127.0.0.5", 1002, "seed", "127.0.0.5")
    assert register("127.0.0.8", 2002, "aware", "127.0.0.8", credential=credential) is None
    assert _nodes(store) == {"seed": "127.0.0.5:1002", "aware": "127.0.0.8:2002"}
    assert "re-pointed from 127.0.0.5:1001 (unhealthy) to 127.0.0.5:1002" in caplog.text
    assert "re-pointed from 127.0.0.7:2001 (unhealthy) to 127.0.0.8:2002" in caplog.text
    assert main(["nodes", "list"]) == 0
    listed = capsys.readouterr().out
    assert "from 127.0.0.5:1001 at" in listed and "from 127.0.0.7:2001 at" in listed
    # an agent that lost its credential is let back in from the node's host once the node
    # is unhealthy, and gets a new one (the old one stops working)
    check_health(store.db, store.settings)
    fresh = register("127.0.0.8", 2003, "aware", "127.0.0.8", credential="")
    assert fresh and fresh != credential
    with pytest.raises(NotThatNode):
        register("127.0.0.8", 2003, "aware", "127.0.0.8", credential=credential)
    register("127.0.0.8", 2003, "aware", "127.0.0.8", credential=fresh)


def test_a_guests_report_token_can_report_on_its_own_vm_only(
    store: Env, registry: RunningRegistry
) -> None:
    replica_id = _recorded(
        store, "127.0.0.1:50051", "req-own", Vm("vm-own", "http://127.0.0.1:20001")
    )
    stub = _stub(registry)
    other = (("authorization", f"Bearer {report_token('reg-t0ken', 'vm-other')}"),)
    forged = (("authorization", "Bearer vm.vm-own.0123456789abcdef0123456789abcdef"),)
    own = (("authorization", f"Bearer {report_token('reg-t0ken', 'vm-own')}"),)
    for metadata, code in (
        (other, grpc.StatusCode.PERMISSION_DENIED),
        (forged, grpc.StatusCode.UNAUTHENTICATED),
    ):
        for status in (READY, FINISHED):
            with pytest.raises(grpc.RpcError) as err:
                stub.UpdateStatus(
                    resmngr_pb2.StatusUpdateRequest(vmid="vm-own", status=status),
                    timeout=5,
                    metadata=metadata,
                )
            assert err.value.code() == code
        with pytest.raises(grpc.RpcError) as err:
            mngrinfo_grpc.AvAManagerInfoStub(
                grpc.insecure_channel(registry.address)
            ).GetAvAManagerInfo(
                mngrinfo_pb2.AvAManagerInfoRequest(vmid="vm-own"), timeout=5, metadata=metadata
            )
        assert err.value.code() == code
    with pytest.raises(grpc.RpcError) as err:  # nor may it register a node
        _register(stub, "127.0.0.1", 7777, "guest-node", metadata=own)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with store.db.read() as s:
        assert s.get(Replica, replica_id).status == ReplicaState.STARTING  # type: ignore[union-attr]
        assert s.scalars(select(Node).where(Node.external_id == "guest-node")).first() is None
    _ready_makes_it_idle(store, stub, "vm-own", replica_id, own)


def test_the_reference_agent_gives_each_guest_its_own_report_token(
    store: Env, registry: RunningRegistry
) -> None:
    agent = serve_fcdaemon(
        "127.0.0.1:0",
        driver=ProcessDriver((33000, 33999)),
        registry=registry.address,
        token="reg-t0ken",
    )
    try:
        reply = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(agent.address)).CreateReplica(
            fcdaemon_pb2.CreateRequest(imageName="examples.hello"), timeout=30
        )
        (vm,) = agent.driver.list()
        assert vm.pid is not None
        raw = Path(f"/proc/{vm.pid}/environ").read_bytes().decode()
        environ = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
    finally:
        agent.stop(grace=0)
    assert environ["REPORT_TOKEN"] == report_token("reg-t0ken", reply.vmid)
    assert environ["REGISTRY"] == registry.address
    assert "reg-t0ken" not in raw.replace(environ["REPORT_TOKEN"], "")


def test_node_ids_match_exactly(store: Env, registry: RunningRegistry) -> None:
    stub = _stub(registry)
    with store.db.transaction() as s:  # an operator's node whose name a node_id derives to
        upsert_node(s, "127.0.0.1:7000", name="gpu-1")
    _register(stub, "127.0.0.1", 7001, "Gpu.1")
    _register(stub, "127.0.0.1", 7002, "gpu-1")
    with store.db.read() as s:
        nodes = {n.name: (n.external_id, n.address) for n in s.scalars(select(Node))}
    assert nodes == {
        "gpu-1": (None, "127.0.0.1:7000"),
        "gpu-1-2": ("Gpu.1", "127.0.0.1:7001"),
        "gpu-1-3": ("gpu-1", "127.0.0.1:7002"),
    }


def _guest_spawn(env: Env, node_address: str, request_id: str) -> tuple[str, Pending]:
    """A guest-readiness function and one spawn in flight on a node at ``node_address``."""
    with env.db.transaction() as s:
        if s.scalars(select(Function)).first() is None:
            deploy(
                s,
                spec_from(name="g", image="examples.hello", kernel="/k", readiness="guest"),
                env.settings,
            )
        node, _ = upsert_node(
            s, node_address, name="n-" + node_address.replace(".", "-").replace(":", "-")
        )
        node_id = node.id
        fn_id = s.scalars(select(Function.id)).one()
    pending = creating(env, fn_id, request_id, node_id)
    return pending.replica_id, pending


def _recorded(env: Env, node_address: str, request_id: str, vm: Vm) -> str:
    """A Starting replica of a guest-readiness function, its VM ``vm`` recorded; its id."""
    replica_id, pending = _guest_spawn(env, node_address, request_id)
    record_vm(env, pending, vm)
    return replica_id


def _ready_makes_it_idle(
    env: Env,
    stub: resmngr_grpc.ResMngrServiceStub,
    vmid: str,
    replica_id: str,
    metadata: tuple[tuple[str, str], ...],
) -> None:
    reply = stub.UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid=vmid, status=READY), timeout=5, metadata=metadata
    )
    assert reply.action == Reply.OK
    with env.db.read() as s:
        assert s.get(Replica, replica_id).status == ReplicaState.IDLE  # type: ignore[union-attr]


def test_update_status_is_answered_at_once_and_an_early_ready_is_applied_on_record(
    store: Env, registry: RunningRegistry
) -> None:
    replica_id, pending = _guest_spawn(store, "127.0.0.1:50051", "req-1")
    stub = _stub(registry)
    started = time.monotonic()
    # The spawn is in flight (no vmid yet); CORRAL_READY_GRACE_S is 5 s, the call has 4.5:
    # an answer that waited for the record would miss it (2 s left a loaded machine none)
    reply = stub.UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid="vm-early", status=READY),
        timeout=4.5,
        metadata=TOKEN,
    )
    assert reply.action == Reply.OK
    assert time.monotonic() - started < 4.5
    with store.db.read() as s:
        assert s.get(Replica, replica_id).status == ReplicaState.CREATING  # type: ignore[union-attr]
        assert s.scalars(select(Lease.name)).all() == ["ready:vm-early"]
    # the spawn records the VM: the remembered READY applies in the same transaction
    state = record_vm(store, pending, Vm("vm-early", "http://127.0.0.1:20001"))
    assert state == ReplicaState.IDLE.label
    with store.db.read() as s:
        assert s.get(Replica, replica_id).status == ReplicaState.IDLE  # type: ignore[union-attr]
        assert s.scalars(select(Lease.name)).all() == []


def test_reports_count_only_from_the_replicas_or_its_nodes_ip(
    store: Env, registry: RunningRegistry
) -> None:
    stub = _stub(registry)
    # a replica at 127.0.0.9 on a node at 127.0.0.8; this test calls from 127.0.0.1
    replica_id, pending = _guest_spawn(store, "127.0.0.8:50051", "req-far")
    reply = stub.UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid="vm-far", status=READY), timeout=5, metadata=TOKEN
    )
    assert reply.action == Reply.OK  # remembered, not yet judged
    state = record_vm(store, pending, Vm("vm-far", "http://127.0.0.9:20001"))
    assert state == ReplicaState.STARTING.label  # the early report came from a stranger
    for status in (READY, FINISHED):
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateStatus(
                resmngr_pb2.StatusUpdateRequest(vmid="vm-far", status=status),
                timeout=5,
                metadata=TOKEN,
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with store.db.read() as s:
        assert s.get(Replica, replica_id).status == ReplicaState.STARTING  # type: ignore[union-attr]
    # the same report from the node's own IP (loopback here) is accepted
    near_id = _recorded(
        store, "127.0.0.1:50051", "req-near", Vm("vm-near", "http://127.0.0.1:20002")
    )
    _ready_makes_it_idle(store, stub, "vm-near", near_id, TOKEN)


def test_finished_and_gpu_info_only_from_the_guest_itself(
    store: Env, registry: RunningRegistry
) -> None:
    """A guest behind its node's IP is not every guest of that node: FINISHED and
    GetAvAManagerInfo count only from the replica's own IP (READY also from its node's,
    whose agent reports it)."""
    stub = _stub(registry)
    # the node is at 127.0.0.1 (this test's peer); its replica at 127.0.0.9
    replica_id = _recorded(
        store, "127.0.0.1:50051", "req-nat", Vm("vm-nat", "http://127.0.0.9:20001")
    )
    _ready_makes_it_idle(store, stub, "vm-nat", replica_id, TOKEN)
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateStatus(
            resmngr_pb2.StatusUpdateRequest(vmid="vm-nat", status=FINISHED),
            timeout=5,
            metadata=TOKEN,
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        mngrinfo_grpc.AvAManagerInfoStub(grpc.insecure_channel(registry.address)).GetAvAManagerInfo(
            mngrinfo_pb2.AvAManagerInfoRequest(vmid="vm-nat"), timeout=5, metadata=TOKEN
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # the guest itself (its own IP) is heard
    assert registry.registry.update_status("vm-nat", FINISHED, "127.0.0.9") == Reply.KEEP_ALIVE


def test_a_vmid_is_bounded_before_anything_is_kept(store: Env, registry: RunningRegistry) -> None:
    """The issue's reproduction: early READYs of 3.9 MB vmids were each kept in memory."""
    _guest_spawn(store, "127.0.0.1:50051", "req-long")  # a spawn in flight: READYs are kept
    stub = _stub(registry)
    for vmid, code in (
        ("v" * 3_900_000, grpc.StatusCode.RESOURCE_EXHAUSTED),  # > 64 KiB
        ("v" * 200, grpc.StatusCode.INVALID_ARGUMENT),
        ("../etc", grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateStatus(
                resmngr_pb2.StatusUpdateRequest(vmid=vmid, status=READY), timeout=10, metadata=TOKEN
            )
        assert err.value.code() == code, err.value.details()
    assert registry.registry.pending == set()
    with store.db.read() as s:
        assert s.scalars(select(Lease.name)).all() == []


def test_one_caller_cannot_fill_the_early_ready_slots(
    store: Env, registry: RunningRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "MAX_PENDING_PER_CALLER", 3)
    _guest_spawn(store, "127.0.0.1:50051", "req-fill")
    stub = _stub(registry)
    for i in range(3):
        reply = stub.UpdateStatus(
            resmngr_pb2.StatusUpdateRequest(vmid=f"fill-{i}", status=READY),
            timeout=5,
            metadata=TOKEN,
        )
        assert reply.action == Reply.OK
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateStatus(
            resmngr_pb2.StatusUpdateRequest(vmid="fill-3", status=READY), timeout=5, metadata=TOKEN
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # another caller's early READY still gets a slot; a repeat of a kept one is no new slot
    assert registry.registry.update_status("real-vm", READY, "127.0.0.2") == Reply.OK
    reply = stub.UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid="fill-0", status=READY), timeout=5, metadata=TOKEN
    )
    assert reply.action == Reply.OK
    assert registry.registry.pending == {"fill-0", "fill-1", "fill-2", "real-vm"}
    # expired ones give their slots back
    clock.travel(store.settings.create_timeout_s + store.settings.ready_grace_s + 1)
    registry.registry.sweep()
    reply = stub.UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid="fill-3", status=READY), timeout=5, metadata=TOKEN
    )
    assert reply.action == Reply.OK


def test_an_early_ready_nobody_records_expires(store: Env) -> None:
    # A wait of its own no loaded machine outlasts between the report and the first sweep
    # (the fixture's 2 + 5 s went by there once: the READY had expired already).
    settings = store.set(registry_token="reg-t0ken", ready_grace_s="40", health_misses="1")
    registry = serve_registry(settings, "127.0.0.1:0", queue=QUEUE)
    try:
        _guest_spawn(store, "127.0.0.1:50051", "req-never")
        reply = _stub(registry).UpdateStatus(
            resmngr_pb2.StatusUpdateRequest(vmid="vm-never", status=READY),
            timeout=5,
            metadata=TOKEN,
        )
        assert reply.action == Reply.OK
        registry.registry.sweep()  # not recorded yet: still waiting
        assert registry.registry.pending == {"vm-never"}
        clock.travel(settings.create_timeout_s + settings.ready_grace_s + 1)
        registry.registry.sweep()
        assert registry.registry.pending == set()
    finally:
        registry.stop(0)
    with store.db.read() as s:
        assert s.scalars(select(Lease.name).where(Lease.name.startswith("ready:"))).all() == []


def test_no_other_process_can_share_the_registrys_port(registry: RunningRegistry) -> None:
    """gRPC binds with SO_REUSEPORT by default: another process of the same user could then
    listen on the registry's port and take a share of its calls."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", registry.port))


def test_half_sent_calls_leave_authorised_calls_and_health_answered(
    registry: RunningRegistry,
) -> None:
    """The issue's reproduction against the registry: 40 calls without a token and 32 with
    a guest's report token send their headers and never a message.

    Before, the token check answered only once a message arrived and a report token was
    let through to a handler thread, so these calls held every one of the registry's 32
    threads: agents' reports and the health check timed out.
    """
    stub = _stub(registry)
    health_stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(registry.address))
    nobody = resmngr_pb2.StatusUpdateRequest(vmid="nobody", status=READY)
    assert stub.UpdateStatus(nobody, timeout=10, metadata=TOKEN).action == Reply.DESTROY
    guest = (("authorization", f"Bearer {report_token('reg-t0ken', 'vm-guest')}"),)
    method = "/resmngr.ResMngrService/UpdateStatus"
    with (
        half_sent(registry.address, method, 40) as anonymous,
        half_sent(registry.address, method, 32, guest) as guests,
    ):
        for _ in range(3):
            assert stub.UpdateStatus(nobody, timeout=1.0, metadata=TOKEN).action == Reply.DESTROY
            reply = health_stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # refused from their headers alone; the guest may hold two calls (its token's cap)
        # while they wait for a message, and its others were refused at once
        eventually(lambda: all(code_of(c) for c in anonymous), 10, "anonymous refusals")
        assert {code_of(c) for c in anonymous} == {grpc.StatusCode.UNAUTHENTICATED}
        limits = service.LIMITS
        eventually(
            lambda: sum(code_of(c) is None for c in guests) == limits.report_calls_per_token,
            10,
            "all but the guest's cap refused",
        )
        assert {code_of(c) for c in guests} == {None, grpc.StatusCode.RESOURCE_EXHAUSTED}
        # another guest still reports (its VM is unknown here: DESTROY)
        other = (("authorization", f"Bearer {report_token('reg-t0ken', 'vm-other')}"),)
        other_ready = resmngr_pb2.StatusUpdateRequest(vmid="vm-other", status=READY)
        assert stub.UpdateStatus(other_ready, timeout=1.0, metadata=other).action == Reply.DESTROY
