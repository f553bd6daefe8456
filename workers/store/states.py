"""Replica states and the moves between them, written once, as data.

The model
---------
A replica's ``status`` keeps the seed's numbers (Idle=0, Allocated=1, Creating=2,
Dead=13, Starting=200, StartingLimit=210) and adds Deleting=220, Deleted=230 and
Maybe=240. Each state says, in :data:`RULES`, what being in it means for the
bookkeeping:

* ``counted`` - it counts toward the function's ``replica_count`` (capped at max);
* ``live`` - it holds its node slot and GPU grant; a state that is not live is final,
  and a final state is never left;
* ``ready`` - its VM serves (``ready_at`` is stamped when a replica first gets there);
* ``idle_clock`` - the reaper's idle clock runs (``idle_since``, ``reap_at``);
* ``operation`` - what reaching it does to the operation waiting on the replica:
  counts that part done or failed, hands it on (a maybe's, to its replacement), or
  keeps it waiting;
* ``deadline`` - the deadline the stuck sweep holds it to.

:data:`MOVES` is every move the code may make, from one state to another (or the
state a row is inserted in), with who makes it. What a move does follows from its
two states (:class:`Move`): the count moves by one when it enters or leaves the
counted states, a final state gives the slot and GPU back and ends the replica's
claims, the waiting operation is settled as the target says, the clocks are stamped
or cleared, and leaving Creating disowns the row's create. :attr:`Move.writes` names
the columns a move writes, the same for every row it moves, so
:mod:`workers.replicas.lifecycle` carries a move out the same way for one locked row
(``transition``) and as one statement for a batch (``arrive``, ``mark_deleting``,
``retire_deleting``, the claims' hot path): the values come from one function of the
move. A move that is not in the table is refused (:class:`IllegalMove`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReplicaState(enum.IntEnum):
    """Replica states; the first six are the seed's numbers and never change."""

    IDLE = 0
    ALLOCATED = 1
    CREATING = 2
    DEAD = 13
    STARTING = 200
    STARTING_LIMIT = 210
    DELETING = 220
    DELETED = 230
    MAYBE = 240  # a create sent, outcome unknown: its node may run a VM for it

    @property
    def label(self) -> str:
        """Lowercase name used by the CLI and JSON output."""
        return self.name.lower()


class Deadline(enum.Enum):
    """The deadline a replica is held to in a state (the reaper's stuck sweep enforces it)."""

    NONE = "none"
    CREATE = "creating deadline"  # CORRAL_CREATING_DEADLINE_S
    BOOT = "boot deadline"  # CORRAL_BOOT_DEADLINE_S
    MAYBE = "ready window or creating deadline"  # while a READY may still come, or creating


class OnOperation(enum.Enum):
    """What reaching a state does to the operation waiting on the replica."""

    WAITS = "waits"
    DONE = "done"
    FAILED = "failed"
    HANDED_ON = "handed on"  # to the replacement; the row remembers it in ``maybe_of``


@dataclass(frozen=True)
class StateRule:
    """What being in one state means for a replica's bookkeeping."""

    counted: bool
    live: bool
    ready: bool
    idle_clock: bool
    operation: OnOperation
    deadline: Deadline


_S = ReplicaState
_O = OnOperation
_D = Deadline

#: Every state's rule, in the order states are listed (live ones first).
RULES: dict[ReplicaState, StateRule] = {
    _S.CREATING: StateRule(True, True, False, False, _O.WAITS, _D.CREATE),
    _S.STARTING: StateRule(True, True, False, False, _O.WAITS, _D.BOOT),
    _S.STARTING_LIMIT: StateRule(False, True, False, False, _O.WAITS, _D.NONE),
    _S.IDLE: StateRule(True, True, True, True, _O.DONE, _D.NONE),
    _S.ALLOCATED: StateRule(True, True, True, False, _O.DONE, _D.NONE),
    _S.DELETING: StateRule(False, True, False, False, _O.WAITS, _D.CREATE),
    _S.MAYBE: StateRule(False, True, False, False, _O.HANDED_ON, _D.MAYBE),
    _S.DEAD: StateRule(False, False, False, False, _O.FAILED, _D.NONE),
    _S.DELETED: StateRule(False, False, False, False, _O.DONE, _D.NONE),
}

LIVE_STATES: tuple[ReplicaState, ...] = tuple(s for s, r in RULES.items() if r.live)
# States that count toward a function's replica count (scale targets, min/max).
COUNTED_STATES: tuple[ReplicaState, ...] = tuple(s for s, r in RULES.items() if r.counted)
FINAL_STATES: tuple[ReplicaState, ...] = tuple(s for s, r in RULES.items() if not r.live)
# States whose arrival settles the operation waiting on the replica.
SETTLING: tuple[ReplicaState, ...] = tuple(
    s for s, r in RULES.items() if r.operation in (_O.DONE, _O.FAILED)
)


class IllegalMove(ValueError):
    """A replica was asked to move where the table of moves does not allow."""


@dataclass(frozen=True)
class Move:
    """One allowed move: from a state (None: the row is inserted) to a state, and who makes it."""

    source: ReplicaState | None
    target: ReplicaState
    by: str

    @property
    def count(self) -> int:
        """How the function's count moves: +1 entering the counted states, -1 leaving them."""
        before = self.source is not None and RULES[self.source].counted
        return int(RULES[self.target].counted) - int(before)

    @property
    def retires(self) -> bool:
        """Whether it reaches a final state: slot and GPU given back, claims ended, once."""
        return not RULES[self.target].live

    @property
    def operation(self) -> OnOperation:
        """What it does to the operation waiting on the replica."""
        return RULES[self.target].operation

    @property
    def deadline(self) -> Deadline:
        """The deadline the replica is held to after it (stamped afresh, or cleared)."""
        return RULES[self.target].deadline

    @property
    def first_ready(self) -> bool:
        """Whether the replica becomes ready for the first time (``ready_at`` stamped)."""
        return RULES[self.target].ready and not (
            self.source is not None and RULES[self.source].ready
        )

    @property
    def disowns(self) -> bool:
        """Whether it ends the row's ownership of its create (it leaves Creating, or moves)."""
        return self.source == ReplicaState.CREATING

    @property
    def unsends(self) -> bool:
        """Whether the sent mark goes: a Creating row moved to another node, sent nowhere yet."""
        return self.source == self.target == ReplicaState.CREATING

    @property
    def writes(self) -> tuple[str, ...]:
        """The replica columns this move writes, the same for every row it moves."""
        cols = ["status", "deadline_at", "idle_since", "reap_at"]
        if self.first_ready:
            cols.append("ready_at")
        if self.disowns:
            cols += ["owner", "owner_until"]
        if self.unsends:
            cols.append("sent_at")
        if self.operation != OnOperation.WAITS:
            cols.append("operation_id")
        if self.operation == OnOperation.HANDED_ON:
            cols.append("maybe_of")
        if self.retires:
            cols += ["retired_at", "envs_in_use", "gpu_slot"]
        return tuple(cols)


_ANY_LIVE_TO_DEAD = "its node was lost (health), its VM vanished (reconcile)"
# a lost node that cannot list its VMs: a VM there is released once it answers (health)
_LOST_WAITS = "its VM's node lost, and it cannot list (health)"

#: Every move the code makes. ``source`` None: a row inserted in that state.
MOVES: dict[tuple[ReplicaState | None, ReplicaState], Move] = {
    (m.source, m.target): m
    for m in (
        Move(None, _S.CREATING, "a spawn places it, or a maybe's replacement (node slot reserved)"),
        Move(None, _S.DEAD, "a spawn's row past the function's max: never counted nor placed"),
        Move(_S.CREATING, _S.CREATING, "moved off a node that failed its create (moves.move)"),
        Move(_S.CREATING, _S.STARTING, "its VM recorded; the guest reports READY (arrive)"),
        Move(_S.CREATING, _S.IDLE, "its VM recorded (arrive)"),
        Move(_S.CREATING, _S.MAYBE, "its create went out, outcome unknown (maybes.replace)"),
        Move(
            _S.CREATING,
            _S.DELETING,
            f"deleted before it was ready; stuck with a VM (reaper); {_LOST_WAITS}",
        ),
        Move(
            _S.CREATING,
            _S.DEAD,
            f"its create failed for good, or stuck (reaper); {_ANY_LIVE_TO_DEAD}",
        ),
        Move(_S.STARTING, _S.IDLE, "its guest said READY (registry)"),
        Move(_S.STARTING, _S.STARTING_LIMIT, "no READY by its boot deadline (reaper)"),
        Move(_S.STARTING, _S.DELETING, f"deleted, or finished (delete, registry); {_LOST_WAITS}"),
        Move(_S.STARTING, _S.DEAD, _ANY_LIVE_TO_DEAD),
        Move(
            _S.STARTING_LIMIT,
            _S.DELETING,
            f"on its way out: its VM is released (reaper); {_LOST_WAITS}",
        ),
        Move(_S.STARTING_LIMIT, _S.DEAD, f"no VM to release (reaper); {_ANY_LIVE_TO_DEAD}"),
        Move(_S.IDLE, _S.IDLE, "an environment taken, another still free; or given back (claims)"),
        Move(_S.IDLE, _S.ALLOCATED, "its last free environment taken (claims)"),
        Move(
            _S.IDLE,
            _S.DELETING,
            f"reaped, scaled down, drained, deleted (mark_deleting); {_LOST_WAITS}",
        ),
        Move(_S.IDLE, _S.DEAD, _ANY_LIVE_TO_DEAD),
        Move(_S.ALLOCATED, _S.IDLE, "an environment given back: released, expired, FINISHED"),
        Move(
            _S.ALLOCATED,
            _S.DELETING,
            f"failed to answer a request (claims.suspect), deleted; {_LOST_WAITS}",
        ),
        Move(_S.ALLOCATED, _S.DEAD, _ANY_LIVE_TO_DEAD),
        Move(
            _S.DELETING,
            _S.DELETING,
            "a delete that died midway, taken over (reaper); a release its node never got "
            "waits, if the node cannot list its VMs (delete, reaper)",
        ),
        Move(_S.DELETING, _S.DELETED, "its VM released or gone (retire_deleting, reconcile)"),
        Move(_S.DELETING, _S.DEAD, f"its release failed (retire_deleting); {_ANY_LIVE_TO_DEAD}"),
        Move(_S.MAYBE, _S.IDLE, "its VM showed up and the function wants it: adopted"),
        Move(_S.MAYBE, _S.DELETED, "its VM showed up after its replacement: released"),
        Move(_S.MAYBE, _S.DELETING, f"deleted by an operator (delete); {_LOST_WAITS}"),
        Move(_S.MAYBE, _S.DEAD, f"no sign of its VM by its deadline (reaper); {_ANY_LIVE_TO_DEAD}"),
    )
}


def move(source: ReplicaState | None, target: ReplicaState) -> Move:
    """The move from ``source`` (None: an insert) to ``target``, or :class:`IllegalMove`."""
    found = MOVES.get((source, target))
    if found is None:
        came = "a new row" if source is None else ReplicaState(source).label
        raise IllegalMove(f"a replica may not move from {came} to {ReplicaState(target).label}")
    return found


def _cell(value: object) -> str:
    return "" if value in (0, False, None, "") else str(value)


def markdown() -> str:
    """The table of moves as Markdown (docs/architecture.md holds it; a test compares)."""
    lines = [
        "| from | to | count | gives back | operation | deadline | who moves it |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in MOVES.values():
        op = m.operation.value if m.operation != OnOperation.WAITS else ""
        lines.append(
            f"| {m.source.label if m.source is not None else '(new row)'} | {m.target.label} "
            f"| {_cell(f'{m.count:+d}' if m.count else '')} "
            f"| {'slot, GPU, claims' if m.retires and m.source is not None else ''} "
            f"| {op} | {m.deadline.value if m.deadline != Deadline.NONE else ''} | {m.by} |"
        )
    return "\n".join(lines) + "\n"
