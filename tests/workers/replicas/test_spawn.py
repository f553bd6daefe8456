"""A spawn (workers/replicas/spawn.py): its plan fixed once, its rows written first, batch by
batch, and every delivery working the same requests.

Who may send a create, and what a lost answer does, are tested in test_owners.py,
test_creates.py and test_maybes.py; the messages a spawn sends (jobs, batches, follow-ups)
in test_plan.py; here, the spawn's own steps: the plan stored on the operation, the rows
:func:`place` writes (placed, counted, over the max, on a removed function) and a batch
run twice.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import delete, select

from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, operation, replicas
from tests.workers.replicas.helpers import created, no_drift, spawn_op
from workers.base.errors import InputError
from workers.base.kinds import OpKind
from workers.operations import create_operation
from workers.replicas.owners import Budget
from workers.replicas.spawn import place, plan_spawn, run_batch
from workers.store.models import Function, Node, ReplicaState

S = ReplicaState


def _spawn_op(env: Env, fn_id: str, count: object) -> str:
    with env.db.transaction() as s:
        params: dict[str, Any] = {"function": "hello", "count": count}
        return create_operation(s, OpKind.SPAWN, params, function_id=fn_id).id


def test_the_plan_is_stored_once_and_every_delivery_works_the_same_requests(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(2, env=corral_env)
    fn_id = deploy_fn(corral_env, "hello", placement="spread")
    op_id = _spawn_op(corral_env, fn_id, 2)
    got_fn, jobs = plan_spawn(corral_env.db, op_id)
    assert got_fn == fn_id and len(jobs) == 4  # two on each of the two nodes
    assert len({j.node_id for j in jobs}) == 2
    op = operation(corral_env, op_id)
    assert (op.status, op.total) == ("running", 4) and op.result is not None
    start_agents(1, env=corral_env)  # a node joins before the message is delivered again
    assert plan_spawn(corral_env.db, op_id) == (fn_id, jobs)


def test_a_finished_spawn_plans_nothing_and_a_removed_function_is_refused(
    corral_env: Env,
) -> None:
    fn_id = deploy_fn(corral_env)
    bad = _spawn_op(corral_env, fn_id, 0)
    with pytest.raises(InputError, match="count must be between 1 and"):
        plan_spawn(corral_env.db, bad)
    gone = _spawn_op(corral_env, fn_id, 1)
    with corral_env.db.transaction() as s:
        s.execute(delete(Function))
    with pytest.raises(InputError, match="the function of this spawn no longer exists"):
        plan_spawn(corral_env.db, gone)


def test_place_writes_each_row_once_on_a_node_counted_toward_max(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    op_id, fn_id, jobs = spawn_op(corral_env, 3, max=2)
    written = place(corral_env.db, corral_env.settings, op_id, fn_id, jobs)
    assert [p.request_id for p in written] == [j.request_id for j in jobs[:2]]
    rows = {r.request_id: r for r in replicas(corral_env)}
    assert [rows[j.request_id].status for j in jobs] == [S.CREATING, S.CREATING, S.DEAD]
    assert rows[jobs[2].request_id].node_id is None  # over the max: never placed
    assert rows[jobs[2].request_id].error == "hello is at its max of 2 replicas"
    with corral_env.db.read() as s:
        assert s.scalar(select(Function.replica_count)) == 2
        assert s.scalar(select(Node.live)) == 2
    assert operation(corral_env, op_id).failed == 1
    # a redelivery writes nothing twice
    assert place(corral_env.db, corral_env.settings, op_id, fn_id, jobs) == []
    assert len(replicas(corral_env)) == 3
    no_drift(corral_env)


def test_place_on_a_removed_function_fails_the_parts_and_writes_nothing(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    op_id, fn_id, jobs = spawn_op(corral_env, 2)
    with corral_env.db.transaction() as s:
        s.execute(delete(Function))
    assert place(corral_env.db, corral_env.settings, op_id, fn_id, jobs) == []
    assert replicas(corral_env) == []
    op = operation(corral_env, op_id)
    assert op.failed == 2 and "was removed" in (op.error or "")


def test_a_batch_run_twice_creates_each_vm_once(corral_env: Env, start_agents: StartAgents) -> None:
    (agent,) = start_agents(1, env=corral_env)
    op_id, fn_id, jobs = spawn_op(corral_env, 3)
    budget = Budget.of(corral_env.settings)
    first = run_batch(corral_env.db, corral_env.settings, op_id, fn_id, jobs, budget)
    assert set(first.states.values()) == {"idle"} and created([agent]) == 3
    again = run_batch(corral_env.db, corral_env.settings, op_id, fn_id, jobs, budget)
    assert created([agent]) == 3 and not again.again
    assert [r.status for r in replicas(corral_env)] == [S.IDLE] * 3
    assert operation(corral_env, op_id).status == "succeeded"
    no_drift(corral_env)
