"""Functions: validating a deployment, applying the seed's labels, and the CRUD around it.

A deployment arrives as a :class:`FunctionSpec` (from CLI options or a TOML file).
The seed configured functions through labels (``KERNEL_IMAGE_PATH``,
``com.openfaas.scale.min``, ``GPU_MEM``, ...); :func:`apply_labels` reads those,
and explicit options win over labels. Every deploy bumps ``build_version``, which
makes replicas of older builds *stale*: they are no longer handed out and the
reaper replaces them.

Every text a tenant gives is checked before anything is stored (:func:`check_text`):
printable (no control, line-breaking or bidirectional character: a newline in
``--image`` forged a row of ``functions list``, an escape sequence repainted the
operator's terminal), bounded in length, and for an image, a path, a URL, an interface
and a name server, a grammar of its own (:data:`GRAMMARS`). Bad input is a clear error
and changes nothing.

A function as shown (:func:`function_view`) never carries its AWS keys, and its
environment only masked: every env value, and the value of every ``--env=K=V``
kernel argument (also inside a ``KERNEL_ARGS`` label), is ``***`` unless asked for
(``corral functions show --show-secrets``). Env values are secrets until shown
otherwise, as Kubernetes and OpenFaaS treat theirs: a tenant's database password
travels there as often as a log level.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NamedTuple, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from config.redact import MASK
from config.settings import Settings
from netplumb import guest_env
from workers.backends.base import backend
from workers.base.clock import iso, now
from workers.base.errors import InputError
from workers.base.kinds import POLICIES, NodeKind
from workers.base.names import check_name
from workers.store.models import LIVE_STATES, Function, Replica, ReplicaState
from workers.store.rows import one_or_not_found

MAX_REPLICAS = 10_000
ENV_KEY_RE = re.compile(rf"^{guest_env.NAME_RE.pattern}$")
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9_.\-/]{1,253}$")
MAX_LABELS = 256
MAX_LABEL_VALUE = 4096


class Grammar(NamedTuple):
    """What one kind of tenant text may be: a pattern, a length, and how to name it."""

    pattern: re.Pattern[str]
    most: int
    expected: str


_VISIBLE = r"[!-~]"  # printable ASCII but the space
GRAMMARS: dict[str, Grammar] = {
    # a module (examples.hello) or an OCI reference (registry:5000/ns/name:tag@sha256:...)
    "image": Grammar(re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*"), 255, "an image name"),
    # a file on the node: no space, and never an option (a leading '-')
    "path": Grammar(re.compile(r"(?!-)[A-Za-z0-9._/+~@:,=%-]+"), 4096, "a path"),
    # the rootfs of a Lambdo function: a URL or an image name, no space
    "rootfs": Grammar(
        re.compile(r"[A-Za-z0-9][A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=%-]*"), 2048, "a URL"
    ),
    "interface": Grammar(re.compile(r"[A-Za-z0-9_.:-]+"), 15, "a network interface name"),
    "host": Grammar(re.compile(r"[A-Za-z0-9.:-]+"), 253, "an IP address or host name"),
    "arguments": Grammar(re.compile(r".*", re.DOTALL), 4096, "kernel arguments"),
    "secret": Grammar(re.compile(f"{_VISIBLE}+"), 256, "a key without spaces"),
}
# Each text field of a function and its grammar.
TEXT_FIELDS = {
    "image": "image",
    "kernel": "path",
    "initrd": "path",
    "image_storage": "path",
    "rootfs": "rootfs",
    "inet_dev": "interface",
    "name_server": "host",
    "kernel_args": "arguments",
    "aws_access_key_id": "secret",
    "aws_secret_access_key": "secret",
}


def check_text(value: str, grammar: Grammar, *, secret: bool = False) -> str:
    """``value`` if it is printable text of ``grammar`` within its length; ValueError if not.

    The value is shown in the error escaped and shortened (never, for a secret).
    """
    shown = "the value" if secret else repr(value[:40]) + ("..." if len(value) > 40 else "")
    if not value.isprintable():
        raise ValueError(f"{shown} has a control, line-breaking or bidirectional character")
    if len(value) > grammar.most:
        raise ValueError(f"{shown} is over {grammar.most} characters")
    if not grammar.pattern.fullmatch(value):
        raise ValueError(f"{shown} is not {grammar.expected}")
    return value


# The seed's labels and the spec field each one fills.
SEED_LABELS: dict[str, str] = {
    "KERNEL_IMAGE_PATH": "kernel",
    "INITRD_PATH": "initrd",
    "VM_TYPE": "vm_type",
    "KERNEL_ARGS": "kernel_args",
    "IMAGE_STORAGE": "image_storage",
    "INET_DEV": "inet_dev",
    "NAMESERVER": "name_server",
    "com.openfaas.cpu": "cpu",
    "com.openfaas.memory": "mem",
    "com.openfaas.scale.min": "min",
    "com.openfaas.scale.max": "max",
    "GPU_MEM": "gpu_mem",
}


def parse_pairs(items: list[str] | None, what: str) -> dict[str, str]:
    """``["K=V", ...]`` as a dict; a clear error for anything else."""
    pairs: dict[str, str] = {}
    key_re = ENV_KEY_RE if what == "env" else LABEL_KEY_RE
    if len(items or []) > MAX_LABELS:
        raise InputError(f"at most {MAX_LABELS} of {what}s")
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key_re.match(key):
            raise InputError(f"malformed {what} {item!r}: expected KEY=VALUE")
        if not value.isprintable():
            raise InputError(f"malformed {what} {key!r}: value has non-printable characters")
        if len(value) > MAX_LABEL_VALUE:
            raise InputError(f"malformed {what} {key!r}: value over {MAX_LABEL_VALUE} characters")
        reason = guest_env.refusal(key, value) if what == "env" else None
        if reason is not None:
            raise InputError(f"env {reason}")
        pairs[key] = value
    return pairs


class FunctionSpec(BaseModel):
    """Everything a deploy may say about a function; ``None`` means "not given"."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    image: str | None = None
    backend: Literal["fcdaemon", "lambdo"] | None = None
    kernel: str | None = None
    initrd: str | None = None
    kernel_args: str | None = None
    vm_type: Literal["osv", "linux"] | None = None
    cpu: int | None = Field(None, ge=1, le=1024)
    mem: int | None = Field(None, ge=16, le=1_048_576)
    min: int | None = Field(None, ge=0, le=MAX_REPLICAS)
    max: int | None = Field(None, ge=0, le=MAX_REPLICAS)
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    image_storage: str | None = None
    inet_dev: str | None = None
    name_server: str | None = None
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    rootfs: str | None = None
    ports: list[int] | None = None
    idle_timeout: float | None = Field(None, ge=0, le=30 * 86400)
    readiness: Literal["agent", "guest"] | None = None
    exec_envs: int | None = Field(None, ge=1, le=1000)
    gpu_mem: int | None = Field(None, ge=0, le=10_000_000)
    placement: str | None = None
    autoscale: bool | None = None
    # seconds without a request before the autoscaler may go to zero; 0 turns it off
    scale_to_zero_after: float | None = Field(None, ge=0, le=30 * 86400)
    # how long an idle replica is kept: the fixed idle timeout, or windows learnt from the
    # function's idle times (workers.autoscale.keepalive)
    keep_alive: Literal["fixed", "adaptive"] | None = None
    # asynchronous calls (workers.invocations): attempts of one call, and the longest a call
    # may wait for an attempt to start (None: the settings' defaults)
    call_attempts: int | None = Field(None, ge=1, le=100)
    call_max_age: float | None = Field(None, gt=0, le=30 * 86400)

    @field_validator(*TEXT_FIELDS)
    @classmethod
    def _text(cls, value: str | None, info: Any) -> str | None:
        """Printable, bounded, of its field's grammar (empty: not given)."""
        if value:
            field = info.field_name
            check_text(value, GRAMMARS[TEXT_FIELDS[field]], secret=field.startswith("aws"))
        return value

    @field_validator("ports")
    @classmethod
    def _ports(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not all(0 < p < 65536 for p in value):
            raise ValueError("ports must be between 1 and 65535")
        return value

    @field_validator("placement")
    @classmethod
    def _placement(cls, value: str | None) -> str | None:
        if value is not None and value not in POLICIES:
            choices = ", ".join(POLICIES)
            raise ValueError(f"unknown placement policy {value!r}; use one of {choices}")
        return value

    @field_validator("kernel_args")
    @classmethod
    def _kernel_env(cls, value: str | None) -> str | None:
        """The ``--env=K=V`` tokens of kernel args reach the guest too: the same rule."""
        try:
            guest_env.check(guest_env.parse_env_args(value or ""))
        except ValueError as exc:
            raise ValueError(f"--env in kernel args: {exc}") from None
        return value

    @field_validator("labels", "env")
    @classmethod
    def _pairs(cls, value: dict[str, str], info: Any) -> dict[str, str]:
        what = "env" if info.field_name == "env" else "label"
        return parse_pairs([f"{k}={v}" for k, v in value.items()], what)


def spec_from(**fields: Any) -> FunctionSpec:
    """A validated spec; pydantic's complaints become one :class:`InputError` line."""
    try:
        return FunctionSpec(**fields)
    except ValidationError as exc:
        raise InputError(_one_line(exc)) from None


def spec_from_toml(path: Path) -> FunctionSpec:
    """A validated spec read from a TOML file (keys as in :class:`FunctionSpec`)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: invalid TOML: {exc}") from None
    try:
        return FunctionSpec.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{path}: {_one_line(exc)}") from None


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "spec"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{loc}: {msg}")
    return "invalid function spec: " + "; ".join(parts)


def _label_int(labels: dict[str, str], key: str) -> int:
    raw = labels[key].strip()
    if key == "com.openfaas.memory":
        raw = re.sub(r"(?i)(mi|m|mib)$", "", raw)
    try:
        return int(raw)
    except ValueError:
        raise InputError(f"malformed label {key}={labels[key]!r}: expected a number") from None


def apply_labels(spec: FunctionSpec) -> dict[str, Any]:
    """The spec's fields with the seed's labels filled in where no option was given."""
    fields = spec.model_dump()
    for label, field in SEED_LABELS.items():
        if label not in spec.labels or fields.get(field) is not None:
            continue
        if field in ("cpu", "mem", "min", "max", "gpu_mem"):
            fields[field] = _label_int(spec.labels, label)
        else:
            fields[field] = spec.labels[label]
    try:
        return FunctionSpec(**fields).model_dump()  # labels re-checked like options
    except ValidationError as exc:
        raise InputError(_one_line(exc)) from None


def build_version() -> str:
    """A new build version: the deploy time, sortable, to the microsecond."""
    return now().strftime("%Y%m%d%H%M%S%f")


def deploy(session: Session, spec: FunctionSpec, settings: Settings) -> tuple[Function, bool]:
    """Create or update a function; returns (function, created)."""
    check_name(spec.name)
    f = apply_labels(spec)
    fn = session.scalars(select(Function).where(Function.name == spec.name)).first()
    created = fn is None
    if fn is None:
        kind = f.get("backend") or NodeKind.FCDAEMON
        if not f["image"] and not backend(kind).image_of_rootfs(f.get("rootfs")):
            raise InputError(
                "--image is required for a new function (a lambdo function may give "
                "only --rootfs: its rootfs is its image)"
            )
        fn = Function(name=spec.name, image="", build_version="")
        session.add(fn)
    values = _values(spec, f, fn, created=created)
    _check(values, f)
    timeout_changed = not created and values["idle_timeout_s"] != fn.idle_timeout_s
    for key, value in values.items():
        setattr(fn, key, value)
    fn.build_version = build_version()
    if fn.target is not None:
        fn.target = max(fn.min_replicas, min(fn.target, fn.max_replicas))
    session.flush()
    if timeout_changed:
        bump_reap_at(session, fn, settings)
    return fn, created


def idle_timeout(fn: Function, settings: Settings) -> float:
    """The function's idle timeout in seconds (its own, else the default)."""
    return fn.idle_timeout_s if fn.idle_timeout_s is not None else settings.idle_timeout_s


def bump_reap_at(session: Session, fn: Function, settings: Settings) -> None:
    """Recompute ``reap_at`` for a function's Idle replicas (its idle timeout changed)."""
    seconds = idle_timeout(fn, settings)
    for replica in session.scalars(
        select(Replica).where(
            Replica.function_id == fn.id,
            Replica.status == ReplicaState.IDLE,
            Replica.idle_since.is_not(None),
        )
    ):
        assert replica.idle_since is not None  # noqa: S101 - narrows for mypy
        replica.reap_at = replica.idle_since + timedelta(seconds=seconds)


# column, the option that sets it, its default for a new function
_COLUMNS: tuple[tuple[str, str, Any], ...] = (
    ("kernel", "kernel", ""),
    ("initrd", "initrd", ""),
    ("kernel_args", "kernel_args", ""),
    ("vm_type", "vm_type", "osv"),
    ("cpu", "cpu", 1),
    ("mem_mb", "mem", 512),
    ("min_replicas", "min", 0),
    ("max_replicas", "max", 20),
    ("image_storage", "image_storage", ""),
    ("inet_dev", "inet_dev", ""),
    ("name_server", "name_server", ""),
    ("aws_access_key_id", "aws_access_key_id", None),
    ("aws_secret_access_key", "aws_secret_access_key", None),
    ("rootfs", "rootfs", None),
    ("ports", "ports", [8080]),
    ("idle_timeout_s", "idle_timeout", None),
    ("readiness", "readiness", "agent"),
    ("exec_envs", "exec_envs", 1),
    ("gpu_mem_mb", "gpu_mem", 0),
    ("placement", "placement", None),
    ("autoscale", "autoscale", False),
    ("keep_alive", "keep_alive", "fixed"),
    ("call_attempts", "call_attempts", None),
    ("call_max_age_s", "call_max_age", None),
)


def _values(
    spec: FunctionSpec, f: dict[str, Any], fn: Function, *, created: bool
) -> dict[str, Any]:
    """The function's columns: each option given, else its default (new) or value (update)."""

    def pick(option: str, current: Any, default: Any) -> Any:
        value = f.get(option)
        if value is not None:
            return value
        return default if created else current

    image = pick("image", fn.image, "")
    if image.endswith(":latest"):
        image = image[: -len(":latest")]
    kind = pick("backend", fn.backend, NodeKind.FCDAEMON)
    if not image:
        image = backend(kind).image_of_rootfs(pick("rootfs", fn.rootfs, None))
    values: dict[str, Any] = {"image": image, "backend": kind}
    for column, option, default in _COLUMNS:
        fresh = list(default) if isinstance(default, list) else default  # no shared list
        values[column] = pick(option, getattr(fn, column), fresh)
    values["scale_to_zero_after_s"] = (
        pick("scale_to_zero_after", fn.scale_to_zero_after_s, None) or None
    )  # 0 turns it off
    values["labels"] = spec.labels if (created or spec.labels) else fn.labels
    values["env"] = spec.env if (created or spec.env) else fn.env
    return values


def _check(values: dict[str, Any], f: dict[str, Any]) -> None:
    """Refuse a function that could never run, naming the option to fix."""
    if values["min_replicas"] > values["max_replicas"]:
        raise InputError(f"max ({values['max_replicas']}) is below min ({values['min_replicas']})")
    if f.get("scale_to_zero_after") and not values["autoscale"]:
        raise InputError(
            "--scale-to-zero-after needs --autoscale: only the autoscaler scales a function to zero"
        )
    if (
        values["keep_alive"] == "adaptive"
        and values["autoscale"]
        and not values["scale_to_zero_after_s"]
    ):
        raise InputError(
            "--keep-alive adaptive on an autoscaled function needs "
            "--scale-to-zero-after (its fixed fallback): without it the "
            "autoscaler never lets the last replica go"
        )
    backend(values["backend"]).check_function(values)
    if not values["ports"]:
        raise InputError("a function needs at least one --port")


def get_function(session: Session, name: str, *, lock: bool = False) -> Function:
    """The function called ``name``, or :class:`NotFound`."""
    check_name(name)
    query = select(Function).where(Function.name == name)
    return one_or_not_found(session, query, f"function {name!r}", lock=lock)


class FunctionView(TypedDict):
    """A function as the CLI and API show it; secrets are never included."""

    id: str
    name: str
    backend: str
    image: str
    kernel: str
    initrd: str
    kernel_args: str
    vm_type: str
    cpu: int
    mem: int
    min: int
    max: int
    target: int | None
    labels: dict[str, Any]
    env: dict[str, Any]
    rootfs: str | None
    ports: list[Any]
    build_version: str
    idle_timeout: float | None
    readiness: str
    exec_envs: int
    gpu_mem: int
    placement: str | None
    autoscale: bool
    scale_to_zero_after: float | None
    keep_alive: str  # fixed | adaptive
    call_attempts: int | None  # attempts of one asynchronous call (None: the default)
    call_max_age: float | None  # seconds (None: the default)
    aws_credentials: str  # "set" or "unset", never the keys
    created_at: str | None
    updated_at: str | None
    replicas: NotRequired[dict[str, int]]  # live replicas by state label (listings, show)
    keep_alive_windows: NotRequired[dict[str, Any]]  # adaptive: the windows now (show)
    live: NotRequired[int]  # their sum (the listing)


def masked_env_args(kernel_args: str) -> str:
    """``kernel_args`` with the value of each ``--env=K=V`` masked (tokens as the agent
    reads them, :func:`netplumb.guest_env.parse_env_args`)."""
    if "--env=" not in kernel_args:
        return kernel_args
    try:
        tokens, quoted = shlex.split(kernel_args), True
    except ValueError:  # unbalanced quotes: the agent splits on spaces, and so does this
        tokens, quoted = kernel_args.split(), False
    return " ".join(
        _masked_env_arg(token) or (shlex.quote(token) if quoted else token) for token in tokens
    )


def _masked_env_arg(token: str) -> str | None:
    """``--env=K=***`` for an ``--env=K=V`` token with a value; None for any other."""
    key, sep, value = token.removeprefix("--env=").partition("=")
    return f"--env={key}={MASK}" if token.startswith("--env=") and sep and value else None


def function_view(
    fn: Function, counts: dict[str, int] | None = None, *, secrets: bool = False
) -> FunctionView:
    """A function as the CLI and API show it: never its AWS keys; its env values and
    ``--env=`` kernel arguments masked unless ``secrets``."""
    kernel_args, labels = fn.kernel_args, fn.labels
    env = dict(fn.env or {})
    if not secrets:
        kernel_args = masked_env_args(kernel_args or "")
        env = {key: MASK if value else value for key, value in env.items()}
        if isinstance((labels or {}).get("KERNEL_ARGS"), str):
            labels = {**labels, "KERNEL_ARGS": masked_env_args(labels["KERNEL_ARGS"])}
    view: FunctionView = {
        "id": fn.id,
        "name": fn.name,
        "backend": fn.backend,
        "image": fn.image,
        "kernel": fn.kernel,
        "initrd": fn.initrd,
        "kernel_args": kernel_args,
        "vm_type": fn.vm_type,
        "cpu": fn.cpu,
        "mem": fn.mem_mb,
        "min": fn.min_replicas,
        "max": fn.max_replicas,
        "target": fn.target,
        "labels": labels,
        "env": env,
        "rootfs": fn.rootfs,
        "ports": fn.ports,
        "build_version": fn.build_version,
        "idle_timeout": fn.idle_timeout_s,
        "readiness": fn.readiness,
        "exec_envs": fn.exec_envs,
        "gpu_mem": fn.gpu_mem_mb,
        "placement": fn.placement,
        "autoscale": fn.autoscale,
        "scale_to_zero_after": fn.scale_to_zero_after_s,
        "keep_alive": fn.keep_alive,
        "call_attempts": fn.call_attempts,
        "call_max_age": fn.call_max_age_s,
        "aws_credentials": "set" if fn.aws_access_key_id or fn.aws_secret_access_key else "unset",
        "created_at": iso(fn.created_at),
        "updated_at": iso(fn.updated_at),
    }
    if counts is not None:
        view["replicas"] = counts
    return view


def list_functions(session: Session) -> list[Function]:
    """Every function, by name."""
    return list(session.scalars(select(Function).order_by(Function.name)))


def replica_counts(session: Session, function_id: str | None = None) -> dict[str, dict[str, int]]:
    """Live replicas per function id and state label (only ``function_id``'s, if given)."""
    query = (
        select(Replica.function_id, Replica.status, func.count())
        .where(Replica.status.in_(LIVE_STATES))
        .group_by(Replica.function_id, Replica.status)
    )
    if function_id is not None:
        query = query.where(Replica.function_id == function_id)
    counts: dict[str, dict[str, int]] = {}
    for fid, status, n in session.execute(query):
        counts.setdefault(fid, {})[ReplicaState(status).label] = n
    return counts


def live_replica_ids(session: Session, fn: Function) -> list[str]:
    """The ids of ``fn``'s live replicas."""
    return list(
        session.scalars(
            select(Replica.id).where(Replica.function_id == fn.id, Replica.status.in_(LIVE_STATES))
        )
    )


def remove_function(session: Session, name: str) -> bool:
    """Delete the function ``name`` unless it has a live replica; whether it was deleted."""
    fn = get_function(session, name, lock=True)
    if live_replica_ids(session, fn):
        return False
    session.delete(fn)
    return True
