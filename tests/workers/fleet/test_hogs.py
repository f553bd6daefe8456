"""CPU hogs on reference agents: real busy-loop processes started and stopped per node."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import grpc
import pytest
from sqlalchemy import update

from agents import Fault
from agents.fcdaemon import RunningAgent
from corral import api
from corral.cli import main
from tests.fixtures import Env, StartAgents
from tests.helpers import result_of
from workers.base.errors import InputError
from workers.fleet.hogs import HogRequest, run_hogs
from workers.fleet.nodes import upsert_node
from workers.store.models import Node

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def two_agents(corral_env: Env, start_agents: StartAgents) -> Iterator[list[RunningAgent]]:
    """Two agents as node1 and node2; every hog they run is stopped afterwards."""
    agents = start_agents(2)
    yield agents
    for agent in agents:
        agent.agent.hogs.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_two_then_stop_one_on_every_node(
    two_agents: list[RunningAgent], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = two_agents
    assert main(["hogs", "start", "2", "--wait"]) == 0
    out = capsys.readouterr().out
    assert "succeeded" in out and "started 2 hog(s) on each of 2 node(s)" in out
    for agent in (a, b):
        assert [r.n for r in agent.agent.calls_of("CreateCPUHogs")] == [2]
        assert agent.agent.hogs.count == 2
    pids = a.agent.hogs.pids
    assert all(_alive(p) for p in pids)

    assert main(["hogs", "stop", "1", "--wait", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert (view["kind"], view["status"], view["done"], view["total"]) == (
        "hogs",
        "succeeded",
        2,
        2,
    )
    assert {k: v["state"] for k, v in view["result"]["nodes"].items()} == {
        "node1": "ok",
        "node2": "ok",
    }
    for agent in (a, b):
        assert [r.n for r in agent.agent.calls_of("StopCPUHogs")] == [1]
        assert agent.agent.hogs.count == 1
    assert a.agent.hogs.pids == pids[:1]  # the newest was stopped

    assert main(["hogs", "stop", "64", "--wait"]) == 0
    assert a.agent.hogs.count == b.agent.hogs.count == 0
    assert not any(_alive(p) for p in pids)


def test_one_node_only(two_agents: list[RunningAgent]) -> None:
    a, b = two_agents
    view = api.wait(api.hogs("start", 3, "node2"), timeout=20)
    assert (view["status"], list(result_of(view)["nodes"])) == ("succeeded", ["node2"])
    assert (a.agent.hogs.count, b.agent.hogs.count) == (0, 3)
    assert a.agent.calls_of("CreateCPUHogs") == []


def test_transport_errors_are_retried_on_that_node_only(two_agents: list[RunningAgent]) -> None:
    a, b = two_agents
    b.agent.inject("CreateCPUHogs", Fault.abort(grpc.StatusCode.UNAVAILABLE, "blip"))
    view = api.wait(api.hogs("start", 1), timeout=20)
    assert view["status"] == "succeeded", view
    assert len(a.agent.calls_of("CreateCPUHogs")) == 1  # never started twice
    assert len(b.agent.calls_of("CreateCPUHogs")) == 2
    assert (a.agent.hogs.count, b.agent.hogs.count) == (1, 1)
    assert result_of(view)["nodes"]["node2"]["attempts"] == 2


def test_a_refusing_node_is_reported_and_the_rest_proceed(
    two_agents: list[RunningAgent], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = two_agents
    b.agent.inject(
        "CreateCPUHogs",
        Fault.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "limit"),
        Fault.abort(grpc.StatusCode.INTERNAL, "no"),
    )
    assert main(["hogs", "start", "1", "--wait"]) == 1
    captured = capsys.readouterr()
    assert "partial" in captured.out
    assert "node2  failed" in captured.out and "INTERNAL: no" in captured.out
    assert "1 of 2 failed; first: node node2: CreateCPUHogs failed: INTERNAL: no" in captured.err
    assert (a.agent.hogs.count, b.agent.hogs.count) == (1, 0)
    assert len(b.agent.calls_of("CreateCPUHogs")) == 2  # the retryable error was retried


def test_bad_requests_change_nothing(two_agents: list[RunningAgent], corral_env: Env) -> None:
    for action, n, node, message in [
        ("pause", 1, None, "unknown hog action"),
        ("start", 0, None, "between 1 and 1024"),
        ("start", True, None, "must be an integer"),
        ("start", 1, "node9", "unknown node 'node9'"),
    ]:
        with pytest.raises(InputError, match=message):
            api.hogs(action, n, node)
    with corral_env.db.transaction() as s:
        upsert_node(s, "http://127.0.0.1:3000", name="lam", kind="lambdo")
    with pytest.raises(InputError, match="only fcdaemon agents run hogs"):
        api.hogs("start", 1, "lam")
    with corral_env.db.transaction() as s:
        s.execute(update(Node).values(healthy=False))
    with pytest.raises(InputError, match="no healthy fcdaemon nodes"):
        api.hogs("start", 1)
    assert all(not x.agent.calls_of("CreateCPUHogs") for x in two_agents)


def test_a_finished_operation_is_not_repeated(
    two_agents: list[RunningAgent], corral_env: Env
) -> None:
    a, _ = two_agents
    op = api.hogs("start", 1, "node1")
    assert api.wait(op, timeout=20)["status"] == "succeeded"
    again = run_hogs(corral_env.db, corral_env.settings, HogRequest("start", 1, "node1"), op)
    assert again["nodes"]["node1"]["state"] == "ok"
    assert len(a.agent.calls_of("CreateCPUHogs")) == 1  # a redelivery starts nothing more
    assert a.agent.hogs.count == 1


def test_through_a_real_worker_on_the_maintenance_queue(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=thread_worker)
    try:
        view = api.wait(api.hogs("start", 2), timeout=30)
        assert (view["status"], view["done"]) == ("succeeded", 1), view
        assert agent.agent.hogs.count == 2
        view = api.wait(api.hogs("stop", 2, "node1"), timeout=30)
        assert view["status"] == "succeeded" and agent.agent.hogs.count == 0
    finally:
        agent.agent.hogs.close()
