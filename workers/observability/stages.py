"""A cold start, stage by stage: what each stage measures, who times it, where it goes.

The model
---------
A request that finds no Idle replica waits for one to be made. Its time splits into
stages, in the order it passes them (each ends where the next begins):

============  =======================================================================  ========
stage         from -> to                                                               timed by
============  =======================================================================  ========
ask           the claim finds nothing Idle -> its spawn is asked for (operation            gateway
              written, task sent)
queue         the task message sent -> its task starts in a worker process (the            worker
              broker, the worker's pickup)
plan          the task's first transaction (the spawn's request ids fixed)                worker
placement     -> the create sent: the replica's row written Creating on a reserved         worker
              node, owned by the task (:mod:`workers.replicas.owners`)
agent_call    CreateReplica sent -> answered                                               worker
record        answered -> the VM recorded (the replica Idle, or Starting)                  worker
ready         the VM recorded -> the guest's READY applied (guest readiness; 0 when        registry
              the READY came first)
claim         the replica ready -> the waiting request's claim served                      gateway
first_byte    claimed -> the first byte of the replica's answer passed on                  gateway
============  =======================================================================  ========

"worker" is the spawn's task, wherever it runs: a Celery worker, or the gateway itself
for a cold start it waits for (:class:`workers.dispatch.TaskQueue`, ``run_here``).

Where they go:

* a spawn operation (or a scale that spawns) stores its first replica's worker and
  registry stages on the operation: ``result.stages`` (``corral ops OP --json``), with
  ``result.timed`` (that replica, and when its VM was recorded on the store's clock: the
  READY's start) and, when tracing is on, ``result.trace`` (the task's span context,
  the READY span's parent);
* every stage is observed in the histogram ``corral_cold_start_stage_seconds{stage}``:
  the gateway's in its own ``/metrics``; the spawn's (wherever it ran: a worker, or the
  gateway itself) and the registry's in one Redis hash (:data:`KEY`) that every process
  adds to and ``corral metrics`` serves
  (:func:`histogram`), as ``corral_reaped_total`` is kept;
* with tracing on (:mod:`workers.observability.tracing`), each is a span too.

How each VM started, where its node says (a ``qemu`` agent: ``boot`` for a cold boot,
``restore`` from a snapshot; ``CreateReply.start``), is stored on its operation as
``result.starts`` (replica id -> how), for every replica of the operation
(:func:`vm_starts`), beside the stages of the first.

A task times its spawn with :func:`timing` (the timer is the task thread's current one,
so the code that sends creates and records VMs marks it without being handed it) and
marks it at each step; when the task ends, the timer's spans are recorded and its stages
observed, once: a second delivery of the task finds the stages stored and observes
nothing again. Times within one process are ``time.monotonic``; across processes
(queue, ready, claim) the store's clock (:mod:`workers.base.clock`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import redis
from sqlalchemy.orm import Session

from workers.base import timelimits
from workers.base.clock import now
from workers.base.redis_client import TIMEOUT_S
from workers.observability import metric_catalog as catalog
from workers.observability import tracing
from workers.store.models import Operation, Replica

log = logging.getLogger(__name__)

STAGES = (
    "ask",
    "queue",
    "plan",
    "placement",
    "agent_call",
    "record",
    "ready",
    "claim",
    "first_byte",
)
#: Bucket bounds (seconds) of ``corral_cold_start_stage_seconds``, everywhere it is served.
BUCKETS = catalog.STAGE_BUCKETS
METRIC = catalog.COLD_START_STAGE_SECONDS.name
KEY = "corral:cold_start_stages"  # Redis hash: "<stage>|<le>" counts, "<stage>|sum"
SENT_HEADER = "corral_sent_at"  # a first task's message: when it was sent (store clock, epoch s)
SPAN_NAMES = {
    "placement": "spawn.placement",
    "agent_call": "agent.create",
    "record": "spawn.record",
    "ready": "replica.ready",
}


def sent_header() -> dict[str, float]:
    """The header a first task's message carries: when it was sent, on the store's clock."""
    return {SENT_HEADER: now().timestamp()}


@dataclass
class _Call:
    """One create this task sent: its node, when it went out and when it was answered."""

    node: str
    sent: float
    answered: float | None = None


@dataclass
class SpawnTimer:
    """The stages of one spawn task, marked as it runs; stored and observed once, at its end."""

    op_id: str
    started: float = field(default_factory=time.monotonic)
    started_ns: int = field(default_factory=time.time_ns)
    queue: float | None = None
    planned: float | None = None
    calls: dict[str, _Call] = field(default_factory=dict)  # request id -> its create
    first: str | None = None  # the request whose VM was recorded first
    recorded: float | None = None
    stages: dict[str, float] = field(default_factory=dict)  # stored on the operation
    context: Any = None  # the task's span context (tracing on)

    def mark_planned(self) -> None:
        """The spawn's plan is fixed (its first transaction committed)."""
        self.planned = time.monotonic()

    def sent(self, request_id: str, node: str) -> None:
        """A create goes out now."""
        self.calls[request_id] = _Call(node, time.monotonic())

    def answered(self, request_id: str) -> None:
        """A create was answered (a VM, or an error) now."""
        call = self.calls.get(request_id)
        if call is not None and call.answered is None:
            call.answered = time.monotonic()

    def measured(self) -> dict[str, float]:
        """The stages of the first recorded VM, once it is recorded (seconds)."""
        call = self.calls.get(self.first or "")
        if call is None or call.answered is None or self.recorded is None:
            return {}
        planned = self.planned or self.started
        out = {
            "queue": self.queue,
            "plan": planned - self.started,
            "placement": call.sent - planned,
            "agent_call": call.answered - call.sent,
            "record": self.recorded - call.answered,
        }
        return {k: round(max(0.0, v), 6) for k, v in out.items() if v is not None}

    def spans(self) -> None:
        """Record the task's stages as spans under its own (tracing on)."""
        if self.context is None:
            return
        planned = self.planned or self.started
        t0_ns = self.started_ns + int((planned - self.started) * 1e9)
        first = min((c.sent for c in self.calls.values()), default=None)
        if first is not None:
            tracing.record_between(
                "spawn.placement",
                t0_ns,
                _ns(self, first),
                parent=self.context,
                attributes={"corral.op_id": self.op_id},
            )
        for request_id, call in self.calls.items():
            if call.answered is not None:
                tracing.record_between(
                    "agent.create",
                    _ns(self, call.sent),
                    _ns(self, call.answered),
                    parent=self.context,
                    kind="client",
                    attributes={
                        "rpc.method": "CreateReplica",
                        "corral.node": call.node,
                        "corral.request_id": request_id,
                    },
                )
        first_call = self.calls.get(self.first or "")
        if first_call is not None and first_call.answered is not None and self.recorded is not None:
            tracing.record_between(
                "spawn.record",
                _ns(self, first_call.answered),
                _ns(self, self.recorded),
                parent=self.context,
                attributes={"corral.request_id": self.first or ""},
            )


def _ns(timer: SpawnTimer, at: float) -> int:
    """A monotonic reading of the timer's process as wall-clock nanoseconds."""
    return timer.started_ns + int((at - timer.started) * 1e9)


_current: contextvars.ContextVar[SpawnTimer | None] = contextvars.ContextVar(
    "corral_spawn_timer", default=None
)


def current() -> SpawnTimer | None:
    """The spawn timer of the task this thread runs (None outside a timed task)."""
    return _current.get()


@contextlib.contextmanager
def timing(op_id: str, sent_at: object, client: redis.Redis | None) -> Iterator[SpawnTimer]:
    """Time the spawn task of ``op_id`` (``sent_at``: its message's :data:`SENT_HEADER`).

    On the way out the stages it stored are observed (``client``: the Redis to count them
    in) and recorded as spans.
    """
    timer = SpawnTimer(op_id, context=tracing.current())
    if isinstance(sent_at, int | float) and not isinstance(sent_at, bool):
        timer.queue = now().timestamp() - float(sent_at)
    token = _current.set(timer)
    try:
        yield timer
    finally:
        _current.reset(token)
        if timer.stages:
            observe_quietly(client, timer.stages)
            timer.spans()


def recorded(session: Session, op_id: str | None, replica_id: str, request_id: str) -> None:
    """A VM was recorded for a replica in this transaction: store its op's stages, once.

    Does nothing outside a timed task, for another operation's replica, or when the
    operation holds stages already (an earlier delivery stored them).
    """
    timer = _current.get()
    if timer is None or op_id != timer.op_id or timer.first is not None:
        return
    timer.first, timer.recorded = request_id, time.monotonic()
    stages = timer.measured()
    op = session.get(Operation, op_id, with_for_update=True)
    if not stages or op is None or (op.result or {}).get("stages"):
        return
    extra: dict[str, Any] = {
        "stages": stages,
        "timed": {"replica": replica_id, "recorded_at": now().isoformat()},
    }
    if (carried := tracing.carrier_of(timer.context)) is not None:
        extra["trace"] = carried
    op.result = {**(op.result or {}), **extra}
    session.flush()
    timer.stages = stages


#: Most entries an operation's ``result.starts`` holds (a spawn of thousands keeps the first).
MAX_STARTS = 1000


def vm_starts(session: Session, op_id: str, starts: Mapping[str, str]) -> None:
    """Store how VMs of an operation started (replica id -> "boot" / "restore") on it."""
    if not starts:
        return
    op = session.get(Operation, op_id, with_for_update=True)
    if op is None:
        return
    result = op.result or {}
    have = dict(result.get("starts") or {})
    for replica_id, how in starts.items():
        if len(have) >= MAX_STARTS:
            break
        have[replica_id] = how
    op.result = {**result, "starts": have}
    session.flush()


@dataclass(frozen=True)
class Ready:
    """The READY stage of one spawn, to observe once its transaction has committed."""

    seconds: float
    trace: Any  # the spawn task's stored context (tracing.context_of)
    at_ns: int = field(default_factory=time.time_ns)  # when the READY was applied

    def observe(self, client: redis.Redis | None) -> None:
        """Count it in the histogram and record its span (tracing on)."""
        tracing.record_between(
            "replica.ready",
            self.at_ns - int(self.seconds * 1e9),
            self.at_ns,
            parent=tracing.context_of(self.trace),
        )
        observe_quietly(client, {"ready": self.seconds})


def ready(session: Session, replica: Replica, *, early: bool = False) -> Ready | None:
    """The guest's READY for ``replica`` is applied in this transaction: its ``ready`` stage.

    When the replica is the one its operation timed, adds ``ready`` to the operation's
    stages (seconds since its VM was recorded; 0 with ``early``: the READY came first)
    and returns it, to observe after the commit; otherwise None.
    """
    if not replica.operation_id:
        return None
    op = session.get(Operation, replica.operation_id, with_for_update=True)
    result = (op.result or {}) if op is not None else {}
    stages, timed = result.get("stages"), result.get("timed")
    if (
        op is None
        or not isinstance(stages, dict)
        or "ready" in stages
        or not isinstance(timed, dict)
        or timed.get("replica") != replica.id
    ):
        return None
    try:
        recorded_at = datetime.fromisoformat(str(timed.get("recorded_at")))
    except ValueError:
        return None
    seconds = 0.0 if early else max(0.0, (now() - recorded_at).total_seconds())
    op.result = {**result, "stages": {**stages, "ready": round(seconds, 6)}}
    session.flush()
    return Ready(seconds, result.get("trace"))


# -- the histogram -----------------------------------------------------------------------------


def _name(bound: float) -> str:
    """A bucket's field name in the hash: its upper bound."""
    return "+Inf" if bound == float("inf") else repr(bound)


def _bucket(seconds: float) -> str:
    """The (non-cumulative) bucket a value falls in, named by its upper bound."""
    return _name(next((bound for bound in BUCKETS if seconds <= bound), float("inf")))


def observe(client: redis.Redis, stages: Mapping[str, float]) -> None:
    """Add one observation per stage to the shared histogram, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for stage, seconds in stages.items():
        if stage in STAGES:
            pipe.hincrby(KEY, f"{stage}|{_bucket(seconds)}", 1)
            pipe.hincrbyfloat(KEY, f"{stage}|sum", seconds)
    pipe.execute()


def observe_quietly(client: redis.Redis | None, stages: Mapping[str, float]) -> None:
    """:func:`observe`, where a statistic is not worth failing the caller over.

    Nor worth a task's hard limit: a task with less time left than Redis may take to
    answer (:data:`~workers.base.redis_client.TIMEOUT_S`, to connect and to answer) does
    without it.
    """
    if client is None or not stages:
        return
    left = timelimits.hard_left()
    if left is not None and left < 2 * TIMEOUT_S:
        log.debug("cold-start stages not counted: %.1fs left before the hard limit", left)
        return
    try:
        observe(client, stages)
    except redis.RedisError as exc:  # Redis away: these observations are lost, nothing else
        log.debug("could not count cold-start stages: %s", exc)


def histogram(raw: Mapping[Any, Any]) -> dict[str, tuple[list[tuple[float, float]], float]]:
    """The shared hash as cumulative buckets (bound, count) and a sum, per stage seen."""
    counts: dict[str, dict[str, float]] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else key
        stage, _, field_name = name.partition("|")
        if stage not in STAGES:
            continue
        try:
            counts.setdefault(stage, {})[field_name] = float(value)
        except ValueError:
            continue
    out = {}
    for stage in STAGES:
        got = counts.get(stage)
        if not got:
            continue
        total, buckets = 0.0, []
        for bound in (*BUCKETS, float("inf")):
            total += got.get(_name(bound), 0.0)
            buckets.append((bound, total))
        out[stage] = (buckets, got.get("sum", 0.0))
    return out
