"""The table of moves (workers/store/states.py): which moves exist, and what each one does.

What a move does follows from its two states' rules, never from a case written by hand;
the code that carries the moves out is tested against the table in
tests/workers/replicas/test_lifecycle.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.store.states import (
    FINAL_STATES,
    LIVE_STATES,
    MOVES,
    RULES,
    SETTLING,
    Deadline,
    IllegalMove,
    Move,
    OnOperation,
    ReplicaState,
    markdown,
    move,
)

S = ReplicaState


def test_the_seeds_numbers_never_change() -> None:
    assert [(s.label, int(s)) for s in S] == [
        ("idle", 0),
        ("allocated", 1),
        ("creating", 2),
        ("dead", 13),
        ("starting", 200),
        ("starting_limit", 210),
        ("deleting", 220),
        ("deleted", 230),
        ("maybe", 240),
    ]


def test_every_state_has_one_rule_and_is_live_or_final() -> None:
    assert set(RULES) == set(S)
    assert set(LIVE_STATES) | set(FINAL_STATES) == set(S)
    assert not set(LIVE_STATES) & set(FINAL_STATES)
    assert set(FINAL_STATES) == {S.DEAD, S.DELETED}


def test_the_table_never_leaves_a_final_state_and_can_always_end_a_live_one() -> None:
    assert not [m for m in MOVES.values() if m.source in FINAL_STATES]
    for state in LIVE_STATES:  # health ends any live replica Dead; a delete marks it Deleting
        assert (state, S.DEAD) in MOVES and (state, S.DELETING) in MOVES, state
    assert {m.target for m in MOVES.values() if m.source is None} == {S.CREATING, S.DEAD}


def test_what_a_move_does_follows_from_its_two_states() -> None:
    creating_to_maybe = MOVES[(S.CREATING, S.MAYBE)]
    assert (creating_to_maybe.count, creating_to_maybe.operation) == (-1, OnOperation.HANDED_ON)
    assert "maybe_of" in creating_to_maybe.writes and creating_to_maybe.disowns
    assert MOVES[(S.MAYBE, S.IDLE)].count == 1  # adopted: counted again
    assert MOVES[(S.MAYBE, S.IDLE)].first_ready and not MOVES[(S.ALLOCATED, S.IDLE)].first_ready
    assert MOVES[(S.IDLE, S.DELETING)].count == -1 and not MOVES[(S.IDLE, S.DELETING)].retires
    dead = MOVES[(S.DELETING, S.DEAD)]
    assert dead.retires and dead.operation == OnOperation.FAILED and dead.count == 0
    moved = MOVES[(S.CREATING, S.CREATING)]
    assert moved.unsends and moved.disowns and moved.deadline == Deadline.CREATE
    assert not MOVES[(S.CREATING, S.MAYBE)].unsends  # a maybe keeps its sent mark


def test_the_architecture_doc_shows_the_table() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "architecture.md").read_text()
    assert markdown() in doc, "docs/architecture.md: paste workers.store.states.markdown()"


@pytest.mark.parametrize(("source", "target"), sorted(MOVES, key=str))
def test_move_finds_every_listed_move(source: S | None, target: S) -> None:
    found = move(source, target)
    assert (found.source, found.target) == (source, target) and found.by


@pytest.mark.parametrize(
    ("source", "target", "said"),
    [
        (S.DEAD, S.IDLE, "from dead to idle"),
        (S.DELETED, S.DELETING, "from deleted to deleting"),
        (None, S.IDLE, "from a new row to idle"),
        (S.IDLE, S.CREATING, "from idle to creating"),
        (S.MAYBE, S.MAYBE, "from maybe to maybe"),
    ],
)
def test_a_move_not_in_the_table_is_illegal(source: S | None, target: S, said: str) -> None:
    with pytest.raises(IllegalMove, match=f"a replica may not move {said}$"):
        move(source, target)


def test_the_count_moves_only_across_the_counted_states() -> None:
    counted = {s for s in S if RULES[s].counted}
    assert counted == {S.CREATING, S.STARTING, S.IDLE, S.ALLOCATED}  # a stuck boot is not
    for m in MOVES.values():
        before = m.source in counted
        assert m.count == int(m.target in counted) - int(before), m


def test_a_new_row_is_counted_when_it_is_placed_and_never_past_the_max() -> None:
    assert move(None, S.CREATING).count == 1
    assert move(None, S.DEAD).count == 0  # past the max: never counted
    # nor placed: a new row that is Dead at once has no slot or GPU to give back
    assert "| (new row) | dead |  |  |" in markdown()
    assert not move(None, S.CREATING).first_ready and not move(None, S.CREATING).disowns


def test_settling_states_are_those_that_end_the_wait_of_an_operation() -> None:
    assert set(SETTLING) == {
        s for s in S if RULES[s].operation in (OnOperation.DONE, OnOperation.FAILED)
    }
    assert S.IDLE in SETTLING and S.DEAD in SETTLING and S.CREATING not in SETTLING


def test_only_a_move_that_retires_gives_back_and_writes_the_retirement() -> None:
    for m in MOVES.values():
        retiring = {"retired_at", "envs_in_use", "gpu_slot"} <= set(m.writes)
        assert retiring == m.retires == (m.target in FINAL_STATES), m


def test_a_deadline_is_stamped_by_the_state_a_replica_enters() -> None:
    assert move(S.CREATING, S.STARTING).deadline == Deadline.BOOT
    assert move(S.CREATING, S.IDLE).deadline == Deadline.NONE
    assert move(S.IDLE, S.DELETING).deadline == RULES[S.DELETING].deadline


def test_the_architecture_doc_shows_the_table_of_moves_in_full() -> None:
    table = markdown()
    assert table.count("\n") == len(MOVES) + 2  # a header, its rule and one row per move
    assert "| (new row) | creating | +1 |" in table
    assert "| idle | deleting | -1 |" in table


def test_a_move_is_a_value() -> None:
    assert move(S.IDLE, S.ALLOCATED) == Move(S.IDLE, S.ALLOCATED, MOVES[(S.IDLE, S.ALLOCATED)].by)
