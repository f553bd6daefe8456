"""The replica handlers (workers/replicas/handlers.py): a task's one call, without a broker.

A :class:`Post` stands where Celery would: it keeps the messages a handler asks to send
(and what the store held at that moment), and this test delivers them to their handlers
itself. Real store (SQLite and PostgreSQL), real gRPC agents on loopback, no Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, operation, replicas
from tests.workers.replicas.helpers import no_drift
from workers.base.kinds import OpKind
from workers.operations import create_operation
from workers.replicas import handlers, plan
from workers.replicas.owners import Budget
from workers.store.models import ReplicaState


class RetriesSpent(Exception):
    """What :meth:`Post.retry` raises: these tests never expect a retry."""


@dataclass
class Post:
    """A port that keeps each message sent, with how many rows the store held then."""

    env: Env
    sent: list[tuple[plan.Message, int]] = field(default_factory=list)

    def send(self, messages: Sequence[plan.Message]) -> None:
        """Keep the messages, in order."""
        rows = len(replicas(self.env))
        self.sent += [(m, rows) for m in messages]

    def retry(self, what: str, error: Exception) -> int:
        """Refuse: a retry here is a failure of the test's setup."""
        raise RetriesSpent(f"{what}: {error}")

    def deliver(self, ctx: handlers.Context) -> list[dict[str, Any]]:
        """Run every message kept (and what they send in turn) through its handler."""
        results = []
        while self.sent:
            m, _ = self.sent.pop(0)
            if isinstance(m, plan.SpawnBatch):
                assert m.op_id is not None  # a spawn's batches are its operation's
                results.append(handlers.spawn_batch(ctx, m.op_id, m.function_id, m.wire_jobs()))
            elif isinstance(m, plan.DeleteBatch):
                results.append(handlers.delete_batch(ctx, m.op_id, list(m.replica_ids)))
            else:
                raise AssertionError(f"unexpected {m}")
        return results


def _context(env: Env, post: Post) -> handlers.Context:
    return handlers.Context(env.db, env.settings, Budget.of(env.settings), post)


def _op(env: Env, kind: OpKind, fn_id: str, **params: object) -> str:
    with env.db.transaction() as s:
        return create_operation(s, kind, {"function": "hello", **params}, function_id=fn_id).id


def test_a_spawn_sends_its_other_batches_before_it_works_the_first(
    corral_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan, "SPAWN_BATCH", 2)
    start_agents(1, env=corral_env)
    fn_id = deploy_fn(corral_env)
    op_id = _op(corral_env, OpKind.SPAWN, fn_id, count=5)
    post = Post(corral_env)
    ctx = _context(corral_env, post)
    result = handlers.spawn_operation(ctx, op_id)
    assert result == {"op_id": op_id, "replicas": 5, "states": {"idle": 2}}
    # two batches sent while the store held no row: before the first batch was worked
    assert [(len(m.jobs), rows) for m, rows in post.sent if isinstance(m, plan.SpawnBatch)] == [
        (2, 0),
        (1, 0),
    ]
    assert len(post.sent) == 2
    # the first task delivered again before the others ran: the same plan, the same
    # batches sent again, the first batch's rows found and nothing made twice
    again = handlers.spawn_operation(ctx, op_id)
    assert again["replicas"] == 5 and len(replicas(corral_env)) == 2
    assert [m for m, _ in post.sent[2:]] == [m for m, _ in post.sent[:2]]
    assert [r["replicas"] for r in post.deliver(ctx)] == [2, 1, 2, 1]
    assert len(replicas(corral_env)) == 5
    assert {r.status for r in replicas(corral_env)} == {ReplicaState.IDLE}
    assert operation(corral_env, op_id).status == "succeeded"
    no_drift(corral_env)


def test_a_scale_down_sends_its_surplus_as_delete_batches(
    corral_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan, "DELETE_BATCH", 2)
    start_agents(1, env=corral_env)
    fn_id = deploy_fn(corral_env, min=0)
    post = Post(corral_env)
    ctx = _context(corral_env, post)
    handlers.scale_operation(ctx, _op(corral_env, OpKind.SCALE, fn_id, target=3))
    post.deliver(ctx)
    assert len(replicas(corral_env, live=True)) == 3
    down = _op(corral_env, OpKind.SCALE, fn_id, target=0)
    assert handlers.scale_operation(ctx, down) == {
        "op_id": down,
        "spawn": 0,
        "delete": 3,
        "note": None,
    }
    assert [len(m.replica_ids) for m, _ in post.sent if isinstance(m, plan.DeleteBatch)] == [2, 1]
    post.deliver(ctx)
    assert replicas(corral_env, live=True) == []
    assert operation(corral_env, down).status == "succeeded"
    no_drift(corral_env)
