"""Typed settings read from ``CORRAL_*`` environment variables.

Precedence, highest first: the process environment, the state file of a running
``corral up`` stack in the working directory (``.corral/stack.json``, or the
directory named by ``CORRAL_STATE_DIR``), then the defaults below. A setting that
does not parse fails at start with a :class:`ConfigError` naming the variable; the
message never shows a secret setting's value nor a password inside a URL.

A token, key or password is a secret: wherever the settings are shown (printed,
dumped as JSON, in an error) its value is masked.

The state file is trusted only if it is owned by the current user and writable by
nobody else: it names the database and broker every command then talks to, so a
file another user could plant or edit would redirect this user's commands.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import stat
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from config.processes import pid_exists
from config.redact import redact

ENV_PREFIX = "CORRAL_"
MAX_KEEPALIVE_BINS = 10_000
MAX_DEFAULT_STATEMENT_S = 20.0
STACK_FILE = "stack.json"


# The kinds of setting most knobs are: each states its check once.
Seconds = Annotated[float, Field(gt=0)]
"""A duration that must be positive."""
SecondsOrZero = Annotated[float, Field(ge=0)]
"""A duration that may be 0 (no grace, no wait, or a guard turned off)."""
Port = Annotated[int, Field(ge=1, le=65535)]
"""A TCP port."""
Count = Annotated[int, Field(ge=1)]
"""A number of things or tries, at least one."""


class ConfigError(Exception):
    """A setting is missing or malformed; the message names the variable."""


def reveal(secret: SecretStr | None) -> str | None:
    """A secret setting's value for the one call that sends it; None when unset or empty."""
    if secret is None:
        return None
    return secret.get_secret_value() or None


def is_secret(info: FieldInfo) -> bool:
    """True if a setting holds a secret: it is declared a :class:`~pydantic.SecretStr`."""
    return info.annotation is SecretStr or SecretStr in get_args(info.annotation)


class _Group(BaseModel):
    """A group of settings, one section of the reference.

    Each field is described by the string on the line below it, which
    :mod:`config.docs` reads from the group's source when it writes the reference (not
    pydantic's ``use_attribute_docstrings``, which would parse the source of every group
    at every import of the settings). A secret is a
    :class:`~pydantic.SecretStr`, shown masked in every dump of the settings (``repr``,
    ``model_dump``, JSON, a validation error); its reader takes the value with
    :func:`reveal` where it hands it on.
    """


class _Places(_Group):
    """Where things are: the state directory, the store, the broker, the registry.

    ``corral up`` fills in the database and broker URLs (its own SQLite file and
    embedded Redis) when they are not set, and publishes them for the CLI in its
    state file.
    """

    state_dir: Path = Path(".corral")
    """Where ``corral up`` keeps its state (``stack.json``, logs, the SQLite file, Redis's data)."""
    database_url: str = "sqlite:///corral.sqlite"
    """The store: ``sqlite:///PATH`` (WAL mode) or ``postgresql+psycopg://USER:PASSWORD@HOST/DB``."""
    broker_url: str = "redis://localhost:6379/0"
    """The Celery broker (Redis; ``corral up`` starts its own when this is unset)."""
    result_backend: str | None = None
    """The Celery result backend; unset: the broker's Redis (corral itself stores no results)."""
    eager: bool = False
    """Run tasks in the calling process instead of queueing them (tests, one-shot scripts)."""
    registry_listen: str = "127.0.0.1:50052"
    """Where ``corral registry`` listens; off loopback it needs ``CORRAL_REGISTRY_TOKEN``."""
    ready_grace_s: SecondsOrZero = 2.0
    """How long past the create timeout an early READY (its vmid not yet recorded) is kept."""


class _Reliability(_Group):
    """Reliability: task time limits, retries, broker redelivery."""

    task_soft_time_limit_s: Seconds = 60.0
    """A task's soft time limit: past it the task stops at its next agent call or transaction;
    below the hard limit."""
    task_time_limit_s: Seconds = 90.0
    """A task's hard time limit: its process is killed (a thread pool's by ``corral worker``)."""
    worker_pool: Literal["threads", "prefork"] = "threads"
    """The pool ``corral worker`` runs tasks in, unless ``-P`` says otherwise."""
    worker_concurrency: int = Field(8, ge=1, le=256)
    """Tasks one worker runs at once (threads, or prefork processes), unless ``-c`` says."""
    visibility_timeout_s: int = Field(300, gt=0)
    """Seconds before Redis hands an unacknowledged message on again; above the hard limit."""
    broker_poll_s: float = Field(1.0, gt=0, le=10)
    """How long an idle worker's wait for a message (Redis BRPOP) lasts before it asks again;
    a warm stop waits for the one in flight."""
    retry_max: int = Field(5, ge=0, le=100)
    """Retries of a transport error (or a transient database error) before the task gives up."""
    retry_backoff_s: SecondsOrZero = 0.5
    """The first retry's backoff ceiling, doubled per retry; a wait is half to all of it."""
    retry_backoff_max_s: SecondsOrZero = 30.0
    """The largest backoff ceiling."""


class _Backends(_Group):
    """Node agents and Lambdo hosts: deadlines, credentials, calls in flight, quarantine."""

    rpc_timeout_s: Seconds = 10.0
    """Deadline of a gRPC call to an agent other than CreateReplica."""
    create_timeout_s: Seconds = 30.0
    """Deadline of a CreateReplica call."""
    lambdo_timeout_s: Seconds = 10.0
    """Deadline of an HTTP call to a Lambdo host (the whole call, not one read)."""
    lambdo_token: SecretStr | None = None
    """Bearer token sent to Lambdo hosts."""
    agent_token: SecretStr | None = None
    """Bearer token sent to node agents (their ``--token``)."""
    agent_tls_ca: Path | None = None
    """CA bundle to verify agents' TLS certificates; set: agents are called over TLS."""
    agent_tls_cert: Path | None = None
    """Client certificate presented to agents (mutual TLS)."""
    agent_tls_key: Path | None = None
    """The client certificate's key."""
    registry_token: SecretStr | None = None
    """Bearer token the registry requires of every call (needed to listen off loopback)."""
    registry_tls_cert: Path | None = None
    """The registry's TLS certificate; with the key, the registry serves TLS."""
    registry_tls_key: Path | None = None
    """The registry certificate's key."""
    node_capacity: Count = Field(64, le=100_000)
    """Replicas a node holds when it is added or registers without saying."""
    node_max_inflight: Count = Field(16, le=10_000)
    """Agent calls in flight to one node from the whole fleet (leases in the broker's Redis)."""
    max_inflight: Count = Field(512, le=100_000)
    """Agent calls in flight from one worker process to all nodes together."""
    node_failures: Count = Field(3, le=1000)
    """Failed creates in a row that quarantine a node."""
    node_quarantine_s: Seconds = 30.0
    """A quarantine's first length; it doubles while the node keeps failing."""
    node_quarantine_max_s: Seconds = 600.0
    """A quarantine's longest length."""
    replica_networks: str = ""
    """CIDRs (comma separated) where an fcdaemon node's replicas may also live, besides the
    node's own host, unless the node lists its own (``nodes add --replica-network``)."""


class _CreateDefaults(_Group):
    """CreateRequest defaults: the seed's, overridden per function by its labels or options."""

    image_storage: str = "/var/run/osv-storage"
    """``imageStoragePrefix``: where the agent keeps images."""
    inet_dev: str = ""
    """``inetDev``: the agent's network device for the VM (empty: the agent's own choice)."""
    name_server: str = "8.8.8.8"
    """``nameServer``: the VM's DNS server."""
    aws_access_key_id: SecretStr | None = None
    """Default AWS access key id sent in CreateRequest (never logged or shown)."""
    aws_secret_access_key: SecretStr | None = None
    """Default AWS secret key sent in CreateRequest (never logged or shown)."""


class _Maintenance(_Group):
    """Replica lifecycle and beat's passes: reaper, reconcile, health, redrive."""

    idle_timeout_s: SecondsOrZero = 600.0
    """A function's idle timeout unless it sets its own: Idle this long, a replica is reaped."""
    reap_interval_s: Seconds = 60.0
    """How often beat sends a reaper pass."""
    reap_batch: Count = Field(100, le=100_000)
    """Replicas one reaper pass deletes at most."""
    reconcile_interval_s: Seconds = 60.0
    """How often beat sends a reconcile pass."""
    orphan_grace_s: SecondsOrZero = 60.0
    """How long reconcile sees a VM without a row (on corral's clock) before destroying it."""
    reconcile_concurrency: int = Field(16, ge=1, le=256)
    """Nodes one reconcile pass lists at once (each call with its own deadline)."""
    reconcile_batch: Count = Field(200, le=100_000)
    """Orphan VMs one reconcile pass releases at most (all at once within each node's bound);
    the next pass releases the rest."""
    health_interval_s: Seconds = 5.0
    """How often beat sends a health pass (every node probed)."""
    health_misses: Count = 3
    """Missed probes in a row that make a node unhealthy (no placements)."""
    health_timeout_s: Seconds = 2.0
    """Deadline of one health probe."""
    node_dead_grace_s: SecondsOrZero = 60.0
    """How long a node stays unhealthy before its replicas are marked Dead (those with a VM on
    a node that cannot list its VMs: Deleting, their VMs released once it answers)."""
    creating_deadline_s: Seconds = 300.0
    """A replica Creating (or Deleting) longer than this is stuck: the reaper retires it."""
    redrive_after_s: Seconds = 120.0
    """An operation unmoved this long has its first task re-sent (doubling, 3 times at most)."""
    boot_deadline_s: Seconds = 60.0
    """A replica Starting (its guest has not said READY) longer than this is stuck."""
    lease_ttl_s: Seconds = 300.0
    """How long a reaper or reconcile pass holds its lease at most; inside a task, until just
    after its hard time limit (a pass killed mid-way frees it then)."""
    claim_ttl_s: Seconds = Field(300.0, le=86_400)
    """A claim's lease unless the caller asks for another; the reaper takes back expired claims."""


class _DatabaseGuards(_Group):
    """PostgreSQL guards (0 turns one off).

    A statement waiting this long for a row lock, or running this long at all, fails
    with an OperationalError instead of hanging a worker behind a stuck lock holder. Inside
    a task both are cut further to the time left before the task's hard limit (SQLite's
    busy timeout too), and a statement that locks several rows waits at most the lock
    timeout for all of them together.
    """

    db_lock_timeout_s: SecondsOrZero = 10.0
    """PostgreSQL ``lock_timeout`` on every connection."""
    db_statement_timeout_s: float | None = Field(None, ge=0)
    """PostgreSQL ``statement_timeout`` on every connection; unset: half the time between the soft
    and the hard time limit, at most 20 s. Set, it must be below that time (a task's way out
    after its soft limit must never wait on one statement past its hard limit)."""
    db_idle_in_transaction_timeout_s: SecondsOrZero = 60.0
    """PostgreSQL ``idle_in_transaction_session_timeout``: a session this long idle inside a
    transaction is ended by the server and its locks freed (transactions take milliseconds)."""


class _Autoscale(_Group):
    """The autoscaler, for functions deployed with ``--autoscale`` (Knative's model)."""

    autoscale_interval_s: Seconds = 2.0
    """How often beat sends an autoscaler pass."""
    autoscale_target_utilization: float = Field(0.7, gt=0, le=1)
    """Share of a replica's execution environments the autoscaler aims to keep busy."""
    autoscale_stable_window_s: Seconds = 60.0
    """Scale down only once this window's largest demand allows it."""
    autoscale_panic_window_s: Seconds = 6.0
    """The panic window: demand averaged over it is compared with the threshold."""
    autoscale_panic_threshold: float = Field(2.0, ge=1)
    """Panic (never scale down) when the panic window asks for this many x the ready replicas."""
    autoscale_max_scale_up_rate: float = Field(10.0, ge=1)
    """One pass raises a target to at most this many times the ready replicas."""
    autoscale_max_scale_down_rate: float = Field(2.0, gt=1)
    """One pass lowers a target to no less than the ready replicas / this (2: halve)."""
    autoscale_demand_stale_s: Seconds = 10.0
    """A gateway's demand sample older than this is ignored (the gateway is gone)."""


class _KeepAlive(_Group):
    """Adaptive keep-alive (``--keep-alive adaptive``): idle-time histograms, the hybrid policy.

    corral records every function's idle times (from the end of one invocation to the
    start of the next) in a histogram of fixed bins over a fixed range, kept in the
    broker's Redis; an idle time beyond the range is counted apart (out of bounds). An
    adaptive function's replica is pre-warmed at the histogram's head and kept until its
    tail (Shahrad et al., USENIX ATC 2020); see docs/autoscaling.md.
    """

    keepalive_bin_s: Seconds = 60.0
    """Width of one histogram bin (the paper's 1 minute)."""
    keepalive_range_s: Seconds = 14_400.0
    """Idle times the histogram resolves; longer ones are out of bounds (the paper's 4 h)."""
    keepalive_history: int = Field(10_000, ge=10, le=10_000_000)
    """Idle times a histogram holds before all its counts are halved (old ones fade)."""
    keepalive_head_percentile: float = Field(5.0, ge=0, lt=100)
    """The histogram's head: the pre-warm window starts at this percentile's bin."""
    keepalive_tail_percentile: float = Field(99.0, gt=0, le=100)
    """The histogram's tail: the keep-alive window ends with this percentile's bin."""
    keepalive_margin: float = Field(0.1, ge=0, lt=1)
    """Share taken off the pre-warm window and added to the keep-alive window."""
    keepalive_cv_threshold: float = Field(2.0, ge=0)
    """A histogram whose bin counts vary less than this (std / mean) shows no pattern."""
    keepalive_min_idle_times: int = Field(5, ge=1, le=1_000_000)
    """Fewer idle times than this are not representative: the fixed keep-alive holds."""
    keepalive_oob_threshold: float = Field(0.5, gt=0, le=1)
    """This share of idle times beyond the range or more: forecast from the latest of them."""


class _Metrics(_Group):
    """The control plane's Prometheus exporter (``corral metrics``)."""

    metrics_listen: str = "127.0.0.1:9808"
    """Where ``corral metrics`` listens."""
    metrics_token: SecretStr | None = None
    """Bearer token every scrape must send (needed to listen off loopback)."""


class _Tracing(_Group):
    """Traces (OpenTelemetry): the stages of a cold start as spans, sent over OTLP."""

    otlp_endpoint: str | None = None
    """OTLP/gRPC collector for traces (``http://127.0.0.1:4317``: Jaeger, Tempo...); unset: none."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        if not value:
            return None  # set but empty: off
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (OTLP over gRPC)")
        return value


class _Placement(_Group):
    """Placement and GPUs (AvA)."""

    placement: Literal["loadbalance", "roundrobin", "spread", "random", "pack"] = "loadbalance"
    """Node policy unless a function sets its own."""
    gpu_fit: Literal["best", "first"] = "best"
    """GPU choice: least free memory that fits (``best``) or the first that fits."""
    workers_per_gpu: Count = Field(4, le=1024)
    """AvA worker slots per GPU."""
    first_worker_port: Port = 4000
    """Port of a new GPU server's first AvA worker (slot ``s`` listens on first port + s)."""
    gpu_manager_port: Port = 3333
    """Port of the AvA manager's API server on a GPU host."""


class _Faults(_Group):
    """Test-only fault injection: never set it in production."""

    fault_raise_in: str = ""
    """Task names (comma separated, e.g. ``corral.scale``) that raise before running; ``NAME@here``:
    before one carried out in the caller's process is set up."""


def parse_networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Comma-separated addresses or CIDRs; raises ValueError naming a bad one."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an IP address or CIDR") from None
    return tuple(out)


_HOST_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOST_PATTERN = re.compile(rf"(\*\.)?{_HOST_LABEL}(\.{_HOST_LABEL})*")


def parse_hosts(
    text: str,
) -> tuple[tuple[str, ...], tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]]:
    """Comma-separated host names (``*.example.com`` for any below it), IPs and CIDRs: the
    names (lower case) and the networks; raises ValueError naming a bad entry."""
    names: list[str] = []
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item.strip("[]"), strict=False))
            continue
        except ValueError:
            pass
        name = item.lower().rstrip(".")
        if len(name) > 253 or not _HOST_PATTERN.fullmatch(name):
            raise ValueError(f"{item!r} is not a host name, *.domain, IP address or CIDR")
        names.append(name)
    return tuple(names), tuple(nets)


class _Gateway(_Group):
    """The invocation gateway (``corral gateway``)."""

    gateway_listen: str = "127.0.0.1:8080"
    """Where the gateway listens."""
    gateway_token: SecretStr | None = None
    """Bearer token callers must send (needed to listen off loopback)."""
    gateway_max_body: int = Field(10 * 1024 * 1024, ge=0)
    """Largest request body in bytes (10 MiB); larger is answered 413."""
    gateway_timeout_s: float = Field(60.0, gt=0)
    """One call to a replica, its response included; longer is answered 504."""
    gateway_cold_start_timeout_s: float = Field(30.0, ge=0, le=3600)
    """Waiting for a replica or a place in the queue; longer is answered 503."""
    gateway_queue: int = Field(1000, ge=0, le=1_000_000)
    """Requests waiting per function beyond its limit; one more is answered 429."""
    gateway_store_threads: Count = Field(16, le=256)
    """Threads for the gateway's store calls (one on SQLite)."""
    gateway_report_interval_s: Seconds = 1.0
    """How often the gateway publishes each function's demand for the autoscaler."""
    gateway_keep_s: float = Field(1.5, ge=0, le=3600)
    """Unused this long, an environment the gateway holds goes back to the store (0: at once)."""
    gateway_claim_ttl_s: float = Field(30.0, ge=1, le=86_400)
    """The lease of each claim the gateway holds, renewed at least every 2 s while held."""
    gateway_body_budget: int = Field(64 * 1024 * 1024, ge=0)
    """Request bodies the gateway holds at once, in all (bytes, as they arrive); over: 503."""
    gateway_body_per_peer: int = Field(16 * 1024 * 1024, ge=0)
    """Of that, what one peer address's bodies may hold at once (trusted proxies: the total)."""
    gateway_body_min_rate: int = Field(4096, ge=1)
    """Bytes a second a body must average once its grace period is over; slower: 408."""
    gateway_body_grace_s: Seconds = 10.0
    """A body's time before its average rate counts (each piece still within the read timeout)."""
    gateway_read_timeout_s: Seconds = 15.0
    """Longest wait for a request's head, or the next piece of its body; then 408 and closed."""
    gateway_send_timeout_s: Seconds = 30.0
    """Longest a caller may take to accept the next piece of its answer; then it is cut off."""
    gateway_max_connections: Count = Field(4096, le=1_000_000)
    """Connections the gateway serves at once; one more is answered 503 and closed."""
    gateway_max_connections_per_peer: Count = Field(1024, le=1_000_000)
    """Of them, from one peer address (trusted proxies: the total only); one more: 503."""
    gateway_anonymous_per_peer: Count = Field(256, le=1_000_000)
    """Of a peer's connections, how many may have shown no credential yet (a token checked)."""
    gateway_max_head_bytes: int = Field(64 * 1024, ge=1024, le=1024 * 1024)
    """Largest request head (request line and headers, raw bytes); larger is answered 431."""
    gateway_answer_head_max: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)
    """Largest head of a replica's answer in bytes (interim heads in; trailers alike); over: 502."""
    gateway_answer_head_lines: int = Field(100, ge=1, le=100_000)
    """Most header lines in a replica's answer, interim heads included; more: 502."""
    gateway_answer_head_timeout_s: Seconds = 10.0
    """Longest a replica may take to send a head once its first byte came; then 504."""
    gateway_read_ahead: int = Field(1024 * 1024, ge=64 * 1024)
    """Bytes of one answer read from its replica ahead of the caller (memory, not payload)."""
    gateway_read_ahead_budget: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    """All answers' bytes read ahead of their callers, in all; past it only waiting callers read."""
    gateway_trusted_proxies: str = ""
    """Proxies (addresses or CIDRs, comma separated) whose X-Forwarded-* the gateway keeps."""
    gateway_spawn_here: bool = True
    """Carry out the spawn of a cold start in the gateway (it then calls agents); off: queued."""

    @field_validator("gateway_trusted_proxies")
    @classmethod
    def _networks(cls, value: str) -> str:
        parse_networks(value)
        return value


class _Calls(_Group):
    """Asynchronous calls (``POST /async-function/NAME``): attempts, retention, callbacks.

    A call is stored, queued on ``corral.invocations`` and run by a worker through the
    gateway's own request flow; an attempt that gets no answer, a 429 or a 5xx is tried
    again after a backoff until the function's attempts or age are spent, and the call is
    then *dead*, kept with its last answer. A function may set its own attempts and age
    (``functions deploy --call-attempts N --call-max-age S``).
    """

    calls_max_attempts: int = Field(3, ge=1, le=100)
    """Attempts of one call, the first included, unless its function sets its own."""
    calls_max_age_s: Seconds = 21_600.0
    """No attempt starts later than this after the call was accepted, unless its function says."""
    calls_backoff_s: Seconds = 1.0
    """The first retry's backoff ceiling, doubled per attempt; a wait is half to all of it."""
    calls_backoff_max_s: Seconds = 60.0
    """The largest backoff ceiling (a 429's or 503's ``Retry-After`` is honoured up to it)."""
    calls_queue_max: int = Field(100_000, ge=1)
    """Messages waiting in ``corral.invocations`` at which a new call is answered 429."""
    calls_idempotency_window_s: Seconds = 86_400.0
    """How long an ``Idempotency-Key`` names the call it made (per function), while it is kept."""
    calls_keep_s: Seconds = 86_400.0
    """Finished calls, with their answers, are kept this long after they finished."""
    calls_keep_max: int = Field(100_000, ge=1)
    """Finished calls kept at most; the sweep purges the oldest beyond."""
    calls_answer_max: int = Field(1024 * 1024, ge=0, le=64 * 1024 * 1024)
    """Bytes of an answer's body kept; the rest is dropped and the call marked truncated."""
    calls_resend_s: Seconds = 120.0
    """A call its message should have started this long ago is sent again (a message lost)."""
    calls_sweep_interval_s: Seconds = 5.0
    """How often beat sends the calls' sweep (lost messages sent again, old calls purged)."""
    callback_key: SecretStr | None = None
    """HMAC-SHA256 key that signs callbacks (``X-Corral-Signature``); unset: callbacks refused."""
    callback_hosts: str = ""
    """Hosts callbacks may go to (comma separated: a name, ``*.example.com``, an IP or CIDR)."""
    callback_attempts: int = Field(5, ge=1, le=100)
    """Deliveries of one callback tried before it is given up (failed)."""
    callback_timeout_s: Seconds = 10.0
    """One callback delivery, connecting and the receiver's answer included."""


class _Dataplane(_Group):
    """The warm data plane: a private HAProxy in front of the gateway (``workers.gateway.haproxy``).

    HAProxy carries warm calls; the gateway stays behind it as the activator (cold starts,
    queueing, every call HAProxy cannot carry), and carries everything where HAProxy is absent.
    """

    gateway_dataplane: Literal["auto", "haproxy", "python"] = "auto"
    """Who carries warm calls: ``haproxy``, ``python`` (the gateway), ``auto`` (HAProxy if any)."""
    gateway_haproxy: str = "haproxy"
    """The HAProxy binary (2.6 or later): a name looked up on ``PATH``, or a path."""
    gateway_haproxy_threads: int = Field(1, ge=1, le=64)
    """Threads of the gateway's HAProxy."""
    gateway_warm_functions: int = Field(128, ge=1, le=10_000)
    """Functions HAProxy carries at once (its backends); the others take the Python path."""
    gateway_warm_queue: int = Field(0, ge=0, le=100_000)
    """Requests HAProxy queues per function when all its environments are busy; more: activator."""


class _Flower(_Group):
    """Flower, the Celery monitor ``corral up`` starts."""

    flower_port: int = Field(5555, ge=0, le=65535)
    """Flower's port under ``corral up`` (0: 5555; taken: any free port)."""
    flower_user: str | None = None
    """Flower's basic-auth user (with the password: Flower asks for them)."""
    flower_password: SecretStr | None = None
    """Flower's basic-auth password."""


class Settings(
    _Places,
    _Reliability,
    _Backends,
    _CreateDefaults,
    _Maintenance,
    _DatabaseGuards,
    _Autoscale,
    _KeepAlive,
    _Metrics,
    _Tracing,
    _Placement,
    _Faults,
    _Gateway,
    _Calls,
    _Dataplane,
    _Flower,
    BaseSettings,
):
    """Every knob corral reads, with its default: the groups above, one flat namespace.

    Each field is read from ``CORRAL_<NAME>``; the groups only organise the code and
    this reference, which ``python -m config.docs`` writes from the string below each
    field. Rules hold between settings: the soft time limit is below the hard one and
    exceeds the longest agent call by more than a second, a statement timeout set is
    below the time between the two limits, the visibility timeout is above the hard
    limit, the panic window
    no longer than the stable window, the keep-alive range between 1 and 10000 bins,
    and the keep-alive head percentile below the tail.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        frozen=True,
        hide_input_in_errors=True,  # a ValidationError's text never shows a value
    )

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, value: str) -> str:
        if not value.startswith(("sqlite", "postgresql")):
            raise ValueError("must be a sqlite:/// or postgresql+psycopg:// URL")
        return value

    @field_validator("replica_networks")
    @classmethod
    def _networks(cls, value: str) -> str:
        for cidr in filter(None, (c.strip() for c in value.split(","))):
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not a network (CIDR, e.g. 10.0.0.0/24)") from None
        return value

    @field_validator("callback_hosts")
    @classmethod
    def _callback_hosts(cls, value: str) -> str:
        parse_hosts(value)
        return value

    @field_validator("broker_url")
    @classmethod
    def _known_broker(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "memory://", "unix://")):
            raise ValueError("must be a redis:// URL")
        return value

    @model_validator(mode="after")
    def _limits_fit(self) -> Settings:
        if self.task_soft_time_limit_s >= self.task_time_limit_s:
            raise ValueError("CORRAL_TASK_SOFT_TIME_LIMIT_S must be below CORRAL_TASK_TIME_LIMIT_S")
        if self.autoscale_panic_window_s > self.autoscale_stable_window_s:
            raise ValueError(
                "CORRAL_AUTOSCALE_PANIC_WINDOW_S must not exceed CORRAL_AUTOSCALE_STABLE_WINDOW_S"
            )
        if not 1 <= self.keepalive_range_s / self.keepalive_bin_s <= MAX_KEEPALIVE_BINS:
            raise ValueError(
                f"CORRAL_KEEPALIVE_RANGE_S must hold between 1 and {MAX_KEEPALIVE_BINS} bins of "
                "CORRAL_KEEPALIVE_BIN_S"
            )
        if self.keepalive_head_percentile >= self.keepalive_tail_percentile:
            raise ValueError(
                "CORRAL_KEEPALIVE_HEAD_PERCENTILE must be below CORRAL_KEEPALIVE_TAIL_PERCENTILE"
            )
        if self.call_timeout_s >= self.task_soft_time_limit_s - 1:
            raise ValueError(
                "CORRAL_TASK_SOFT_TIME_LIMIT_S must exceed the longest agent call "
                "(CORRAL_CREATE_TIMEOUT_S, CORRAL_RPC_TIMEOUT_S, CORRAL_LAMBDO_TIMEOUT_S) by "
                "more than a second: a task's calls must end before it is out of time"
            )
        wrap_up = self.task_time_limit_s - self.task_soft_time_limit_s
        if self.db_statement_timeout_s is not None and self.db_statement_timeout_s >= wrap_up:
            raise ValueError(
                "CORRAL_DB_STATEMENT_TIMEOUT_S must be below CORRAL_TASK_TIME_LIMIT_S - "
                f"CORRAL_TASK_SOFT_TIME_LIMIT_S ({wrap_up:g} s): a task's way out after its soft "
                "limit must never wait on one statement past its hard limit"
            )
        if self.visibility_timeout_s <= self.task_time_limit_s:
            raise ValueError(
                "CORRAL_VISIBILITY_TIMEOUT_S must exceed CORRAL_TASK_TIME_LIMIT_S, or a running "
                "task's message would be handed to a second worker"
            )
        return self

    @property
    def longest_countdown_s(self) -> float:
        """The longest a message may wait delivered before it runs (a countdown): a worker
        holds it unacknowledged meanwhile, so the wait and the task's hard limit must end
        before the visibility timeout hands it to another worker (5 s to spare)."""
        return max(0.0, self.visibility_timeout_s - self.task_time_limit_s - 5.0)

    @property
    def statement_timeout_s(self) -> float:
        """PostgreSQL's ``statement_timeout``: set, or half the wrap-up time (20 s at most)."""
        if self.db_statement_timeout_s is not None:
            return self.db_statement_timeout_s
        wrap_up = self.task_time_limit_s - self.task_soft_time_limit_s
        return min(MAX_DEFAULT_STATEMENT_S, wrap_up / 2)

    @property
    def call_timeout_s(self) -> float:
        """The longest any single agent or Lambdo call may take."""
        return max(self.create_timeout_s, self.rpc_timeout_s, self.lambdo_timeout_s)

    @property
    def backend_url(self) -> str:
        """The Celery result backend: explicit, or the broker's Redis."""
        return self.result_backend or self.broker_url


def _stack_defaults(environ: dict[str, str]) -> dict[str, Any]:
    """Addresses published by a running ``corral up`` in this directory, if any."""
    state_dir = Path(environ.get(ENV_PREFIX + "STATE_DIR", ".corral"))
    path = state_dir / STACK_FILE
    try:
        if not _trusted(path):
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    pid = data.get("pid")
    if not isinstance(pid, int) or not pid_exists(pid):
        return {}
    published = data.get("settings", {})
    return {k: v for k, v in published.items() if ENV_PREFIX + k.upper() not in environ}


def _trusted(path: Path) -> bool:
    """True if ``path`` is owned by this user and not writable by group or others."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        logging.getLogger(__name__).warning(
            "ignoring %s: it must be owned by uid %d and writable by nobody else "
            "(owner %d, mode %o)",
            path,
            os.getuid(),
            info.st_uid,
            stat.S_IMODE(info.st_mode),
        )
        return False
    return True


SECRETS = frozenset(name for name, info in Settings.model_fields.items() if is_secret(info))
"""The names of the secret settings."""


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment, a running stack's state file and overrides."""
    values = {**_stack_defaults(dict(os.environ)), **overrides}
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    """One line naming each bad variable; never a secret setting's value nor a URL's password."""
    problems = []
    for err in exc.errors():
        field = "_".join(str(p) for p in err["loc"])
        msg = redact(err["msg"].removeprefix("Value error, "))
        if not field:  # a rule between settings: its message names them, no value is shown
            problems.append(msg)
        elif field in SECRETS:
            problems.append(f"{ENV_PREFIX}{field.upper()}: {msg}")
        else:
            shown = redact(repr(err.get("input")))
            problems.append(f"{ENV_PREFIX}{field.upper()}: {msg} (got {shown})")
    return "bad setting: " + "; ".join(problems)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, loaded once."""
    return load_settings()


def reset_settings() -> None:
    """Forget the cached settings (tests and ``corral up`` change the environment)."""
    get_settings.cache_clear()
