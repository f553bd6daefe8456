"""The registry trusts nobody by default: node identity and guest reports, over real gRPC."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc
import pytest
from sqlalchemy import select

from agents.fcdaemon import serve_fcdaemon
from protos import resmngr_grpc, resmngr_pb2
from tests.fixtures import Env
from workers import clock
from workers.backends import Vm
from workers.fleet.health import check_health
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.registry.service import RunningRegistry, serve_registry
from workers.replicas.actions import begin_spawn, finish_spawn
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
    running = serve_registry(settings, "127.0.0.1:0")
    yield running
    running.stop(0)


def _stub(running: RunningRegistry) -> resmngr_grpc.ResMngrServiceStub:
    return resmngr_grpc.ResMngrServiceStub(grpc.insecure_channel(running.address))


def _register(stub: resmngr_grpc.ResMngrServiceStub, ip: str, port: int, node_id: str,
              metadata: tuple[tuple[str, str], ...] = TOKEN) -> None:
    stub.RegisterNode(resmngr_pb2.RegisterNodeRequest(ip=ip, port=port, node_id=node_id),
                      timeout=10, metadata=metadata)


def _nodes(env: Env) -> dict[str, str]:
    with env.db.read() as s:
        return {n.external_id or n.name: n.address for n in s.scalars(select(Node))}


def test_an_attacker_cannot_join_or_divert_a_healthy_node(
    store: Env, registry: RunningRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="workers.registry.service")
    agent = serve_fcdaemon("127.0.0.1:0")
    port = int(agent.address.rsplit(":", 1)[1])
    stub = _stub(registry)
    # without the token: refused, nothing written
    with pytest.raises(grpc.RpcError) as err:
        _register(stub, "127.0.0.66", 50051, "evil", metadata=())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _nodes(store) == {}
    try:
        _register(stub, "127.0.0.1", port, "node-a")
        _register(stub, "127.0.0.1", port, "node-a")  # a heartbeat refreshes it
        # with the token, from elsewhere: the healthy node is not re-pointed
        with pytest.raises(grpc.RpcError) as err:
            _register(stub, "127.0.0.66", 6666, "node-a")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _nodes(store) == {"node-a": agent.address}
        assert "not re-pointing it to 127.0.0.66:6666" in caplog.text
    finally:
        agent.stop(grace=0)
    # the old address fails its health checks: now the node may move (and the log says so)
    report = check_health(store.db, store.settings)
    assert report.became_unhealthy == ["node-a"]
    _register(stub, "127.0.0.2", 50051, "node-a")
    assert _nodes(store) == {"node-a": "127.0.0.2:50051"}
    assert "re-pointed from 127.0.0.1" in caplog.text


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


def _guest_spawn(env: Env, node_address: str, request_id: str) -> tuple[str, object]:
    """A guest-readiness function and one spawn in flight on a node at ``node_address``."""
    with env.db.transaction() as s:
        if s.scalars(select(Function)).first() is None:
            deploy(s, spec_from(name="g", image="examples.hello", kernel="/k",
                                readiness="guest"), env.settings)
        node, _ = upsert_node(s, node_address, name="n-" + node_address.replace(".", "-")
                              .replace(":", "-"))
        node_id = node.id
        fn_id = s.scalars(select(Function.id)).one()
    pending = begin_spawn(env.db, env.settings, None, request_id, fn_id, node_id)
    assert pending is not None
    return pending.replica_id, pending


def test_update_status_is_answered_at_once_and_an_early_ready_is_applied_on_record(
    store: Env, registry: RunningRegistry
) -> None:
    replica_id, pending = _guest_spawn(store, "127.0.0.1:50051", "req-1")
    stub = _stub(registry)
    started = time.monotonic()
    # The spawn is in flight (no vmid yet); CORRAL_READY_GRACE_S is 5 s, the call has 2.
    reply = stub.UpdateStatus(resmngr_pb2.StatusUpdateRequest(vmid="vm-early", status=READY),
                              timeout=2, metadata=TOKEN)
    assert reply.action == Reply.OK
    assert time.monotonic() - started < 2
    with store.db.read() as s:
        assert s.get(Replica, replica_id).status == ReplicaState.CREATING  # type: ignore[union-attr]
        assert s.scalars(select(Lease.name)).all() == ["ready:vm-early"]
    # the spawn records the VM: the remembered READY applies in the same transaction
    state = finish_spawn(store.db, store.settings, pending,  # type: ignore[arg-type]
                         Vm("vm-early", "http://127.0.0.1:20001"))
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
    reply = stub.UpdateStatus(resmngr_pb2.StatusUpdateRequest(vmid="vm-far", status=READY),
                              timeout=5, metadata=TOKEN)
    assert reply.action == Reply.OK  # remembered, not yet judged
    state = finish_spawn(store.db, store.settings, pending,  # type: ignore[arg-type]
                         Vm("vm-far", "http://127.0.0.9:20001"))
    assert state == ReplicaState.STARTING.label  # the early report came from a stranger
    for status in (READY, FINISHED):
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateStatus(resmngr_pb2.StatusUpdateRequest(vmid="vm-far", status=status),
                              timeout=5, metadata=TOKEN)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with store.db.read() as s:
        assert s.get(Replica, replica_id).status == ReplicaState.STARTING  # type: ignore[union-attr]
    # the same report from the node's own IP (loopback here) is accepted
    near_id, near = _guest_spawn(store, "127.0.0.1:50051", "req-near")
    finish_spawn(store.db, store.settings, near,  # type: ignore[arg-type]
                 Vm("vm-near", "http://127.0.0.1:20002"))
    reply = stub.UpdateStatus(resmngr_pb2.StatusUpdateRequest(vmid="vm-near", status=READY),
                              timeout=5, metadata=TOKEN)
    assert reply.action == Reply.OK
    with store.db.read() as s:
        assert s.get(Replica, near_id).status == ReplicaState.IDLE  # type: ignore[union-attr]


def test_an_early_ready_nobody_records_expires(store: Env, registry: RunningRegistry) -> None:
    _guest_spawn(store, "127.0.0.1:50051", "req-never")
    reply = _stub(registry).UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid="vm-never", status=READY), timeout=5, metadata=TOKEN)
    assert reply.action == Reply.OK
    registry.registry.sweep()  # not recorded yet: still waiting
    assert registry.registry.pending == {"vm-never"}
    clock.travel(store.settings.create_timeout_s + store.settings.ready_grace_s + 1)
    registry.registry.sweep()
    assert registry.registry.pending == set()
    with store.db.read() as s:
        assert s.scalars(select(Lease.name).where(Lease.name.startswith("ready:"))).all() == []
