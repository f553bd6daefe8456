"""Moving a row its handler owns off the node its create went to, and the locks that takes.

A create that failed on a node moves its replica to another (:func:`move`): the old
node's slot is freed and a new one reserved in the same transaction, only by the owner
of the create on the row's current node (its token and that node are checked on the
locked row), so a stale handler can neither move a row nor free a slot twice. A
request is tried on at most :data:`MAX_PLACEMENTS` nodes (moves and maybe
replacements, :mod:`workers.replicas.maybes`, count alike), then it is Dead.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.errors import CapacityError
from workers.fleet.nodes import note_creates
from workers.fleet.placement import free_node, reserve_node
from workers.locks import lock_gpus, lock_nodes
from workers.replicas.lifecycle import lock_replica, transition
from workers.replicas.owners import Pending, owns
from workers.store.db import Database
from workers.store.models import Function, ReplicaState

log = logging.getLogger(__name__)

MAX_PLACEMENTS = 3  # nodes a replica is tried on before it is marked Dead


class Moved(enum.Enum):
    """What :func:`move` did to a row."""

    MOVED = "moved"  # on another node, disowned: nothing was sent there yet
    DEAD = "dead"  # tried on enough nodes, or no other node has room
    STAY = "stay"  # no other node, and it may stay (nothing changed)
    LOST = "lost"  # not this handler's row on that node any more (nothing changed)


def lock_for_moves(s: Session, pendings: Sequence[Pending]) -> None:
    """Lock what moving replicas touches, in the one order (workers.locks).

    Their functions, then every node (and GPU) of their backends; the replica rows
    themselves are locked one by one after these (:func:`move`, :func:`_fail`).
    """
    fn_ids = sorted({p.function.id for p in pendings})
    s.execute(
        select(Function.id)
        .where(Function.id.in_(fn_ids))
        .order_by(Function.name)
        .with_for_update(key_share=True)
    ).all()
    for kind in sorted({p.node.kind for p in pendings}):
        lock_nodes(s, kind)
    if any(p.function.gpu_mem_mb for p in pendings):
        lock_gpus(s)


def fail(s: Session, settings: Settings, p: Pending, token: str, error: str) -> bool:
    """End a row this handler owns Dead; False if it is no longer ours to end."""
    replica = lock_replica(s, p.replica_id)
    if replica is None or not owns(replica, token, p.node.id):
        return False
    transition(s, replica, ReplicaState.DEAD, settings, error=error)
    return True


def move(  # noqa: PLR0913 - one move's parts, the rest by name
    s: Session,
    settings: Settings,
    p: Pending,
    token: str,
    error: str,
    *,
    counted: bool,
    avoid: Sequence[str] = (),
    or_stay: bool = False,
) -> Moved:
    """Move a row this handler owns off the node that failed its create (and ``avoid``).

    :attr:`Moved.STAY` only with ``or_stay``. Only the owner of the create on the row's
    current node frees that node's slot, once; the move from Creating to Creating
    (:mod:`workers.store.states`) disowns the row and clears its sent mark.
    """
    replica = lock_replica(s, p.replica_id)
    if replica is None or not owns(replica, token, p.node.id):
        return Moved.LOST
    if counted and replica.placements >= MAX_PLACEMENTS:
        tried = f" (tried on {replica.placements} nodes)" if replica.placements > 1 else ""
        transition(s, replica, ReplicaState.DEAD, settings, error=f"{error}{tried}")
        return Moved.DEAD
    fn = replica.function
    try:
        node = reserve_node(s, fn, fn.placement or settings.placement, avoid=[p.node.id, *avoid])
    except CapacityError as exc:
        if or_stay:
            return Moved.STAY
        transition(
            s, replica, ReplicaState.DEAD, settings, error=f"{error}; no other node to try ({exc})"
        )
        return Moved.DEAD
    free_node(s, p.node.id)
    replica.node_id = node.id
    replica.placements += int(counted)
    transition(s, replica, ReplicaState.CREATING, settings)
    log.info("replica %s moved from node %s to %s: %s", replica.id, p.node.name, node.name, error)
    return Moved.MOVED


def owned_move(db: Database, settings: Settings, p: Pending, token: str, error: str) -> bool:
    """Move a row this handler owns after its retries are spent; True when it moved."""
    with db.transaction() as s:
        lock_for_moves(s, [p])
        why = note_creates(s, settings, p.node.id, [error])
        if why:
            log.warning("node %s %s", p.node.name, why)
        return move(s, settings, p, token, error, counted=True) == Moved.MOVED
