"""``corral db check [--fix]``: counters recounted from the replica rows."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select, update

from corral import api
from corral.cli import main
from tests.fixtures import Env, StartAgents
from tests.helpers import spawn_ok
from workers.store.models import Function, Gpu, Node


def _counters(env: Env) -> tuple[int, int, tuple[int, int]]:
    with env.db.read() as s:
        node = s.scalars(select(Node)).one()
        fn = s.scalars(select(Function)).one()
        gpu = s.scalars(select(Gpu)).one()
        return node.live, fn.replica_count, (gpu.slots_free, gpu.mem_free_mb)


def test_drifted_counters_are_reported_then_fixed(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    start_agents(1, capacity=3, env=corral_env)
    assert (
        main(
            [
                "functions",
                "deploy",
                "hello",
                "--image",
                "examples.hello",
                "--kernel",
                "/k",
                "--max",
                "10",
            ]
        )
        == 0
    )
    spawn_ok("hello", 2)
    with corral_env.db.transaction() as s:
        s.add(
            Gpu(
                uuid="GPU-1",
                server="127.0.0.1:50053",
                mngr_addr="127.0.0.1:3333",
                mem_total_mb=16000,
                mem_free_mb=16000,
                slots_total=4,
                slots_free=4,
                first_port=4000,
            )
        )
    capsys.readouterr()
    assert main(["db", "check"]) == 0
    assert capsys.readouterr().out.strip() == (
        "counters agree with the replica rows (1 nodes, 1 functions, 1 GPUs)"
    )

    # Someone edits rows by hand: the node looks full, the function bigger, the GPU busy.
    with corral_env.db.transaction() as s:
        s.execute(update(Node).values(live=3))
        s.execute(update(Function).values(replica_count=7))
        s.execute(update(Gpu).values(slots_free=1, mem_free_mb=1000))
    assert api.wait(api.spawn("hello", 1))["status"] == "failed"  # "no capacity"
    assert main(["db", "check"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "function hello: replica_count is 7, the replica rows say 2",
        "node node1: live is 3, the replica rows say 2",
        "gpu GPU-1: slots_used is 3, the replica rows say 0",
        "gpu GPU-1: mem_used_mb is 15000, the replica rows say 0",
        "4 counter(s) disagree; `corral db check --fix` sets them to the rows' values",
    ]
    assert _counters(corral_env) == (3, 7, (1, 1000))  # a check changes nothing

    assert main(["db", "check", "--fix"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "fixed 4 counter(s)"
    assert _counters(corral_env) == (2, 2, (4, 16000))
    spawn_ok("hello", 1)
    assert main(["db", "check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {
        "checked": {"functions": 1, "gpus": 1, "nodes": 1},
        "drift": [],
        "fixed": False,
    }
    assert _counters(corral_env)[:2] == (3, 3)
