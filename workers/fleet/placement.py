"""Where a new replica goes: a node chosen by policy, and a GPU chosen by fit.

Choosing and reserving are one step. A policy proposes a candidate with an
indexed query, and the reservation is a conditional UPDATE
(``live < capacity AND healthy AND NOT draining AND not quarantined`` for nodes,
``mem_free_mb >= need AND slots_free >= 1`` for GPUs) in the transaction that
writes the replica row. If a concurrent worker took the last slot first, the
UPDATE matches nothing and the next candidate is tried, so capacity holds under
any number of workers; CHECK constraints on the counters back this up.

Node policies: ``loadbalance`` (fewest live replicas), ``pack`` (fullest node
that still fits), ``roundrobin`` (next node by name after the function's last,
read and written under the function's row lock so concurrent spawns take turns),
``random``, and ``spread`` (the caller pins one replica to every healthy node;
here it behaves like loadbalance). GPU fit: ``best`` (least free memory that
still fits) or ``first`` (first GPU in recording order that fits).

A batch of unpinned least-loaded replicas (``loadbalance``, ``spread``) whose
transaction already holds the backend's node locks is placed in one step
(:func:`reserve_nodes`): the same choices, one read and one UPDATE per node used
instead of a query and an UPDATE per replica.

A node whose creates keep failing is quarantined for a while
(:func:`workers.fleet.nodes.note_creates`); placement skips it until the quarantine
ends, and a replica moved off a failing node names that node in ``avoid``.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, bindparam, case, func, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from workers.base.clock import now
from workers.base.errors import CapacityError
from workers.store.models import Function, Gpu, Node, Replica

# The policies a function may name (workers.base.kinds.POLICIES) are carried out in _candidate.
FITS = ("best", "first")
MAX_ATTEMPTS = 16


# A node that may be given replicas (at ``now``: a bind parameter): healthy, not draining,
# not quarantined; placeable when it has a free slot too.
_USABLE: tuple[ColumnElement[bool], ...] = (
    Node.healthy.is_(True),
    Node.draining.is_(False),
    or_(Node.quarantined_until.is_(None), Node.quarantined_until <= bindparam("now")),
)
_PLACEABLE: tuple[ColumnElement[bool], ...] = (*_USABLE, Node.live < Node.capacity)


def _placeable(kind: str) -> list[ColumnElement[bool]]:
    return [Node.kind == kind, *_PLACEABLE]


# Built once, like the statements of workers.replicas.lifecycle: the common candidate query
# (loadbalance / spread, nothing to skip) and the slot reservation.
_LEAST_LOADED = (
    select(Node)
    .where(Node.kind == bindparam("backend"), *_PLACEABLE)
    .order_by(Node.live, Node.name)
    .limit(1)
)
_TAKE_SLOT = (
    update(Node)
    .where(Node.id == bindparam("node_id"), Node.kind == bindparam("backend"), *_PLACEABLE)
    .values(live=Node.live + 1)
    .execution_options(synchronize_session=False)
)


_TAKE_SLOTS = (
    update(Node)
    .where(
        Node.id == bindparam("node_id"),
        Node.kind == bindparam("backend"),
        *_PLACEABLE,
        Node.live + bindparam("k") <= Node.capacity,
    )
    .values(live=Node.live + bindparam("k"))
    .execution_options(synchronize_session=False)
)


def _rowcount(result: Any) -> int:
    """Rows a conditional UPDATE changed (0: someone else took the last room first)."""
    return int(cast(CursorResult[Any], result).rowcount)  # pragma: no mutate - a type only


def _candidate(session: Session, fn: Function, policy: str, skip: Sequence[str]) -> Node | None:
    at = {"now": now()}
    # (not mutated: the prebuilt query is the else branch's below, kept for speed)
    if policy in ("loadbalance", "spread") and not skip:  # pragma: no mutate
        return session.scalars(_LEAST_LOADED, {"backend": fn.backend, **at}).first()
    where = [*_placeable(fn.backend)]
    if skip:
        where.append(Node.id.not_in(skip))
    query = select(Node).where(*where)
    if policy == "pack":
        query = query.order_by(Node.live.desc(), Node.name)
    elif policy == "random":
        query = query.order_by(func.random())
    elif policy == "roundrobin":
        # Read the last node fresh and locked, not from ``fn``: ``fn`` may have been
        # loaded before a concurrent spawn of the same function committed, and a stale
        # value sends both to the same node. FOR NO KEY UPDATE (held until commit) is
        # the lock the replica-count UPDATE already took, and it does not conflict with
        # the key-share locks that concurrent replica INSERTs take on the function.
        last = select(Function.rr_last_node).where(Function.id == fn.id)
        after = session.scalar(last.with_for_update(key_share=True)) or ""
        following = query.where(Node.name > after).order_by(Node.name)
        nxt = session.scalars(following.limit(1), at).first()  # pragma: no mutate - as below
        if nxt is not None:
            return nxt
        query = query.order_by(Node.name)
    else:  # loadbalance, spread
        query = query.order_by(Node.live, Node.name)
    return session.scalars(query.limit(1), at).first()  # pragma: no mutate - first() reads one


def reserve_node(
    session: Session,
    fn: Function,
    policy: str,
    pinned: str | None = None,
    avoid: Sequence[str] = (),
) -> Node:
    """Pick a node for one replica of ``fn`` (not one in ``avoid``) and take one of its slots."""
    tried: list[str] = list(avoid)
    pinned_name = pinned
    for _ in range(MAX_ATTEMPTS):
        if pinned is not None:
            node = session.get(Node, pinned)
            if node is not None:
                pinned_name = node.name  # the error below names it as operators know it
            if node is None or pinned in tried:
                break
        else:
            node = _candidate(session, fn, policy, tried)
            if node is None:
                break
        took = _rowcount(
            session.connection().execute(
                _TAKE_SLOT, {"node_id": node.id, "backend": fn.backend, "now": now()}
            )
        )
        if took:
            set_committed_value(node, "live", node.live + 1)  # what the UPDATE wrote
            if policy == "roundrobin":
                session.execute(
                    update(Function)
                    .where(Function.id == fn.id)
                    .values(rr_last_node=node.name)
                    .execution_options(synchronize_session=False)
                )
                set_committed_value(fn, "rr_last_node", node.name)
            return node
        tried.append(node.id)
    where = f"node {pinned_name}" if pinned else f"any healthy {fn.backend} node"
    raise CapacityError(f"no capacity for {fn.name} on {where}")


def reserve_nodes(session: Session, fn: Function, n: int) -> list[Node]:
    """Nodes for up to ``n`` unpinned replicas of ``fn`` by least load, slots taken together.

    For ``loadbalance`` / ``spread`` and only under the backend's node locks
    (:func:`workers.locks.lock_nodes`): the nodes read once here cannot change until
    commit, so choosing in Python gives what ``n`` calls of :func:`reserve_node`
    would, in one read and one UPDATE per node used. Fewer than ``n`` when the
    nodes fill up (the caller reserves the rest one by one, which says why not).
    """
    # Only the n least loaded can be chosen: a node outside them becomes the least loaded
    # only once each of the n has been chosen at least once, i.e. after n choices.
    nodes = session.scalars(
        select(Node)
        .where(*_placeable(fn.backend))
        .order_by(Node.live, Node.name)
        .limit(n),  # pragma: no mutate - no limit reads them all: the n least loaded are chosen
        {"now": now()},
    ).all()
    heap = [(node.live, node.name, i) for i, node in enumerate(nodes)]
    heapq.heapify(heap)
    chosen: list[Node] = []
    taken: dict[int, int] = {}
    while heap and len(chosen) < n:
        live, name, i = heapq.heappop(heap)
        chosen.append(nodes[i])
        taken[i] = taken.get(i, 0) + 1
        if live + 1 < nodes[i].capacity:
            heapq.heappush(heap, (live + 1, name, i))
    for i, k in taken.items():
        node = nodes[i]
        took = _rowcount(
            session.connection().execute(
                _TAKE_SLOTS, {"node_id": node.id, "backend": fn.backend, "now": now(), "k": k}
            )
        )
        if not took:  # not under the node locks after all: refuse rather than overbook
            raise RuntimeError("reserve_nodes needs the backend's node locks held")
        set_committed_value(node, "live", node.live + k)
    return chosen


# The one statement that gives node slots back: ``n`` on a node, never below zero. A
# replica's final transition frees one, a batch of retired replicas one count per node.
_FREE_SLOTS = (
    update(Node)
    .where(Node.id == bindparam("node_id"))
    .values(live=case((Node.live >= bindparam("n"), Node.live - bindparam("n")), else_=0))
    .execution_options(synchronize_session=False)
)


def free_nodes(session: Session, slots: Mapping[str, int]) -> None:
    """Give back slots on nodes: node id -> how many, in one statement."""
    if slots:
        session.connection().execute(
            _FREE_SLOTS, [{"node_id": node_id, "n": n} for node_id, n in slots.items()]
        )


def free_node(session: Session, node_id: str) -> None:
    """Give back one slot on a node."""
    free_nodes(session, {node_id: 1})


@dataclass(frozen=True)
class GpuGrant:
    """A GPU, a worker slot on it and the memory reserved there."""

    gpu_id: str
    slot: int
    mem_mb: int


def reserve_gpu(session: Session, fn: Function, fit: str) -> GpuGrant:
    """Reserve GPU memory and one worker slot for one replica of ``fn``."""
    need = fn.gpu_mem_mb
    tried: list[str] = []
    for _ in range(MAX_ATTEMPTS):
        query = select(Gpu).where(Gpu.mem_free_mb >= need, Gpu.slots_free >= 1)
        if tried:
            query = query.where(Gpu.id.not_in(tried))
        if fit == "first":
            query = query.order_by(Gpu.created_at, Gpu.first_port, Gpu.uuid)
        else:
            query = query.order_by(Gpu.mem_free_mb, Gpu.uuid)
        gpu = session.scalars(query.limit(1)).first()  # pragma: no mutate - first() reads one
        if gpu is None:
            break
        # The UPDATE checks again what the SELECT read: only a concurrent grant makes them
        # differ (test_placement_postgres.py races them; the mutation run leaves it out).
        still_fits = (Gpu.mem_free_mb >= need, Gpu.slots_free >= 1)  # pragma: no mutate
        took = _rowcount(
            session.execute(
                update(Gpu)
                .where(Gpu.id == gpu.id, *still_fits)
                .values(mem_free_mb=Gpu.mem_free_mb - need, slots_free=Gpu.slots_free - 1)
                .execution_options(synchronize_session=False)  # pragma: no mutate - None: same
            )
        )
        if took:
            # The UPDATE holds the GPU's row lock until commit, so the slots read
            # here include every committed grant and no concurrent one can pick
            # the same slot (the unique index on (gpu_id, gpu_slot) backs this up).
            used = set(session.scalars(select(Replica.gpu_slot).where(Replica.gpu_id == gpu.id)))
            slot = next((s for s in range(gpu.slots_total) if s not in used), None)
            if slot is not None:
                return GpuGrant(gpu.id, slot, need)
            # Counters said a slot was free but replicas hold them all: give the
            # reservation back and try another GPU rather than fail obscurely.
            free_gpu(session, gpu.id, need)
        tried.append(gpu.id)
    raise CapacityError(f"no GPU capacity for {fn.name} ({need} MB)")


def free_gpu(session: Session, gpu_id: str, mem_mb: int) -> None:
    """Give back memory and one worker slot on a GPU."""
    session.execute(
        update(Gpu)
        .where(Gpu.id == gpu_id)
        .values(mem_free_mb=Gpu.mem_free_mb + mem_mb, slots_free=Gpu.slots_free + 1)
        .execution_options(synchronize_session=False)  # pragma: no mutate - None: same
    )


def spread_nodes(session: Session, fn: Function) -> list[str]:
    """Ids of every node a ``spread`` spawn puts replicas on."""
    query = select(Node.id).where(Node.kind == fn.backend, *_USABLE).order_by(Node.name)
    return list(session.scalars(query, {"now": now()}))
