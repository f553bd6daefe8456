"""The ``claim``, ``release`` and ``reap`` commands through ``corral.cli.main``."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from corral.cli import main
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, one_agent
from tests.workers.replicas.helpers import by_id, one_node_idle, released, spawn_idle
from workers.base import clock
from workers.store.models import ReplicaState


def test_claim_release_reap_json(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    agents = start_agents(1)
    deploy_fn(corral_env, idle_timeout=30)
    spawn_idle(corral_env, "hello", 2)
    clock.travel(20)

    assert main(["claim", "hello", "--json", "--ttl", "60"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["function"] == "hello" and got["address"].startswith("http://127.0.0.1:")
    assert {"claim_id", "replica_id", "address", "expires_at"} <= set(got)
    assert by_id(corral_env)[got["replica_id"]].status == ReplicaState.ALLOCATED
    assert got["expires_at"].endswith("Z")  # ISO 8601 UTC, one minute from now
    expires = datetime.fromisoformat(got["expires_at"][:-1])
    assert abs((expires - clock.now() - timedelta(seconds=60)).total_seconds()) < 5

    assert main(["release", got["claim_id"], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {
        "claim_id": got["claim_id"],
        "released": True,
        "replica_id": got["replica_id"],
        "function": "hello",
        "status": "idle",
        "envs_in_use": 0,
        "envs_total": 1,
    }

    clock.travel(15)  # never used: idle 35 s; the released one: 15 s
    assert main(["reap", "--wait", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["status"] == "succeeded" and view["kind"] == "reap"
    report = view["result"]
    assert report["counts"] == {"idle": 1, "stale": 0, "stuck": 0}  # the other was used
    (item,) = report["deleted"]
    assert item["reason"] == "idle" and item["outcome"] == "deleted"
    assert item["replica_id"] != got["replica_id"]
    assert released(agents) == {item["vmid"]: 1}

    assert main(["reap", "--json"]) == 0  # without --wait: the operation id
    assert len(json.loads(capsys.readouterr().out)["operation"]) == 32


def test_human_output(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    one_node_idle(corral_env, start_agents, 2, idle_timeout=30, min=1)
    assert main(["claim", "hello"]) == 0
    claim_id, address = capsys.readouterr().out.split()
    assert len(claim_id) == 32 and address.startswith("http://")
    assert main(["release", claim_id]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"released {claim_id}: replica ") and " idle (0 of 1" in out
    assert main(["release", claim_id]) == 0  # a second release changes nothing, and says so
    assert capsys.readouterr().out == (
        f"claim {claim_id} is not held (already released, or expired and given back): "
        "nothing changed\n"
    )
    clock.travel(31)
    assert main(["reap", "--idle-timeout", "10", "--wait"]) == 0
    out = capsys.readouterr().out
    assert "reap pass deleted 1 replica(s): 1 idle, 0 stale, 0 stuck" in out
    assert "kept for min: hello=1" in out


def test_errors_are_one_line(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    one_agent(corral_env, start_agents)
    assert main(["release", "not-a-claim"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "corral: error: malformed claim id 'not-a-claim': expected 32 hex characters\n"
    )

    assert main(["claim", "hello", "--json"]) == 1
    assert capsys.readouterr().err == "corral: error: no idle replica of hello\n"

    assert main(["reap", "--idle-timeout", "-5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("corral: error: idle timeout must be between") and err.count("\n") == 1

    (replica,) = spawn_idle(corral_env, "hello", 1)
    assert main(["claim", "hello", "--ttl", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("corral: error: claim ttl must be above 0") and err.count("\n") == 1
    assert by_id(corral_env)[replica.id].envs_in_use == 0
