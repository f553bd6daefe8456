"""The producer's Python API: everything the ``corral`` command shows or changes.

Operations - :func:`spawn`, :func:`scale`, :func:`delete`, :func:`hogs`, :func:`reap`,
:func:`reconcile` - validate their input against the store (unknown function, bad
count, target outside [min, max] raise :class:`~workers.base.errors.InputError` and change
nothing), write an operation record, queue the task that carries it out and return the
operation id. :func:`wait` follows an operation to its end::

    from corral import api
    op = api.spawn("hello", 3)
    print(api.wait(op, timeout=60)["status"])

The rest reads and changes the store directly, as the CLI's commands do: nodes
(:func:`nodes`, :func:`add_node`, :func:`remove_node`, :func:`drain_node`), functions
(:func:`functions`, :func:`function`, :func:`deploy`, :func:`remove_function`),
replicas (:func:`replicas`, :func:`replica`), operations (:func:`operations`,
:func:`operation`), GPUs (:func:`gpus`, :func:`add_gpus`, :func:`remove_gpu`), claims
(:func:`claim`, :func:`release`), asynchronous calls (:func:`calls`, :func:`call`,
:func:`redrive_calls`, :func:`purge_calls`) and the schema (:func:`upgrade_db`,
:func:`check_db`). Results are typed mappings (``NodeView``, ``FunctionView``,
``ReplicaView``, ``OperationView``, ``GpuView``, ``ClaimView``, ``ReleaseView``,
``CallView``): plain dicts, ready for JSON.

Importing the API loads the settings and the store, and no more: ``corral nodes list``
is one query. What loads Celery (the Celery queue and the tasks, :data:`tasks.maintenance.QUEUE`:
the first operation queued; in eager mode the tasks run here), gRPC and the agent
clients (requests, CPU hogs, the reaper's checks, the GPU inventory) or Alembic
(:func:`upgrade_db`) is imported when first used (:class:`config.lazy.LazyModule`).
``tests/corral/cli/test_startup.py`` checks what each command imports.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NotRequired, TypedDict, TypeVar, cast

from sqlalchemy.orm import Session

from config.lazy import LazyModule, module_getattr
from config.settings import Settings, get_settings
from workers import dispatch
from workers.base.errors import BrokerError, InputError
from workers.base.kinds import OpKind
from workers.fleet import nodes as fleet
from workers.fleet.nodes import NodeView, node_view
from workers.functions import (
    FunctionSpec,
    FunctionView,
    function_view,
    get_function,
    list_functions,
    live_replica_ids,
    replica_counts,
)
from workers.functions import deploy as deploy_spec
from workers.functions import remove_function as remove_function_row
from workers.invocations import records as call_records
from workers.invocations.records import CallView
from workers.operations import (
    OperationView,
    create_operation,
    get_operation,
    list_operations,
    operation_view,
)
from workers.replicas.views import (
    ReplicaView,
    get_replica,
    list_replicas,
    maybes_of,
    replica_view,
)
from workers.store.db import Database, get_database
from workers.store.models import OP_FINISHED, Operation
from workers.store.revisions import check_schema, safe_url

if TYPE_CHECKING:
    import redis

    from tasks import invocations, maintenance
    from workers.autoscale import idletimes
    from workers.base import redis_client as redis_clients
    from workers.fleet import gpus as gpu_inventory
    from workers.fleet import hogs as fleet_hogs
    from workers.fleet.gpus import GpuView
    from workers.invocations import stats as call_stats
    from workers.maintenance import audit as counters
    from workers.maintenance import reaper, redrive
    from workers.maintenance.audit import Audit
    from workers.maintenance.redrive import RESENDABLE, Redrive
    from workers.replicas import claims, coldstarts, requests
    from workers.store import migrate
else:
    # Celery; the agent clients and gRPC; Alembic; Redis; what one group of calls needs
    redis = LazyModule("redis")
    maintenance = LazyModule("tasks.maintenance")
    invocations = LazyModule("tasks.invocations")
    call_stats = LazyModule("workers.invocations.stats")
    redis_clients = LazyModule("workers.base.redis_client")
    idletimes = LazyModule("workers.autoscale.idletimes")
    gpu_inventory = LazyModule("workers.fleet.gpus")
    fleet_hogs = LazyModule("workers.fleet.hogs")
    counters = LazyModule("workers.maintenance.audit")
    reaper = LazyModule("workers.maintenance.reaper")
    redrive = LazyModule("workers.maintenance.redrive")
    claims = LazyModule("workers.replicas.claims")
    coldstarts = LazyModule("workers.replicas.coldstarts")
    requests = LazyModule("workers.replicas.requests")
    migrate = LazyModule("workers.store.migrate")
    # Names the API exports from modules it imports when first used (mypy sees the imports
    # above: the names are typed, and a misspelt one is an error, not Any).
    __getattr__ = module_getattr(
        __name__,
        {
            "GpuView": "workers.fleet.gpus:GpuView",
            "Audit": "workers.maintenance.audit:Audit",
            "RESENDABLE": "workers.maintenance.redrive:RESENDABLE",
        },
    )


__all__ = [
    "RESENDABLE",
    "Audit",
    "BrokerError",
    "CallView",
    "ClaimView",
    "FunctionView",
    "GpuView",
    "Migration",
    "NodeView",
    "OperationView",
    "ReleaseView",
    "ReplicaView",
    "Saved",
    "add_gpus",
    "add_node",
    "call",
    "calls",
    "check_db",
    "check_id",
    "claim",
    "database",
    "delete",
    "deploy",
    "drain_node",
    "function",
    "functions",
    "gpus",
    "hogs",
    "nodes",
    "operation",
    "operations",
    "purge_calls",
    "reap",
    "reconcile",
    "redrive_calls",
    "release",
    "remove_function",
    "remove_gpu",
    "remove_node",
    "replica",
    "replicas",
    "resend",
    "scale",
    "spawn",
    "suspect",
    "upgrade_db",
    "wait",
]

MAX_COLD_START_S = 3600.0

V = TypeVar("V")
_checked: set[str] = set()


@dataclass(frozen=True)
class Saved(Generic[V]):
    """What an add or deploy wrote: the row as shown, and whether it is new."""

    view: V
    created: bool


class Migration(TypedDict):
    """What :func:`upgrade_db` did: the database (password hidden), revisions before and after."""

    database: str
    before: str | None
    after: str


class ClaimView(TypedDict):
    """One execution environment lent by :func:`claim`, and where to send the request."""

    claim_id: str
    replica_id: str
    address: str | None
    vmid: str | None
    function: str
    expires_at: str  # ISO 8601 UTC
    waited_s: float  # how long the claim waited for a replica
    spawned: list[str]  # the spawn operations this claim asked for


class ReleaseView(TypedDict):
    """What :func:`release` did; ``released`` False: the claim was not held (``detail`` says)."""

    claim_id: str
    released: bool
    detail: NotRequired[str]
    replica_id: NotRequired[str]
    function: NotRequired[str]
    status: NotRequired[str]
    envs_in_use: NotRequired[int]
    envs_total: NotRequired[int]


def database(settings: Settings | None = None) -> Database:
    """The store, checked once per process to be migrated."""
    settings = settings or get_settings()
    db = get_database(settings.database_url)
    if db.url not in _checked:
        check_schema(db)
        _checked.add(db.url)
    return db


def check_id(value: str, what: str) -> str:
    """A row id (32 hex characters), or a clear :class:`InputError`."""
    if not isinstance(value, str) or len(value) != 32 or not value.isalnum():
        raise InputError(f"malformed {what} id {value!r}: expected 32 hex characters")
    return value


def resend(redrive: Redrive) -> None:
    """Send the first task of an operation that stopped moving again (see maintenance.redrive)."""
    maintenance.QUEUE.send(redrive.work)


def _submit(db: Database, write: Callable[[Session], Operation]) -> str:
    """Write an operation and queue its first task (:func:`workers.dispatch.submit`); its id."""
    return dispatch.submit(db, maintenance.QUEUE, write)


def _enqueue(db: Database, op: Operation) -> str:
    """Queue the first task of an operation already written; its id."""
    return dispatch.enqueue(db, maintenance.QUEUE, op)


# -- the schema --------------------------------------------------------------------------------


def upgrade_db(*, settings: Settings | None = None) -> Migration:
    """Migrate the database to the newest schema."""
    settings = settings or get_settings()
    before, after = migrate.upgrade(get_database(settings.database_url))
    return {"database": safe_url(settings.database_url), "before": before, "after": after}


def check_db(*, fix: bool = False, settings: Settings | None = None) -> Audit:
    """Recount node, function and GPU counters from the replica rows (and with ``fix`` set them)."""
    with database(settings).transaction() as s:
        return counters.audit(s, fix=fix)


# -- operations --------------------------------------------------------------------------------


def spawn(function: str, count: int = 1, *, settings: Settings | None = None) -> str:
    """Ask for ``count`` more replicas of ``function``; returns the operation id."""
    return _submit(database(settings), lambda s: requests.request_spawn(s, function, count))


def scale(function: str, target: int, *, settings: Settings | None = None) -> str:
    """Set ``function``'s replica target; returns the operation id."""
    return _submit(database(settings), lambda s: requests.request_scale(s, function, target))


def delete(replica_id: str, *, settings: Settings | None = None) -> str:
    """Delete one replica; returns the operation id."""
    db = database(settings)
    check_id(replica_id, "replica")
    return _submit(db, lambda s: requests.request_delete(s, replica_id))


def hogs(action: str, n: int, node: str | None = None, *, settings: Settings | None = None) -> str:
    """Start or stop ``n`` CPU hogs on ``node`` (default: all healthy agents); returns the op id."""
    db = database(settings)
    action, n = fleet_hogs.check_hogs(action, n)

    def write(s: Session) -> Operation:
        fleet_hogs.hog_targets(s, node)  # unknown node, Lambdo host, no healthy agent: refuse
        return create_operation(s, OpKind.HOGS, {"action": action, "n": n, "node": node})

    return _submit(db, write)


def reap(idle_timeout: float | None = None, *, settings: Settings | None = None) -> str:
    """Ask for one reaper pass (optionally with an idle-timeout override); returns the op id."""
    db = database(settings)
    idle_timeout = reaper.check_idle_timeout(idle_timeout)
    return _submit(db, lambda s: create_operation(s, OpKind.REAP, {"idle_timeout": idle_timeout}))


def reconcile(*, settings: Settings | None = None) -> str:
    """Ask for one reconcile pass now; returns the operation id."""
    return _submit(database(settings), lambda s: create_operation(s, OpKind.RECONCILE, {}))


def operation(op_id: str, *, settings: Settings | None = None) -> OperationView:
    """The operation's current record, with what became of its maybes."""
    with database(settings).read() as s:
        op = get_operation(s, op_id)
        return operation_view(op, maybes_of(s, op.id))


def operations(limit: int = 50, *, settings: Settings | None = None) -> list[OperationView]:
    """The newest ``limit`` operations, newest first."""
    with database(settings).read() as s:
        return [operation_view(o) for o in list_operations(s, limit)]


WAIT_POLL_MAX_S = 0.2  # wait() reads the operation at least this often


def wait(
    op_id: str,
    *,
    timeout: float = 120.0,
    poll: float = 0.05,
    settings: Settings | None = None,
    progress: Callable[[OperationView], None] | None = None,
) -> OperationView:
    """Block until the operation finishes (or ``timeout``); returns its record."""
    deadline = time.monotonic() + timeout
    delay = poll
    while True:
        view = operation(op_id, settings=settings)
        if progress is not None:
            progress(view)
        if view["status"] in OP_FINISHED:
            return view
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"operation {op_id} still {view['status']} after {timeout:g}s "
                f"({view['done']} done, {view['failed']} failed of {view['total']})"
            )
        time.sleep(delay)
        # Backing off, but not past WAIT_POLL_MAX_S: a spawn of slow VMs ends within a
        # second or two, and a long last sleep would add most of that again.
        delay = min(delay * 1.5, WAIT_POLL_MAX_S)


# -- nodes -------------------------------------------------------------------------------------


def nodes(*, settings: Settings | None = None) -> list[NodeView]:
    """Every node, by name."""
    with database(settings).read() as s:
        return [node_view(n) for n in fleet.list_nodes(s)]


def add_node(  # noqa: PLR0913 - keyword-only options with defaults
    address: str,
    *,
    name: str | None = None,
    kind: str = "fcdaemon",
    capacity: int | None = None,
    replica_networks: list[str] | None = None,
    settings: Settings | None = None,
) -> Saved[NodeView]:
    """Add (or update, by name) a node agent or Lambdo host.

    A host name in ``address`` is resolved now, once: the node is stored at the IP (the
    view's ``resolved_from`` names the host). ``replica_networks`` (CIDRs): where its
    replicas' addresses may be (None: unchanged; a new node gets its kind's default).
    """
    settings = settings or get_settings()
    resolved, host = fleet.resolve_address(address, kind)
    with database(settings).transaction() as s:
        node, created = fleet.upsert_node(
            s,
            resolved,
            name=name or fleet.default_name(fleet.normalize_address(address, kind)),
            kind=kind,
            capacity=capacity,
            default_capacity=settings.node_capacity,
            replica_networks=replica_networks,
        )
        view = node_view(node)
    if host is not None:
        view["resolved_from"] = host
    return Saved(view, created)


def remove_node(name: str, *, settings: Settings | None = None) -> None:
    """Remove a node that runs nothing."""
    with database(settings).transaction() as s:
        fleet.remove_node(s, name)


def drain_node(name: str, *, undo: bool = False, settings: Settings | None = None) -> None:
    """Stop placing replicas on a node (``undo``: accept them again)."""
    with database(settings).transaction() as s:
        fleet.drain_node(s, name, draining=not undo)


# -- functions ---------------------------------------------------------------------------------


def functions(*, settings: Settings | None = None) -> list[FunctionView]:
    """Every function, by name, with its live replicas by state and their sum (``live``)."""
    with database(settings).read() as s:
        counts = replica_counts(s)
        views = [function_view(f, counts.get(f.id, {})) for f in list_functions(s)]
    for view in views:
        view["live"] = sum(counts.get(view["id"], {}).values())
    return views


def function(name: str, *, secrets: bool = False, settings: Settings | None = None) -> FunctionView:
    """One function, with its live replicas by state (and its keep-alive windows, if adaptive).

    Env values and ``--env=`` kernel arguments are masked unless ``secrets``.
    """
    settings = settings or get_settings()
    with database(settings).read() as s:
        fn = get_function(s, name)
        view = function_view(fn, replica_counts(s, fn.id).get(fn.id, {}), secrets=secrets)
    if view["keep_alive"] == "adaptive":
        view["keep_alive_windows"] = _keep_alive_windows(settings, name)
    return view


def _keep_alive_windows(settings: Settings, name: str) -> dict[str, Any]:
    """What the function's recorded idle times say now, for ``functions show``."""
    client = redis_clients.redis_client(settings.broker_url)
    if client is None:
        return {"mode": "fixed", "reason": "no Redis broker: no idle times are recorded"}
    try:
        plan = idletimes.plans(client, settings, [name])[name]
    except redis.RedisError as exc:
        return {"mode": "unknown", "reason": f"Redis did not answer: {exc}"}
    now = time.time()
    return {
        **plan.windows.as_dict(),
        "last_activity_s_ago": None if plan.last is None else round(now - plan.last, 1),
        "warm_now": plan.warm(now),
    }


def deploy(spec: FunctionSpec, *, settings: Settings | None = None) -> Saved[FunctionView]:
    """Create or update a function (a new build: older replicas become stale)."""
    settings = settings or get_settings()
    with database(settings).transaction() as s:
        fn, created = deploy_spec(s, spec, settings)
        return Saved(function_view(fn), created)


def remove_function(
    name: str, *, force: bool = False, timeout: float = 120.0, settings: Settings | None = None
) -> int:
    """Remove a function; with ``force`` delete its replicas first. How many were deleted."""
    db = database(settings)
    with db.read() as s:
        live = live_replica_ids(s, get_function(s, name))
    if live and not force:
        raise InputError(
            f"function {name!r} has {len(live)} replica(s); delete them or use --force"
        )
    for op_id in [delete(rid, settings=settings) for rid in live]:
        view = wait(op_id, timeout=timeout, settings=settings)
        if view["status"] != "succeeded":
            raise InputError(f"could not delete a replica of {name}: {view['error']}")
    with db.transaction() as s:
        if not remove_function_row(s, name):
            raise InputError(f"function {name!r} gained a replica meanwhile; try again")
    client = redis_clients.redis_client((settings or get_settings()).broker_url)
    if client is not None:
        with contextlib.suppress(redis.RedisError):  # then it expires by itself (30 days)
            idletimes.forget(client, name)
    return len(live)


# -- replicas ----------------------------------------------------------------------------------


def replicas(
    function: str | None = None, *, all: bool = False, settings: Settings | None = None
) -> list[ReplicaView]:
    """Live replicas, oldest first (``all``: dead and deleted too), of one function if named."""
    with database(settings).read() as s:
        function_id = get_function(s, function).id if function else None
        return [replica_view(r) for r in list_replicas(s, function_id, include_retired=all)]


def replica(replica_id: str, *, settings: Settings | None = None) -> ReplicaView:
    """One replica."""
    with database(settings).read() as s:
        return replica_view(get_replica(s, check_id(replica_id, "replica")))


# -- GPUs --------------------------------------------------------------------------------------


def gpus(*, settings: Settings | None = None) -> list[GpuView]:
    """Every recorded GPU with the memory and slots replicas hold, by server and port."""
    with database(settings).read() as s:
        return [gpu_inventory.gpu_view(g) for g in gpu_inventory.list_gpus(s)]


def add_gpus(
    address: str, *, manager: str | None = None, settings: Settings | None = None
) -> list[GpuView]:
    """Record (or refresh) the GPUs a GPU server's AvA manager reports; they, by port."""
    settings = settings or get_settings()
    found = gpu_inventory.add_gpu_server(database(settings), settings, address, mngr_addr=manager)
    return [gpu_inventory.gpu_view(g) for g in found]


def remove_gpu(uuid: str, *, settings: Settings | None = None) -> None:
    """Forget a GPU no live replica uses (:class:`InputError` while one does)."""
    with database(settings).transaction() as s:
        gpu_inventory.remove_gpu(s, uuid)


# -- claims ------------------------------------------------------------------------------------


def claim(
    function: str,
    *,
    cold_start_timeout: float = 0.0,
    ttl: float | None = None,
    settings: Settings | None = None,
) -> ClaimView:
    """Take one execution environment of an Idle replica of ``function``, as a lease.

    Returns the claim (``claim_id``, ``replica_id``, ``address``, ``expires_at``, ...): give it
    back with :func:`release`; unreleased, the reaper gives it back after ``ttl`` seconds
    (default ``CORRAL_CLAIM_TTL_S``). With nothing Idle and ``cold_start_timeout > 0``,
    wait up to that many seconds for a new replica: concurrent waiters of one function
    share spawns (a spawn is asked for only while waiters outnumber the environments
    already on their way).
    """
    settings = settings or get_settings()
    _check_cold_start_timeout(cold_start_timeout)
    called = time.time()
    db = database(settings)
    attempt = coldstarts.ClaimAttempt(
        db,
        settings,
        function,
        cold_start_timeout=cold_start_timeout,
        ttl_s=ttl,
        queue=lambda op: _enqueue(db, op),
    )
    try:
        while True:
            got = attempt.step()
            if isinstance(got, claims.Claimed):
                _invocation(settings, got.function, idletimes.Activity(arrivals=[called]))
                return cast(
                    ClaimView,
                    {
                        **got.as_dict(),
                        "waited_s": round(attempt.waited_s, 3),
                        "spawned": attempt.spawned,
                    },
                )
            time.sleep(got)
    finally:
        attempt.close()


def _check_cold_start_timeout(value: object) -> None:
    """Refuse a cold-start timeout that is not a number of seconds in [0, MAX_COLD_START_S]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"cold-start timeout must be a number, got {value!r}")
    if not 0 <= value <= MAX_COLD_START_S:
        raise InputError(
            f"cold-start timeout must be between 0 and {MAX_COLD_START_S:g}s, got {value!r}"
        )


def release(claim_id: str, *, settings: Settings | None = None) -> ReleaseView:
    """Give back exactly the environment a claim holds (``released`` False: it was not held)."""
    settings = settings or get_settings()
    released = claims.release(database(settings), settings, check_id(claim_id, "claim"))
    if released["released"]:
        _invocation(settings, released["function"], idletimes.Activity(last=time.time()))
    return cast(ReleaseView, released)


def _invocation(settings: Settings, function: str, seen: idletimes.Activity) -> None:
    """A claim is an invocation's start, its release the end: for the keep-alive histograms."""
    idletimes.record_quietly(
        redis_clients.redis_client(settings.broker_url),
        idletimes.Shape.from_settings(settings),
        {function: seen},
    )


def suspect(claim_id: str, reason: str, *, settings: Settings | None = None) -> str | None:
    """Give back a claim whose replica failed to answer and delete that replica; the op id."""
    db = database(settings)
    op = claims.suspect(db, settings or get_settings(), check_id(claim_id, "claim"), reason)
    return _enqueue(db, op) if op is not None else None


# -- asynchronous calls --------------------------------------------------------------------


def calls(
    function: str | None = None,
    *,
    status: str | None = None,
    limit: int = 50,
    settings: Settings | None = None,
) -> list[CallView]:
    """Asynchronous calls, newest first (of one function, in one status)."""
    with database(settings).read() as s:
        found = call_records.list_calls(s, function=function, status=status, limit=limit)
        return [call_records.call_view(c) for c in found]


def call(call_id: str, *, settings: Settings | None = None) -> CallView:
    """One asynchronous call, with its stored answer (``answer``)."""
    with database(settings).read() as s:
        return call_records.call_view(call_records.get_call(s, call_id), answer=True)


def redrive_calls(
    ids: list[str] | None = None,
    *,
    function: str | None = None,
    every: bool = False,
    settings: Settings | None = None,
) -> list[str]:
    """Queue dead calls again - these ``ids``, those of ``function``, or ``every`` one; their ids.

    Each keeps its id and gets a fresh budget of attempts and age from its function.
    """
    if not ids and function is None and not every:
        raise InputError("name the calls to redrive: their ids, --function NAME or --all")
    settings = settings or get_settings()
    redriven = call_records.redrive(
        database(settings), settings, ids or (), function=function, limit=100_000
    )
    counters = redis_clients.redis_client(settings.broker_url)
    for call_id in redriven:
        invocations.CALLS.send(call_id)  # a send that fails: the sweep sends it
    if redriven and counters is not None:
        with contextlib.suppress(redis.RedisError):
            call_stats.count(counters, "redriven", len(redriven))
    return redriven


def purge_calls(older_than: float | None = None, *, settings: Settings | None = None) -> int:
    """Delete finished calls that finished ``older_than`` seconds ago (default
    ``CORRAL_CALLS_KEEP_S``); how many."""
    settings = settings or get_settings()
    return call_records.purge(database(settings), settings, older_than_s=older_than)
