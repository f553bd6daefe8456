"""A node's address is an IP fixed when it is stored, and one node holds one address.

Issue 29's reproductions (3 and 4), against a real registry gRPC server and real agents
on loopback. A name is the real ``localhost`` (it resolves to the caller, 127.0.0.1),
the part of the attack a test can play without a DNS server of its own: on the old
code it was accepted, stored, and resolved again by every later check.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError

from agents.fcdaemon import RunningAgent, build_parser, serve_fcdaemon
from corral import api
from corral.cli import main
from netplumb.addresses import join_hostport
from protos import resmngr_grpc, resmngr_pb2
from tasks.maintenance import QUEUE
from testkit.eventually import eventually
from tests.fixtures import Env
from tests.helpers import deploy_fn, replicas, spawn_ok
from workers.backends import networks
from workers.fleet.health import check_health
from workers.fleet.nodes import AddressTaken, upsert_node
from workers.maintenance.reconcile import reconcile
from workers.registry.identity import Caller
from workers.registry.service import RunningRegistry, serve_registry
from workers.store.models import Node, ReplicaState

TOKEN = (("authorization", "Bearer reg-t0ken"),)


@pytest.fixture
def registry(corral_env: Env) -> Iterator[RunningRegistry]:
    settings = corral_env.set(registry_token="reg-t0ken", health_misses="1", orphan_grace_s="0")
    running = serve_registry(settings, "127.0.0.1:0", queue=QUEUE)
    networks.forget()
    yield running
    running.stop(0)
    networks.forget()


def _register(running: RunningRegistry, ip: str, port: int, node_id: str) -> grpc.RpcError | None:
    """RegisterNode as a holder of the registry token would send it; the error, if refused."""
    stub = resmngr_grpc.ResMngrServiceStub(grpc.insecure_channel(running.address))
    try:
        stub.RegisterNode(
            resmngr_pb2.RegisterNodeRequest(ip=ip, port=port, node_id=node_id),
            timeout=10,
            metadata=TOKEN,
        )
    except grpc.RpcError as exc:
        return exc
    return None


def _nodes(env: Env) -> dict[str, str]:
    with env.db.read() as s:
        return {n.name: n.address for n in s.scalars(select(Node))}


def _victim(env: Env, running: RunningRegistry) -> RunningAgent:
    """A real agent that registered itself as node ``victim``, running one Idle replica."""
    agent = serve_fcdaemon(
        "127.0.0.1:0", registry=running.address, node_id="victim", token="reg-t0ken"
    )
    assert agent.reporter is not None and agent.reporter.registered.wait(20)
    deploy_fn(env)
    spawn_ok("hello", 1)
    (replica,) = replicas(env)
    assert replica.status == ReplicaState.IDLE and replica.vmid
    return agent


def _untouched(env: Env, agent: RunningAgent, vmid: str) -> None:
    """The victim's VM still runs, nothing asked to release it, its replica still Idle."""
    assert [vm.vmid for vm in agent.driver.list()] == [vmid]
    assert agent.agent.calls_of("ReleaseVMSetup") == []
    assert [r.status for r in replicas(env)] == [ReplicaState.IDLE]


def test_a_host_name_in_register_node_is_refused(
    corral_env: Env, registry: RunningRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """3: ``localhost`` resolves to the caller, so the old check let it in and stored it."""
    caplog.set_level(logging.WARNING, logger="workers.registry")
    for ip in ("localhost", "127.0.0.1:4000", "127.0.0.1.nip.io"):
        err = _register(registry, ip, 4000, "alias-node")
        assert err is not None, f"{ip} was accepted"
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "must be an IP address" in (err.details() or "")
        assert "docs/operations.md" in (err.details() or "")  # where NAT is explained
    assert _nodes(corral_env) == {}
    assert "RegisterNode of node_id 'alias-node' refused" in caplog.text
    # the IP itself, from that IP, is a node (stored as the IP, canonical)
    assert _register(registry, "::ffff:127.0.0.1", 4000, "alias-node") is None
    assert _nodes(corral_env) == {"alias-node": "127.0.0.1:4000"}
    # node ids are printable text: no terminal escapes in `nodes list`'s NODE_ID
    err = _register(registry, "127.0.0.1", 4001, "evil\x1b]0;title\x07")
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_name_stored_by_an_older_corral_is_never_resolved(
    corral_env: Env, registry: RunningRegistry
) -> None:
    """3 (a) and (b): a node row whose address is a name pointing at another agent. Its
    health is not taken from wherever the name points now, its default replica network is
    not built from the name, and reconcile does not list the other agent as its own."""
    agent = _victim(corral_env, registry)
    try:
        (victim_vm,) = agent.driver.list()
        with corral_env.db.transaction() as s:  # as the old registry stored a name
            s.add(Node(name="alias-node", address=f"localhost:{agent.port}", healthy=True, live=0))
        health = check_health(corral_env.db, corral_env.settings)
        assert health.missed == ["alias-node"] and health.became_unhealthy == ["alias-node"]
        with corral_env.db.read() as s:
            alias = s.scalars(select(Node).where(Node.name == "alias-node")).one()
        assert "names a host, which corral does not resolve" in (alias.last_error or "")
        assert networks.default_networks(alias.kind, alias.address, corral_env.settings) == []
        report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
        assert report.orphans_destroyed == [] and report.nodes_checked == ["victim"]
        _untouched(corral_env, agent, victim_vm.vmid)
    finally:
        agent.stop(grace=0)


def test_a_second_node_at_an_address_is_refused(
    corral_env: Env, registry: RunningRegistry, capsys: pytest.CaptureFixture[str]
) -> None:
    """4: a new node_id registering the exact ``host:port`` of a registered node."""
    agent = _victim(corral_env, registry)
    try:
        (victim_vm,) = agent.driver.list()
        before = _nodes(corral_env)
        assert before == {"victim": agent.address}
        err = _register(registry, "127.0.0.1", agent.port, "dup-node")
        assert err is not None, "a second node was registered at the victim's address"
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        assert f"address {agent.address} is already victim's" in (err.details() or "")
        # an operator's `nodes add` is refused the same way, by IP or by a name for it
        for address in (agent.address, f"localhost:{agent.port}"):
            assert main(["nodes", "add", address, "--name", "dup-node"]) == 1
            assert "one node per address" in capsys.readouterr().err
        assert _nodes(corral_env) == before
        report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
        assert report.orphans_destroyed == []
        _untouched(corral_env, agent, victim_vm.vmid)
    finally:
        agent.stop(grace=0)


def test_reconcile_destroys_no_vm_another_nodes_row_holds(
    corral_env: Env, registry: RunningRegistry
) -> None:
    """4: one agent answering at two node addresses (two IPs of one host; no index can see
    that they are one): each node lists the other's VMs, and none is an orphan."""
    corral_env.set(agent_token="agent-t0ken")
    agent = serve_fcdaemon("0.0.0.0:0", require_token="agent-t0ken")
    try:
        with corral_env.db.transaction() as s:
            upsert_node(s, f"127.0.0.1:{agent.port}", name="victim")
        deploy_fn(corral_env)
        spawn_ok("hello", 1)
        (victim_vm,) = agent.driver.list()
        with corral_env.db.transaction() as s:
            upsert_node(s, f"127.0.0.2:{agent.port}", name="twin")
        report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
        assert report.nodes_checked == ["twin", "victim"]
        assert report.orphans_destroyed == []
        assert report.held_elsewhere == [f"twin/{victim_vm.vmid}"]
        # the next pass judges the victim's row against its own listing: still there
        reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
        _untouched(corral_env, agent, victim_vm.vmid)
    finally:
        agent.stop(grace=0)


def test_concurrent_registrations_at_one_address_one_wins(
    corral_env: Env, registry: RunningRegistry
) -> None:
    """Eight node ids register one address at once: one node, seven clear refusals."""
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def register(i: int) -> None:
        barrier.wait()
        try:
            registry.registry.register_node(
                "127.0.0.3", 5000, f"racer-{i}", Caller("127.0.0.3", "")
            )
            outcomes.append("won")
        except AddressTaken:
            outcomes.append("refused")

    threads = [threading.Thread(target=register, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(outcomes) == ["refused"] * 7 + ["won"]
    assert list(_nodes(corral_env).values()) == ["127.0.0.3:5000"]


def test_the_store_holds_one_node_per_address_whoever_checked_first(corral_env: Env) -> None:
    """The index, not only the check: a second addition whose check ran before the first
    committed (PostgreSQL: its insert waits on the index) is refused, and so is a row
    written around the check."""
    refused: list[BaseException] = []

    def second() -> None:
        try:
            with corral_env.db.transaction() as s:
                upsert_node(s, "127.0.0.4:6000", name="second")
        except BaseException as exc:
            refused.append(exc)

    def waiting() -> int:  # a new connection each time: activity is a per-transaction snapshot
        with corral_env.db.engine.connect() as conn:
            query = (
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
            return int(conn.execute(text(query)).scalar_one())

    thread = threading.Thread(target=second)
    with corral_env.db.transaction() as s:
        upsert_node(s, "127.0.0.4:6000", name="first")
        thread.start()
        if not corral_env.db.is_sqlite:  # (SQLite: its BEGIN waits for this commit)
            eventually(
                waiting,
                20,
                "the second insert to wait on the first",
                detail=lambda: f"the second ended: {refused!r}",
            )
    thread.join(30)
    assert [type(exc) for exc in refused] == [AddressTaken]
    assert _nodes(corral_env) == {"first": "127.0.0.4:6000"}
    with pytest.raises(IntegrityError), corral_env.db.transaction() as s:
        s.add(Node(name="around", address="127.0.0.4:6000", endpoint="127.0.0.4:6000", live=0))


def test_nodes_add_resolves_a_name_once_and_says_so(
    corral_env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    first = str(socket.getaddrinfo("localhost", 7000, type=socket.SOCK_STREAM)[0][4][0])
    at = f"[{first}]:7000" if ":" in first else f"{first}:7000"
    assert main(["nodes", "add", "localhost:7000", "--name", "n1"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"added node n1 at {at} (resolved from localhost) (fcdaemon, capacity 64)"
    )
    assert _nodes(corral_env) == {"n1": at}
    assert api.add_node(at, name="n1").view.get("resolved_from") is None  # an IP: as is
    assert main(["nodes", "add", "no-such-host.invalid:7000", "--name", "n2"]) == 1
    assert "cannot resolve node host 'no-such-host.invalid'" in capsys.readouterr().err
    assert _nodes(corral_env) == {"n1": at}


def test_an_agent_listening_on_a_name_registers_its_ip(
    corral_env: Env, registry: RunningRegistry, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference agent resolves its own listen host once and registers the IP (compose's
    agent used to register the name "agent"); ``--advertise-ip`` takes an IP only."""
    agent = serve_fcdaemon(
        "localhost:0", registry=registry.address, node_id="by-name", token="reg-t0ken"
    )
    try:
        assert agent.reporter is not None and agent.reporter.registered.wait(20)
        first = str(socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)[0][4][0])
        assert _nodes(corral_env) == {"by-name": join_hostport(first, agent.port)}
    finally:
        agent.stop(grace=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--advertise-ip", "agent"])
    assert "'agent' is not an IP address" in capsys.readouterr().err
