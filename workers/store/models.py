"""The rows corral keeps: functions, nodes, GPUs, replicas, operations, leases and calls.

A *replica* is one microVM (or Lambdo VM) serving a function. Its ``status`` keeps
the seed's numbers (Idle=0, Allocated=1, Creating=2, Dead=13, Starting=200,
StartingLimit=210) and adds Deleting=220, Deleted=230 and Maybe=240. A replica holds a slot
on its node (``nodes.live``) and, for GPU functions, memory and a worker slot on
one GPU (``gpus.mem_free_mb`` / ``gpus.slots_free``) exactly while it is *live*
(any state but Dead and Deleted), and counts toward its function's
``replica_count`` (capped at ``max_replicas``) while it is Creating, Starting,
Idle or Allocated (a *maybe* - a create sent whose outcome is unknown, on a node that
cannot tell, :mod:`workers.replicas.maybes` - holds its slot but not the count, which
passed to its replacement). The states, and every move between them with what it does
to these counters, are one table (:mod:`workers.store.states`);
:mod:`workers.replicas.lifecycle` carries the moves out in the transaction of every state
change. Counters are guarded in the database by CHECK
constraints and changed only by conditional UPDATEs, so no interleaving of
workers can over-commit a node or a GPU.

A *claim* is one execution environment of a replica lent to one caller until it is
released or its ``expires_at`` passes (the reaper then gives it back): a replica's
``envs_in_use`` equals the number of its claim rows.

An *operation* is one producer request (spawn, delete, scale, reap, ...): what was
asked, how far it got, and how it ended.

A *call* is one asynchronous invocation (``POST /async-function/NAME``): the request as
the gateway would forward it, its attempts, and the one terminal record it ends in
(succeeded or dead) with the last answer; :mod:`workers.invocations` keeps it.

The status and kind columns are read as their enums (``Replica.status`` as
:class:`ReplicaState`, ``Operation.status`` as :class:`OpStatus`, ``Operation.kind`` as
:class:`~workers.base.kinds.OpKind`, ``Node.kind`` and ``Function.backend`` as
:class:`~workers.base.kinds.NodeKind`) and store the members' plain values, so a value that
names no member never reaches the database.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from workers.base.clock import now
from workers.base.kinds import NodeKind, OpKind
from workers.store.states import COUNTED_STATES as COUNTED_STATES
from workers.store.states import FINAL_STATES as FINAL_STATES
from workers.store.states import LIVE_STATES as LIVE_STATES
from workers.store.states import ReplicaState as ReplicaState


def new_id() -> str:
    """A fresh random identifier for a row."""
    return uuid.uuid4().hex


class OpStatus(enum.StrEnum):
    """Where an operation is: open (pending, running) or finished (the other three).

    :data:`OP_FINISHED` and :data:`OP_OPEN` (the stored string values) are the one
    definition of each; ``OpStatus(op.status).finished`` asks it of one status.
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PARTIAL = "partial"

    @property
    def finished(self) -> bool:
        """Whether an operation in this status is over (never left again)."""
        return self.value in OP_FINISHED


# The stored values of finished and of open operations: never changed again / still moving.
OP_FINISHED: tuple[str, ...] = (
    OpStatus.SUCCEEDED.value,
    OpStatus.FAILED.value,
    OpStatus.PARTIAL.value,
)
OP_OPEN: tuple[str, ...] = tuple(s.value for s in OpStatus if s.value not in OP_FINISHED)


class CallStatus(enum.StrEnum):
    """Where an asynchronous call is: open (queued, running, retrying) or over (the other two).

    *succeeded*: an attempt got an answer that is not retried (any status but 429 and 5xx);
    *dead*: its attempts or its age were spent (the last answer and error kept). A call
    reaches one of them once; only ``corral calls redrive`` opens a dead one again.
    """

    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    DEAD = "dead"

    @property
    def finished(self) -> bool:
        """Whether a call in this status is over."""
        return self.value in CALL_FINISHED


CALL_FINISHED: tuple[str, ...] = (CallStatus.SUCCEEDED.value, CallStatus.DEAD.value)
CALL_OPEN: tuple[str, ...] = tuple(s.value for s in CallStatus if s.value not in CALL_FINISHED)


class _Stored(TypeDecorator[Any]):
    """A status or kind column read as its enum, written as the member's value (schema unchanged).

    Writing a value that is not a member raises ``ValueError`` before the statement runs.
    """

    members: type[enum.Enum]

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        """The stored value of a member (or of a raw value that names one)."""
        return None if value is None else self.members(value).value

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        """The member a stored value names."""
        return None if value is None else self.members(value)


class StoredReplicaState(_Stored):
    """``replicas.status``: the seed's numbers, read as :class:`ReplicaState`."""

    impl = Integer
    members = ReplicaState
    cache_ok = True  # SQLAlchemy asks each TypeDecorator class itself


class StoredOpStatus(_Stored):
    """``operations.status``: the status strings, read as :class:`OpStatus`."""

    impl = String
    members = OpStatus
    cache_ok = True


class StoredCallStatus(_Stored):
    """``calls.status``: the status strings, read as :class:`CallStatus`."""

    impl = String
    members = CallStatus
    cache_ok = True


class StoredNodeKind(_Stored):
    """``nodes.kind`` and ``functions.backend``: the kind strings, read as :class:`NodeKind`."""

    impl = String
    members = NodeKind
    cache_ok = True


class StoredOpKind(_Stored):
    """``operations.kind``: the kind strings, read as :class:`OpKind`."""

    impl = String
    members = OpKind
    cache_ok = True


class Base(DeclarativeBase):
    """Declarative base for corral's tables."""

    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Keyed:
    """A table whose key is a generated 32-character hex id (``new_id``), its first column."""

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id, sort_order=-2)


class Named(Keyed):
    """A keyed table whose rows also have a unique DNS-label name (63 characters at most)."""

    name: Mapped[str] = mapped_column(String(63), unique=True, sort_order=-1)


class Function(Named, Base):
    """A deployable function: what to run and how many replicas it may have."""

    __tablename__ = "functions"

    backend: Mapped[NodeKind] = mapped_column(StoredNodeKind(16), default=NodeKind.FCDAEMON)
    image: Mapped[str] = mapped_column(String(1024))
    kernel: Mapped[str] = mapped_column(String(1024), default="")
    initrd: Mapped[str] = mapped_column(String(1024), default="")
    kernel_args: Mapped[str] = mapped_column(Text, default="")
    vm_type: Mapped[str] = mapped_column(String(16), default="osv")
    cpu: Mapped[int] = mapped_column(Integer, default=1)
    mem_mb: Mapped[int] = mapped_column(Integer, default=512)
    min_replicas: Mapped[int] = mapped_column(Integer, default=0)
    max_replicas: Mapped[int] = mapped_column(Integer, default=20)
    target: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Replicas in COUNTED_STATES; kept by lifecycle.transition, capped at max_replicas.
    replica_count: Mapped[int] = mapped_column(Integer, default=0)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    env: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    image_storage: Mapped[str] = mapped_column(String(1024), default="")
    inet_dev: Mapped[str] = mapped_column(String(64), default="")
    name_server: Mapped[str] = mapped_column(String(255), default="")
    aws_access_key_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    aws_secret_access_key: Mapped[str | None] = mapped_column(String(256), nullable=True)
    rootfs: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    build_version: Mapped[str] = mapped_column(String(32))
    ports: Mapped[list[Any]] = mapped_column(JSON, default=list)
    idle_timeout_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    readiness: Mapped[str] = mapped_column(String(8), default="agent")
    exec_envs: Mapped[int] = mapped_column(Integer, default=1)
    gpu_mem_mb: Mapped[int] = mapped_column(Integer, default=0)
    placement: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # Demand-driven scaling (workers.autoscale.decision): off unless deployed with --autoscale;
    # scale_to_zero_after_s None keeps at least one replica (or min) while autoscaled.
    autoscale: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    scale_to_zero_after_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Keep-alive of idle replicas: "fixed" (the idle timeout, or scale_to_zero_after_s) or
    # "adaptive" (windows read off the function's idle-time histogram, workers.autoscale.keepalive).
    keep_alive: Mapped[str] = mapped_column(String(8), default="fixed", server_default="fixed")
    rr_last_node: Mapped[str | None] = mapped_column(String(63), nullable=True)
    # Asynchronous calls (workers.invocations): attempts of one call and the longest a call
    # may wait for an attempt to start; None: the settings' defaults.
    call_attempts: Mapped[int | None] = mapped_column(Integer, nullable=True)
    call_max_age_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=now)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=now, onupdate=now)

    __table_args__ = (
        CheckConstraint("min_replicas >= 0 AND min_replicas <= max_replicas", name="ck_fn_minmax"),
        CheckConstraint("exec_envs >= 1", name="ck_fn_envs"),
        CheckConstraint("replica_count >= 0", name="ck_fn_replica_count"),
        CheckConstraint("gpu_mem_mb >= 0", name="ck_fn_gpu_mem"),
    )


class Node(Named, Base):
    """A node agent (fcdaemon) or a Lambdo host that runs replicas."""

    __tablename__ = "nodes"

    kind: Mapped[NodeKind] = mapped_column(StoredNodeKind(16), default=NodeKind.FCDAEMON)
    address: Mapped[str] = mapped_column(String(255))
    # Its IP and port (``10.0.0.5:50051``, ``[::1]:3000``): one node per address, whatever
    # its kind (workers.fleet.nodes). None only for a row an older corral stored with a
    # host name, which corral no longer resolves.
    endpoint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    external_id: Mapped[str | None] = mapped_column(String(255), unique=True, nullable=True)
    capacity: Mapped[int] = mapped_column(Integer, default=64)
    live: Mapped[int] = mapped_column(Integer, default=0)
    healthy: Mapped[bool] = mapped_column(Boolean, default=True)
    draining: Mapped[bool] = mapped_column(Boolean, default=False)
    misses: Mapped[int] = mapped_column(Integer, default=0)
    unhealthy_since: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    last_seen_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    can_list: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    # When a guest of this node first reported READY for a recorded replica (None: never
    # seen - a maybe there waits for its creating deadline, workers.replicas.maybes).
    ready_seen_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # Placement learns (workers.fleet.nodes.note_creates): failed creates in a row, when the
    # last create succeeded (None: never - a new node is on probation), and a quarantine.
    create_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_create_ok_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    quarantined_until: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    quarantine_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Identity (workers.registry.identity): the SHA-256 of the credential issued to the agent
    # that registered it (None: a seed agent, pinned to its host), and the last time its
    # address was re-pointed (only ever while unhealthy) and from where.
    credential_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    repointed_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    repointed_from: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # The networks its replicas' addresses may be in (CIDRs; None: its kind's default).
    replica_networks: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=now)

    __table_args__ = (
        CheckConstraint("live >= 0", name="ck_node_live"),
        CheckConstraint("capacity >= 0", name="ck_node_capacity"),
        Index("ix_nodes_place", "kind", "healthy", "draining", "live"),
        Index("ux_nodes_endpoint", "endpoint", unique=True),
    )


class Gpu(Keyed, Base):
    """One GPU on a GPU server, with its memory and AvA worker slots."""

    __tablename__ = "gpus"

    uuid: Mapped[str] = mapped_column(String(128), unique=True)
    server: Mapped[str] = mapped_column(String(255))
    mngr_addr: Mapped[str] = mapped_column(String(255))
    mem_total_mb: Mapped[int] = mapped_column(Integer)
    mem_free_mb: Mapped[int] = mapped_column(Integer)
    slots_total: Mapped[int] = mapped_column(Integer)
    slots_free: Mapped[int] = mapped_column(Integer)
    first_port: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=now)

    __table_args__ = (
        CheckConstraint("mem_free_mb >= 0 AND mem_free_mb <= mem_total_mb", name="ck_gpu_mem"),
        CheckConstraint("slots_free >= 0 AND slots_free <= slots_total", name="ck_gpu_slots"),
        Index("ix_gpus_fit", "mem_free_mb"),
    )


class Replica(Keyed, Base):
    """One VM of a function on a node, from the moment a spawn is accepted."""

    __tablename__ = "replicas"

    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    function_id: Mapped[str] = mapped_column(ForeignKey("functions.id", ondelete="CASCADE"))
    node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id"), nullable=True)
    operation_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    status: Mapped[ReplicaState] = mapped_column(StoredReplicaState, default=ReplicaState.CREATING)
    vmid: Mapped[str | None] = mapped_column(String(255), nullable=True)
    address: Mapped[str | None] = mapped_column(String(255), nullable=True)
    build_version: Mapped[str] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    envs_total: Mapped[int] = mapped_column(Integer, default=1)
    envs_in_use: Mapped[int] = mapped_column(Integer, default=0)
    gpu_id: Mapped[str | None] = mapped_column(ForeignKey("gpus.id"), nullable=True)
    gpu_slot: Mapped[int | None] = mapped_column(Integer, nullable=True)
    gpu_mem_mb: Mapped[int] = mapped_column(Integer, default=0)
    placements: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # Who may send this row's create (workers.replicas.owners): a token, and until when
    # its handler may still write (the task's hard time limit); NULL: nobody. ``sent_at``:
    # when its create was marked sent, committed right before the call (NULL: never sent
    # to the row's current node, so any handler may send it).
    owner: Mapped[str | None] = mapped_column(String(32), nullable=True)
    owner_until: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    sent_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # A maybe's operation: the one its replacement serves (workers.replicas.maybes).
    maybe_of: Mapped[str | None] = mapped_column(String(32), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=now)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=now, onupdate=now)
    ready_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    idle_since: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    reap_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    deadline_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    retired_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)

    function: Mapped[Function] = relationship(lazy="joined")
    node: Mapped[Node | None] = relationship(lazy="joined")
    gpu: Mapped[Gpu | None] = relationship(lazy="joined")

    __table_args__ = (
        CheckConstraint("envs_in_use >= 0 AND envs_in_use <= envs_total", name="ck_rep_envs"),
        Index("ix_replicas_fn_status", "function_id", "status"),
        # Claims (Idle replicas of the current build) and the reaper's stale sweep (Idle
        # replicas of any other build) are each one range of this index.
        Index("ix_replicas_claim", "function_id", "status", "build_version"),
        Index("ix_replicas_node_status", "node_id", "status"),
        Index("ix_replicas_reap", "status", "reap_at"),
        Index("ix_replicas_idle", "status", "idle_since"),
        Index("ix_replicas_deadline", "status", "deadline_at"),
        Index("ix_replicas_vmid", "vmid"),
        Index("ix_replicas_op", "operation_id"),
        Index(
            "ix_replicas_maybe_of",
            "maybe_of",
            sqlite_where=text("maybe_of IS NOT NULL"),
            postgresql_where=text("maybe_of IS NOT NULL"),
        ),
        Index(
            "ux_replicas_gpu_slot",
            "gpu_id",
            "gpu_slot",
            unique=True,
            sqlite_where=text("gpu_slot IS NOT NULL"),
            postgresql_where=text("gpu_slot IS NOT NULL"),
        ),
    )

    @property
    def state(self) -> ReplicaState:
        """The status as an enum."""
        return ReplicaState(self.status)


class Operation(Keyed, Base):
    """One producer request and its outcome."""

    __tablename__ = "operations"

    kind: Mapped[OpKind] = mapped_column(StoredOpKind(16))
    function_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    status: Mapped[OpStatus] = mapped_column(StoredOpStatus(16), default=OpStatus.PENDING)
    total: Mapped[int] = mapped_column(Integer, default=0)
    done: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=now)
    started_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # When the operation last moved (created, its task ran, a part settled), and how
    # often its task was re-sent for want of progress (workers.maintenance.redrive).
    progress_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True, default=now)
    redrives: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    __table_args__ = (
        Index("ix_operations_created", "created_at"),
        Index("ix_operations_status_progress", "status", "progress_at"),
    )


class OpPart(Base):
    """A part of an operation (a replica, or a request that never got a row) counted once.

    :func:`workers.operations.settle` writes one row per part it counts, so a part reached
    by two deliveries (or two paths) of one operation is counted done or failed only once.
    """

    __tablename__ = "op_parts"

    operation_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    part: Mapped[str] = mapped_column(String(128), primary_key=True)


class OrphanRelease(Base):
    """A VM no replica took, to be released on its node: kept until the release concludes.

    :mod:`workers.replicas.orphans` writes it where an orphan is found and ends it when the
    node released the VM (or no longer has it, or a live row took it after all).
    """

    __tablename__ = "orphan_releases"

    node_id: Mapped[str] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    vmid: Mapped[str] = mapped_column(String(128), primary_key=True)
    noted_at: Mapped[datetime] = mapped_column(DateTime, default=now)
    due_at: Mapped[datetime] = mapped_column(DateTime)  # when reconcile may release it
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (Index("ix_orphan_releases_due", "due_at"),)


class Lease(Base):
    """A named lock with an expiry: one reap or reconcile pass at a time."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime] = mapped_column(DateTime)


class Claim(Keyed, Base):
    """One execution environment of a replica, lent to one caller until released or expired."""

    __tablename__ = "claims"

    replica_id: Mapped[str] = mapped_column(ForeignKey("replicas.id", ondelete="CASCADE"))
    function_id: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=now)
    expires_at: Mapped[datetime] = mapped_column(DateTime)

    __table_args__ = (
        # A replica's oldest claim (a guest's FINISHED gives it back) and its claim count.
        Index("ix_claims_replica", "replica_id", "created_at"),
        # The reaper's expiry sweep: one range of this index.
        Index("ix_claims_expires", "expires_at"),
    )


class Call(Keyed, Base):
    """One asynchronous call: the stored request, its attempts, its outcome and its callback.

    The id (random, 128 bits) is what its caller holds: ``GET /calls/ID`` shows the call.
    ``resend_at`` is when the calls' sweep sends its message again if the call has not
    moved by then (a lost message, a worker that died mid-attempt); None once it is over.
    """

    __tablename__ = "calls"

    function: Mapped[str] = mapped_column(String(63))
    status: Mapped[CallStatus] = mapped_column(StoredCallStatus(16), default=CallStatus.QUEUED)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # The request as the gateway would forward it (workers.gateway.calls): text is latin-1.
    method: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(Text, default="")
    query: Mapped[str] = mapped_column(Text, default="")
    headers: Mapped[list[Any]] = mapped_column(JSON, default=list)
    body: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    client: Mapped[str | None] = mapped_column(String(64), nullable=True)
    scheme: Mapped[str] = mapped_column(String(8), default="http")
    trace: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # Attempts: how many started, the number the next may not reach, until when one may start.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    attempt_limit: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[datetime] = mapped_column(DateTime)
    owner: Mapped[str | None] = mapped_column(String(32), nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    next_at: Mapped[datetime] = mapped_column(DateTime, default=now)
    resend_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    redrives: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=now)
    started_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=now)
    # The last attempt's answer (None: it got none) and what went wrong, if anything.
    answer_status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    answer_headers: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    answer_body: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    answer_truncated: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # X-Callback-Url: its delivery once the call is over (pending, delivered, failed).
    callback_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    callback_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    callback_attempts: Mapped[int] = mapped_column(Integer, default=0)
    callback_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    callback_status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    callback_error: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (
        CheckConstraint("attempts >= 0 AND attempt_limit >= 1", name="ck_call_attempts"),
        # One call per key and function: the store refuses a second (no check-then-insert).
        Index("ux_calls_key", "function", "idempotency_key", unique=True),
        Index("ix_calls_status_created", "status", "created_at"),
        Index("ix_calls_function_created", "function", "created_at"),
        Index("ix_calls_resend", "resend_at"),
        Index("ix_calls_finished", "finished_at"),
        Index("ix_calls_callback", "callback_at"),
    )
