"""The CLI contract scripts depend on: JSON documents, operation ids, exit codes."""

from __future__ import annotations

import json

import pytest

from agents.faults import Fault
from corral.cli import main
from protos import fcdaemon_pb2
from tests.fixtures import Env, StartAgents


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> object:
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_listing_commands_print_one_json_document(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    start_agents(2)
    deployed = _json(
        capsys,
        [
            "functions",
            "deploy",
            "hello",
            "--image",
            "examples.hello",
            "--kernel",
            "/k",
            "--env",
            "A=1",
            "--label",
            "team=x",
            "--json",
        ],
    )
    assert isinstance(deployed, dict) and deployed["name"] == "hello"
    op = _json(capsys, ["spawn", "hello", "-n", "3", "--wait", "--json"])
    assert isinstance(op, dict) and op["status"] == "succeeded" and op["done"] == 3
    replicas = _json(capsys, ["replicas", "--function", "hello", "--json"])
    assert isinstance(replicas, list) and len(replicas) == 3
    for r in replicas:
        for key in (
            "id",
            "function",
            "node",
            "status",
            "vmid",
            "address",
            "created_at",
            "last_used_at",
        ):
            assert key in r
        assert r["status"] == "idle" and r["function"] == "hello"
    shown = _json(capsys, ["replicas", "show", replicas[0]["id"], "--json"])
    assert isinstance(shown, dict) and shown["id"] == replicas[0]["id"]
    nodes = _json(capsys, ["nodes", "list", "--json"])
    assert isinstance(nodes, list) and sum(n["live"] for n in nodes) == 3
    fns = _json(capsys, ["functions", "list", "--json"])
    assert isinstance(fns, list) and fns[0]["replicas"] == {"idle": 3}
    ops = _json(capsys, ["ops", "--json"])
    assert isinstance(ops, list) and ops[0]["kind"] == "spawn"
    one = _json(capsys, ["ops", op["id"], "--json"])
    assert isinstance(one, dict) and one["status"] == "succeeded"


def test_without_wait_commands_print_the_operation_id(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    start_agents(1)
    assert main(["functions", "deploy", "hello", "--image", "i", "--kernel", "/k"]) == 0
    capsys.readouterr()
    assert main(["scale", "hello", "2"]) == 0
    op_id = capsys.readouterr().out.strip()
    assert len(op_id) == 32 and op_id.isalnum()
    status = _json(capsys, ["ops", op_id, "--json"])
    assert isinstance(status, dict) and status["kind"] == "scale"


def test_remove_refuses_with_replicas_unless_forced(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    (agent,) = start_agents(1)
    assert main(["functions", "deploy", "hello", "--image", "i", "--kernel", "/k"]) == 0
    assert main(["spawn", "hello", "-n", "2", "--wait"]) == 0
    capsys.readouterr()
    assert main(["functions", "remove", "hello"]) == 1
    assert "has 2 replica(s); delete them or use --force" in capsys.readouterr().err
    assert main(["functions", "remove", "hello", "--force"]) == 0
    assert "removed function hello and 2 replica(s)" in capsys.readouterr().out
    assert len(agent.agent.calls_of("ReleaseVMSetup")) == 2
    assert agent.driver.list() == []
    assert _json(capsys, ["functions", "list", "--json"]) == []


def test_an_unused_node_is_removed_and_then_unknown(
    corral_env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["nodes", "add", "127.0.0.1:1", "--name", "spare"]) == 0
    capsys.readouterr()
    assert main(["nodes", "remove", "spare"]) == 0
    assert capsys.readouterr().out.strip() == "removed node spare"
    assert _json(capsys, ["nodes", "list", "--json"]) == []
    assert main(["nodes", "remove", "spare"]) == 1
    assert "unknown node 'spare'" in capsys.readouterr().err


def test_failed_wait_exits_non_zero(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    (agent,) = start_agents(1)
    assert main(["functions", "deploy", "hello", "--image", "i", "--kernel", "/k"]) == 0
    agent.agent.inject("CreateReplica", Fault.reply(fcdaemon_pb2.CreateReply()))
    capsys.readouterr()
    assert main(["spawn", "hello", "--wait"]) == 1
    out, err = capsys.readouterr()
    assert "failed" in out and "empty vmid" in err


def test_scale_below_the_count_deletes_the_surplus_idle_replicas(
    store_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    """`corral scale F N` under the current count (on PostgreSQL: a locked select of Replica)."""
    (agent,) = start_agents(1)
    assert main(["functions", "deploy", "hello", "--image", "i", "--kernel", "/k"]) == 0
    assert main(["scale", "hello", "4", "--wait"]) == 0
    op = _json(capsys, ["scale", "hello", "1", "--wait", "--json"])
    assert isinstance(op, dict) and op["status"] == "succeeded", op
    assert (op["done"], op["total"]) == (3, 3)
    assert len(agent.agent.calls_of("ReleaseVMSetup")) == 3
    assert len(agent.driver.list()) == 1
    replicas = _json(capsys, ["replicas", "--function", "hello", "--json"])
    assert isinstance(replicas, list)
    assert [r["status"] for r in replicas] == ["idle"]  # deleted rows are not listed


def test_deploy_autoscale_options(corral_env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["functions", "deploy", "web", "--image", "i", "--kernel", "/k", "--json"]
    plain = _json(capsys, base)
    assert plain["autoscale"] is False and plain["scale_to_zero_after"] is None  # type: ignore[index]
    auto = _json(capsys, [*base, "--autoscale", "--scale-to-zero-after", "120"])
    assert auto["autoscale"] is True and auto["scale_to_zero_after"] == 120.0  # type: ignore[index]
    off = _json(capsys, [*base, "--no-autoscale", "--scale-to-zero-after", "0"])
    assert off["autoscale"] is False and off["scale_to_zero_after"] is None  # type: ignore[index]
    capsys.readouterr()
    assert main([*base, "--scale-to-zero-after", "60"]) == 1
    assert "needs --autoscale" in capsys.readouterr().err


def test_deploy_keep_alive_and_show_its_windows(
    corral_env: Env, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    corral_env.set(broker_url=redis_url)
    base = ["functions", "deploy", "web", "--image", "i", "--kernel", "/k", "--json"]
    assert _json(capsys, base)["keep_alive"] == "fixed"  # type: ignore[index]
    adaptive = _json(capsys, [*base, "--keep-alive", "adaptive"])
    assert adaptive["keep_alive"] == "adaptive"  # type: ignore[index]
    shown = _json(capsys, ["functions", "show", "web", "--json"])
    assert shown["keep_alive_windows"]["mode"] == "fixed"  # type: ignore[index]
    capsys.readouterr()
    assert main(["functions", "show", "web"]) == 0
    text = capsys.readouterr().out
    rows = {k: v.strip() for k, _, v in (line.partition(" ") for line in text.splitlines())}
    assert rows["keep_alive"] == "adaptive"
    assert '"reason": "no idle times recorded"' in rows["keep_alive_windows"]
    with pytest.raises(SystemExit) as refused:
        main([*base, "--keep-alive", "sometimes"])
    assert refused.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err
    assert main([*base, "--autoscale"]) == 1
    assert "needs --scale-to-zero-after" in capsys.readouterr().err
    assert _json(capsys, ["functions", "show", "web", "--json"])["autoscale"] is False  # type: ignore[index]
