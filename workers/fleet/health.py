"""Node health: probes, misses, and what happens to a node that stops answering.

Every ``CORRAL_HEALTH_INTERVAL_S`` the health task probes each node (the gRPC
health service, or any answer at all from an agent that lacks it; an HTTP
answer from a Lambdo host). A probe that fails counts a miss, as does a spawn or
delete that gave up on transport errors (:func:`note_failure`). After
``CORRAL_HEALTH_MISSES`` misses in a row the node is unhealthy and placement
skips it; after ``CORRAL_NODE_DEAD_GRACE_S`` more, its replicas are marked Dead by
the health task (:func:`workers.replicas.lost.mark_lost`; reconcile then brings
functions back to their min elsewhere). One good answer makes it healthy again.

A node is probed at the IP its row holds, never through a name (a name could resolve
to another machine by the next pass): a row an older corral stored with a host name is
not dialled; each pass counts it a miss, saying to re-add it (``corral nodes add``
resolves a name once).

One pass runs at a time: a pass takes the ``health`` lease (:mod:`workers.leases`)
like reap and reconcile, and a pass that cannot is skipped, so two passes that
overlap (a slow pass and the next beat) never count the same miss twice. The
lease lives a few intervals, so a worker killed mid-pass holds health up only
briefly.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from sqlalchemy import select

from config.settings import Settings
from netplumb.addresses import ip_of
from workers import backends, leases
from workers.base.clock import now
from workers.base.errors import BackendError
from workers.store.db import Database
from workers.store.models import Node

log = logging.getLogger(__name__)
LEASE = "health"


def note_failure(db: Database, settings: Settings, node_id: str, error: str) -> bool:
    """Count a miss for a node; returns True when this made it unhealthy."""
    with db.transaction() as s:
        node = s.get(Node, node_id, with_for_update=True)
        if node is None:
            return False
        node.misses += 1
        node.last_error = error[:1000]
        if node.healthy and node.misses >= settings.health_misses:
            node.healthy = False
            node.unhealthy_since = now()
            log.warning("node %s is unhealthy after %d misses: %s", node.name, node.misses, error)
            return True
        return False


def note_success(db: Database, node_id: str) -> bool:
    """Record a good answer from a node; returns True when it came back."""
    with db.transaction() as s:
        node = s.get(Node, node_id, with_for_update=True)
        if node is None:
            return False
        back = not node.healthy
        node.misses = 0
        node.healthy = True
        node.unhealthy_since = None
        node.last_seen_at = now()
        if back:
            log.info("node %s is healthy again", node.name)
        return back


@dataclass
class HealthReport:
    """What one health pass saw."""

    skipped: bool = False  # another pass holds the lease
    probed: int = 0
    healthy: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    became_unhealthy: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """Whether a node changed health in this pass."""
        return bool(self.became_unhealthy or self.recovered)


def _probe(node: Node, settings: Settings) -> str | None:
    if ip_of(node.address) is None:
        return (
            f"node {node.name}: its address {node.address} names a host, which corral does "
            f"not resolve: re-add it (`corral nodes add ADDRESS --name {node.name}` resolves "
            "a name once) or remove it"
        )
    try:
        ok = backends.probe(node, settings)
    except BackendError as exc:
        return str(exc)
    except Exception as exc:  # a probe must never kill the pass
        return f"node {node.name}: probe failed: {type(exc).__name__}: {exc}"
    return None if ok else f"node {node.name}: health service says NOT_SERVING"


PROBE_THREADS = 16


def _probe_all(nodes: list[Node], settings: Settings) -> list[str | None]:
    """Probe nodes in parallel; a probe still running at the pass's deadline counts a miss.

    Each probe has its own deadline, but a hung one (a stuck name lookup, a peer
    that never answers) must not stall the pass: it is left behind and counted.
    """
    rounds = -(-len(nodes) // PROBE_THREADS)
    limit = rounds * 2 * settings.health_timeout_s + 1.0
    pool = ThreadPoolExecutor(
        max_workers=min(PROBE_THREADS, len(nodes)), thread_name_prefix="health-probe"
    )
    try:
        futs = [pool.submit(_probe, node, settings) for node in nodes]
        wait(futs, timeout=limit)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [
        fut.result()
        if fut.done() and not fut.cancelled()
        else f"node {node.name}: probe did not finish within {limit:g}s"
        for node, fut in zip(nodes, futs, strict=True)
    ]


def lease_ttl(settings: Settings) -> float:
    """How long a health pass holds its lease: a few intervals, and longer than its probes."""
    return max(3 * settings.health_interval_s, 4 * settings.health_timeout_s)


def check_health(db: Database, settings: Settings, *, holder: str | None = None) -> HealthReport:
    """Probe every node once and update its health.

    Skipped (``report.skipped``) while another pass holds the ``health`` lease.
    """
    holder = holder or leases.holder_name()
    if not leases.acquire(db, LEASE, holder, lease_ttl(settings)):
        return HealthReport(skipped=True)
    try:
        return _check_health(db, settings)
    finally:
        leases.release(db, LEASE, holder)


def _check_health(db: Database, settings: Settings) -> HealthReport:
    with db.transaction() as s:
        nodes = list(s.scalars(select(Node).order_by(Node.name)))
    report = HealthReport(probed=len(nodes))
    if not nodes:
        return report
    probe_settings = settings.model_copy(
        update={
            "rpc_timeout_s": settings.health_timeout_s,
            "lambdo_timeout_s": settings.health_timeout_s,
        }
    )
    results = _probe_all(nodes, probe_settings)
    for node, error in zip(nodes, results, strict=True):
        if error is None:
            report.healthy.append(node.name)
            if note_success(db, node.id):
                report.recovered.append(node.name)
        else:
            report.missed.append(node.name)
            if note_failure(db, settings, node.id, error):
                report.became_unhealthy.append(node.name)
    return report
