"""Reconcile: make the rows and the fleet agree, because agents are the truth about what runs.

One pass (under the ``reconcile`` lease, so never two at once; the lease lives until just
after the pass's task meets its hard limit, so a holder killed mid-pass blocks the next
pass for seconds, not ``CORRAL_LEASE_TTL_S``; a pass that finds it held is *skipped* and
says who holds it - an operator's ``corral reconcile`` waits a little for it first, then
ends failed, "skipped", never succeeded):

1. Every healthy node that can list its VMs (``ListReplicas`` on agents,
   ``GET /vms`` on Lambdo hosts) is asked - ``CORRAL_RECONCILE_CONCURRENCY`` nodes
   at once, each call with its own deadline (``CORRAL_RPC_TIMEOUT_S``), so a few
   slow nodes cost a pass one deadline, not one each - and what it runs is compared
   with the live rows on it:

   * a VM with no row is an *orphan* (a spawn whose worker died between the
     agent's answer and the commit, a delete that could not reach the node, a VM
     made behind corral's back). A VM belongs to the row that records it, whichever
     node that row is on: one agent can answer at two node addresses (two IPs of one
     host, a port forward), and a VM another node's row holds is never destroyed
     (the pass reports it in ``held_elsewhere``). A listed vmid that is not a
     well-formed id is never acted on (reported in ``errors``, escaped). Once a VM
     has been seen without a row for
     ``CORRAL_ORPHAN_GRACE_S`` - on the store's clock, from the pass that first saw it
     (a lease ``seen:<node>/<vmid>``), never the agent's own clock - so a spawn still
     in flight is never hit, and unless it carries the request id of a replica still
     Creating, it is destroyed. The orphans of every node are released together once
     the nodes are judged, at most ``CORRAL_RECONCILE_BATCH`` per pass, all in flight at
     once within each node's bound (``workers.replicas.delete.release_all``: the fleet's
     node call slots) and none started past the pass's soft time limit (less the longest
     call): 60 orphans that take 1.2 s each to release cost a pass about 1.2 s x 60 / the
     node's bound, never its hard limit. What is left (``orphans_left``, ``more``) the
     next pass releases at once: their grace is over;
   * a row whose VM the node no longer runs is marked Dead ("VM vanished"),
     which frees its reservations; a Deleting row whose VM is gone is Deleted.
     Only rows that already had their VM *before* the node was listed are
     judged (they are read first, and re-checked under the row lock): a spawn
     that records its VM while the listing is in flight is not mistaken for a
     vanished one (and its VM then for an orphan).

   A node that answers UNIMPLEMENTED / 404 cannot list: it is skipped, and the
   report says so the first time (``nodes.can_list`` remembers).

   The orphans kept in the store (:mod:`workers.replicas.orphans`: ones the registry
   found, on any node, whose release is due because its message did not conclude it)
   are released with the listed ones, in the same batch and bounds; one whose release
   fails again is put off.
2. Idle replicas on draining nodes are marked Deleting, their deletes asked of the queue
   the pass is handed (:class:`workers.dispatch.TaskQueue`), and replaced elsewhere.
3. Functions below their min get a spawn for the difference (queued by the
   task), unless a spawn for them is still pending from the last few minutes.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select

from config.settings import Settings
from workers import backends, leases
from workers.base.clock import now
from workers.base.errors import BackendError, Unsupported
from workers.base.kinds import OpKind
from workers.base.untrusted import VMID_RE
from workers.dispatch import TaskQueue
from workers.locks import lock_functions
from workers.operations import finish, open_of
from workers.replicas import orphans as kept_orphans
from workers.replicas.delete import Doomed, release_all
from workers.replicas.lifecycle import lock_replica, transition
from workers.replicas.owners import Budget
from workers.replicas.scale import unplaced
from workers.store.db import Database
from workers.store.models import (
    LIVE_STATES,
    OP_FINISHED,
    Function,
    Lease,
    Node,
    Operation,
    Replica,
    ReplicaState,
)

log = logging.getLogger(__name__)
LEASE = "reconcile"
SEEN = "seen:"  # a VM seen without a row, per node: the orphan grace runs from then


@dataclass
class ReconcileReport:
    """What one reconcile pass found and did."""

    skipped: bool = False
    held_by: str | None = None  # skipped: who holds the lease
    nodes_checked: list[str] = field(default_factory=list)
    nodes_unlistable: list[str] = field(default_factory=list)
    node_errors: dict[str, str] = field(default_factory=dict)
    orphans_destroyed: list[str] = field(default_factory=list)
    orphans_waiting: int = 0
    orphans_left: int = 0  # past their grace, not released by this pass: the next one does
    more: bool = False  # more orphans than one pass releases (CORRAL_RECONCILE_BATCH)
    held_elsewhere: list[str] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)
    top_up: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """Whether the pass destroyed, retired, drained or asked for anything."""
        return bool(self.orphans_destroyed or self.vanished or self.drained or self.top_up)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return asdict(self)


def reconcile(  # noqa: PLR0913 - the pass's parts, the rest by name
    db: Database,
    settings: Settings,
    *,
    holder: str,
    queue: TaskQueue,
    budget: Budget | None = None,
    lease_wait_s: float = 0.0,
) -> ReconcileReport:
    """Run one reconcile pass, unless another holds the lease; deletes go to ``queue``.

    ``budget`` is the time of the task the pass runs in (no release starts past its soft
    limit, less the longest call); ``lease_wait_s`` lets a pass someone asked for wait
    that long for a running pass to end instead of being skipped at once.
    """
    report = ReconcileReport()
    taken, report.held_by = leases.acquire_within(
        db, LEASE, holder, leases.pass_ttl(settings), lease_wait_s
    )
    if not taken:
        report.skipped = True
        log.info("reconcile pass %s skipped: lease held by %s", holder, report.held_by)
        return report
    try:
        with db.read() as s:
            nodes = list(
                s.scalars(
                    select(Node)
                    .where(Node.healthy.is_(True), Node.can_list.is_not(False))
                    .order_by(Node.name)
                )
            )
        # Rows read *before* the listings: a VM recorded on one of these rows existed
        # before its node was asked, so its absence from the listing means it is gone. A
        # spawn that records its VM while the node is listed is not among them (judged
        # next pass).
        before = {node.id: _live_rows(db, node) for node in nodes}
        orphans: list[tuple[Node, backends.ListedVm]] = []
        for node, listed in zip(nodes, _list_all(settings, nodes), strict=True):
            orphans += _reconcile_node(db, settings, _Seen(node, before[node.id], listed), report)
        _destroy_orphans(db, settings, orphans, report, budget)
        _drain(db, settings, report, queue)
        report.top_up = below_min(db, settings)
    finally:
        leases.release(db, LEASE, holder)
    return report


def record(db: Database, op_id: str, report: ReconcileReport, result: dict[str, Any]) -> None:
    """Finish an operator's reconcile with ``result``: failed if skipped, partial if it left any.

    A pass skipped because another holds the lease did nothing: its operation says so
    ("skipped: ..."), never succeeded. One that left orphans or could not release some
    is partial, with how many and why.
    """
    with db.transaction() as s:
        op = s.get(Operation, op_id, with_for_update=True)
        if op is None or op.status in OP_FINISHED:
            return
        op.result = result
        if report.skipped:
            op.total, op.failed = 1, 1
            held = report.held_by or "unknown"
            error = f"skipped: another reconcile pass holds the lease ({held})"
            finish(op, failed=1, total=1, error=error)
            return
        failed = report.orphans_left + len(report.errors)
        op.total = len(report.orphans_destroyed) + failed or 1
        op.failed, op.done = failed, op.total - failed
        why = report.errors[0] if report.errors else None
        if report.orphans_left:
            why = f"{report.orphans_left} orphan VM(s) left for the next pass"
        finish(op, failed=failed, total=op.total, error=why)


def _live_rows(db: Database, node: Node) -> list[Any]:
    """The node's live rows: id, vmid, status and request id."""
    with db.read() as s:
        return list(
            s.execute(
                select(Replica.id, Replica.vmid, Replica.status, Replica.request_id).where(
                    Replica.node_id == node.id, Replica.status.in_(LIVE_STATES)
                )
            )
        )


def _list_all(settings: Settings, nodes: list[Node]) -> list[Listed]:
    """Every node's VMs, asked of ``CORRAL_RECONCILE_CONCURRENCY`` nodes at once."""
    if not nodes:
        return []

    def one(node: Node) -> Listed:
        try:
            return backends.list_vms(node, settings)
        except BackendError as exc:  # Unsupported among them
            return exc

    with ThreadPoolExecutor(
        min(len(nodes), settings.reconcile_concurrency), thread_name_prefix="reconcile-list"
    ) as pool:
        return list(pool.map(one, nodes))


#: A node's listing: its VMs, or the error that stood in for them.
Listed = list[backends.ListedVm] | BackendError


@dataclass(frozen=True)
class _Seen:
    """A node as this pass saw it: its live rows read before it was asked, and its listing."""

    node: Node
    before: list[Any]
    listed: Listed


def _reconcile_node(
    db: Database, settings: Settings, seen: _Seen, report: ReconcileReport
) -> list[tuple[Node, backends.ListedVm]]:
    """End the rows whose VM vanished from the node; its orphans past their grace."""
    node = seen.node
    vms = _listing(db, node, seen.listed, report)
    if vms is None:
        return []
    orphans = _past_grace(db, settings, node, _unknown(db, node, vms, report), report)
    on_node = {vm.vmid for vm in vms}
    for row in seen.before:
        if row.vmid is None or row.vmid in on_node or row.status == ReplicaState.CREATING:
            continue
        _vanished(db, settings, node, row, report)
    return [(node, vm) for vm in orphans]


def _set_can_list(db: Database, node: Node, can_list: bool) -> None:
    """Remember whether the node can list its VMs."""
    with db.transaction() as s:
        row = s.get(Node, node.id)
        if row is not None:
            row.can_list = can_list


def _listing(
    db: Database, node: Node, listed: Listed, report: ReconcileReport
) -> list[backends.ListedVm] | None:
    """The node's VMs, or None when it could not list them (now or ever)."""
    if isinstance(listed, Unsupported):
        _set_can_list(db, node, False)
        report.nodes_unlistable.append(node.name)
        log.info("node %s cannot list its VMs; reconcile skips it from now on", node.name)
        return None
    if isinstance(listed, BackendError):
        report.node_errors[node.name] = str(listed)
        return None
    report.nodes_checked.append(node.name)
    if node.can_list is None:
        _set_can_list(db, node, True)
    return listed


def _destroy_orphans(
    db: Database,
    settings: Settings,
    orphans: list[tuple[Node, backends.ListedVm]],
    report: ReconcileReport,
    budget: Budget | None,
) -> None:
    """Release orphan VMs past their grace, and kept orphans due again: at most a batch, all
    at once within each node's bound, none started past the pass's soft limit; what is
    left waits for the next pass."""
    found = [(node, vm.vmid) for node, vm in orphans]
    kept = [(d.node, d.vmid) for d in kept_orphans.due(db, settings.reconcile_batch)]
    listed = {(node.id, vmid) for node, vmid in found}
    every = found + [(node, vmid) for node, vmid in kept if (node.id, vmid) not in listed]
    batch = every[: settings.reconcile_batch]
    report.more = len(every) > len(batch)
    report.orphans_left = len(every) - len(batch)
    doomed = {
        f"{node.name}/{vmid}": (node, Doomed(f"{node.name}/{vmid}", vmid, node))
        for node, vmid in batch
    }
    done = release_all(settings, [d for _, d in doomed.values()], budget)
    for key, released in done.items():
        node, d = doomed[key]
        vmid = str(d.vmid)
        if released is None:  # not sent in the pass's time: the next pass
            report.orphans_left += 1
            kept_orphans.put_off(db, node.id, vmid, None)
        elif isinstance(released, BackendError):
            report.errors.append(f"orphan {key}: {released}")
            kept_orphans.put_off(db, node.id, vmid, str(released))
        else:  # released, or gone already
            report.orphans_destroyed.append(key)
            kept_orphans.end(db, node.id, vmid)
            log.warning("destroyed orphan VM %s", key)
    if report.orphans_left:
        log.info("reconcile left %d orphan VM(s) to the next pass", report.orphans_left)


#: Listed ids looked up per query (bound parameters stay well under every store's limit).
_CHUNK = 500


def _unknown(
    db: Database, node: Node, vms: list[backends.ListedVm], report: ReconcileReport
) -> list[backends.ListedVm]:
    """The listed VMs no live row records - on any node - nor a Creating row is making."""
    good = []
    for vm in vms:
        if VMID_RE.fullmatch(vm.vmid) and set(vm.vmid) != {"."}:
            good.append(vm)
        else:
            report.errors.append(f"node {node.name} listed a malformed vmid {vm.vmid[:60]!r}")
    # Rows read *after* the listing: a listed VM with no row here has none (orphans).
    holders: dict[str, str | None] = {}
    creating: set[str] = set()
    with db.read() as s:
        for at in range(0, len(good), _CHUNK):
            chunk = good[at : at + _CHUNK]
            rows = s.execute(
                select(Replica.vmid, Replica.node_id).where(
                    Replica.vmid.in_([vm.vmid for vm in chunk]), Replica.status.in_(LIVE_STATES)
                )
            )
            holders.update((str(vmid), node_id) for vmid, node_id in rows)
            asked = [vm.request_id for vm in chunk if vm.request_id]
            if asked:
                creating.update(
                    s.scalars(
                        select(Replica.request_id).where(
                            Replica.request_id.in_(asked),
                            Replica.status == ReplicaState.CREATING,
                        )
                    )
                )
    for vmid, holder in holders.items():
        if holder != node.id:
            report.held_elsewhere.append(f"{node.name}/{vmid}")
            log.warning(
                "node %s lists VM %s, which another node's replica holds: left alone (one "
                "agent at two node addresses?)",
                node.name,
                vmid,
            )
    return [
        vm
        for vm in good
        if vm.vmid not in holders and not (vm.request_id and vm.request_id in creating)
    ]


def _past_grace(
    db: Database,
    settings: Settings,
    node: Node,
    unknown: list[backends.ListedVm],
    report: ReconcileReport,
) -> list[backends.ListedVm]:
    """The unknown VMs first seen without a row at least ``CORRAL_ORPHAN_GRACE_S`` ago.

    The sighting is a lease per node and VM, on the store's clock; sightings of VMs that
    are no longer unknown (recorded, or gone) are dropped.
    """
    names = {leases.keyed_name(SEEN, f"{node.id}/{vm.vmid}"): vm for vm in unknown}
    out = []
    with db.transaction() as s:
        s.execute(
            delete(Lease).where(
                Lease.name.startswith(SEEN), Lease.holder == node.id, Lease.name.not_in(list(names))
            )
        )
        at = now()
        for name, vm in names.items():
            grace = settings.orphan_grace_s
            if grace <= 0 or leases.first_seen(s, name, node.id, grace) <= at:
                out.append(vm)
            else:
                report.orphans_waiting += 1
    return out


def _vanished(
    db: Database, settings: Settings, node: Node, row: Any, report: ReconcileReport
) -> None:
    """End a row (``row``: its id and vmid, as read before the listing) whose VM the node no
    longer lists: Deleted if it was being deleted, else Dead."""
    with db.transaction() as s:
        replica = lock_replica(s, row.id)
        if replica is None or replica.status not in LIVE_STATES or replica.vmid != row.vmid:
            return
        if replica.status == ReplicaState.DELETING:
            transition(s, replica, ReplicaState.DELETED, settings)
        else:
            transition(
                s,
                replica,
                ReplicaState.DEAD,
                settings,
                error=f"VM {replica.vmid} vanished from node {node.name}",
            )
            report.vanished.append(replica.id)


def _drain(db: Database, settings: Settings, report: ReconcileReport, queue: TaskQueue) -> None:
    """Delete Idle replicas of draining nodes; their functions get replacements."""
    doomed: list[str] = []
    with db.transaction() as s:
        if s.scalar(select(Node.id).where(Node.draining.is_(True)).limit(1)) is None:
            return
        lock_functions(s)  # counters of any function may move (workers.locks)
        rows = s.scalars(
            select(Replica)
            .join(Node, Replica.node_id == Node.id)
            .where(
                Node.draining.is_(True),
                Replica.status == ReplicaState.IDLE,
                Replica.envs_in_use == 0,
            )
            .limit(settings.reap_batch)
            .with_for_update(of=Replica, skip_locked=True)
        ).all()
        for replica in rows:
            transition(s, replica, ReplicaState.DELETING, settings)
            doomed.append(replica.id)
            report.drained.append(replica.id)
    for replica_id in doomed:
        queue.delete_replica(replica_id)


def below_min(db: Database, settings: Settings) -> dict[str, int]:
    """Functions under their min, counting replicas planned but not yet placed: name -> how many.

    A function with a spawn pending from the last few minutes is left alone.
    """
    with db.read() as s:
        short = s.execute(
            select(Function.id, Function.name, Function.min_replicas, Function.replica_count).where(
                Function.replica_count < Function.min_replicas
            )
        ).all()
        pending = {
            fid
            for fid in s.scalars(
                select(Operation.function_id).where(
                    open_of(OpKind.SPAWN),
                    Operation.created_at >= now() - timedelta(seconds=settings.creating_deadline_s),
                )
            )
        }
        wanted: dict[str, int] = {}
        for fid, name, minimum, count in short:
            if fid in pending:
                continue
            missing = minimum - count - unplaced(s, fid)  # a scale on its way counts
            if missing > 0:
                wanted[name] = missing
    return wanted
