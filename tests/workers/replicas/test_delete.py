"""Deleting replicas (workers/replicas/delete.py): marked Deleting, VMs released at once, rows
retired; each replica counted once; a release its node never got waits where nothing else
would find the VM.

The agents are real gRPC agents on loopback; the store is SQLite and PostgreSQL. Deletes
delivered twice are in test_owners.py, releases that wait for their node in
test_release_waits.py.
"""

from __future__ import annotations

import pytest
from sqlalchemy import update

from tests.fixtures import Env, StartAgents
from tests.helpers import operation, replicas
from tests.workers.replicas.helpers import (
    by_id,
    idle_on,
    no_drift,
    one_node_idle,
    released,
    running,
    spawn_op,
)
from workers.base.errors import InputError, NotFound, TransientBackendError
from workers.base.kinds import OpKind
from workers.operations import create_operation
from workers.replicas.delete import (
    WAITS,
    begin_delete,
    delete_batch,
    delete_one,
    release_orphan,
    release_waits,
)
from workers.replicas.owners import Budget
from workers.replicas.spawn import place
from workers.store.models import Node, ReplicaState

S = ReplicaState


def _delete_op(env: Env, total: int) -> str:
    with env.db.transaction() as s:
        return create_operation(s, OpKind.DELETE, {"replica": "many"}, total=total).id


@pytest.mark.parametrize("bad", [[], [1], ["r1", None], "r1", b"r1"])
def test_a_batch_that_names_no_replicas_is_refused(
    corral_env: Env, start_agents: StartAgents, bad: object
) -> None:
    one_node_idle(corral_env, start_agents)
    op_id = _delete_op(corral_env, 1)
    budget = Budget.of(corral_env.settings)
    with pytest.raises(InputError, match="replica_ids must be a non-empty list"):
        delete_batch(corral_env.db, corral_env.settings, op_id, bad, budget)  # type: ignore[arg-type]
    assert [r.status for r in replicas(corral_env)] == [S.IDLE]  # nothing changed
    assert operation(corral_env, op_id).done == 0  # a string's letters are no replicas gone


def test_a_batch_releases_every_vm_and_retires_every_row_once(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agents, idle = idle_on(corral_env, start_agents, 1, 3)
    op_id = _delete_op(corral_env, 4)
    ids = [r.id for r in idle] + ["0" * 32]  # one already gone: a delete that succeeded
    out = delete_batch(
        corral_env.db, corral_env.settings, op_id, ids, Budget.of(corral_env.settings)
    )
    assert (out.done, out.retry, out.rest) == (3, [], [])
    rows = by_id(corral_env)
    assert {rows[r.id].status for r in idle} == {S.DELETED}
    assert running(agents) == set() and set(released(agents).values()) == {1}
    op = operation(corral_env, op_id)
    assert (op.status, op.done, op.failed) == ("succeeded", 4, 0)
    no_drift(corral_env)


def test_a_replica_deleted_before_it_was_ready_fails_its_spawns_part(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    spawn_id, fn_id, jobs = spawn_op(corral_env, 1)
    (pending,) = place(corral_env.db, corral_env.settings, spawn_id, fn_id, jobs)
    doomed = begin_delete(corral_env.db, corral_env.settings, pending.replica_id)
    assert doomed is not None and doomed.vmid is None  # no VM yet: nothing to release
    spawn = operation(corral_env, spawn_id)
    assert spawn.failed == 1 and "was deleted before it was ready" in (spawn.error or "")
    assert by_id(corral_env)[pending.replica_id].status == S.DELETING


def test_begin_delete_of_an_unknown_or_finished_replica(
    corral_env: Env, start_agents: StartAgents
) -> None:
    with pytest.raises(NotFound, match="unknown replica"):
        begin_delete(corral_env.db, corral_env.settings, "0" * 32)
    (replica,) = one_node_idle(corral_env, start_agents)
    assert delete_one(corral_env.db, corral_env.settings, replica.id, None) == ("deleted", None)
    op_id = _delete_op(corral_env, 1)
    assert begin_delete(corral_env.db, corral_env.settings, replica.id, op_id) is None
    assert operation(corral_env, op_id).done == 1  # gone already: a delete that succeeded
    assert delete_one(corral_env.db, corral_env.settings, replica.id, None) == (
        "already gone",
        None,
    )


@pytest.mark.parametrize(("can_list", "waits"), [(None, True), (False, True), (True, False)])
def test_a_release_waits_where_only_the_node_could_find_its_vm(
    can_list: bool | None, waits: bool
) -> None:
    assert release_waits(Node(name="n", address="127.0.0.1:1", can_list=can_list)) is waits
    assert release_waits(None) is False  # no node: no VM to find


@pytest.mark.parametrize(("can_list", "state"), [(None, "deleting"), (True, "dead")])
def test_a_release_its_node_never_got(
    corral_env: Env, start_agents: StartAgents, can_list: bool | None, state: str
) -> None:
    (replica,) = one_node_idle(corral_env, start_agents)
    with corral_env.db.transaction() as s:
        s.execute(update(Node).values(can_list=can_list))
    op_id = _delete_op(corral_env, 1)
    error = TransientBackendError("UNAVAILABLE: down")
    got, message = delete_one(corral_env.db, corral_env.settings, replica.id, op_id, error=error)
    assert got == state and message is not None and message.startswith("UNAVAILABLE: down; ")
    row = by_id(corral_env)[replica.id]
    if state == "deleting":  # the seed protocol's node: it keeps the slot its VM holds
        assert WAITS in message and row.status == S.DELETING
    else:  # reconcile will find the VM as an orphan
        assert "reconcile will destroy the VM" in message and row.status == S.DEAD
    op = operation(corral_env, op_id)
    assert (op.status, op.failed) == ("failed", 1)
    no_drift(corral_env)


def test_an_orphan_is_released_unless_a_live_row_has_it(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,), (replica,) = idle_on(corral_env, start_agents, 1, 1)
    settings, db = corral_env.settings, corral_env.db
    assert replica.node_id is not None and replica.vmid is not None
    assert release_orphan(db, settings, "0" * 32, "vm-x") == "no such node"
    assert release_orphan(db, settings, replica.node_id, replica.vmid) == "taken"
    assert replica.vmid in running([agent])
    with db.transaction() as s:  # the row ends; the VM is an orphan now
        s.execute(update(type(replica)).values(status=int(S.DEAD), vmid=None))
    assert release_orphan(db, settings, replica.node_id, replica.vmid) == "released"
    assert running([agent]) == set()
    assert release_orphan(db, settings, replica.node_id, replica.vmid) == "already gone"
    assert [r.status for r in replicas(corral_env)] == [S.DEAD]
