"""The ``claim``, ``release`` and ``reap`` commands through ``tasks.cli.main``."""

from __future__ import annotations

import json

import pytest

from tasks.cli import main
from tests.claims.helpers import by_id, deploy_fn, released, spawn_idle
from tests.fixtures import Env, StartAgents
from workers import clock
from workers.store.models import ReplicaState


def test_claim_release_reap_json(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    agents = start_agents(1)
    deploy_fn(corral_env, idle_timeout=30)
    spawn_idle(corral_env, "hello", 2)
    clock.travel(20)

    assert main(["claim", "hello", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["function"] == "hello" and got["address"].startswith("http://127.0.0.1:")
    assert by_id(corral_env)[got["replica_id"]].status == ReplicaState.ALLOCATED

    assert main(["release", got["replica_id"], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"replica_id": got["replica_id"], "function": "hello", "status": "idle",
                   "envs_in_use": 0, "envs_total": 1}

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
    start_agents(1)
    deploy_fn(corral_env, idle_timeout=30, min=1)
    spawn_idle(corral_env, "hello", 2)
    assert main(["claim", "hello"]) == 0
    rid, address = capsys.readouterr().out.split()
    assert len(rid) == 32 and address.startswith("http://")
    assert main(["release", rid]) == 0
    assert capsys.readouterr().out.startswith(f"released {rid}: idle")
    clock.travel(31)
    assert main(["reap", "--idle-timeout", "10", "--wait"]) == 0
    out = capsys.readouterr().out
    assert "reap pass deleted 1 replica(s): 1 idle, 0 stale, 0 stuck" in out
    assert "kept for min: hello=1" in out


def test_errors_are_one_line(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    start_agents(1)
    deploy_fn(corral_env)
    assert main(["release", "0123456789abcdef0123456789abcdef"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "corral: error: unknown replica '0123456789abcdef0123456789abcdef'\n"

    assert main(["claim", "hello", "--json"]) == 1
    assert capsys.readouterr().err == "corral: error: no idle replica of hello\n"

    assert main(["reap", "--idle-timeout", "-5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("corral: error: idle timeout must be between") and err.count("\n") == 1

    (replica,) = spawn_idle(corral_env, "hello", 1)
    assert main(["release", replica.id]) == 1
    err = capsys.readouterr().err
    assert "has no execution environment in use" in err and err.count("\n") == 1
