"""The plan of a spawn, delete or scale (workers/replicas/plan.py): the messages to send.

Plain values in, plain values out: no store, no broker, no Redis
(``python -m pytest tests/workers/replicas/test_plan.py -n0`` runs it alone). What the
messages become on the wire (each its task's signature) is tested in
tests/tasks/test_replicas.py; the handlers that send them in test_handlers.py.
"""

from __future__ import annotations

import pytest

from workers.base.errors import InputError, TransientBackendError
from workers.replicas.outcomes import Next, Request, Retry
from workers.replicas.plan import (
    DELETE_BATCH,
    SPAWN_BATCH,
    DeleteBatch,
    DeleteOne,
    SpawnBatch,
    SpawnJob,
    SpawnOne,
    delete_batches,
    delete_follow_ups,
    fan_out,
    follow_ups,
    parse_jobs,
    spawn_jobs,
    split,
)


def test_jobs_are_read_from_a_message() -> None:
    assert parse_jobs([["r1", None], ("r2", "n1")]) == [SpawnJob("r1"), SpawnJob("r2", "n1")]


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ([], "jobs must be a non-empty list, got list"),
        ("r1", "jobs must be a non-empty list, got str"),
        ([["r1"]], "malformed job"),
        ([["r1", None, "x"]], "malformed job"),
        ([[1, None]], "malformed job"),
        ([["r1", 7]], "malformed job"),
        (["r1"], "malformed job"),
    ],
)
def test_a_malformed_message_is_refused(raw: object, said: str) -> None:
    with pytest.raises(InputError, match=said):
        parse_jobs(raw)


def test_a_batch_carries_its_jobs_as_the_message_reads_them() -> None:
    jobs = (SpawnJob("r1"), SpawnJob("r2", "n1"))
    wire = SpawnBatch("op", "fn", jobs).wire_jobs()
    assert wire == [["r1", None], ["r2", "n1"]]
    assert parse_jobs(wire) == list(jobs)  # the round trip loses nothing


def test_a_plan_is_count_replicas_on_each_planned_node() -> None:
    jobs = spawn_jobs("op", {"count": 2, "nodes": ["a", "b"]})
    assert jobs == [
        SpawnJob("op.0.0", "a"),
        SpawnJob("op.1.0", "a"),
        SpawnJob("op.0.1", "b"),
        SpawnJob("op.1.1", "b"),
    ]
    assert spawn_jobs("op", {"count": 2}) == [SpawnJob("op.0.0"), SpawnJob("op.1.0")]
    assert spawn_jobs("op", {"count": 1, "nodes": []}) == [SpawnJob("op.0.0")]


@pytest.mark.parametrize(
    ("n", "sizes"),
    [(0, (0, [])), (1, (1, [])), (SPAWN_BATCH, (SPAWN_BATCH, [])), (250, (100, [100, 50]))],
)
def test_a_spawn_is_split_into_batches(n: int, sizes: tuple[int, list[int]]) -> None:
    jobs = [SpawnJob(f"r{i}") for i in range(n)]
    first, rest = split(jobs)
    assert (len(first), [len(b) for b in rest]) == sizes
    assert first + [j for b in rest for j in b] == jobs  # in order, none lost


def test_a_fan_out_works_the_first_batch_and_sends_the_others() -> None:
    jobs = [SpawnJob(f"r{i}", "n1" if i % 2 else None) for i in range(2 * SPAWN_BATCH + 1)]
    first, others = fan_out("op", "fn", jobs)
    assert first == jobs[:SPAWN_BATCH]
    assert others == [
        SpawnBatch("op", "fn", tuple(jobs[SPAWN_BATCH : 2 * SPAWN_BATCH])),
        SpawnBatch("op", "fn", tuple(jobs[2 * SPAWN_BATCH :])),
    ]
    assert fan_out("op", "fn", []) == ([], [])
    assert fan_out("op", "fn", jobs[:3]) == (jobs[:3], [])  # one batch: nothing to send


def test_what_a_spawn_left_becomes_retries_after_a_backoff_moves_at_once_and_batches() -> None:
    error = TransientBackendError("connection refused", node="node1")
    nxt = Next(
        retry=[Retry("op1", "r1", error, "n1")],
        again=[Request("op1", "r2"), Request(None, "r3")],
        rest=[Request("op1", "r4"), Request("op2", "r5"), Request("op1", "r6")],
    )
    assert follow_ups("fn", nxt) == [
        SpawnOne("op1", "r1", "fn", after_backoff=True),
        SpawnOne("op1", "r2", "fn"),
        SpawnOne(None, "r3", "fn"),
        # the unsent rest: one batch per operation, in the order first met, no node pinned
        SpawnBatch("op1", "fn", (SpawnJob("r4"), SpawnJob("r6"))),
        SpawnBatch("op2", "fn", (SpawnJob("r5"),)),
    ]
    assert follow_ups("fn", Next()) == []


def test_a_scales_surplus_is_deleted_in_batches() -> None:
    ids = [f"rep{i}" for i in range(DELETE_BATCH + 1)]
    assert delete_batches("op", ids) == [
        DeleteBatch("op", tuple(ids[:DELETE_BATCH])),
        DeleteBatch("op", (ids[DELETE_BATCH],)),
    ]
    assert delete_batches("op", []) == []


def test_what_a_delete_left_becomes_lone_retries_and_one_batch_of_the_rest() -> None:
    assert delete_follow_ups("op", ["a", "b"], ["c", "d"]) == [
        DeleteOne("a", "op"),
        DeleteOne("b", "op"),
        DeleteBatch("op", ("c", "d")),
    ]
    assert delete_follow_ups(None, [], []) == []
    assert delete_follow_ups(None, [], ["c"]) == [DeleteBatch(None, ("c",))]
