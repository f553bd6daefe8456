"""The registry: the gRPC service node agents and guests call into corral.

``resmngr.ResMngrService``:

* ``RegisterNode(ip, port, node_id)`` adds the agent as an fcdaemon node or
  refreshes it (idempotent by ``node_id``) and marks it healthy.
* ``UpdateStatus(vmid, READY)`` moves a Starting replica to Idle. A guest can
  report READY before the agent's CreateReply has reached corral, so an unknown
  vmid is given a grace period (longer while any spawn is still waiting for its
  vmid) before it is answered DESTROY - a merely early VM is not killed, a true
  orphan is not kept.
* ``UpdateStatus(vmid, FINISHED)`` gives back the replica's oldest claim and
  answers KEEP_ALIVE, or DESTROY when the replica should go (stale build, more
  replicas than the function's target, node draining); corral then deletes it.

``mngrinfo.AvAManagerInfo.GetAvAManagerInfo(vmid)`` tells a guest which GPU and
AvA worker it was given (NOT_FOUND for an unknown vmid or a replica without GPU).

When ``CORRAL_REGISTRY_TOKEN`` is set, every call must carry
``authorization: Bearer <token>`` metadata or it is refused UNAUTHENTICATED; TLS
is on when ``CORRAL_REGISTRY_TLS_CERT`` / ``_KEY`` are set.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import empty_pb2
from sqlalchemy import select

from config.settings import Settings
from protos import mngrinfo_grpc, mngrinfo_pb2, resmngr_grpc, resmngr_pb2
from workers.claims import finish_oldest
from workers.errors import CorralError
from workers.lifecycle import lock_replica, transition
from workers.nodes import default_name, upsert_node
from workers.store.db import Database, get_database
from workers.store.models import LIVE_STATES, Replica, ReplicaState

log = logging.getLogger(__name__)

READY = resmngr_pb2.StatusUpdateRequest.READY
FINISHED = resmngr_pb2.StatusUpdateRequest.FINISHED
DESTROY = resmngr_pb2.StatusUpdateReply.DESTROY
KEEP_ALIVE = resmngr_pb2.StatusUpdateReply.KEEP_ALIVE
OK = resmngr_pb2.StatusUpdateReply.OK


def _find_live(db: Database, vmid: str) -> str | None:
    with db.read() as s:
        return s.scalar(
            select(Replica.id).where(Replica.vmid == vmid, Replica.status.in_(LIVE_STATES))
        )


def _spawns_in_flight(db: Database) -> bool:
    with db.read() as s:
        return (
            s.scalar(
                select(Replica.id)
                .where(Replica.status == ReplicaState.CREATING, Replica.vmid.is_(None))
                .limit(1)
            )
            is not None
        )


class Registry:
    """The registry's logic, independent of gRPC plumbing."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        on_destroy: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.db = db
        self.settings = settings
        self.on_destroy = on_destroy or _queue_delete
        self._sleep = sleep

    def register_node(self, ip: str, port: int, node_id: str) -> str:
        """Add or refresh the node an agent announces; returns its name."""
        if not ip or not 0 < port < 65536:
            raise CorralError(f"RegisterNode needs an ip and a port, got {ip!r}:{port}")
        external = node_id or f"{ip}:{port}"
        with self.db.transaction() as s:
            node, created = upsert_node(
                s, f"{ip}:{port}", name=default_name(external), kind="fcdaemon",
                external_id=external, default_capacity=self.settings.node_capacity,
            )
            name = node.name
        log.info("%s node %s at %s:%d", "registered" if created else "refreshed", name, ip, port)
        return name

    def wait_for(self, vmid: str) -> str | None:
        """The live replica with this vmid, waiting out a READY that beat its CreateReply."""
        grace = self.settings.ready_grace_s
        started = time.monotonic()
        delay = 0.05
        while True:
            replica_id = _find_live(self.db, vmid)
            if replica_id is not None:
                return replica_id
            waited = time.monotonic() - started
            limit = grace
            if waited >= grace and _spawns_in_flight(self.db):
                limit = max(grace, self.settings.create_timeout_s)
            if waited >= limit:
                return None
            self._sleep(delay)
            delay = min(delay * 2, 0.5)

    def update_status(self, vmid: str, status: int) -> int:
        """Apply a guest's READY / FINISHED; returns the action to answer."""
        if not vmid:
            return DESTROY
        replica_id = self.wait_for(vmid)
        if replica_id is None:
            log.warning("status %s for unknown vmid %s: answering DESTROY", status, vmid)
            return DESTROY
        if status == READY:
            return self._ready(replica_id)
        return self._finished(replica_id)

    def _ready(self, replica_id: str) -> int:
        with self.db.transaction() as s:
            replica = lock_replica(s, replica_id)
            if replica is None or replica.status not in LIVE_STATES:
                return DESTROY
            if replica.status == ReplicaState.STARTING:
                transition(s, replica, ReplicaState.IDLE, self.settings)
                return OK
            if replica.status in (ReplicaState.IDLE, ReplicaState.ALLOCATED):
                return OK
            if replica.status == ReplicaState.CREATING:
                return OK  # its spawn will record it; readiness=agent functions go Idle then
            return DESTROY  # Deleting or past its boot deadline

    def _finished(self, replica_id: str) -> int:
        with self.db.transaction() as s:
            replica = lock_replica(s, replica_id)
            if replica is None or replica.status not in LIVE_STATES:
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

    def manager_info(self, vmid: str) -> tuple[str, str, int] | None:
        """(GPU uuid, manager address, worker port) given to the replica with this vmid."""
        from workers.gpus import manager_info

        with self.db.read() as s:
            return manager_info(s, vmid)


def _queue_delete(replica_id: str) -> None:
    """Have a worker release the VM and retire the row."""
    from tasks.replicas import delete_replica

    try:
        delete_replica.delay(replica_id)
    except Exception as exc:  # the reaper's stuck sweep will finish it
        log.warning("could not queue delete of %s: %s", replica_id, exc)


def _check_token(context: grpc.ServicerContext, token: str | None) -> None:
    if not token:
        return
    sent = dict(context.invocation_metadata()).get("authorization", "")
    if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid registry token")


class ResMngrServicer(resmngr_grpc.ResMngrServiceServicer):  # type: ignore[misc]
    """``resmngr.ResMngrService`` over a :class:`Registry`."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def RegisterNode(self, request: Any, context: grpc.ServicerContext) -> Any:
        """An agent announces itself."""
        _check_token(context, self.registry.settings.registry_token)
        try:
            self.registry.register_node(request.ip, int(request.port), request.node_id)
        except CorralError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return empty_pb2.Empty()

    def UpdateStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        """A guest reports READY or FINISHED."""
        _check_token(context, self.registry.settings.registry_token)
        action = self.registry.update_status(request.vmid, int(request.status))
        return resmngr_pb2.StatusUpdateReply(action=action)


class AvAManagerInfoServicer(mngrinfo_grpc.AvAManagerInfoServicer):  # type: ignore[misc]
    """``mngrinfo.AvAManagerInfo`` over a :class:`Registry`."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def GetAvAManagerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Which GPU and AvA worker a guest was given."""
        _check_token(context, self.registry.settings.registry_token)
        info = self.registry.manager_info(request.vmid)
        if info is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no GPU replica with vmid {request.vmid!r}")
        assert info is not None
        uuid, mngr_addr, port = info
        return mngrinfo_pb2.AvAManagerInfoReply(
            gpu_uuid=uuid, mngr_addr=mngr_addr, worker_port=port
        )


class RunningRegistry:
    """A registry server running in background threads."""

    def __init__(self, server: grpc.Server, port: int, registry: Registry) -> None:
        self.server = server
        self.port = port
        self.registry = registry
        self.address = f"127.0.0.1:{port}"

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace`` seconds)."""
        self.server.stop(grace).wait()

    def wait(self) -> None:
        """Block until the server stops."""
        self.server.wait_for_termination()


def serve_registry(settings: Settings, listen: str | None = None,
                   registry: Registry | None = None) -> RunningRegistry:
    """Start the registry on ``listen`` (default ``CORRAL_REGISTRY_LISTEN``)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    registry = registry or Registry(get_database(settings.database_url), settings)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="registry"))
    resmngr_grpc.add_ResMngrServiceServicer_to_server(ResMngrServicer(registry), server)
    mngrinfo_grpc.add_AvAManagerInfoServicer_to_server(AvAManagerInfoServicer(registry), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = listen or settings.registry_listen
    if settings.registry_tls_cert and settings.registry_tls_key:
        creds = grpc.ssl_server_credentials(
            [(settings.registry_tls_key.read_bytes(), settings.registry_tls_cert.read_bytes())]
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"registry cannot listen on {address}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("registry listening on %s (port %d)", address, port)
    return RunningRegistry(server, port, registry)
