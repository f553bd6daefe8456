"""How each VM of a spawn started, as its node says (``CreateReply.start``): stored on the
operation as ``result.starts`` (``corral ops OP --json``), never what a node makes up."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest

from agents import MemoryDriver, RunningAgent, serve_fcdaemon
from agents.drivers import VM, VMSpec
from corral import api
from corral.cli import main
from tests.fixtures import Env
from tests.helpers import deploy_fn, spawn_ok
from workers.backends import inflight
from workers.fleet.nodes import upsert_node


class SayingDriver(MemoryDriver):
    """Records VMs, and says each started as ``how`` (as the qemu driver says boot/restore)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def start(self, spec: VMSpec) -> VM:
        """Record the VM; it says how it started."""
        return dataclasses.replace(super().start(spec), start=self.how)


@pytest.fixture
def saying_agent(corral_env: Env, request: pytest.FixtureRequest) -> Iterator[RunningAgent]:
    """An agent whose VMs say they started as the test's parameter says; ``hello`` deployed."""
    running = serve_fcdaemon("127.0.0.1:0", driver=SayingDriver(request.param))
    with corral_env.db.transaction() as s:
        upsert_node(s, running.address, name="node1", capacity=16)
    deploy_fn(corral_env, "hello")
    yield running
    running.stop(grace=0)
    inflight.reset()


@pytest.mark.parametrize("saying_agent", ["restore"], indirect=True)
def test_each_replica_of_a_spawn_says_how_its_vm_started(
    saying_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    op_id = spawn_ok("hello", 3)["id"]
    capsys.readouterr()
    assert main(["ops", op_id, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    ids = {r["id"] for r in api.replicas("hello")}
    assert len(ids) == 3
    assert shown["result"]["starts"] == dict.fromkeys(ids, "restore")


@pytest.mark.parametrize("saying_agent", ["", "rebooted; rm -rf /"], indirect=True)
def test_a_node_that_says_nothing_or_nonsense_records_nothing(
    saying_agent: RunningAgent,
) -> None:
    view = spawn_ok("hello", 2)
    assert view["result"] is not None
    assert "starts" not in view["result"]
