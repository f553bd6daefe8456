"""CPU hogs: busy-loop processes started or stopped on node agents, to study interference.

The model. A hog request is an operation of kind ``hogs`` (``start`` or ``stop``,
``n`` hogs, one named node or every healthy fcdaemon node). Its first run fixes
the target nodes and records them in ``operation.result["nodes"]`` as
``{name: {"state": "pending"}}``; each node then gets one ``CreateCPUHogs`` or
``StopCPUHogs`` call and its outcome (``ok``, or ``failed`` with the error).
Neither RPC is idempotent - a second ``CreateCPUHogs(n)`` starts ``n`` more - so
a node whose call succeeded is never called again for the same operation: a
redelivered message or a retry after transport errors only calls the nodes still
``pending`` or failed with a retryable error. When every node has an outcome
the operation ends ``succeeded``, ``partial`` or ``failed`` with done/failed
counts per node. Without an operation id the task makes one attempt per node
and only returns what happened.

:func:`run_hogs` is the plain logic; the ``corral.hogs`` task in
:mod:`tasks.hogs` (queue ``corral.maintenance``) wraps it and decides retries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from config.settings import Settings
from workers import backends
from workers.base.errors import BackendError, InputError
from workers.base.kinds import NodeKind
from workers.fleet.health import note_failure
from workers.fleet.nodes import get_node
from workers.operations import finish, mark_running
from workers.store.db import Database
from workers.store.models import OP_FINISHED, Node, Operation

log = logging.getLogger(__name__)

ACTIONS = ("start", "stop")
MAX_HOGS = 1024


def check_hogs(action: object, n: object) -> tuple[str, int]:
    """``(action, n)`` if valid (start/stop, 1..1024), else a clear :class:`InputError`."""
    if action not in ACTIONS:
        raise InputError(f"unknown hog action {action!r}; use start or stop")
    if isinstance(n, bool) or not isinstance(n, int):
        raise InputError(f"n must be an integer, got {n!r}")
    if n < 1 or n > MAX_HOGS:
        raise InputError(f"n must be between 1 and {MAX_HOGS}, got {n}")
    return str(action), n


def hog_targets(session: Any, node: str | None) -> list[Node]:
    """The nodes a hog request goes to: the named fcdaemon node, or every healthy one."""
    if node is not None:
        one = get_node(session, node)
        if not backends.backend(one.kind).runs_hogs:
            raise InputError(f"node {node!r} is a {one.kind} node; only fcdaemon agents run hogs")
        return [one]
    kinds = [kind for kind in NodeKind if backends.backend(kind).runs_hogs]
    nodes = list(
        session.scalars(
            select(Node).where(Node.kind.in_(kinds), Node.healthy.is_(True)).order_by(Node.name)
        )
    )
    if not nodes:
        raise InputError("no healthy fcdaemon nodes to run hogs on")
    return nodes


@dataclass(frozen=True)
class HogCall:
    """One node's outcome for one attempt."""

    node_id: str
    node: str
    ok: bool
    error: str | None = None
    retryable: bool = False


def call_node(node: Node, settings: Settings, action: str, n: int) -> HogCall:
    """Send ``CreateCPUHogs`` / ``StopCPUHogs`` to one node; never raises for RPC errors."""
    try:
        backends.hogs(node, action, n, settings)
    except BackendError as exc:
        return HogCall(node.id, node.name, False, str(exc), exc.retryable)
    return HogCall(node.id, node.name, True)


@dataclass(frozen=True)
class HogRequest:
    """One hog request: start or stop ``n`` hogs on the node named ``node`` (None: every
    healthy fcdaemon node)."""

    action: str
    n: int
    node: str | None = None


def run_hogs(
    db: Database,
    settings: Settings,
    request: HogRequest,
    op_id: str | None = None,
    *,
    last_try: bool = True,
) -> dict[str, Any]:
    """Call the nodes still owed a hog request; returns ``{"nodes": ..., "retry": bool}``.

    ``retry`` is True when some node failed with a retryable error and
    ``last_try`` is False: the operation then stays open for another attempt.
    """
    action, n = check_hogs(request.action, request.n)
    request = HogRequest(action, n, request.node)
    owed = _owed(db, request, op_id)
    if owed.finished:
        return {"nodes": owed.outcomes, "retry": False}
    calls = [
        call_node(target, settings, action, n)
        if target is not None
        else HogCall(owed.outcomes[name]["node_id"], name, False, f"node {name} was removed")
        for name, target in owed.nodes.items()
    ]
    retry = not last_try and any(c.retryable for c in calls)
    outcomes = owed.record(db, calls, retry=retry)
    if not retry:
        for c in calls:
            if c.retryable:
                note_failure(db, settings, c.node_id, c.error or "hog request failed")
    return {"nodes": outcomes, "retry": retry}


@dataclass
class _Owed:
    """The nodes a hog operation still owes a call (None: removed since it was planned)."""

    request: HogRequest
    op_id: str | None
    outcomes: dict[str, dict[str, Any]]
    nodes: dict[str, Node | None]
    finished: bool = False

    def record(
        self, db: Database, calls: list[HogCall], *, retry: bool
    ) -> dict[str, dict[str, Any]]:
        """Write each call's outcome on the operation; finish it unless a retry is due."""
        action, n, op_id, outcomes = self.request.action, self.request.n, self.op_id, self.outcomes
        with db.transaction() as s:
            op = s.get(Operation, op_id, with_for_update=True) if op_id else None
            if op is not None:
                outcomes = dict((op.result or {}).get("nodes", outcomes))
            for c in calls:
                attempts = int(outcomes.get(c.node, {}).get("attempts", 0)) + 1
                outcomes[c.node] = {
                    "node_id": c.node_id,
                    "state": "ok" if c.ok else "failed",
                    "attempts": attempts,
                    **({} if c.ok else {"error": c.error, "retryable": c.retryable}),
                }
                log.info("hogs %s %d on %s: %s", action, n, c.node, "ok" if c.ok else c.error)
            if op is not None:
                op.result = {"action": action, "n": n, "nodes": outcomes}
                op.done = sum(1 for o in outcomes.values() if o["state"] == "ok")
                op.failed = sum(1 for o in outcomes.values() if o["state"] == "failed")
                if not retry and op.status not in OP_FINISHED:
                    errors = [o["error"] for o in outcomes.values() if o.get("error")]
                    op.result = {**op.result, "errors": errors[:5]}
                    finish(op, failed=op.failed, total=op.total)
        return outcomes


def _owed(db: Database, request: HogRequest, op_id: str | None) -> _Owed:
    """Plan the operation's targets on its first run; then the ones pending or retryable."""
    with db.transaction() as s:
        op = s.get(Operation, op_id, with_for_update=True) if op_id else None
        if op_id and op is None:
            raise InputError(f"unknown operation {op_id!r}")
        if op is not None and op.status in OP_FINISHED:
            return _Owed(request, op_id, (op.result or {}).get("nodes", {}), {}, finished=True)
        outcomes: dict[str, dict[str, Any]] = dict((op.result or {}).get("nodes", {})) if op else {}
        if not outcomes:
            outcomes = {
                t.name: {"node_id": t.id, "state": "pending"} for t in hog_targets(s, request.node)
            }
            if op is not None:
                op.total = len(outcomes)
                op.result = {"action": request.action, "n": request.n, "nodes": outcomes}
                mark_running(op)
        owed = [
            name
            for name, o in outcomes.items()
            if o["state"] == "pending" or (o["state"] == "failed" and o.get("retryable"))
        ]
        found = {nd.name: nd for nd in s.scalars(select(Node).where(Node.name.in_(owed)))}
        return _Owed(request, op_id, outcomes, {name: found.get(name) for name in owed})
