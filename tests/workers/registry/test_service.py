"""The registry over real gRPC on loopback: nodes registering, guests reporting status."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from sqlalchemy import select

from corral import api
from protos import resmngr_grpc, resmngr_pb2
from tasks.maintenance import QUEUE
from testkit.eventually import eventually
from tests.fixtures import Env, StartAgents
from tests.helpers import creating
from workers.functions import deploy, spec_from
from workers.registry.service import RunningRegistry, serve_registry
from workers.replicas import reports
from workers.replicas.lifecycle import transition
from workers.store.models import Function, Node, Replica, ReplicaState

READY = resmngr_pb2.StatusUpdateRequest.READY
FINISHED = resmngr_pb2.StatusUpdateRequest.FINISHED
Reply = resmngr_pb2.StatusUpdateReply


@pytest.fixture
def registry(corral_env: Env) -> Iterator[RunningRegistry]:
    corral_env.set(ready_grace_s="0.3")
    running = serve_registry(corral_env.settings, "127.0.0.1:0", queue=QUEUE)
    yield running
    running.stop(0)


def _stub(registry: RunningRegistry) -> resmngr_grpc.ResMngrServiceStub:
    return resmngr_grpc.ResMngrServiceStub(grpc.insecure_channel(registry.address))


def test_register_node_twice_gives_one_healthy_node(
    corral_env: Env, registry: RunningRegistry
) -> None:
    stub = _stub(registry)
    for _ in range(2):  # a heartbeat refreshes it
        stub.RegisterNode(
            resmngr_pb2.RegisterNodeRequest(ip="127.0.0.1", port=50051, node_id="agent-a"),
            timeout=5,
        )
    # restarted on another port: not while its old address is healthy (test_security.py)
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterNode(
            resmngr_pb2.RegisterNodeRequest(ip="127.0.0.1", port=50061, node_id="agent-a"),
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with corral_env.db.read() as s:
        nodes = list(s.scalars(select(Node)))
    assert len(nodes) == 1
    assert nodes[0].external_id == "agent-a"
    assert nodes[0].address == "127.0.0.1:50051"
    assert nodes[0].healthy


def test_register_node_without_ip_is_invalid(registry: RunningRegistry) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _stub(registry).RegisterNode(resmngr_pb2.RegisterNodeRequest(port=1), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_ready_for_unknown_vmid_is_destroy(registry: RunningRegistry) -> None:
    """No spawn waits for a vmid: the VM is an orphan, answered DESTROY at once."""
    reply = _stub(registry).UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid="nobody-knows-me", status=READY), timeout=10
    )
    assert reply.action == Reply.DESTROY


def _guest_function(env: Env, **fields: object) -> None:
    spec = {"name": "g", "image": "img", "kernel": "/k", "readiness": "guest", **fields}
    with env.db.transaction() as s:
        deploy(s, spec_from(**spec), env.settings)


def test_ready_moves_starting_to_idle_and_finished_keeps_alive(
    corral_env: Env, registry: RunningRegistry, start_agents: StartAgents
) -> None:
    start_agents(1)
    _guest_function(corral_env)
    op = api.spawn("g", 1)
    with corral_env.db.read() as s:
        replica = s.scalars(select(Replica)).one()
    assert replica.status == ReplicaState.STARTING
    assert api.operation(op)["status"] == "running"  # waits for the guest
    stub = _stub(registry)
    reply = stub.UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid=replica.vmid or "", status=READY), timeout=5
    )
    assert reply.action == Reply.OK
    with corral_env.db.read() as s:
        assert s.get(Replica, replica.id).status == ReplicaState.IDLE  # type: ignore[union-attr]
    assert api.operation(op)["status"] == "succeeded"
    reply = stub.UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid=replica.vmid or "", status=FINISHED), timeout=5
    )
    assert reply.action == Reply.KEEP_ALIVE


def test_ready_that_beats_the_create_reply_is_not_destroyed(
    corral_env: Env, registry: RunningRegistry, start_agents: StartAgents
) -> None:
    """READY for a vmid whose spawn is still in flight is remembered, answered at once,
    and applied by the registry's sweep when the row gets its vmid some other way."""
    start_agents(1)
    _guest_function(corral_env)
    with corral_env.db.read() as s:
        fn_id = s.scalars(select(Function.id)).one()
    # A spawn in flight: row written as Creating, the agent has not answered yet.
    pending = creating(corral_env, fn_id, "req-early")
    reply = _stub(registry).UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid="early-vm", status=READY), timeout=10
    )
    assert reply.action == Reply.OK
    assert registry.registry.pending == {"early-vm"}
    with corral_env.db.transaction() as s:
        replica = s.get(Replica, pending.replica_id)
        assert replica is not None
        replica.vmid, replica.address = "early-vm", "http://127.0.0.1:8080"
        transition(s, replica, ReplicaState.STARTING, corral_env.settings)

    def status() -> ReplicaState | None:
        with corral_env.db.read() as s:
            replica = s.get(Replica, pending.replica_id)
            return None if replica is None else replica.status

    # The sweep commits the row's READY, then forgets the report: wait for both (cis121,
    # two suites at once, read the row Idle while the report was still remembered).
    eventually(
        lambda: status() == ReplicaState.IDLE and not registry.registry.pending,
        timeout=20,
        what="the sweep to apply the early READY and forget it",
        detail=lambda: f"status {status()}, pending {registry.registry.pending}",
    )


def test_a_sweep_while_an_early_ready_is_being_stored_keeps_it(
    corral_env: Env,
    registry: RunningRegistry,
    start_agents: StartAgents,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep forgets a remembered vmid with no stored report: not one whose report is
    being stored right then (cis220, two suites at once: pending was empty after the OK)."""
    start_agents(1)
    _guest_function(corral_env)
    with corral_env.db.read() as s:
        fn_id = s.scalars(select(Function.id)).one()
    creating(corral_env, fn_id, "req-early")
    store = reports.remember
    swept: list[set[str]] = []

    def sweep_then_store(*args: Any) -> bool:  # the sweep thread's pass, at the worst moment
        registry.registry.sweep()
        swept.append(set(registry.registry.pending))
        return bool(store(*args))

    monkeypatch.setattr(reports, "remember", sweep_then_store)
    reply = _stub(registry).UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid="early-vm", status=READY), timeout=10
    )
    assert reply.action == Reply.OK
    assert swept == [{"early-vm"}]
    assert registry.registry.pending == {"early-vm"}


def test_finished_on_a_stale_build_is_destroy(
    corral_env: Env, registry: RunningRegistry, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1)
    _guest_function(corral_env, readiness="agent")
    api.wait(api.spawn("g", 1), timeout=5)
    _guest_function(corral_env, readiness="agent")  # re-deploy: new build
    with corral_env.db.read() as s:
        replica = s.scalars(select(Replica)).one()
    reply = _stub(registry).UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid=replica.vmid or "", status=FINISHED), timeout=5
    )
    assert reply.action == Reply.DESTROY
    with corral_env.db.read() as s:
        assert s.scalars(select(Replica)).one().status == ReplicaState.DELETED
    assert [r.vmid for r in agent.agent.calls_of("ReleaseVMSetup")] == [replica.vmid]


def test_registry_token_is_enforced(corral_env: Env) -> None:
    settings = corral_env.set(registry_token="t0ken")
    running = serve_registry(settings, "127.0.0.1:0", queue=QUEUE)
    try:
        stub = _stub(running)
        req = resmngr_pb2.RegisterNodeRequest(ip="127.0.0.1", port=50051, node_id="n")
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterNode(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.RegisterNode(req, timeout=5, metadata=(("authorization", "Bearer t0ken"),))
        with corral_env.db.read() as s:
            assert len(list(s.scalars(select(Node)))) == 1
    finally:
        running.stop(0)


def test_finished_gives_the_claimed_environment_back(
    corral_env: Env, registry: RunningRegistry, start_agents: StartAgents
) -> None:
    start_agents(1)
    _guest_function(corral_env, readiness="agent")
    api.wait(api.spawn("g", 1), timeout=5)
    claimed = api.claim("g")
    with corral_env.db.read() as s:
        assert s.get(Replica, claimed["replica_id"]).status == ReplicaState.ALLOCATED  # type: ignore[union-attr]
    reply = _stub(registry).UpdateStatus(
        resmngr_pb2.StatusUpdateRequest(vmid=claimed["vmid"] or "", status=FINISHED), timeout=5
    )
    assert reply.action == Reply.KEEP_ALIVE
    with corral_env.db.read() as s:
        replica = s.get(Replica, claimed["replica_id"])
        assert replica is not None
        assert (replica.status, replica.envs_in_use) == (ReplicaState.IDLE, 0)
        assert replica.last_used_at is not None
    assert not api.release(claimed["claim_id"])["released"]  # FINISHED gave that claim back
