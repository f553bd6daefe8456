"""A replica's address is one its node may give out: inside the node's replica networks and
never one of corral's own listeners. Real agents on loopback answer what a hostile one
would (scripted replies); the spawn must fail as an untrusted reply and store no address."""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from sqlalchemy import select

from agents.faults import Fault
from agents.fcdaemon import RunningAgent, serve_fcdaemon
from agents.lambdo import serve_lambdo
from corral import api
from corral.cli import main
from protos import fcdaemon_pb2
from tests.fixtures import Env, postgres_only
from workers.backends import networks
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.store.models import Node, Replica

# where this test's control plane listens (none of these ports is bound: the settings say
# so). All lie below the fake hosts' port ranges (Lambdo 10000-19999, fcdaemon 20000-29999):
# an honest answer must never land on one by chance. (They once lay inside Lambdo's range,
# and a fresh CI run's honest Lambdo spawn failed in 1.3 s, as a listener collision would.)
LISTENERS = {
    "metrics_listen": "127.0.0.1:9808",
    "gateway_listen": "127.0.0.1:8088",
    "registry_listen": "0.0.0.0:5052",
    "flower_port": "5555",
}


@pytest.fixture
def env(corral_env: Env) -> Iterator[Env]:
    corral_env.set(**LISTENERS)
    networks.forget()
    yield corral_env
    networks.forget()


@pytest.fixture
def agent(env: Env) -> Iterator[RunningAgent]:
    running = serve_fcdaemon("127.0.0.1:0")
    with env.db.transaction() as s:
        upsert_node(s, running.address, name="n1")
        deploy(s, spec_from(name="victim", image="examples.hello", kernel="/k"), env.settings)
    yield running
    running.stop(grace=0)


def _spawn_fails_untrusted(env: Env, why: str) -> None:
    view = api.wait(api.spawn("victim", 1), timeout=30)
    assert view["status"] == "failed" and why in (view["error"] or ""), view["error"]
    with env.db.read() as s:
        assert [r.address for r in s.scalars(select(Replica))] == [None]


@pytest.mark.parametrize(
    "port",
    [9808, 8088, 5052, 5555, 1],
    ids=["metrics", "gateway", "registry-wildcard", "flower", "broker"],
)
def test_an_agent_cannot_point_a_replica_at_corrals_own_listeners(
    env: Env, agent: RunningAgent, port: int
) -> None:
    # the reproduction: a fake agent pointed a replica at the metrics exporter
    agent.agent.inject(
        "CreateReplica", Fault.reply(fcdaemon_pb2.CreateReply(vmid="v1", ip="127.0.0.1", port=port))
    )
    _spawn_fails_untrusted(env, "one of corral's own listeners")


def test_a_replica_outside_its_nodes_networks_is_untrusted_until_the_operator_lists_it(
    env: Env, agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    reply = fcdaemon_pb2.CreateReply(vmid="v1", ip="10.9.8.7", port=8080)
    agent.agent.inject("CreateReplica", Fault.reply(reply))
    _spawn_fails_untrusted(env, "outside the node's replica networks")
    # a malformed network: a clear error, the node unchanged
    assert (
        main(["nodes", "add", agent.address, "--name", "n1", "--replica-network", "10.9.8.0/33"])
        == 1
    )
    assert "--replica-network: '10.9.8.0/33' is not a network" in capsys.readouterr().err
    with env.db.read() as s:
        assert s.scalars(select(Node.replica_networks)).one() is None
    assert (
        main(
            [
                "nodes",
                "add",
                agent.address,
                "--name",
                "n1",
                "--replica-network",
                "10.9.8.0/24",
                "--replica-network",
                "127.0.0.1",
            ]
        )
        == 0
    )
    networks.forget()  # another process would see it within networks.TTL_S
    agent.agent.inject("CreateReplica", Fault.reply(reply))
    view = api.wait(api.spawn("victim", 1), timeout=30)
    assert view["status"] == "succeeded", view["error"]
    with env.db.read() as s:
        assert "http://10.9.8.7:8080" in [r.address for r in s.scalars(select(Replica))]
    assert json.loads(_nodes_json(capsys))[0]["replica_networks"] == ["10.9.8.0/24", "127.0.0.1/32"]
    # a listener stays refused inside a listed network
    agent.agent.inject(
        "CreateReplica",
        Fault.reply(fcdaemon_pb2.CreateReply(vmid="v2", ip="127.0.0.1", port=8088)),
    )
    view = api.wait(api.spawn("victim", 1), timeout=30)
    assert view["status"] == "failed" and "own listeners" in (view["error"] or ""), view["error"]


def _nodes_json(capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["nodes", "list", "--json"]) == 0
    return capsys.readouterr().out


def test_a_lambdo_host_cannot_map_a_replica_onto_a_listener(env: Env) -> None:
    host = serve_lambdo("127.0.0.1:0")
    try:
        with env.db.transaction() as s:
            upsert_node(s, host.url, name="l1", kind="lambdo")
            deploy(
                s,
                spec_from(
                    name="victim", image="examples.hello", backend="lambdo", rootfs="examples.hello"
                ),
                env.settings,
            )
        host.agent.inject(
            "spawn", Fault.reply(200, json.dumps({"id": "v1", "port_mapping": [[8088, 8080]]}))
        )
        _spawn_fails_untrusted(env, "one of corral's own listeners")
        view = api.wait(api.spawn("victim", 1), timeout=30)  # an honest answer is fine
        assert view["status"] == "succeeded", view["error"]
    finally:
        host.stop()


@postgres_only  # the store is one of corral's listeners only when it is a server
def test_nor_at_the_database(env: Env, agent: RunningAgent) -> None:
    port = urlsplit(env.settings.database_url).port
    assert port is not None
    agent.agent.inject(
        "CreateReplica", Fault.reply(fcdaemon_pb2.CreateReply(vmid="v1", ip="127.0.0.1", port=port))
    )
    _spawn_fails_untrusted(env, "one of corral's own listeners")
