"""``corral up``: broker, store, registry, worker, beat, Flower, gateway, metrics, agents.

Start order: embedded Redis (unless ``CORRAL_BROKER_URL`` names one), the SQLite store
(migrated); then, all at once (each needs only those two), the registry, one Celery worker
on the control plane's queues with task events (as ``corral worker`` runs it:
:mod:`stack.worker`) and one on ``corral.invocations`` (asynchronous calls: a queue and
worker of their own), celery beat, Flower, the invocation gateway (http://127.0.0.1:8080
unless that port is taken) and the Prometheus exporter (``corral metrics``,
127.0.0.1:9808 unless taken); once they all serve, an fcdaemon agent (which registers
itself through the registry) and a Lambdo host (added as a node), both with the process
driver (``--driver qemu``: the fcdaemon agent's replicas are QEMU microVMs instead), at
once. A default port is used only when nothing listens there and no other ``corral up``
on this machine claims it (two stacks starting at once would both find it free): each
stack claims the defaults it takes while it runs (:meth:`_Launch.port`); any free port
otherwise. Stop order is the reverse of the start order. Everything lives under the
state directory (``.corral/`` in the working directory by default): data, logs, the lock
that keeps a second ``corral up`` out, the stack's credentials (:mod:`stack.credentials`)
and ``stack.json``, from which the CLI run in the same directory learns the broker,
database and registry addresses and the credentials.

Every listener asks for a credential, on loopback too: the registry and the agents
their tokens (the agent's ``--require-token``), the Lambdo host and the exporter
theirs, Redis a password (``CONFIG``, ``MODULE`` and ``DEBUG`` renamed away), Flower a
user and password (:mod:`stack.flower`: cross-site requests and unknown hosts refused).
Only the gateway's invocations (``/function/NAME``) stay open on loopback unless
``CORRAL_GATEWAY_TOKEN`` is set, as OpenFaaS's and Knative's are.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import select

from config.celery import CONTROL_QUEUES, INVOCATIONS
from config.redact import redact
from config.settings import get_settings, load_settings
from stack.credentials import FILE as CREDENTIALS
from stack.credentials import Credentials, load_or_make
from stack.redis import free_port, redis_argv, write_private_config
from stack.supervisor import Child, Supervisor
from workers.base.kinds import NodeKind
from workers.fleet.nodes import upsert_node
from workers.store.db import get_database
from workers.store.migrate import safe_url, upgrade
from workers.store.models import Node

DEFAULT_PORTS = {
    "redis": 6379,
    "registry": 50052,
    "flower": 5555,
    "fcdaemon": 50051,
    "lambdo": 3000,
    "gateway": 8080,
    "metrics": 9808,
}


class AlreadyRunning(RuntimeError):
    """Another ``corral up`` holds this state directory."""


@dataclass
class UpOptions:
    """What ``corral up`` was asked to run."""

    state_dir: Path
    agents: bool = True
    worker_concurrency: int | None = None  # None: CORRAL_WORKER_CONCURRENCY
    driver: str = "process"  # the fcdaemon agent's: "process" or "qemu" (real microVMs)


def _say(message: str) -> None:
    print(f"corral up: {message}", flush=True)


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.3):
            return True
    except OSError:
        return False


def _private(state_dir: Path) -> None:
    """Make the state directory and all this stack writes readable by this user only.

    It holds the SQLite store (functions' AWS keys), Redis's append-only file (task
    messages) and the logs: the directory becomes 0700, and the umask of this process
    and every child it starts 077 (new files 0600).
    """
    os.umask(0o077)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if state_dir.stat().st_uid == os.getuid():
        state_dir.chmod(0o700)


def _lock(state_dir: Path) -> Any:
    """Hold ``up.lock`` for as long as this process lives (released by the kernel on exit)."""
    _private(state_dir)
    handle = open(state_dir / "up.lock", "a+")  # noqa: SIM115 - held for the process lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        pid = handle.read().strip() or "?"
        handle.close()
        raise AlreadyRunning(
            f"corral up is already running in {state_dir.resolve()} (pid {pid}); "
            "stop it first, or use --state-dir for a second stack"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def run(options: UpOptions) -> int:
    """Run the stack until SIGINT / SIGTERM; returns the exit status."""
    state = options.state_dir.resolve()
    lock = _lock(state)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    sup = Supervisor(_say)
    stop_requested = False

    def _on_signal(signum: int, _frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    stack_file = state / "stack.json"
    try:
        published, services = _start(options, state, logs, sup)
        _write_private(
            stack_file,
            json.dumps({"pid": os.getpid(), "settings": published, "services": services}, indent=2),
        )
        _summary(published, services, state, options, _dataplane(logs / "gateway.log"))
        while not stop_requested:
            sup.watch_once()
            time.sleep(0.5)
        _say("stopping (Ctrl-C)")
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        _say(f"error: {exc}")
        return 1
    finally:
        with contextlib.suppress(OSError):
            stack_file.unlink()
        sup.stop_all()
        _say("stopped; nothing left running")
        lock.close()


def _start(
    options: UpOptions, state: Path, logs: Path, sup: Supervisor
) -> tuple[dict[str, Any], dict[str, str]]:
    """Start every service; returns (settings the CLI should use, where services listen)."""
    base = load_settings()  # validates CORRAL_* now, naming any bad one
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_UNAUTHENTICATED_API"}
    credentials = load_or_make(state, env)
    # CORRAL_* settings for children (by environment, never argv) and the CLI (stack.json)
    published: dict[str, Any] = dict(credentials.settings())
    services: dict[str, str] = {}

    launch = _Launch(sup, env, state, logs)
    broker = os.environ.get("CORRAL_BROKER_URL") or _start_redis(launch, credentials)
    published["broker_url"] = broker
    published["result_backend"] = os.environ.get("CORRAL_RESULT_BACKEND", broker)
    database = os.environ.get("CORRAL_DATABASE_URL") or f"sqlite:///{state / 'corral.sqlite'}"
    published["database_url"] = database
    before, after = upgrade(get_database(database))
    _say(
        f"database {safe_url(database)} at revision {after}"
        + ("" if before == after else f" (migrated from {before or 'empty'})")
    )

    reg_port = launch.port(DEFAULT_PORTS["registry"])
    published["registry_listen"] = services["registry"] = f"127.0.0.1:{reg_port}"
    flower_port = launch.port(base.flower_port or DEFAULT_PORTS["flower"])
    published["flower_port"] = flower_port
    services["flower"] = f"http://127.0.0.1:{flower_port}/"
    for key, value in published.items():
        env["CORRAL_" + key.upper()] = str(value)
    env["CORRAL_STATE_DIR"] = str(state)

    with launch.together():  # each needs only the broker and the store
        launch.start(
            "registry", [PY, "-m", "corral.cli", "registry"], ready=lambda: _port_open(reg_port)
        )
        _start_celery(launch, options, credentials, flower_port)
        services["gateway"] = _start_http(launch, "gateway", ["corral.cli", "gateway"], "")
        services["metrics"] = _start_http(launch, "metrics", ["corral.cli", "metrics"], "/metrics")
    if options.agents:
        services.update(_start_agents(launch, database, reg_port, options.driver))
    return published, services


PY = sys.executable


@dataclass
class _Launch:
    """How the stack's children start: one supervisor, one environment, the state and logs
    directories (a child's log is ``logs/<name>.log``)."""

    sup: Supervisor
    env: dict[str, str]
    state: Path
    logs: Path
    _waits: list[tuple[Child, Callable[[], bool] | None, float]] | None = None
    _claims: list[int] = field(default_factory=list)

    def port(self, preferred: int) -> int:
        """``preferred`` unless in use or claimed by another ``corral up``; else any free port.

        A port is free only until its child binds it, a second later: two stacks starting
        at once would both find the default free. The claim (an exclusive ``flock`` on
        ``corral-ports-<uid>/<port>`` in the temporary directory, held while this stack
        runs) keeps a second stack to another port.
        """
        fd = _claim(preferred)
        if fd is not None:
            if free_port(preferred) == preferred:
                self._claims.append(fd)
                return preferred
            os.close(fd)
        return free_port()

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        ready: Callable[[], bool] | None = None,
        timeout: float = 60.0,
    ) -> None:
        """Start child ``name`` and wait until ``ready()`` says it serves (inside
        :meth:`together`: when the block ends)."""
        child = self.sup.launch(Child(name, argv, self.env, self.logs / f"{name}.log", self.state))
        wait = (child, ready, timeout)
        if self._waits is None:
            self.sup.wait_ready([wait])
        else:
            self._waits.append(wait)

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Children started in the block start at once; its end waits until each serves."""
        self._waits = []
        try:
            yield
            self.sup.wait_ready(self._waits)
        finally:
            self._waits = None


def _claim(port: int) -> int | None:
    """An open descriptor holding ``port``'s claim, or None if another process holds it."""
    folder = Path(tempfile.gettempdir()) / f"corral-ports-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if folder.stat().st_uid != os.getuid():
            raise PermissionError(folder)  # another user's folder: its claims mean nothing
        fd = os.open(folder / str(port), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # no private folder to claim in: the port is only checked free
        return os.open(os.devnull, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _start_redis(launch: _Launch, credentials: Credentials) -> str:
    """Start the embedded Redis (a password, no ``CONFIG``...: :mod:`stack.redis`); its URL."""
    data = launch.state / "redis"
    data.mkdir(exist_ok=True)
    config = write_private_config(data / "corral.conf", credentials.redis_password)
    port = launch.port(DEFAULT_PORTS["redis"])
    launch.start(
        "redis",
        redis_argv(data, port, config=config),
        ready=lambda: _port_open(port),
        timeout=20,
    )
    return f"redis://:{quote(credentials.redis_password, safe='')}@127.0.0.1:{port}/0"


INVOKER_CONCURRENCY = 16  # asynchronous calls one invoker runs at once (each waits on a replica)


def _start_celery(
    launch: _Launch, options: UpOptions, credentials: Credentials, flower_port: int
) -> None:
    """Start the worker, beat and Flower (on loopback, behind the stack's user and password)."""
    worker_log = launch.logs / "worker.log"
    launch.start(
        "worker",
        [  # `corral worker`: the worker under the supervisor that keeps its hard time limits
            PY,
            "-m",
            "stack.worker",
            "-E",
            "-l",
            "INFO",
            *(["-c", str(options.worker_concurrency)] if options.worker_concurrency else []),
            "-n",
            "corral@%h",
            "-Q",
            ",".join(CONTROL_QUEUES),
        ],
        ready=lambda: worker_log.exists() and b" ready." in worker_log.read_bytes(),
        timeout=60,
    )
    invoker_log = launch.logs / "invoker.log"
    launch.start(
        "invoker",
        [  # asynchronous calls: their own worker, so a backlog never delays the control plane
            PY,
            "-m",
            "stack.worker",
            "-E",
            "-l",
            "INFO",
            "-c",
            str(INVOKER_CONCURRENCY),
            "-n",
            "invoker@%h",
            "-Q",
            INVOCATIONS,
        ],
        ready=lambda: invoker_log.exists() and b" ready." in invoker_log.read_bytes(),
        timeout=60,
    )
    launch.start(
        "beat",
        [
            PY,
            "-m",
            "workers.command",
            "beat",
            "-l",
            "INFO",
            "-s",
            str(launch.state / "beat-schedule"),
        ],
    )
    flower_argv = [PY, "-m", "stack.flower", f"--port={flower_port}", "--address=127.0.0.1"]
    # through the environment, not argv, so `ps` does not show the password
    user, password = credentials.flower_user, credentials.flower_password
    launch.env["FLOWER_BASIC_AUTH"] = f"{user}:{password}"
    launch.start("flower", flower_argv, ready=lambda: _port_open(flower_port), timeout=60)


def _start_http(launch: _Launch, name: str, module_args: list[str], path: str) -> str:
    """Start one of corral's HTTP services on a loopback port; its URL."""
    port = launch.port(DEFAULT_PORTS[name])
    launch.start(
        name,
        [PY, "-m", *module_args, "--listen", f"127.0.0.1:{port}"],
        ready=lambda: _port_open(port),
        timeout=30,
    )
    return f"http://127.0.0.1:{port}{path}"


def _fcdaemon_driver(driver: str, state: Path) -> tuple[list[str], float]:
    """The fcdaemon agent's driver options, and how long it may take to start serving.

    ``qemu``: its VMs' state lives in the state directory (a restarted stack adopts the
    VMs a killed agent left), and its first start may fetch and unpack the guest kernel
    and probe KVM.
    """
    if driver != "qemu":
        return ["--driver", "process"], 30.0
    return ["--driver", "qemu", "--qemu-state", str(state / "qemu")], 180.0


def _start_agents(
    launch: _Launch, database: str, reg_port: int, driver: str = "process"
) -> dict[str, str]:
    """Start a local fcdaemon agent and Lambdo host, registered as nodes; their addresses."""
    driver_args, ready_s = _fcdaemon_driver(driver, launch.state)
    with launch.together():  # the agent registers through the registry, up by now
        fc_port = launch.port(DEFAULT_PORTS["fcdaemon"])
        launch.start(
            "fcdaemon",
            [
                PY,
                "-m",
                "agents.fcdaemon",
                "--listen",
                f"127.0.0.1:{fc_port}",
                "--registry",
                f"127.0.0.1:{reg_port}",
                "--node-id",
                "local-fcdaemon",
                *driver_args,
            ],
            ready=lambda: _node_registered(database, "local-fcdaemon"),
            timeout=ready_s,
        )
        lb_port = launch.port(DEFAULT_PORTS["lambdo"])
        lambdo = f"http://127.0.0.1:{lb_port}"
        launch.start(
            "lambdo",
            [PY, "-m", "agents.lambdo", "--listen", f"127.0.0.1:{lb_port}", "--driver", "process"],
            ready=lambda: _port_open(lb_port),
        )
    _add_lambdo_node(database, lambdo)
    return {"fcdaemon": f"127.0.0.1:{fc_port}", "lambdo": lambdo}


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` readable and writable by this user only (settings trust nothing else)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _node_registered(database: str, external_id: str) -> bool:

    with get_database(database).read() as s:
        return s.scalar(select(Node.id).where(Node.external_id == external_id)) is not None


def _add_lambdo_node(database: str, url: str) -> None:
    with get_database(database).transaction() as s:
        upsert_node(
            s,
            url,
            name="local-lambdo",
            kind=NodeKind.LAMBDO,
            default_capacity=get_settings().node_capacity,
        )


DATAPLANE_WAIT_S = 10.0  # how long the gateway may take to say which data plane it runs


def _dataplane(log: Path) -> str:
    """The data plane the gateway says it runs (``corral gateway`` prints it once serving)."""
    deadline = time.monotonic() + DATAPLANE_WAIT_S
    while True:
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("data plane: "):
                    return line.removeprefix("data plane: ")
        if time.monotonic() > deadline:
            return "not said yet (see its log)"
        time.sleep(0.05)


def _summary(
    published: dict[str, Any],
    services: dict[str, str],
    state: Path,
    options: UpOptions,
    dataplane: str,
) -> None:
    lines = [
        "corral is up",
        f"  state directory  {state}",
        f"  broker           {redact(published['broker_url'])}",
        f"  database         {redact(published['database_url'])}",
        f"  registry         {services['registry']}",
        f"  flower           {services['flower']} (user {published['flower_user']}, "
        f"password: flower_password in {CREDENTIALS})",
        f"  gateway          {services['gateway']} (call {services['gateway']}/function/NAME)",
        f"  data plane       {dataplane}",
        f"  metrics          {services['metrics']} (Prometheus; bearer token: metrics_token "
        f"in {CREDENTIALS})",
        f"  credentials      {state / CREDENTIALS} (tokens and passwords of every listener)",
    ]
    if options.agents:
        lines += [
            f"  fcdaemon agent   {services['fcdaemon']} (node local-fcdaemon, {options.driver})",
            f"  lambdo host      {services['lambdo']} (node local-lambdo)",
        ]
    lines += [
        f"  logs             {state / 'logs'}",
        "run `corral ...` from this directory in another terminal; Ctrl-C stops everything",
    ]
    print("\n".join(lines), flush=True)
