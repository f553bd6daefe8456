"""``arrive`` (the spawn path's one-statement move) writes what ``transition`` would."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from tests.fixtures import Env, StartAgents
from workers.functions import deploy, spec_from
from workers.operations import create_operation
from workers.replicas import lifecycle
from workers.replicas.actions import SpawnJob, pending_spawn, place
from workers.store.models import Operation, Replica, ReplicaState

FIXED = datetime(2026, 11, 30, 9, 0, 0)
COLUMNS = ("status", "vmid", "address", "deadline_at", "ready_at", "idle_since", "reap_at",
           "operation_id", "envs_in_use", "node_id", "error", "retired_at")


@pytest.mark.parametrize("readiness", ["agent", "guest"])
def test_arrive_and_transition_give_the_same_row(
    corral_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch, readiness: str
) -> None:
    start_agents(1, env=corral_env)
    settings = corral_env.settings
    with corral_env.db.transaction() as s:
        fn, _ = deploy(s, spec_from(name="hello", image="examples.hello", kernel="/k",
                                    readiness=readiness, idle_timeout=42), settings)
        op_id = create_operation(s, "spawn", {"function": "hello", "count": 2},
                                 function_id=fn.id, total=2).id
        fn_id = fn.id
    place(corral_env.db, settings, op_id, fn_id,
          [SpawnJob(f"{op_id}.0.0", None), SpawnJob(f"{op_id}.1.0", None)])
    monkeypatch.setattr(lifecycle, "now", lambda: FIXED)
    fast, slow = (pending_spawn(corral_env.db, f"{op_id}.{i}.0") for i in (0, 1))
    assert fast is not None and slow is not None

    with corral_env.db.transaction() as s:
        to = lifecycle.arrive(s, fast.replica_id, fast.operation_id, ("vm-a", "127.0.0.1"),
                              fast.function, settings)
    with corral_env.db.transaction() as s:
        replica = lifecycle.lock_replica(s, slow.replica_id)
        assert replica is not None
        replica.vmid, replica.address = "vm-a", "127.0.0.1"
        assert to is not None
        lifecycle.transition(s, replica, to, settings)

    def row(replica_id: str) -> dict[str, Any]:
        with corral_env.db.read() as s:
            r = s.get(Replica, replica_id)
            assert r is not None
            return {c: getattr(r, c) for c in COLUMNS}

    expected = ReplicaState.STARTING if readiness == "guest" else ReplicaState.IDLE
    assert to == expected
    assert row(fast.replica_id) == row(slow.replica_id)
    with corral_env.db.read() as s:
        op = s.get(Operation, op_id)
        assert op is not None
        assert op.done == (2 if expected == ReplicaState.IDLE else 0)
        assert op.status == ("succeeded" if expected == ReplicaState.IDLE else "pending")

    with corral_env.db.transaction() as s:  # no longer Creating: nothing changes
        again = lifecycle.arrive(s, fast.replica_id, fast.operation_id, ("vm-b", "x"),
                                 fast.function, settings)
    assert again is None
    assert row(fast.replica_id)["vmid"] == "vm-a"
