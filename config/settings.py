"""Typed settings read from ``CORRAL_*`` environment variables.

Precedence, highest first: the process environment, the state file of a running
``corral up`` stack in the working directory (``.corral/stack.json``, or the
directory named by ``CORRAL_STATE_DIR``), then the defaults below. A setting that
does not parse fails at start with a :class:`ConfigError` naming the variable; the
message never shows a secret setting's value nor a password inside a URL.

The state file is trusted only if it is owned by the current user and writable by
nobody else: it names the database and broker every command then talks to, so a
file another user could plant or edit would redirect this user's commands.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "CORRAL_"
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
Secret = str | None
"""A token, key or password, unset by default (its name hides it in error messages)."""


class ConfigError(Exception):
    """A setting is missing or malformed; the message names the variable."""


class _Places(BaseModel):
    """Where the state, the database, the broker and the registry are."""

    state_dir: Path = Path(".corral")
    database_url: str = "sqlite:///corral.sqlite"
    broker_url: str = "redis://localhost:6379/0"
    result_backend: str | None = None
    eager: bool = False
    registry_listen: str = "127.0.0.1:50052"
    ready_grace_s: SecondsOrZero = 2.0


class _Reliability(BaseModel):
    """Reliability: time limits, retries, broker redelivery."""

    task_soft_time_limit_s: Seconds = 60.0
    task_time_limit_s: Seconds = 90.0
    visibility_timeout_s: int = Field(300, gt=0)
    retry_max: int = Field(5, ge=0, le=100)
    retry_backoff_s: SecondsOrZero = 0.5
    retry_backoff_max_s: SecondsOrZero = 30.0


class _Backends(BaseModel):
    """Node agents and Lambdo hosts: timeouts, credentials, calls in flight, quarantine."""

    rpc_timeout_s: Seconds = 10.0
    create_timeout_s: Seconds = 30.0
    lambdo_timeout_s: Seconds = 10.0
    lambdo_token: Secret = None
    agent_token: Secret = None
    agent_tls_ca: Path | None = None
    agent_tls_cert: Path | None = None
    agent_tls_key: Path | None = None
    registry_token: Secret = None
    registry_tls_cert: Path | None = None
    registry_tls_key: Path | None = None
    node_capacity: Count = Field(64, le=100_000)
    # Calls in flight from one worker process: to one node, and to all nodes together.
    node_max_inflight: Count = Field(16, le=10_000)
    max_inflight: Count = Field(256, le=100_000)
    # Placement learns: failed creates in a row before a node is quarantined, and for how
    # long (doubling while it keeps failing, up to the max).
    node_failures: Count = Field(3, le=1000)
    node_quarantine_s: Seconds = 30.0
    node_quarantine_max_s: Seconds = 600.0


class _CreateDefaults(BaseModel):
    """CreateRequest defaults (the seed's, overridable per function)."""

    image_storage: str = "/var/run/osv-storage"
    inet_dev: str = ""
    name_server: str = "8.8.8.8"
    aws_access_key_id: str | None = None
    aws_secret_access_key: Secret = None


class _Maintenance(BaseModel):
    """Replica lifecycle and the maintenance passes."""

    idle_timeout_s: SecondsOrZero = 600.0
    reap_interval_s: Seconds = 60.0
    reap_batch: Count = Field(100, le=100_000)
    reconcile_interval_s: Seconds = 60.0
    orphan_grace_s: SecondsOrZero = 60.0
    health_interval_s: Seconds = 5.0
    health_misses: Count = 3
    health_timeout_s: Seconds = 2.0
    node_dead_grace_s: SecondsOrZero = 60.0
    creating_deadline_s: Seconds = 300.0
    redrive_after_s: Seconds = 120.0
    boot_deadline_s: Seconds = 60.0
    lease_ttl_s: Seconds = 300.0
    claim_ttl_s: Seconds = Field(300.0, le=86_400)


class _DatabaseGuards(BaseModel):
    """PostgreSQL guards (0 turns one off): a statement waiting this long for a row lock,
    or running this long at all, fails with an OperationalError instead of hanging a
    worker behind a stuck lock holder.
    """

    db_lock_timeout_s: SecondsOrZero = 10.0
    db_statement_timeout_s: SecondsOrZero = 60.0


class _Autoscale(BaseModel):
    """The autoscaler (workers.autoscale.decision) for functions deployed with --autoscale."""

    autoscale_interval_s: Seconds = 2.0
    autoscale_target_utilization: float = Field(0.7, gt=0, le=1)
    autoscale_stable_window_s: Seconds = 60.0
    autoscale_panic_window_s: Seconds = 6.0
    autoscale_panic_threshold: float = Field(2.0, ge=1)
    autoscale_max_scale_up_rate: float = Field(10.0, ge=1)
    autoscale_demand_stale_s: Seconds = 10.0


class _Metrics(BaseModel):
    """The control-plane Prometheus exporter (corral metrics)."""

    metrics_listen: str = "127.0.0.1:9808"
    metrics_token: Secret = None


class _Placement(BaseModel):
    """Placement and GPUs."""

    placement: Literal["loadbalance", "roundrobin", "spread", "random", "pack"] = "loadbalance"
    gpu_fit: Literal["best", "first"] = "best"
    workers_per_gpu: Count = Field(4, le=1024)
    first_worker_port: Port = 4000
    gpu_manager_port: Port = 3333


class _Faults(BaseModel):
    """Test-only: task names (comma separated) that raise before running (workers.celery)."""

    fault_raise_in: str = ""


class _Gateway(BaseModel):
    """The invocation gateway (workers/gateway)."""

    gateway_listen: str = "127.0.0.1:8080"
    gateway_token: Secret = None
    gateway_max_body: int = Field(10 * 1024 * 1024, ge=0)  # bytes
    gateway_timeout_s: float = Field(60.0, gt=0)  # one call to a replica, response included
    gateway_cold_start_timeout_s: float = Field(30.0, ge=0, le=3600)
    gateway_queue: int = Field(1000, ge=0, le=1_000_000)  # waiting requests per function
    gateway_store_threads: Count = Field(16, le=256)
    gateway_report_interval_s: Seconds = 1.0
    # Claims a gateway holds between requests: unused this long, they are released; each
    # claim it holds (in use or kept) is a lease of this ttl, renewed while it is held.
    gateway_keep_s: float = Field(1.5, ge=0, le=3600)
    gateway_claim_ttl_s: float = Field(30.0, ge=1, le=86_400)


class _Flower(BaseModel):
    """Flower, the Celery monitor."""

    flower_port: int = Field(5555, ge=0, le=65535)
    flower_user: str | None = None
    flower_password: Secret = None


class Settings(
    _Places, _Reliability, _Backends, _CreateDefaults, _Maintenance, _DatabaseGuards,
    _Autoscale, _Metrics, _Placement, _Faults, _Gateway, _Flower, BaseSettings,
):
    """Every knob corral reads, with its default: the groups above, one flat namespace.

    Each field is read from ``CORRAL_<NAME>`` (the groups only organise this file).
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, value: str) -> str:
        if not value.startswith(("sqlite", "postgresql")):
            raise ValueError("must be a sqlite:/// or postgresql+psycopg:// URL")
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
            raise ValueError(
                "CORRAL_TASK_SOFT_TIME_LIMIT_S must be below CORRAL_TASK_TIME_LIMIT_S"
            )
        if self.autoscale_panic_window_s > self.autoscale_stable_window_s:
            raise ValueError(
                "CORRAL_AUTOSCALE_PANIC_WINDOW_S must not exceed CORRAL_AUTOSCALE_STABLE_WINDOW_S"
            )
        if self.visibility_timeout_s <= self.task_time_limit_s:
            raise ValueError(
                "CORRAL_VISIBILITY_TIMEOUT_S must exceed CORRAL_TASK_TIME_LIMIT_S, or a running "
                "task's message would be handed to a second worker"
            )
        return self

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
            "(owner %d, mode %o)", path, os.getuid(), info.st_uid, stat.S_IMODE(info.st_mode),
        )
        return False
    return True


def pid_exists(pid: int) -> bool:
    """True if a process ``pid`` exists (a zombie too), even one owned by another user."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment, a running stack's state file and overrides."""
    values = {**_stack_defaults(dict(os.environ)), **overrides}
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


_SECRET_WORDS = ("secret", "token", "password", "key")
_URL_PASSWORD = re.compile(r"(://[^/\s:@]*:)[^\s/]*@")


def hide_url_password(text: str) -> str:
    """``text`` with the password of any ``scheme://user:password@host`` replaced by ***."""
    return _URL_PASSWORD.sub(r"\1***@", text)


def _describe(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        field = "_".join(str(p) for p in err["loc"])
        shown = ("<redacted>" if any(w in field for w in _SECRET_WORDS)
                 else hide_url_password(repr(err.get("input"))))
        problems.append(f"{ENV_PREFIX}{field.upper()}: {err['msg']} (got {shown})")
    return "bad setting: " + "; ".join(problems)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, loaded once."""
    return load_settings()


def reset_settings() -> None:
    """Forget the cached settings (tests and ``corral up`` change the environment)."""
    get_settings.cache_clear()
