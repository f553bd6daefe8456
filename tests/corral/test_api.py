"""The producer API the CLI is built on: what it returns is what ``--json`` prints."""

from __future__ import annotations

import json

import pytest
from sqlalchemy.engine import make_url

from corral import api
from corral.cli import main
from tests.fixtures import Env, StartAgents
from workers.base.errors import InputError, NotFound
from workers.functions import spec_from


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_listings_are_what_the_cli_prints(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    start_agents(2)
    saved = api.deploy(spec_from(name="hello", image="i", kernel="/k"))
    assert saved.created and saved.view["name"] == "hello"
    assert not api.deploy(spec_from(name="hello", image="i", kernel="/k")).created
    op = api.wait(api.spawn("hello", 3), timeout=60)
    assert op["status"] == "succeeded" and op["done"] == 3

    fns = api.functions()
    assert [(f["name"], f["live"], f.get("replicas")) for f in fns] == [("hello", 3, {"idle": 3})]
    assert _cli(capsys, "functions", "list") == fns
    assert _cli(capsys, "functions", "show", "hello") == api.function("hello")
    assert "live" not in api.function("hello")  # only the listing sums them
    assert _cli(capsys, "nodes", "list") == api.nodes()
    assert sum(n["live"] for n in api.nodes()) == 3
    shown = api.replicas("hello")
    assert len(shown) == 3 and _cli(capsys, "replicas", "--function", "hello") == shown
    assert api.replica(shown[0]["id"]) == shown[0]
    assert _cli(capsys, "ops") == api.operations() and api.operations(1)[0]["id"] == op["id"]
    assert api.operation(op["id"]) == op
    assert api.gpus() == [] == _cli(capsys, "gpus", "list")


def test_remove_function_deletes_its_replicas_only_when_forced(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1)
    api.deploy(spec_from(name="hello", image="i", kernel="/k"))
    api.wait(api.spawn("hello", 2), timeout=60)
    with pytest.raises(InputError, match="has 2 replica"):
        api.remove_function("hello")
    assert len(api.replicas("hello")) == 2  # refused: nothing changed
    assert api.remove_function("hello", force=True) == 2
    assert agent.driver.list() == [] and api.functions() == []
    assert api.replicas(all=True) == []  # its rows went with it
    with pytest.raises(NotFound):
        api.function("hello")


def test_nodes_drain_and_remove(corral_env: Env) -> None:
    saved = api.add_node("127.0.0.1:9", name="spare", capacity=2)
    assert saved.created and saved.view["capacity"] == 2
    assert not api.add_node("127.0.0.1:9", name="spare", capacity=3).created
    api.drain_node("spare")
    assert [n["draining"] for n in api.nodes() if n["name"] == "spare"] == [True]
    api.drain_node("spare", undo=True)
    assert [n["draining"] for n in api.nodes() if n["name"] == "spare"] == [False]
    api.remove_node("spare")
    assert "spare" not in {n["name"] for n in api.nodes()}
    with pytest.raises(NotFound):
        api.drain_node("spare")
    with pytest.raises(InputError, match="malformed replica id"):
        api.replica("nope")


def test_db_upgrade_and_check(corral_env: Env) -> None:
    done = api.upgrade_db()
    assert done["before"] == done["after"]  # the fixture migrated it already
    password = make_url(corral_env.settings.database_url).password
    assert password is None or str(password) not in done["database"]
    found = api.check_db()
    assert found.drifts == [] and set(found.checked) == {"nodes", "functions", "gpus"}
