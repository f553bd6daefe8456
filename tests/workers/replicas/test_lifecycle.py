"""The table of moves (workers/store/states.py) against the code that carries it out.

The table on its own is tested in tests/workers/store/test_states.py.

Every move the code makes is in the table (a trigger in the store logs every status the
production paths write while they spawn, lend, make maybes, reap and delete); a move the
table does not list is refused and changes nothing; and each move does the bookkeeping
the table says - the function's count, the node slot, the claims, the waiting
operation, the clocks, the owner - whether it is made on one locked row
(``transition``) or by a batch path (``arrive``, ``mark_deleting``, ``retire_deleting``,
the claims' take and release), on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import grpc
import pytest
from sqlalchemy import func, select, text

from agents.faults import Fault
from config.settings import get_settings
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, operation
from tests.workers.replicas.helpers import no_drift, spawn_op
from workers.base import clock
from workers.base.kinds import OpKind
from workers.maintenance.reaper import reap
from workers.operations import create_operation
from workers.replicas import claims, lifecycle
from workers.replicas.outcomes import Outcome
from workers.replicas.owners import Budget
from workers.replicas.plan import SpawnJob
from workers.replicas.spawn import run_batch
from workers.store.models import Claim, Function, Node, Operation, Replica, ReplicaState, new_id
from workers.store.states import (
    MOVES,
    RULES,
    Deadline,
    IllegalMove,
    Move,
    OnOperation,
)

S = ReplicaState
FIXED = datetime(2026, 11, 30, 9, 0, 0)
EARLIER = FIXED - timedelta(minutes=5)
IDLE_TIMEOUT_S = 42


# -- the table itself ----------------------------------------------------------------------


def test_a_claim_takes_with_one_statement_because_its_two_moves_write_the_same() -> None:
    one, last = MOVES[(S.IDLE, S.IDLE)], MOVES[(S.IDLE, S.ALLOCATED)]
    assert one.writes == last.writes
    settings = get_settings()
    a = lifecycle.changes(one, settings, FIXED, busy=True)
    b = lifecycle.changes(last, settings, FIXED, busy=True)
    assert (a.pop("status"), b.pop("status")) == (S.IDLE, S.ALLOCATED) and a == b
    assert claims.taken(settings, FIXED) == a


def test_every_state_is_an_outcome_a_handler_can_report() -> None:
    assert {Outcome.of(state) for state in ReplicaState} <= set(Outcome)


# -- every move the code makes is in the table ---------------------------------------------

_SQLITE_LOG = (
    "CREATE TABLE moves_seen (source INTEGER, target INTEGER)",
    "CREATE TRIGGER moves_seen_u AFTER UPDATE OF status ON replicas BEGIN "
    "INSERT INTO moves_seen VALUES (old.status, new.status); END",
    "CREATE TRIGGER moves_seen_i AFTER INSERT ON replicas BEGIN "
    "INSERT INTO moves_seen VALUES (NULL, new.status); END",
)
_PG_LOG = (
    "CREATE TABLE moves_seen (source integer, target integer)",
    "CREATE FUNCTION moves_seen_note() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "IF TG_OP = 'INSERT' THEN INSERT INTO moves_seen VALUES (NULL, NEW.status); "
    "ELSE INSERT INTO moves_seen VALUES (OLD.status, NEW.status); END IF; RETURN NULL; END $$",
    "CREATE TRIGGER moves_seen_u AFTER UPDATE OF status ON replicas "
    "FOR EACH ROW EXECUTE FUNCTION moves_seen_note()",
    "CREATE TRIGGER moves_seen_i AFTER INSERT ON replicas "
    "FOR EACH ROW EXECUTE FUNCTION moves_seen_note()",
)
_PG_UNLOG = (
    "DROP TRIGGER IF EXISTS moves_seen_u ON replicas",
    "DROP TRIGGER IF EXISTS moves_seen_i ON replicas",
    "DROP FUNCTION IF EXISTS moves_seen_note()",
    "DROP TABLE IF EXISTS moves_seen",
)


Seen = Callable[[], set[tuple[S | None, S]]]


@pytest.fixture
def moves_seen(corral_env: Env) -> Iterator[Seen]:
    """Log every (status before, status written) the store sees; the fixture reads the log."""
    db = corral_env.db
    with db.engine.begin() as conn:
        for statement in _SQLITE_LOG if db.is_sqlite else (*_PG_UNLOG, *_PG_LOG):
            conn.execute(text(statement))

    def seen() -> set[tuple[S | None, S]]:
        with db.engine.begin() as conn:
            rows = conn.execute(text("SELECT DISTINCT source, target FROM moves_seen")).all()
        return {(None if a is None else S(a), S(b)) for a, b in rows}

    yield seen
    if not db.is_sqlite:  # this module's PostgreSQL database outlives the test
        with db.engine.begin() as conn:
            for statement in _PG_UNLOG:
                conn.execute(text(statement))


def test_every_move_the_code_makes_is_in_the_table(
    corral_env: Env, start_agents: StartAgents, moves_seen: Seen
) -> None:
    settings = corral_env.settings
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    # the first create is answered UNAVAILABLE by a seed agent: a maybe, replaced at once
    agent.agent.inject("CreateReplica", Fault.abort(grpc.StatusCode.UNAVAILABLE, "busy"))
    op_id, fn_id, jobs = spawn_op(corral_env, 2, exec_envs=2, max=3)
    run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    held = claims.claim_many(corral_env.db, settings, "hello", 2)  # both of one replica's
    claims.release(corral_env.db, settings, held[0].claim_id)
    with corral_env.db.transaction() as s:  # three more, as two spawns placed at once would
        more = create_operation(s, OpKind.SPAWN, {}, function_id=fn_id, total=3).id
    extra = [SpawnJob(f"{more}.{i}.0") for i in range(3)]
    run_batch(corral_env.db, settings, more, fn_id, extra, Budget.of(settings))
    assert operation(corral_env, more).failed == 2  # past the max of 3: inserted Dead
    clock.travel(settings.creating_deadline_s + settings.idle_timeout_s + 3600)
    reap(corral_env.db, settings, holder="test")  # the maybe ends; idle replicas go
    no_drift(corral_env)

    seen = moves_seen()
    assert seen - MOVES.keys() == set()
    assert seen >= {
        (None, S.CREATING),
        (None, S.DEAD),
        (S.CREATING, S.MAYBE),
        (S.CREATING, S.IDLE),
        (S.IDLE, S.ALLOCATED),
        (S.ALLOCATED, S.IDLE),
        (S.MAYBE, S.DEAD),
        (S.IDLE, S.DELETING),
        (S.DELETING, S.DELETED),
    }, seen


# -- a move the table does not list is refused ---------------------------------------------


@dataclass(frozen=True)
class Books:
    """What a move may change outside its row: node slot, count, claims, the operation."""

    live: int
    count: int
    claims: int
    done: int
    failed: int


def _books(env: Env, ids: tuple[str, str | None]) -> Books:
    replica_id, op_id = ids
    with env.db.read() as s:
        (node,) = s.scalars(select(Node)).all()
        (fn,) = s.scalars(select(Function)).all()
        op = s.get(Operation, op_id) if op_id else None
        held = s.scalar(
            select(func.count()).select_from(Claim).where(Claim.replica_id == replica_id)
        )
        return Books(
            node.live,
            fn.replica_count,
            int(held or 0),
            op.done if op else 0,
            op.failed if op else 0,
        )


def _row(env: Env, replica_id: str) -> Replica:
    with env.db.read() as s:
        replica = s.get(Replica, replica_id)
        assert replica is not None
        return replica


def _row_in(env: Env, source: S, *, waiting: bool = True, held: int = 0) -> tuple[str, str | None]:
    """One replica of ``hello`` in ``source`` on one node, the counters agreeing; its id and the
    id of the operation waiting on it."""
    fn_id = deploy_fn(env, "hello", exec_envs=2, idle_timeout=IDLE_TIMEOUT_S)
    rule = RULES[source]
    unmade = source in (S.CREATING, S.MAYBE)
    with env.db.transaction() as s:
        fn = s.get(Function, fn_id)
        assert fn is not None
        fn.replica_count = int(rule.counted)
        node = Node(name="node1", address="127.0.0.1:7", capacity=4, live=int(rule.live))
        s.add(node)
        s.flush()
        op_id = None
        if waiting:
            op_id = create_operation(s, OpKind.SPAWN, {}, function_id=fn_id, total=1).id
        replica = Replica(
            id=new_id(),
            request_id="spawn.0.0",
            function_id=fn_id,
            node_id=node.id,
            operation_id=op_id,
            status=source,
            build_version=fn.build_version,
            envs_total=2,
            envs_in_use=held,
            vmid=None if unmade else "vm-1",
            address=None if unmade else "127.0.0.1",
            ready_at=EARLIER if rule.ready else None,
            idle_since=EARLIER if rule.idle_clock and not held else None,
            reap_at=EARLIER if rule.idle_clock and not held else None,
            deadline_at=EARLIER if rule.deadline != Deadline.NONE else None,
            owner="a-live-owner" if source == S.CREATING else None,
            owner_until=FIXED + timedelta(hours=1) if source == S.CREATING else None,
            sent_at=EARLIER if unmade else None,
            retired_at=None if rule.live else EARLIER,
        )
        s.add(replica)
        s.flush()
        for _ in range(held):
            s.add(Claim(replica_id=replica.id, function_id=fn_id, expires_at=FIXED))
        return replica.id, op_id


@pytest.mark.parametrize("source", list(ReplicaState), ids=lambda s: s.label)
def test_a_move_the_table_does_not_list_is_refused_and_changes_nothing(
    corral_env: Env, source: S
) -> None:
    ids = _row_in(corral_env, source)
    before, row = _books(corral_env, ids), _row(corral_env, ids[0])
    refused = [to for to in ReplicaState if (source, to) not in MOVES]
    assert refused  # no state may go everywhere
    for to in refused:
        with corral_env.db.transaction() as s:
            replica = lifecycle.lock_replica(s, ids[0])
            assert replica is not None
            with pytest.raises(IllegalMove):
                lifecycle.transition(s, replica, to, corral_env.settings)
    after = _row(corral_env, ids[0])
    assert _books(corral_env, ids) == before
    assert (after.status, after.updated_at, after.deadline_at) == (
        row.status,
        row.updated_at,
        row.deadline_at,
    )


# -- each move's bookkeeping, one row and a batch ------------------------------------------


@pytest.fixture
def fixed_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """The moves are made at :data:`FIXED`."""
    monkeypatch.setattr(lifecycle, "now", lambda: FIXED)
    monkeypatch.setattr(claims, "now", lambda: FIXED)


def _deadline(m: Move, env: Env) -> datetime | None:
    settings = env.settings
    return {
        Deadline.NONE: None,
        Deadline.CREATE: FIXED + timedelta(seconds=settings.creating_deadline_s),
        Deadline.BOOT: FIXED + timedelta(seconds=settings.boot_deadline_s),
        Deadline.MAYBE: FIXED + timedelta(seconds=settings.creating_deadline_s),
    }[m.deadline]


def _check(  # noqa: PLR0913 - the move, and what the path under test adds by name
    env: Env,
    ids: tuple[str, str | None],
    m: Move,
    before: Books,
    row: Replica,
    *,
    claims_delta: int = 0,
    attached: str | None = None,
) -> None:
    """Assert the row and the books after ``m`` are what the table says."""
    replica_id, op_id = ids
    after, now = _books(env, ids), _row(env, replica_id)
    assert now.status == m.target
    settled = op_id is not None and m.operation in (OnOperation.DONE, OnOperation.FAILED)
    assert after == Books(
        live=before.live - int(m.retires),
        count=before.count + m.count,
        claims=0 if m.retires else before.claims + claims_delta,
        done=before.done + int(settled and m.operation == OnOperation.DONE),
        failed=before.failed + int(settled and m.operation == OnOperation.FAILED),
    ), m
    waiting = attached or (op_id if m.operation == OnOperation.WAITS else None)
    assert now.operation_id == waiting
    assert now.maybe_of == (op_id if m.operation == OnOperation.HANDED_ON else row.maybe_of)
    assert now.deadline_at == _deadline(m, env)
    idle = RULES[m.target].idle_clock and now.envs_in_use == 0
    assert now.idle_since == (FIXED if idle else None)
    assert now.reap_at == (FIXED + timedelta(seconds=IDLE_TIMEOUT_S) if idle else None)
    assert now.ready_at == (FIXED if m.first_ready else row.ready_at)
    assert (now.owner, now.owner_until) == (
        (None, None) if m.disowns else (row.owner, row.owner_until)
    )
    assert now.sent_at == (None if m.unsends else row.sent_at)
    assert now.retired_at == (FIXED if m.retires else row.retired_at)
    if m.retires:
        assert (now.envs_in_use, now.gpu_slot) == (0, None)


@pytest.mark.parametrize(
    "m",
    [m for m in MOVES.values() if m.source is not None],
    ids=lambda m: f"{m.source.label if m.source is not None else 'new'}-{m.target.label}",
)
def test_transition_does_what_the_table_says(corral_env: Env, fixed_now: None, m: Move) -> None:
    assert m.source is not None
    ids = _row_in(corral_env, m.source, held=int(m.source == S.ALLOCATED))
    before, row = _books(corral_env, ids), _row(corral_env, ids[0])
    with corral_env.db.transaction() as s:
        replica = lifecycle.lock_replica(s, ids[0])
        assert replica is not None
        assert lifecycle.transition(s, replica, m.target, corral_env.settings) == m
    _check(corral_env, ids, m, before, row)


@pytest.mark.parametrize("readiness", ["agent", "guest"])
def test_arrive_does_what_the_table_says(corral_env: Env, fixed_now: None, readiness: str) -> None:
    ids = _row_in(corral_env, S.CREATING)
    settings = corral_env.settings
    with corral_env.db.transaction() as s:
        fn = s.scalars(select(Function)).one()
        fn.readiness = readiness
    before, row = _books(corral_env, ids), _row(corral_env, ids[0])

    def arrive(node_id: str) -> S | None:
        with corral_env.db.transaction() as s:
            fn = s.scalars(select(Function)).one()
            return lifecycle.arrive(
                s, ids[0], ids[1], ("vm-a", "127.0.0.9"), fn, settings, node_id=node_id
            )

    assert arrive("another node") is None  # not the node its create went to: nothing
    assert _books(corral_env, ids) == before and _row(corral_env, ids[0]).status == S.CREATING
    to = arrive(str(row.node_id))
    m = MOVES[(S.CREATING, S.STARTING if readiness == "guest" else S.IDLE)]
    assert to == m.target
    _check(corral_env, ids, m, before, row)
    recorded = _row(corral_env, ids[0])
    assert (recorded.vmid, recorded.address) == ("vm-a", "127.0.0.9")
    assert arrive(str(row.node_id)) is None  # no longer Creating: nothing changes


def test_mark_deleting_does_what_the_table_says(corral_env: Env, fixed_now: None) -> None:
    ids = _row_in(corral_env, S.IDLE, waiting=False)
    with corral_env.db.transaction() as s:
        fn_id = s.scalars(select(Function.id)).one()
        op_id = create_operation(s, OpKind.DELETE, {}, function_id=fn_id, total=1).id
    before, row = _books(corral_env, ids), _row(corral_env, ids[0])
    with corral_env.db.transaction() as s:
        replica = lifecycle.lock_replica(s, ids[0])
        assert replica is not None
        lifecycle.mark_deleting(s, corral_env.settings, [replica], op_id)
        # the loaded object agrees with the row the UPDATE wrote
        assert (replica.status, replica.operation_id) == (S.DELETING, op_id)
    _check(corral_env, ids, MOVES[(S.IDLE, S.DELETING)], before, row, attached=op_id)
    middle = _books(corral_env, ids)
    with corral_env.db.transaction() as s:  # no longer Idle: nothing changes
        replica = lifecycle.lock_replica(s, ids[0])
        assert replica is not None
        lifecycle.mark_deleting(s, corral_env.settings, [replica], None)
    assert _books(corral_env, ids) == middle and _row(corral_env, ids[0]).operation_id == op_id


@pytest.mark.parametrize("error", [None, "release failed: node unreachable"])
def test_retire_deleting_does_what_the_table_says(
    corral_env: Env, fixed_now: None, error: str | None
) -> None:
    ids = _row_in(corral_env, S.DELETING, held=2)  # claims end with their replica
    before, row = _books(corral_env, ids), _row(corral_env, ids[0])
    with corral_env.db.transaction() as s:
        assert lifecycle.retire_deleting(s, corral_env.settings, {ids[0]: error}) == 1
    _check(corral_env, ids, MOVES[(S.DELETING, S.DEAD if error else S.DELETED)], before, row)
    assert _row(corral_env, ids[0]).error == error
    after = _books(corral_env, ids)
    with corral_env.db.transaction() as s:  # retired already: nothing changes
        assert lifecycle.retire_deleting(s, corral_env.settings, {ids[0]: None}) == 0
    assert _books(corral_env, ids) == after


def test_claims_take_and_give_back_do_what_the_table_says(corral_env: Env, fixed_now: None) -> None:
    ids = _row_in(corral_env, S.IDLE, waiting=False)
    db, settings = corral_env.db, corral_env.settings
    steps: list[tuple[tuple[S, S], int]] = []
    held: list[str] = []

    def step(source: S, target: S, delta: int, what: str) -> None:
        before, row = _books(corral_env, ids), _row(corral_env, ids[0])
        assert row.status == source, what
        if delta > 0:
            held.append(claims.claim(db, settings, "hello").claim_id)
        else:
            assert claims.release(db, settings, held.pop())["released"]
        _check(corral_env, ids, MOVES[(source, target)], before, row, claims_delta=delta)
        steps.append(((source, target), delta))

    step(S.IDLE, S.IDLE, 1, "take one of two")
    step(S.IDLE, S.ALLOCATED, 1, "take the last")
    step(S.ALLOCATED, S.IDLE, -1, "give one back, the other still in use")
    step(S.IDLE, S.IDLE, -1, "give the last back: idle from now")
    assert len(steps) == 4
