"""GPU inventory: the GPUs of AvA GPU servers, their memory, worker slots and ports.

The model. A *GPU server* runs an AvA manager that answers
``gpuresc.GPUResc.GetGPUResource`` (GPU UUID -> memory in MB, port 50053) and an
API server for guests at ``<host>:3333`` (its *manager address*). Each of its
GPUs becomes one :class:`~workers.store.models.Gpu` row with

* ``mem_total_mb`` / ``mem_free_mb`` - memory as reported, and what replicas have
  not reserved;
* ``slots_total`` / ``slots_free`` - AvA worker slots (``CORRAL_WORKERS_PER_GPU``,
  default 4); a GPU replica holds exactly one;
* ``first_port`` - the AvA worker of slot ``s`` listens on ``first_port + s``.
  Ports are handed out when a GPU is first recorded - in sorted-UUID order, from
  ``CORRAL_FIRST_WORKER_PORT`` for a new server, after the last port already in
  use on a known one - and never change afterwards, so a guest told a port keeps
  it for life.

Re-adding a server refreshes memory and slot totals (never below what live
replicas hold) and keeps ports. Reservations themselves are made by
:func:`workers.fleet.placement.reserve_gpu` and given back by
:func:`workers.replicas.lifecycle.transition`; this module only records inventory,
answers ``mngrinfo`` questions (:func:`manager_info`) and audits the counters.
"""

from __future__ import annotations

import logging
import re
from typing import TypedDict

import grpc
from google.protobuf import empty_pb2
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from config.settings import Settings, reveal
from netplumb.addresses import MAX_PORT, join_hostport, parse_hostport
from protos import gpuresc_grpc
from workers.backends.fcdaemon import RETRYABLE_CODES
from workers.base.clock import iso
from workers.base.errors import (
    BackendError,
    InputError,
    PermanentBackendError,
    TransientBackendError,
    Unsupported,
)
from workers.store.db import Database
from workers.store.models import LIVE_STATES, Gpu, Replica
from workers.store.rows import delete_unlinking_replicas, one_or_not_found

log = logging.getLogger(__name__)

DEFAULT_GPURESC_PORT = 50053
UUID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")


def split_address(address: str, default_port: int, what: str = "GPU server") -> tuple[str, int]:
    """``HOST[:PORT]`` as (host, port), or a clear :class:`InputError`."""
    try:
        return parse_hostport(address, default_port, f"{what} address")
    except ValueError as exc:
        raise InputError(str(exc)) from None


def server_address(address: str) -> str:
    """The canonical ``host:port`` of a GPU server (port 50053 when omitted)."""
    return join_hostport(*split_address(address, DEFAULT_GPURESC_PORT))


def fetch_gpus(address: str, timeout_s: float, token: str | None = None) -> dict[str, int]:
    """Ask a GPU server's ``GetGPUResource`` for its GPUs (UUID -> MB), with the agent token."""

    with grpc.insecure_channel(address) as channel:
        stub = gpuresc_grpc.GPURescStub(channel)
        try:
            metadata = (("authorization", f"Bearer {token}"),) if token else None
            reply = stub.GetGPUResource(empty_pb2.Empty(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise _rpc_error(exc, address) from None
    return {str(k): int(v) for k, v in reply.memory.items()}


def _rpc_error(exc: grpc.RpcError, address: str) -> BackendError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    message = f"GPU server {address}: GetGPUResource failed: {code.name}: {detail}"
    if code in RETRYABLE_CODES:
        return TransientBackendError(message, code=code.name)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unsupported(message, code=code.name)
    return PermanentBackendError(message, code=code.name)


def add_gpu_server(
    db: Database, settings: Settings, address: str, *, mngr_addr: str | None = None
) -> list[Gpu]:
    """Record (or refresh) the GPUs a server reports; returns its GPUs by port."""
    server = server_address(address)
    gpus = fetch_gpus(server, settings.rpc_timeout_s, reveal(settings.agent_token))
    if not gpus:
        raise PermanentBackendError(f"GPU server {server} reports no GPUs")
    for uuid, mb in gpus.items():
        if not UUID_RE.match(uuid):
            raise PermanentBackendError(f"GPU server {server} reports a malformed UUID {uuid!r}")
        if mb < 0:
            raise PermanentBackendError(f"GPU server {server} reports {mb} MB for {uuid}")
    if mngr_addr is not None:
        mngr_addr = join_hostport(
            *split_address(mngr_addr, settings.gpu_manager_port, "AvA manager")
        )
    try:
        with db.transaction() as s:
            return record_gpus(s, settings, server, gpus, mngr_addr=mngr_addr)
    except IntegrityError:
        raise InputError(
            f"GPU server {server} was being added by someone else at the same time; try again"
        ) from None


def record_gpus(
    session: Session,
    settings: Settings,
    server: str,
    gpus: dict[str, int],
    *,
    mngr_addr: str | None = None,
) -> list[Gpu]:
    """Write a server's reported GPUs (UUID -> MB) into the inventory; see the module doc."""
    known = list(
        session.scalars(
            select(Gpu)
            .where((Gpu.server == server) | Gpu.uuid.in_(list(gpus)))
            .order_by(Gpu.uuid)  # GPUs are locked by uuid (workers.locks)
            .with_for_update()
        )
    )
    known.sort(key=lambda g: g.first_port)
    for gpu in known:
        if gpu.server != server:
            raise InputError(
                f"GPU {gpu.uuid} is recorded on server {gpu.server}; "
                f"remove it there (`corral gpus remove {gpu.uuid}`) before adding {server}"
            )
    ours = [g for g in known if g.server == server]
    manager = mngr_addr or (ours[0].mngr_addr if ours else None)
    if manager is None:
        host = split_address(server, DEFAULT_GPURESC_PORT)[0]
        manager = join_hostport(host, settings.gpu_manager_port)
    for i, gpu in enumerate(ours):
        if gpu.uuid not in gpus:
            log.warning("GPU %s is no longer reported by %s; kept until removed", gpu.uuid, server)
            continue
        room = ours[i + 1].first_port - gpu.first_port if i + 1 < len(ours) else None
        _refresh(session, gpu, gpus[gpu.uuid], settings.workers_per_gpu, room)
        if mngr_addr is not None:
            gpu.mngr_addr = manager
    _add_new(session, settings, server, manager, gpus, ours)
    session.flush()
    reported = [g for g in ours if g.uuid in gpus]
    return sorted(reported, key=lambda g: g.first_port)


def _add_new(  # noqa: PLR0913 - one server's report and what is known of it
    session: Session,
    settings: Settings,
    server: str,
    manager: str,
    gpus: dict[str, int],
    ours: list[Gpu],
) -> None:
    """Add the reported GPUs not yet known, each with worker ports after the last ones."""
    next_port = max(
        (g.first_port + g.slots_total for g in ours), default=settings.first_worker_port
    )
    known_uuids = {g.uuid for g in ours}
    for uuid in sorted(set(gpus) - known_uuids):
        slots = settings.workers_per_gpu
        if next_port + slots - 1 > MAX_PORT:
            raise InputError(
                f"no worker ports left for GPU {uuid} on {server}: "
                f"{next_port}+{slots} exceeds {MAX_PORT}"
            )
        gpu = Gpu(
            uuid=uuid,
            server=server,
            mngr_addr=manager,
            mem_total_mb=gpus[uuid],
            mem_free_mb=gpus[uuid],
            slots_total=slots,
            slots_free=slots,
            first_port=next_port,
        )
        session.add(gpu)
        ours.append(gpu)
        next_port += slots


def _refresh(session: Session, gpu: Gpu, mem_mb: int, slots: int, room: int | None) -> None:
    """New totals for a known GPU, keeping what live replicas hold (and its ports)."""
    if room is not None:
        slots = min(slots, room)  # never grow into the next GPU's ports
    mem_used = gpu.mem_total_mb - gpu.mem_free_mb
    slots_used = gpu.slots_total - gpu.slots_free
    top_slot = session.scalar(
        select(func.max(Replica.gpu_slot)).where(
            Replica.gpu_id == gpu.id, Replica.gpu_slot.is_not(None)
        )
    )
    if mem_mb < mem_used or slots < slots_used or (top_slot is not None and top_slot >= slots):
        raise InputError(
            f"GPU {gpu.uuid}: live replicas hold {mem_used} MB and {slots_used} slot(s); "
            f"cannot shrink it to {mem_mb} MB and {slots} slot(s) - delete them first"
        )
    gpu.mem_total_mb, gpu.mem_free_mb = mem_mb, mem_mb - mem_used
    gpu.slots_total, gpu.slots_free = slots, slots - slots_used


def list_gpus(session: Session) -> list[Gpu]:
    """Every recorded GPU, by server and port."""
    return list(session.scalars(select(Gpu).order_by(Gpu.server, Gpu.first_port, Gpu.uuid)))


def get_gpu(session: Session, uuid: str, *, lock: bool = False) -> Gpu:
    """The GPU with this UUID, or :class:`NotFound`."""
    if not isinstance(uuid, str) or not UUID_RE.match(uuid):
        raise InputError(f"malformed GPU UUID {uuid!r}")
    return one_or_not_found(
        session, select(Gpu).where(Gpu.uuid == uuid), f"GPU {uuid!r}", lock=lock
    )


def remove_gpu(session: Session, uuid: str) -> None:
    """Forget a GPU that no live replica uses."""
    gpu = get_gpu(session, uuid, lock=True)
    if gpu.slots_free < gpu.slots_total or gpu.mem_free_mb < gpu.mem_total_mb:
        raise InputError(
            f"GPU {uuid} is in use: {gpu.slots_total - gpu.slots_free} slot(s) and "
            f"{gpu.mem_total_mb - gpu.mem_free_mb} MB held by live replicas; delete them first"
        )
    delete_unlinking_replicas(session, gpu, Replica.gpu_id)
    session.flush()


def manager_info(session: Session, vmid: str) -> tuple[str, str, int] | None:
    """(GPU UUID, manager address, worker port) of the live replica ``vmid``; None if none."""
    if not vmid:
        return None
    row = session.execute(
        select(Gpu.uuid, Gpu.mngr_addr, Gpu.first_port, Replica.gpu_slot)
        .join(Gpu, Replica.gpu_id == Gpu.id)
        .where(
            Replica.vmid == vmid,
            Replica.status.in_(LIVE_STATES),
            Replica.gpu_slot.is_not(None),
        )
        .order_by(Replica.created_at.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    uuid, mngr, first_port, slot = row
    assert slot is not None  # noqa: S101 - narrows for mypy; filtered above
    return str(uuid), str(mngr), int(first_port) + int(slot)


class GpuView(TypedDict):
    """A GPU as the CLI and API show it."""

    uuid: str
    server: str
    mngr_addr: str
    mem_total_mb: int
    mem_free_mb: int
    mem_used_mb: int
    slots_total: int
    slots_free: int
    slots_used: int
    first_port: int
    ports: str  # FIRST-LAST
    created_at: str | None


def gpu_view(gpu: Gpu) -> GpuView:
    """A GPU as the CLI and API show it."""
    last_port = gpu.first_port + gpu.slots_total - 1
    return {
        "uuid": gpu.uuid,
        "server": gpu.server,
        "mngr_addr": gpu.mngr_addr,
        "mem_total_mb": gpu.mem_total_mb,
        "mem_free_mb": gpu.mem_free_mb,
        "mem_used_mb": gpu.mem_total_mb - gpu.mem_free_mb,
        "slots_total": gpu.slots_total,
        "slots_free": gpu.slots_free,
        "slots_used": gpu.slots_total - gpu.slots_free,
        "first_port": gpu.first_port,
        "ports": f"{gpu.first_port}-{last_port}",
        "created_at": iso(gpu.created_at),
    }
