"""The batch paths' moves (``arrive``, ``mark_deleting``, ``retire_deleting``) write what
``transition`` would: the same rows, counters and operation counts, on both stores."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import func, select

from tests.fixtures import Env, StartAgents
from workers.functions import deploy, spec_from
from workers.kinds import OpKind
from workers.operations import create_operation
from workers.replicas import claims, lifecycle
from workers.replicas.owners import Budget, Pending, owner_token, take
from workers.replicas.spawn import SpawnJob, place
from workers.store.models import Claim, Function, Node, Operation, Replica, ReplicaState

FIXED = datetime(2026, 11, 30, 9, 0, 0)
COLUMNS = (
    "status",
    "vmid",
    "address",
    "deadline_at",
    "ready_at",
    "idle_since",
    "reap_at",
    "operation_id",
    "envs_in_use",
    "node_id",
    "error",
    "retired_at",
    "owner",
    "owner_until",
)


def _place_two(
    env: Env, monkeypatch: pytest.MonkeyPatch, **spec: Any
) -> tuple[str, str, Pending, Pending]:
    """Two Creating replicas of ``hello`` on one node: the spawn's id, the function's, both."""
    settings = env.settings
    with env.db.transaction() as s:
        fn, _ = deploy(
            s,
            spec_from(name="hello", image="examples.hello", kernel="/k", idle_timeout=42, **spec),
            settings,
        )
        op_id = create_operation(
            s, OpKind.SPAWN, {"function": "hello", "count": 2}, function_id=fn.id, total=2
        ).id
        fn_id = fn.id
    place(
        env.db,
        settings,
        op_id,
        fn_id,
        [SpawnJob(f"{op_id}.0.0", None), SpawnJob(f"{op_id}.1.0", None)],
    )
    monkeypatch.setattr(lifecycle, "now", lambda: FIXED)
    taken = take(
        env.db,
        settings,
        [f"{op_id}.0.0", f"{op_id}.1.0"],
        owner_token(),
        Budget.of(settings).own_until(),
    )
    first, second = sorted(taken.pending, key=lambda p: p.request_id)
    return op_id, fn_id, first, second


@pytest.mark.parametrize("readiness", ["agent", "guest"])
def test_arrive_and_transition_give_the_same_row(
    corral_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch, readiness: str
) -> None:
    start_agents(1, env=corral_env)
    settings = corral_env.settings
    op_id, _, fast, slow = _place_two(corral_env, monkeypatch, readiness=readiness)

    with corral_env.db.transaction() as s:  # a VM from another node is not this row's
        assert (
            lifecycle.arrive(
                s,
                fast.replica_id,
                fast.operation_id,
                ("vm-x", "127.0.0.1"),
                fast.function,
                settings,
                node_id="elsewhere",
            )
            is None
        )
    with corral_env.db.transaction() as s:
        to = lifecycle.arrive(
            s,
            fast.replica_id,
            fast.operation_id,
            ("vm-a", "127.0.0.1"),
            fast.function,
            settings,
            node_id=fast.node.id,
        )
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
        again = lifecycle.arrive(
            s,
            fast.replica_id,
            fast.operation_id,
            ("vm-b", "x"),
            fast.function,
            settings,
            node_id=fast.node.id,
        )
    assert again is None
    assert row(fast.replica_id)["vmid"] == "vm-a"


# mark_deleting and retire_deleting: the batch paths of a delete, against transition.
# Two replicas of one function on one node; one takes the fast path, the other the
# transition, and each move must change the same columns, counters and operation counts.

ROW = (
    "status",
    "deadline_at",
    "ready_at",
    "idle_since",
    "reap_at",
    "operation_id",
    "envs_in_use",
    "node_id",
    "error",
    "retired_at",
    "last_used_at",
)


def _two_idle(
    env: Env, monkeypatch: pytest.MonkeyPatch, *, exec_envs: int = 1
) -> tuple[str, str, str]:
    """Two Idle replicas of ``hello`` on one node, made at :data:`FIXED`; their ids, fn id."""
    _, fn_id, *pending = _place_two(env, monkeypatch, exec_envs=exec_envs)
    for i, p in enumerate(pending):
        with env.db.transaction() as s:
            to = lifecycle.arrive(
                s,
                p.replica_id,
                p.operation_id,
                (f"vm-{i}", "127.0.0.1"),
                p.function,
                env.settings,
                node_id=p.node.id,
            )
        assert to == ReplicaState.IDLE
    return pending[0].replica_id, pending[1].replica_id, fn_id


def _delete_op(env: Env, fn_id: str) -> str:
    with env.db.transaction() as s:
        return create_operation(s, OpKind.DELETE, {}, function_id=fn_id, total=2).id


def _row(env: Env, replica_id: str) -> dict[str, Any]:
    with env.db.read() as s:
        r = s.get(Replica, replica_id)
        assert r is not None
        return {c: getattr(r, c) for c in ROW}


def _counters(env: Env, replica_ids: tuple[str, ...], op_id: str) -> tuple[int, ...]:
    """Node slots, the function's count, claim rows of these replicas, the op's done / failed."""
    with env.db.read() as s:
        (node,) = s.scalars(select(Node)).all()
        (fn,) = s.scalars(select(Function)).all()
        op = s.get(Operation, op_id)
        assert op is not None
        claims = s.scalar(
            select(func.count()).select_from(Claim).where(Claim.replica_id.in_(replica_ids))
        )
        return node.live, fn.replica_count, int(claims or 0), op.done, op.failed


def _delta(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a - b for a, b in zip(after, before, strict=True))


def test_mark_deleting_and_transition_give_the_same_rows(
    corral_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_agents(1, env=corral_env)
    fast, slow, fn_id = _two_idle(corral_env, monkeypatch)
    op_id, settings = _delete_op(corral_env, fn_id), corral_env.settings
    both = (fast, slow)

    before = _counters(corral_env, both, op_id)
    with corral_env.db.transaction() as s:
        replica = lifecycle.lock_replica(s, fast)
        assert replica is not None
        lifecycle.mark_deleting(s, settings, [replica], op_id)
        # the loaded object agrees with the row the UPDATE wrote
        assert replica.status == ReplicaState.DELETING and replica.operation_id == op_id
    middle = _counters(corral_env, both, op_id)
    with corral_env.db.transaction() as s:
        replica = lifecycle.lock_replica(s, slow)
        assert replica is not None
        replica.operation_id = op_id  # as a delete's begin does before its transition
        lifecycle.transition(s, replica, ReplicaState.DELETING, settings)
    after = _counters(corral_env, both, op_id)

    assert _row(corral_env, fast) == _row(corral_env, slow)
    assert _row(corral_env, fast)["status"] == ReplicaState.DELETING
    assert _row(corral_env, fast)["deadline_at"] is not None
    # one less counted replica each, node slots kept until the VM is gone, nothing settled
    assert _delta(before, middle) == _delta(middle, after) == (0, -1, 0, 0, 0)

    with corral_env.db.transaction() as s:  # a replica no longer Idle: nothing changes
        replica = lifecycle.lock_replica(s, fast)
        assert replica is not None
        lifecycle.mark_deleting(s, settings, [replica], None)
    assert _counters(corral_env, both, op_id) == after
    assert _row(corral_env, fast)["operation_id"] == op_id


@pytest.mark.parametrize("outcome", ["deleted", "dead with a claim held"])
def test_retire_deleting_and_transition_give_the_same_rows(
    corral_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    start_agents(1, env=corral_env)
    claimed = outcome != "deleted"
    fast, slow, fn_id = _two_idle(corral_env, monkeypatch, exec_envs=2)
    op_id, settings = _delete_op(corral_env, fn_id), corral_env.settings
    both = (fast, slow)
    if claimed:  # every environment lent out: the claim rows must end with the replica
        monkeypatch.setattr(claims, "now", lambda: FIXED)
        held = [claims.claim(corral_env.db, settings, "hello").replica_id for _ in range(4)]
        assert sorted(held) == sorted(both * 2)
    with corral_env.db.transaction() as s:
        for rid in both:
            replica = lifecycle.lock_replica(s, rid)
            assert replica is not None
            replica.operation_id = op_id
            lifecycle.transition(s, replica, ReplicaState.DELETING, settings)
    error = "release failed: node unreachable" if claimed else None
    final = ReplicaState.DEAD if error else ReplicaState.DELETED

    before = _counters(corral_env, both, op_id)
    with corral_env.db.transaction() as s:
        assert lifecycle.retire_deleting(s, settings, {fast: error}) == 1
    middle = _counters(corral_env, both, op_id)
    with corral_env.db.transaction() as s:
        replica = lifecycle.lock_replica(s, slow)
        assert replica is not None
        lifecycle.transition(s, replica, final, settings, error=error)
    after = _counters(corral_env, both, op_id)

    assert _row(corral_env, fast) == _row(corral_env, slow)
    row = _row(corral_env, fast)
    assert (row["status"], row["error"], row["retired_at"]) == (final, error, FIXED)
    assert row["envs_in_use"] == 0 and row["operation_id"] is None
    # a node slot back, its claims gone, one part of the delete settled: the same each way
    expected = (-1, 0, -2 if claimed else 0, 0 if error else 1, 1 if error else 0)
    assert _delta(before, middle) == _delta(middle, after) == expected
    with corral_env.db.read() as s:
        op = s.get(Operation, op_id)
        assert op is not None
        assert op.status == ("failed" if error else "succeeded")

    with corral_env.db.transaction() as s:  # retired already: nothing changes
        assert lifecycle.retire_deleting(s, settings, {fast: None}) == 0
    assert _counters(corral_env, both, op_id) == after
