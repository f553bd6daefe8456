"""The registry: the gRPC service node agents and guests call into corral.

``resmngr.ResMngrService``:

* ``RegisterNode(ip, port, node_id[, credential])`` adds the agent as an fcdaemon node
  or refreshes it and marks it healthy. ``node_id`` is matched exactly (``Gpu.1`` and
  ``gpu-1`` are two nodes; a new node whose derived name is taken gets a suffix); it is
  printable text of at most 255 characters (INVALID_ARGUMENT otherwise). Who may
  register, refresh or move a node is :mod:`workers.registry.identity`'s: the claimed
  ip must be an IP address (a host name: INVALID_ARGUMENT) and the caller's, a node's
  credential (issued on its first registration) must be shown, a healthy node is never
  re-pointed. An address another node holds is refused ALREADY_EXISTS
  (:class:`~workers.fleet.nodes.AddressTaken`: one node per address).
* ``UpdateStatus(vmid, READY)`` moves a Starting replica to Idle. It is answered at
  once: a READY for a vmid no row has yet, while a spawn is in flight, is remembered
  (:mod:`workers.replicas.reports`) and applied when the spawn records the VM; with no spawn
  in flight the VM is an orphan and is answered DESTROY. A READY that can only be a
  *maybe*'s VM settles that maybe, at once or at a later sweep
  (:func:`~workers.replicas.reports.ready_of_maybe`): adopted (OK), or released
  (DESTROY, and a release queued). A remembered READY nothing takes in time is an
  orphan too: the sweep has its VM released on the node behind the reporting IP. A
  READY for a recorded replica marks its node as one whose guests report READY.
* ``UpdateStatus(vmid, FINISHED)`` gives back the replica's oldest claim and
  answers KEEP_ALIVE, or DESTROY when the replica should go (stale build, more
  replicas than the function's target, node draining); corral then deletes it.

The deletes and releases the registry decides on are asked of the
:class:`~workers.dispatch.TaskQueue` it is handed (``corral registry`` hands it the Celery
one), and a queue that cannot take one is logged: the reaper's stuck sweep finishes a
delete, and reconcile releases an orphan it kept (:mod:`workers.replicas.orphans`) on any
node, or one it finds where the node can list its VMs.

A READY is accepted only from that replica's IP or its node's IP, a FINISHED only from
the replica's own IP (when the peer's address is known); any other caller is refused
PERMISSION_DENIED.

``mngrinfo.AvAManagerInfo.GetAvAManagerInfo(vmid)`` tells a guest which GPU and
AvA worker it was given (NOT_FOUND for an unknown vmid or a replica without GPU; only
the replica's own IP may ask).

When ``CORRAL_REGISTRY_TOKEN`` is set, every call must carry
``authorization: Bearer <token>`` metadata or it is refused UNAUTHENTICATED before its
message is read (the agents' :class:`~netplumb.grpcserve.GuardedServer`; the health
service stays open), or a guest's report token (:func:`~netplumb.grpcserve.report_token`),
good for ``UpdateStatus`` and ``GetAvAManagerInfo`` of its own vmid only, and a few
calls at a time (:data:`LIMITS`); TLS
is on when ``CORRAL_REGISTRY_TLS_CERT`` / ``_KEY`` are set. The registry refuses to
listen off loopback without a token unless started with ``insecure=True``.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections import Counter
from typing import Any

import grpc
from sqlalchemy import select
from sqlalchemy.orm import Session

from config.settings import Settings, reveal
from netplumb.addresses import host_of, join_hostport, peer_ip
from netplumb.grpcserve import GuardedServer, Limits, bearer_of, report_vmid
from netplumb.listening import Server, listen_address
from protos import mngrinfo_grpc, mngrinfo_pb2, resmngr_grpc, resmngr_pb2
from workers.base.clock import now
from workers.base.errors import CorralError, InputError
from workers.base.kinds import NodeKind
from workers.base.untrusted import VMID_RE
from workers.dispatch import TaskQueue
from workers.fleet.gpus import manager_info
from workers.fleet.nodes import AddressTaken, default_name, normalize_address, upsert_node
from workers.observability import stages, tracing
from workers.registry.identity import (
    Admission,
    Caller,
    NotThatNode,
    StillHealthy,
    admit,
    check_claim,
    issue,
)
from workers.replicas import reports
from workers.replicas.claims import finish_oldest
from workers.replicas.lifecycle import lock_replica, transition
from workers.replicas.notices import Readied
from workers.store.db import Database, get_database
from workers.store.models import LIVE_STATES, Node, Replica, ReplicaState

log = logging.getLogger(__name__)

READY = resmngr_pb2.StatusUpdateRequest.READY
FINISHED = resmngr_pb2.StatusUpdateRequest.FINISHED
DESTROY = resmngr_pb2.StatusUpdateReply.DESTROY
KEEP_ALIVE = resmngr_pb2.StatusUpdateReply.KEEP_ALIVE
OK = resmngr_pb2.StatusUpdateReply.OK
#: Early READYs one registry remembers at most (each is a row until applied or expired),
#: and at most from one caller (an IP: an agent reports for the creates in flight on its
#: node; a guest's report token can only ever speak for its own vmid).
MAX_PENDING = 10_000
MAX_PENDING_PER_CALLER = 256
MAX_NODE_ID = 255  # nodes.external_id


class Refused(CorralError):
    """A caller may not do this (answered PERMISSION_DENIED)."""


class Busy(CorralError):
    """Too much waits already; the caller may try again later (RESOURCE_EXHAUSTED)."""


def _free_name(session: Any, base: str) -> str:
    """``base``, or ``base-2``, ``base-3``... whichever no node has yet."""
    taken = set(session.scalars(select(Node.name).where(Node.name.startswith(base[:50]))))
    if base not in taken:
        return base
    n = 2
    while f"{base[:58]}-{n}" in taken:
        n += 1
    return f"{base[:58]}-{n}"


class Registry:
    """The registry's logic, independent of gRPC plumbing."""

    def __init__(self, db: Database, settings: Settings, queue: TaskQueue) -> None:
        self.db = db
        self.settings = settings
        self.queue = queue
        #: vmids of early READYs remembered here, until applied or expired (see sweep).
        self.pending: set[str] = set()
        self._caller_of: dict[str, str] = {}  # pending vmid -> who reported it
        self._per_caller: Counter[str] = Counter()
        #: pending vmids whose report is not stored yet: the sweep, which forgets a pending
        #: vmid with no stored report, leaves them be
        self._storing: Counter[str] = Counter()
        self._lock = threading.Lock()

    def register_node(
        self, ip: str, port: int, node_id: str, caller: Caller | None = None
    ) -> tuple[str, str | None]:
        """Add or refresh the node an agent announces: (its name, a credential issued to it).

        ``caller`` is who asks (:mod:`workers.registry.identity`); None trusts the claim
        (in-process callers).
        """
        if not ip or not 0 < port < 65536:
            raise InputError(f"RegisterNode needs an ip and a port, got {ip[:64]!r}:{port}")
        if len(node_id) > MAX_NODE_ID or not node_id.isprintable():
            raise InputError(
                f"RegisterNode's node_id {node_id[:64]!r} is not printable text of at most "
                f"{MAX_NODE_ID} characters"
            )
        caller = caller or Caller(peer=None, credential=None)
        try:
            ip = check_claim(ip, caller.peer)
        except CorralError as exc:
            log.warning("RegisterNode of node_id %r refused: %s", node_id[:64], exc)
            raise
        external = node_id or join_hostport(ip, port)
        address = normalize_address(join_hostport(ip, port), NodeKind.FCDAEMON)
        credential: str | None = None
        with self.db.transaction() as s:
            node = s.scalars(
                select(Node).where(Node.external_id == external).with_for_update()
            ).first()
            admission = Admission(repoint_from=None, issue=caller.credential is not None)
            if node is None:
                name = _free_name(s, default_name(external))
            else:
                name = node.name
                try:
                    admission = admit(node, address, caller)
                except CorralError as exc:
                    log.warning(
                        "RegisterNode of node %s (node_id %r) at %s from %s refused: %s",
                        name,
                        external,
                        address,
                        caller.peer or "?",
                        exc,
                    )
                    raise
            try:
                node, created = upsert_node(
                    s,
                    address,
                    name=name,
                    kind=NodeKind.FCDAEMON,
                    external_id=external,
                    default_capacity=self.settings.node_capacity,
                )
            except AddressTaken as exc:
                log.warning(
                    "RegisterNode of node_id %r at %s from %s refused: %s",
                    external,
                    address,
                    caller.peer or "?",
                    exc,
                )
                raise
            name = node.name
            if admission.repoint_from is not None:
                node.repointed_at, node.repointed_from = now(), admission.repoint_from
                log.warning(
                    "node %s (node_id %r) re-pointed from %s (unhealthy) to %s by %s",
                    name,
                    external,
                    admission.repoint_from,
                    address,
                    caller.peer or "?",
                )
            if admission.issue:
                credential, node.credential_hash = issue()
        log.info(
            "%s node %s at %s%s",
            "registered" if created else "refreshed",
            name,
            address,
            "; credential issued" if credential else "",
        )
        return name, credential

    def update_status(self, vmid: str, status: int, peer: str | None = None) -> int:
        """Apply a guest's READY / FINISHED from ``peer`` (an IP, if known); the action."""
        if not vmid:
            return DESTROY
        if not VMID_RE.fullmatch(vmid):
            raise InputError(f"malformed vmid {vmid[:40]!r} (expected [A-Za-z0-9._:-]{{1,128}})")
        replica_id = reports.live_replica(self.db, vmid)
        if replica_id is None and not reports.creates_unrecorded(self.db):
            # none in flight now: unknown, unless its spawn recorded it between the two reads
            replica_id = reports.live_replica(self.db, vmid)
            if replica_id is None:
                log.warning("status %s for unknown vmid %s: answering DESTROY", status, vmid)
                return DESTROY
        if replica_id is None:
            if status != READY:
                return KEEP_ALIVE
            adopted = reports.ready_of_maybe(self.db, self.settings, vmid, peer, self.on_orphan)
            if adopted is not None:  # a maybe's VM: kept, or released
                return OK if adopted else DESTROY
            self._remember(vmid, peer)
            replica_id = reports.live_replica(self.db, vmid)  # recorded meanwhile?
            if replica_id is None:
                return OK
            if not reports.apply_reports(self.db, self.settings, [vmid]):
                self._forget({vmid})
        if status == READY:
            return self._ready(replica_id, peer)
        return self._finished(replica_id, peer)

    def _remember(self, vmid: str, peer: str | None) -> None:
        caller = peer or reports.UNKNOWN_PEER
        with self._lock:
            if vmid not in self.pending:
                if self._per_caller[caller] >= MAX_PENDING_PER_CALLER:
                    raise Busy(
                        f"{MAX_PENDING_PER_CALLER} early READY reports from {caller} "
                        "already wait; try again"
                    )
                if len(self.pending) >= MAX_PENDING:
                    raise Busy(f"{MAX_PENDING} early READY reports already wait; try again")
                self.pending.add(vmid)
                self._caller_of[vmid] = caller
                self._per_caller[caller] += 1
            self._storing[vmid] += 1
        try:
            stored = reports.remember(self.db, self.settings, vmid, peer)
        finally:
            with self._lock:
                self._storing[vmid] -= 1
                if self._storing[vmid] <= 0:
                    del self._storing[vmid]
        if not stored:
            log.warning(
                "early READY for %s from %s: another peer's report is already held", vmid, peer
            )
        else:
            log.info("READY for %s before its VM is recorded: remembered", vmid)

    def sweep(self) -> None:
        """Apply remembered READYs whose VM got recorded; forget the ones that expired."""
        with self._lock:
            vmids = self.pending - self._storing.keys()
        if not vmids:
            return
        waiting = reports.apply_reports(self.db, self.settings, vmids)
        self._forget(vmids - waiting)
        with self._lock:  # a maybe's VM, now that nothing in flight can claim it?
            peers = {v: self._caller_of.get(v, reports.UNKNOWN_PEER) for v in waiting}
        for vmid, peer in peers.items():
            settled = reports.ready_of_maybe(self.db, self.settings, vmid, peer, self.on_orphan)
            if settled is not None:
                self._forget({vmid})
        for orphan in reports.orphans(self.db, self.settings):
            self._forget({orphan.vmid})
            for node_id in orphan.node_ids:
                self.on_orphan(node_id, orphan.vmid)

    def _forget(self, vmids: set[str]) -> None:
        """Stop remembering these early READYs (applied or expired)."""
        with self._lock:
            for vmid in vmids & self.pending:
                self.pending.discard(vmid)
                caller = self._caller_of.pop(vmid, reports.UNKNOWN_PEER)
                self._per_caller[caller] -= 1
                if self._per_caller[caller] <= 0:
                    del self._per_caller[caller]

    def scope(self, context: grpc.ServicerContext) -> str | None:
        """The vmid the caller's credential is limited to (a guest's report token); None: any."""
        token = reveal(self.settings.registry_token)
        if not token:
            return None
        bearer = bearer_of(context.invocation_metadata())
        if hmac.compare_digest(bearer.encode(), token.encode()):
            return None
        return report_vmid(token, bearer) or ""  # "": no VM (the interceptor let it by)

    def _check_peer(self, replica: Replica, peer: str | None, node_too: bool) -> None:
        if not reports.peer_allowed(peer, replica, node_too=node_too):
            log.warning(
                "report for %s from %s refused: not its replica's%s IP",
                replica.vmid,
                peer,
                " or node's" if node_too else "",
            )
            raise Refused(f"{peer} may not report on vmid {replica.vmid}")

    def _reported(
        self, s: Session, replica_id: str, peer: str | None, *, node_too: bool
    ) -> Replica | None:
        """The live replica a status report names, locked, its reporter checked; None when
        it is gone (the guest is told to destroy itself)."""
        replica = lock_replica(s, replica_id)
        if replica is None or replica.status not in LIVE_STATES:
            return None
        self._check_peer(replica, peer, node_too)
        return replica

    def _ready(self, replica_id: str, peer: str | None = None) -> int:
        readied = Readied()
        with self.db.transaction() as s:
            # READY comes from the guest or from its node's agent
            replica = self._reported(s, replica_id, peer, node_too=True)
            if replica is None:
                return DESTROY
            reports.note_ready(s, self.settings, replica)  # its node's guests report READY
            if replica.status == ReplicaState.STARTING:
                readied.functions.add(replica.function.name)
                timed = stages.ready(s, replica)  # the cold start's READY stage
                if timed is not None:
                    readied.stages.append(timed)
                transition(s, replica, ReplicaState.IDLE, self.settings)
                action = OK
            elif replica.status in (ReplicaState.IDLE, ReplicaState.ALLOCATED):
                action = OK
            elif replica.status == ReplicaState.CREATING:
                action = OK  # its spawn will record it; readiness=agent functions go Idle then
            else:
                action = DESTROY  # Deleting or past its boot deadline
        readied.tell(self.settings)  # claims waiting on its function: look now
        return action

    def _finished(self, replica_id: str, peer: str | None = None) -> int:
        with self.db.transaction() as s:
            # FINISHED only from the guest itself: not from others behind its node's IP
            replica = self._reported(s, replica_id, peer, node_too=False)
            if replica is None:
                return DESTROY
            finish_oldest(s, replica, self.settings)
            fn, node = replica.function, replica.node
            reason = None
            if replica.status == ReplicaState.DELETING:
                reason = "being deleted"
            elif replica.build_version != fn.build_version:
                reason = "stale build"
            elif node is not None and node.draining:
                reason = f"node {node.name} draining"
            elif fn.target is not None and fn.replica_count > max(fn.target, fn.min_replicas):
                reason = "above target"
            if reason is None or replica.envs_in_use > 0:
                return KEEP_ALIVE
            if replica.status != ReplicaState.DELETING:
                transition(s, replica, ReplicaState.DELETING, self.settings)
        log.info("replica %s finished and goes (%s)", replica_id, reason)
        self.on_destroy(replica_id)
        return DESTROY

    def on_destroy(self, replica_id: str) -> None:
        """Have the replica (marked Deleting) deleted: its VM released, its row retired."""
        try:
            self.queue.delete_replica(replica_id)
        except Exception as exc:  # the reaper's stuck sweep will finish it
            log.warning("could not queue delete of %s: %s", replica_id, exc)

    def on_orphan(self, node_id: str, vmid: str) -> None:
        """Have an orphan VM (one no replica took) released on a node."""
        try:
            self.queue.release_orphan(node_id, vmid)
        except Exception as exc:  # kept in the store: reconcile releases it (replicas.orphans)
            log.warning("could not queue the release of orphan %s: %s", vmid, exc)

    def manager_info(self, vmid: str, peer: str | None = None) -> tuple[str, str, int] | None:
        """(GPU uuid, manager address, worker port) given to the replica with this vmid.

        Only the replica itself (``peer``, its IP) may ask; Refused otherwise.
        """
        with self.db.read() as s:
            replica = s.scalars(
                select(Replica).where(Replica.vmid == vmid, Replica.status.in_(LIVE_STATES))
            ).first()
            if replica is None:
                return None
            self._check_peer(replica, peer, node_too=False)
            return manager_info(s, vmid)


def _own_vm_only(registry: Registry, vmid: str, context: grpc.ServicerContext) -> None:
    """Abort the call when the caller's report token is for another VM than ``vmid``."""
    scope = registry.scope(context)
    if scope is not None and scope != vmid:
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED, "a guest's report token is good for its own VM only"
        )


class ResMngrServicer(resmngr_grpc.ResMngrServiceServicer):
    """``resmngr.ResMngrService`` over a :class:`Registry`."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def RegisterNode(self, request: Any, context: grpc.ServicerContext) -> Any:
        """An agent announces itself (a guest's report token may not)."""
        if self.registry.scope(context) is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "a report token cannot register")
        caller = Caller(
            peer=peer_ip(context.peer()),
            credential=request.credential if request.HasField("credential") else None,
        )
        try:
            _, credential = self.registry.register_node(
                request.ip, int(request.port), request.node_id, caller
            )
        except NotThatNode as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except StillHealthy as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except AddressTaken as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except CorralError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return resmngr_pb2.RegisterNodeReply(credential=credential or "")

    def UpdateStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        """A guest reports READY or FINISHED."""
        _own_vm_only(self.registry, request.vmid, context)
        peer = peer_ip(context.peer())
        try:
            action = self.registry.update_status(request.vmid, int(request.status), peer)
        except Refused as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except Busy as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except InputError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return resmngr_pb2.StatusUpdateReply(
            action=resmngr_pb2.StatusUpdateReply.Action.ValueType(action)
        )


class AvAManagerInfoServicer(mngrinfo_grpc.AvAManagerInfoServicer):
    """``mngrinfo.AvAManagerInfo`` over a :class:`Registry`."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def GetAvAManagerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Which GPU and AvA worker a guest was given (asked by that guest only)."""
        _own_vm_only(self.registry, request.vmid, context)
        try:
            info = self.registry.manager_info(request.vmid, peer_ip(context.peer()))
        except Refused as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if info is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no GPU replica with vmid {request.vmid!r}")
        assert info is not None  # noqa: S101 - context.abort raised above; narrows for mypy
        uuid, mngr_addr, port = info
        return mngrinfo_pb2.AvAManagerInfoReply(
            gpu_uuid=uuid, mngr_addr=mngr_addr, worker_port=port
        )


#: Bounds on work before a caller is known: every registry message is small (a vmid is at
#: most 128 characters), so 64 KiB is plenty; 32 handler threads; callers with the token
#: may have 256 calls in flight from one IP (running or waiting for a thread), guests
#: (report tokens) 8 together and 2 each (:class:`~netplumb.grpcguard.Limits`).
MAX_MESSAGE = 64 * 1024
WORKERS = 32
LIMITS = Limits(calls_per_peer=256)


class RunningRegistry:
    """A registry server running in background threads (and its early-READY sweep)."""

    SWEEP_S = 0.5

    def __init__(
        self, server: GuardedServer, port: int, registry: Registry, listening: str
    ) -> None:
        self.server = server
        self.port = port
        self.registry = registry
        self.address = f"127.0.0.1:{port}"
        self.listening = listening  # HOST:PORT it listens on (port 0: the port it took)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="registry-sweep", daemon=True)
        self._sweeper.start()

    def _sweep(self) -> None:
        while not self._stop.wait(self.SWEEP_S):
            try:
                self.registry.sweep()
            except Exception:  # the store may be briefly away; the next pass retries
                log.exception("early READY sweep failed")

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace`` seconds)."""
        self._stop.set()
        self.server.stop(grace)

    def wait(self) -> None:
        """Block until the server stops."""
        self.server.wait_for_termination()


REGISTRY = Server("corral registry", "CORRAL_REGISTRY_LISTEN", "CORRAL_REGISTRY_TOKEN")


def check_listen(settings: Settings, listen: str | None = None, *, insecure: bool = False) -> str:
    """The address to listen on; :class:`InputError` if malformed or off loopback tokenless."""
    address = listen or settings.registry_listen
    try:
        listen_address(REGISTRY, address, reveal(settings.registry_token), insecure=insecure)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return address


def serve_registry(
    settings: Settings,
    listen: str | None = None,
    *,
    queue: TaskQueue,
    insecure: bool = False,
) -> RunningRegistry:
    """Start the registry on ``listen`` (default ``CORRAL_REGISTRY_LISTEN``), asking ``queue``.

    Off loopback it needs ``CORRAL_REGISTRY_TOKEN`` (:class:`CorralError` otherwise),
    unless ``insecure``, which logs a warning.
    """
    address = check_listen(settings, listen, insecure=insecure)
    tracing.start("corral-registry", settings)  # READY spans (CORRAL_OTLP_ENDPOINT set)
    registry = Registry(get_database(settings.database_url), settings, queue)
    token = reveal(settings.registry_token)
    server = GuardedServer(
        "registry",
        workers=WORKERS,
        max_message=MAX_MESSAGE,
        token=token,
        what="registry",
        report=lambda bearer: report_vmid(token or "", bearer),
        limits=LIMITS,
    )
    server.add(resmngr_grpc.add_ResMngrServiceServicer_to_server, ResMngrServicer(registry))
    server.add(mngrinfo_grpc.add_AvAManagerInfoServicer_to_server, AvAManagerInfoServicer(registry))
    tls = None
    if settings.registry_tls_cert and settings.registry_tls_key:
        tls = (settings.registry_tls_key.read_bytes(), settings.registry_tls_cert.read_bytes())
    port = server.bind(address, tls)
    server.start()
    running = RunningRegistry(server, port, registry, join_hostport(host_of(address), port))
    log.info("registry listening on %s", running.listening)
    return running
