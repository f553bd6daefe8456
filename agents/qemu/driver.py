"""The ``qemu`` driver: every replica a QEMU microVM booting a real Linux guest.

The model
---------
:class:`QemuDriver` is a :class:`~agents.drivers.VMDriver`: ``start`` returns once the
guest answers HTTP on its host port, so a create's answer means a replica that serves
(the agent's READY follows at once). Readiness is the agent's: the guest's network is
``restrict=on`` and reaches no registry. A start is one of two kinds, reported on the VM
(``VM.start``, the ``CreateReply.start`` extension, ``corral ops OP --json``):

* **boot**: QEMU boots the kernel and the image of the function's build
  (:mod:`agents.qemu.image`); the guest loads the function and says ``loaded`` on its
  control port. If the build has no snapshot yet, the driver takes one now (QMP
  ``stop``, ``migrate`` to a file, ``cont``: :mod:`agents.qemu.snapshots`) and publishes
  it once this replica has answered;
* **restore**: QEMU starts with ``-incoming`` on the build's snapshot and is ``cont``-ed:
  the guest is where the snapshot left it, loaded and waiting for an identity.

Either way the driver then sends the guest its identity (environment with ``VMID`` and
the report token, fresh random bytes, the time) and waits for its port to answer. All of
it within ``boot_timeout`` (the create deadline): a guest that is not serving by then is
killed, and the create fails with the tail of its console.

**What runs is what QEMU runs.** A VM whose QEMU process exited is gone: ``list`` and
``get`` drop it (its ports and directory are freed). Each VM has a directory in the
driver's state directory (QMP and control sockets, ``vm.json``); QEMU is not tied to the
agent's life, so an agent that crashes leaves its VMs running, and the next agent on the
same state directory **adopts** every VM that was serving (its QEMU still the one
recorded, answering QMP) and kills the rest: nothing is left orphaned. A clean stop
(``close``) stops every VM, as the other drivers do.

**Disk** is bounded: one kernel, at most ``max_images`` images and ``max_snapshots``
snapshots (least recently used go first); a VM's directory goes with the VM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.drivers import (
    VM,
    BadSpec,
    DriverError,
    PortAllocator,
    VMSpec,
    check_module_name,
    image_module,
    validate_ports,
)
from agents.qemu.cache import cache_secret, default_cache
from agents.qemu.image import Image, ImageCache, ImageError, Runtime
from agents.qemu.kernel import prepare_kernel
from agents.qemu.machine import Machine, Qemu, QemuError, command, machine, probe_accel
from agents.qemu.qmp import Monitor, QmpError, QmpLoop
from agents.qemu.snapshots import SnapshotKey, Snapshots
from agents.runtime import http_answers
from netplumb import guest_env
from netplumb.addresses import is_wildcard

__all__ = ["QemuDriver", "default_cache"]

log = logging.getLogger(__name__)

#: Bytes of one control line from a guest (it is untrusted: longer lines are refused).
MAX_CONTROL_LINE = 64 * 1024
MIN_MEM_MB, DEFAULT_MEM_MB = 128, 256
#: How often the port of a guest that has not said it listens is probed.
SERVING_POLL_S = 0.1
#: Unix socket paths must fit in ``sun_path`` (108 bytes).
_MAX_SOCKET_PATH = 100
_PRINTABLE = re.compile(r"[^\x20-\x7e\n\t]")


@dataclass
class _Guest:
    """One VM: what corral sees (``vm``) and what runs it."""

    vm: VM
    directory: Path
    pid: int
    pidfd: int
    proc: subprocess.Popen[bytes] | None  # None: adopted from an earlier agent
    monitor: Monitor | None = None
    ready: bool = False  # serving: listed, and adopted by the next agent
    closed: bool = field(default=False)


class _Phases:
    """When each phase of a start ended, for the log (``qemu 0.09s, loaded 0.21s...``)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        """Phase ``name`` ends now."""
        self.marks.append((name, time.monotonic() - self.started))

    def __str__(self) -> str:
        return ", ".join(f"{name} {at:.2f}s" for name, at in self.marks)


@dataclass(frozen=True)
class _Plan:
    """One start: the request, the image and machine, ports, deadline, snapshot."""

    spec: VMSpec
    vmid: str
    image: Image
    machine: Machine
    mapping: list[tuple[int, int]]
    deadline: float
    key: SnapshotKey
    slot: str
    restore: Path | None = None  # the snapshot to restore from (None: boot)
    phases: _Phases = field(default_factory=lambda: _Phases())

    @property
    def kind(self) -> str:
        """``restore`` or ``boot``."""
        return "restore" if self.restore is not None else "boot"


def _slot(module: str, m: Machine) -> str:
    """A snapshot's slot: the image and the VM's shape (``examples.hello@256m1c``)."""
    return f"{module}@{m.mem_mb}m{m.cpus}c"


class _StartFailed(Exception):
    """A start failed; the guest is torn down by the caller."""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (a pidfd polls readable then)."""
    try:
        ready, _, _ = select.select([pidfd], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(ready)


def _wait_exit(pidfd: int, timeout: float) -> bool:
    try:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout))
    except (OSError, ValueError):
        return True
    return bool(ready)


class _Control:
    """The host end of a guest's control port: JSON lines, bounded, never executed."""

    def __init__(self, path: Path, deadline: float) -> None:
        self._buf = b""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        while True:
            try:
                self.sock.connect(str(path))
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.sock.close()
                    raise _StartFailed("QEMU never opened the control socket") from None
                time.sleep(0.005)

    def event(
        self, want: str, deadline: float, alive: Callable[[], bool], *, or_none: bool = False
    ) -> dict[str, Any] | None:
        """The guest's next event ``want`` (a JSON object whose ``event`` is it; others are
        passed over); at the deadline, None with ``or_none``, else _StartFailed. A
        ``failed`` event fails the start."""
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                with contextlib.suppress(ValueError):
                    message = json.loads(line)
                    if isinstance(message, dict) and isinstance(message.get("event"), str):
                        if message["event"] == "failed":
                            error = _PRINTABLE.sub("?", str(message.get("error", "")))[-2000:]
                            raise _StartFailed(f"the function failed: {error}")
                        if message["event"] == want:
                            return message
            if len(self._buf) > MAX_CONTROL_LINE:
                raise _StartFailed("the guest sent an overlong control line")
            left = deadline - time.monotonic()
            if left <= 0:
                if or_none:
                    return None
                raise _StartFailed("timed out")
            self.sock.settimeout(min(left, 0.25))
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                if not alive():
                    raise _StartFailed("QEMU exited") from None
                continue
            except OSError as exc:
                raise _StartFailed(f"control port: {exc}") from None
            if not chunk:
                raise _StartFailed("QEMU exited" if not alive() else "control port closed")
            self._buf += chunk

    def send(self, message: dict[str, Any], deadline: float) -> None:
        """Send one JSON line."""
        self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError as exc:
            raise _StartFailed(f"control port: {exc}") from None

    def close(self) -> None:
        """Close the socket."""
        with contextlib.suppress(OSError):
            self.sock.close()


class QemuDriver:
    """Replicas as QEMU microVMs with real guests, snapshots and adoption (see the module)."""

    def __init__(  # noqa: PLR0913 - keyword-only options with defaults
        self,
        port_range: tuple[int, int] = (20000, 29999),
        *,
        cache: Path | None = None,
        state: Path | None = None,
        bind_host: str = "127.0.0.1",
        advertise_ip: str | None = None,
        accel: str = "auto",
        boot_timeout: float = 25.0,
        snapshots: bool = True,
        allow_images: Iterable[str] = (),
        env: dict[str, str] | None = None,
        max_mem_mb: int = 2048,
        max_images: int = 8,
        max_snapshots: int = 8,
        max_snapshot_bytes: int = 4 << 30,
        qemu: str | None = None,
        python: str | None = None,
        busybox: str | None = None,
        tsc_khz: int | None = None,
        download: bool = True,
        run_as: str | None = "nobody",
    ) -> None:
        """Prepare the kernel, runtime and QEMU (QemuError, KernelError, ImageError when
        one is missing), choose the accelerator, and adopt the VMs left in ``state``."""
        if accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"accel must be auto, kvm or tcg, not {accel!r}")
        self.allow_images = frozenset(check_module_name(m) for m in allow_images)
        self.cache = (cache or default_cache()).resolve()
        self.state = (state or self.cache / "run" / "default").resolve()
        if len(str(self.state / ("x" * 16) / "ctl.sock")) > _MAX_SOCKET_PATH:
            raise QemuError(f"state directory {self.state} is too long for unix sockets")
        self.cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.bind_host = bind_host
        self.ip = advertise_ip or ("127.0.0.1" if is_wildcard(bind_host) else bind_host)
        self.boot_timeout = boot_timeout
        self.snapshots_on = snapshots
        self.max_mem_mb = max(MIN_MEM_MB, max_mem_mb)
        self._env = dict(env or {})
        self._tsc_khz = tsc_khz
        #: The user QEMU becomes after start-up (only an agent running as root can say one).
        self.run_as = run_as if os.geteuid() == 0 else None
        self.qemu = Qemu.find(qemu)
        self.kernel = prepare_kernel(self.cache, download=download)
        self.runtime = Runtime.find(python, busybox)
        self.images = ImageCache(self.cache, self.kernel, self.runtime, max_images)
        self._secret = cache_secret(self.cache)
        self.snapshots = Snapshots(
            self.cache, max_snapshots=max_snapshots, max_bytes=max_snapshot_bytes
        )
        if accel == "auto":
            self.accel, why = probe_accel(self.cache, self.qemu, self.kernel, self.runtime.busybox)
        else:
            self.accel, why = accel, "chosen with --qemu-accel"
        log.info(
            "qemu driver: %s (%s); %s; kernel %s; guests run %s %s; cache %s; state %s",
            self.accel.upper(),
            why,
            self.qemu.version,
            self.kernel.key,
            self.runtime.python,
            self.runtime.version,
            self.cache,
            self.state,
        )
        self._ports = PortAllocator(*port_range, host=bind_host)
        self._qmp = QmpLoop()
        self._guests: dict[str, _Guest] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._counts = {"boot": 0, "restore": 0, "restore_failed": 0, "adopted": 0, "killed": 0}
        self._adopt()

    # -- the VM's parts --------------------------------------------------------------------

    def _machine(self, spec: VMSpec) -> Machine:
        mem = spec.mem_mb if spec.mem_mb > 0 else DEFAULT_MEM_MB
        mem = min(max(mem, MIN_MEM_MB), self.max_mem_mb)
        cpus = min(max(spec.cpu, 1), os.cpu_count() or 1)
        return machine(self.qemu, self.accel, mem, cpus, self._tsc_khz)

    def _snapshot_key(self, image: Image, m: Machine, spec: VMSpec) -> SnapshotKey:
        env = json.dumps(self._start_env(spec), sort_keys=True).encode()
        return SnapshotKey(
            build=image.key,
            env=hmac.new(self._secret, env, hashlib.sha256).hexdigest()[:32],
            kernel=self.kernel.key,
            qemu=m.qemu,
            accel=m.accel,
            cpu_model=m.cpu_model,
            mem_mb=m.mem_mb,
            cpus=m.cpus,
            append=m.append,
            devices=m.devices,
        )

    def _start_env(self, spec: VMSpec) -> dict[str, str]:
        """What every replica of a build shares: the function's variables, its port."""
        own = {"PORT": str(spec.guest_port), "HOST": "0.0.0.0", "HOME": "/root"}  # noqa: S104 - the guest's own interface
        return guest_env.guest_environment(spec.checked_env(), {**self._env, **own})

    def _identity(self, spec: VMSpec, vmid: str) -> dict[str, Any]:
        """What is one replica's own: its id and the agent's variables, randomness, the time."""
        env = {**spec.agent_env, "VMID": vmid}
        return {"kind": "identity", "env": env, "seed": os.urandom(32).hex(), "time": time.time()}

    # -- start -----------------------------------------------------------------------------

    def start(self, spec: VMSpec) -> VM:
        """Boot or restore one replica; it answers on its host port when this returns."""
        if self._closed:
            raise DriverError("driver is closed")
        module = image_module(spec.image, self.allow_images)
        spec.checked_env()
        guest_ports = validate_ports(spec)
        vmid = spec.vmid or uuid.uuid4().hex
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", vmid):
            raise BadSpec(f"vmid {vmid!r} is not a plain name")
        try:
            image = self.images.image(module)
        except (ImageError, OSError) as exc:
            raise DriverError(f"cannot build the image of {module!r}: {exc}") from exc
        m = self._machine(spec)
        key = self._snapshot_key(image, m, spec)
        slot = _slot(module, m)
        deadline = time.monotonic() + self.boot_timeout
        mapping = self._ports.map(guest_ports, spec.host_ports)
        state = self.snapshots.find(slot, key) if self.snapshots_on else None
        plan = _Plan(spec, vmid, image, m, mapping, deadline, key, slot)
        try:
            if state is not None:
                try:
                    return self._start(dataclasses.replace(plan, restore=state, phases=_Phases()))
                except DriverError as exc:
                    with self._lock:
                        self._counts["restore_failed"] += 1
                    if time.monotonic() > deadline - 1.0:
                        raise
                    # not out of time: the snapshot itself failed (QEMU refused it, say)
                    self.snapshots.discard(plan.slot, key)
                    log.warning(
                        "restore of %s failed (%s); snapshot deleted, booting cold", vmid, exc
                    )
            return self._start(dataclasses.replace(plan, phases=_Phases()))
        except BaseException:
            self._ports.release(h for h, _ in mapping)
            raise

    def _start(self, plan: _Plan) -> VM:
        """Bring one VM up as ``plan`` says; DriverError (the VM torn down) if it fails."""
        directory = self.state / plan.vmid[:16]
        if directory.exists():
            raise DriverError(f"vmid {plan.vmid} is in use")
        directory.mkdir(mode=0o700)
        started = time.monotonic()
        holder: list[_Guest] = []
        try:
            guest = self._bring_up(plan, directory, holder)
        except (_StartFailed, QmpError, OSError) as exc:
            guest_or_none = holder[0] if holder else None
            tail = self._console_tail(guest_or_none) if guest_or_none is not None else ""
            self._kill(guest_or_none, directory)
            timed_out = time.monotonic() >= plan.deadline
            why = "timed out" if timed_out else str(exc)
            log.warning(
                "replica %s (%s of %s) failed after %.1fs: %s%s",
                plan.vmid,
                plan.kind,
                plan.image.module,
                time.monotonic() - started,
                why,
                f"; console: {tail}" if tail else "",
            )
            killed = f" (after {self.boot_timeout:.0f}s, killed)" if timed_out else ""
            raise DriverError(
                f"guest {plan.vmid} of {plan.image.module!r} not serving ({plan.kind}): {why}"
                + killed
            ) from None
        except BaseException:
            self._kill(holder[0] if holder else None, directory)
            raise
        guest.ready = True
        self._record(guest, ready=True)
        with self._lock:
            self._counts[plan.kind] += 1
            closed = self._closed
        if closed:
            self.stop(plan.vmid)
            raise DriverError("driver is closed")
        log.info(
            "replica %s: %s %s in %.2fs (%s; pid %d, port %d)",
            plan.vmid,
            "restored" if plan.restore is not None else "booted",
            plan.image.module,
            time.monotonic() - started,
            plan.phases,
            guest.pid,
            guest.vm.port,
        )
        return dataclasses.replace(guest.vm, port_mapping=list(guest.vm.port_mapping))

    def _bring_up(self, plan: _Plan, directory: Path, holder: list[_Guest]) -> _Guest:
        """Launch, load or resume, snapshot (first boot of a build), identity, serving."""
        deadline = plan.deadline
        mark = plan.phases.mark
        with contextlib.ExitStack() as stack:
            staging = None
            if plan.restore is None and self.snapshots_on:
                staging = stack.enter_context(self.snapshots.taking(plan.slot, plan.key))
            guest = self._launch(plan, directory, holder)
            mark("qemu")
            monitor = guest.monitor
            assert monitor is not None  # noqa: S101 - _launch connects it

            def alive() -> bool:
                return not _exited(guest.pidfd)

            control = stack.enter_context(
                contextlib.closing(_Control(directory / "ctl.sock", deadline))
            )
            if plan.restore is not None:
                self._resume(monitor, deadline, alive)
                mark("loaded")
            else:
                control.send({"kind": "start", "env": self._start_env(plan.spec)}, deadline)
                self._wait_serving(guest, control, deadline, alive, mark)
                mark("serving")
                if staging is not None:
                    if not self._save(monitor, staging, deadline):
                        staging = None
                    mark("snapshot")
            control.send(self._identity(plan.spec, plan.vmid), deadline)
            control.event("identity", deadline, alive)
            mark("identity")
            self._wait_answer(guest, deadline, alive)
            mark("answered")
            if staging is not None:
                self.snapshots.publish(plan.slot, plan.key, staging)
                log.info("snapshot of %s (%s) published", plan.slot, plan.image.key[:12])
        return guest

    def _launch(self, plan: _Plan, directory: Path, holder: list[_Guest]) -> _Guest:
        """Start QEMU for one VM and connect its monitor; the guest is recorded (and put in
        ``holder`` as soon as it runs, for the caller to tear down on failure)."""
        host = "0.0.0.0" if is_wildcard(self.bind_host) else self.bind_host  # noqa: S104 - the operator's bind host
        forwards = [(host, hp, gp) for hp, gp in plan.mapping]
        restore = plan.restore
        fd = os.open(restore, os.O_RDONLY | os.O_CLOEXEC) if restore is not None else None
        argv = command(
            self.qemu,
            plan.machine,
            self.kernel.vmlinux,
            plan.image.initrd,
            directory,
            forwards,
            incoming_fd=fd,
            run_as=self.run_as,
        )
        try:
            with open(directory / "qemu.log", "wb") as out:
                proc = subprocess.Popen(  # noqa: S603 - QEMU with an argv this driver built
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(fd,) if fd is not None else (),
                    env={"PATH": guest_env.SAFE_PATH},
                )
        finally:
            if fd is not None:
                os.close(fd)
        pidfd = os.pidfd_open(proc.pid)
        vm = VM(
            vmid=plan.vmid,
            ip=self.ip,
            port=plan.mapping[0][0],
            request_id=plan.spec.request_id,
            created_unix=time.time(),
            pid=proc.pid,
            port_mapping=list(plan.mapping),
            image=plan.spec.image,
            start=plan.kind,
        )
        guest = _Guest(vm, directory, proc.pid, pidfd, proc)
        holder.append(guest)
        self._record(guest, ready=False)
        with self._lock:
            self._guests[plan.vmid] = guest
        monitor = Monitor(self._qmp, directory / "qmp.sock", f"vm-{plan.vmid[:8]}")
        guest.monitor = monitor
        try:
            monitor.connect(10.0)
        except QmpError as exc:
            raise _StartFailed(f"QEMU did not start: {self._qemu_log(directory)}") from exc
        return guest

    def _resume(self, monitor: Monitor, deadline: float, alive: Any) -> None:
        """Wait for an incoming snapshot to be loaded, then run the VM."""
        while True:
            status = monitor.execute("query-status", timeout=max(0.1, deadline - time.monotonic()))
            if status.get("status") != "inmigrate":
                break
            if time.monotonic() > deadline:
                raise _StartFailed("timed out")
            if not alive():
                raise _StartFailed("QEMU exited while loading the snapshot")
            time.sleep(0.005)
        monitor.execute("cont", timeout=max(0.1, deadline - time.monotonic()))

    def _save(self, monitor: Monitor, staging: Path, deadline: float) -> bool:
        """Snapshot a loaded guest to ``staging`` and run it again; False if that failed."""
        started = time.monotonic()
        ok = False
        try:
            monitor.execute("stop")
            monitor.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
            fd = os.open(staging, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
            try:
                monitor.send_fd(fd, "corral-snapshot")
            finally:
                os.close(fd)
            monitor.execute("migrate", {"uri": "fd:corral-snapshot"})
            while True:
                info = monitor.execute("query-migrate")
                status = info.get("status")
                if status in ("completed", "failed", "cancelled"):
                    ok = status == "completed"
                    if not ok:
                        log.warning("snapshot failed: %s", info.get("error-desc", status))
                    break
                if time.monotonic() > deadline:
                    with contextlib.suppress(QmpError):
                        monitor.execute("migrate_cancel")
                    log.warning("snapshot not finished in time; abandoned")
                    break
                time.sleep(0.01)
        except (QmpError, OSError) as exc:
            log.warning("snapshot failed: %s", exc)
        finally:
            monitor.execute("cont")
        if ok:
            log.info(
                "snapshot written in %.2fs (%d MiB)",
                time.monotonic() - started,
                staging.stat().st_size >> 20,
            )
        return ok

    def _wait_serving(
        self,
        guest: _Guest,
        control: _Control,
        deadline: float,
        alive: Callable[[], bool],
        mark: Callable[[str], None],
    ) -> None:
        """Wait until a booting guest's function answers HTTP: probed when the guest says
        it listens, and every ``SERVING_POLL_S`` until then (it may listen some other way)."""
        told = False
        while True:
            if not told:
                poll = min(deadline, time.monotonic() + SERVING_POLL_S)
                if control.event("listening", poll, alive, or_none=True) is not None:
                    told = True
                    mark("listening")
            if self._answers(guest, deadline, alive):
                return
            if told:
                time.sleep(0.01)

    def _wait_answer(self, guest: _Guest, deadline: float, alive: Callable[[], bool]) -> None:
        """Wait until the guest's port answers HTTP."""
        while not self._answers(guest, deadline, alive):
            time.sleep(0.01)

    def _answers(self, guest: _Guest, deadline: float, alive: Callable[[], bool]) -> bool:
        """Whether the guest's port answers ``GET /`` now; _StartFailed past the deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise _StartFailed("timed out")
        if not alive():
            raise _StartFailed("QEMU exited")
        host = "127.0.0.1" if is_wildcard(self.bind_host) else self.bind_host
        return http_answers(host, guest.vm.port, min(1.0, max(0.05, left)))

    # -- records, console, teardown ----------------------------------------------------------

    def _record(self, guest: _Guest, *, ready: bool) -> None:
        vm = guest.vm
        _write_json(
            guest.directory / "vm.json",
            {
                "vmid": vm.vmid,
                "request_id": vm.request_id,
                "image": vm.image,
                "ip": vm.ip,
                "port_mapping": vm.port_mapping,
                "created_unix": vm.created_unix,
                "pid": guest.pid,
                "start": vm.start,
                "ready": ready,
            },
        )

    def _console_tail(self, guest: _Guest, chars: int = 1500) -> str:
        """The end of the guest's console (untrusted: printable ASCII only, bounded)."""
        if guest.monitor is None or _exited(guest.pidfd):
            return ""
        try:
            text = guest.monitor.execute(
                "ringbuf-read", {"device": "con", "size": 65536, "format": "utf8"}, timeout=2.0
            )
        except QmpError:
            return ""
        return _PRINTABLE.sub("?", str(text))[-chars:].replace("\n", " | ").strip()

    @staticmethod
    def _qemu_log(directory: Path) -> str:
        with contextlib.suppress(OSError):
            text = (directory / "qemu.log").read_bytes()[-2000:].decode("utf-8", "replace")
            return _PRINTABLE.sub("?", text).strip().replace("\n", " | ") or "no output"
        return "no output"

    def _kill(self, guest: _Guest | None, directory: Path, grace: float = 0.0) -> None:
        """Stop a VM's QEMU (``quit``, then SIGKILL after ``grace``), free its parts."""
        if guest is not None:
            with self._lock:
                if self._guests.get(guest.vm.vmid) is guest:
                    del self._guests[guest.vm.vmid]
                if guest.closed:
                    return
                guest.closed = True
            if guest.monitor is not None:
                if grace > 0 and not _exited(guest.pidfd):
                    with contextlib.suppress(QmpError):
                        guest.monitor.execute("quit", timeout=grace)
                guest.monitor.close()
            if not _wait_exit(guest.pidfd, grace):
                with contextlib.suppress(ProcessLookupError, OSError):
                    signal.pidfd_send_signal(guest.pidfd, signal.SIGKILL)
                _wait_exit(guest.pidfd, 5.0)
            if guest.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    guest.proc.wait(1.0)
            with contextlib.suppress(OSError):
                os.close(guest.pidfd)
            self._ports.release(h for h, _ in guest.vm.port_mapping)
        shutil.rmtree(directory, ignore_errors=True)

    # -- adoption ----------------------------------------------------------------------------

    def _adopt(self) -> None:
        """Adopt the serving VMs an earlier agent left in the state directory; kill the rest."""
        for directory in sorted(p for p in self.state.iterdir() if p.is_dir()):
            record = _read_json(directory / "vm.json") or {}
            pid = record.get("pid")
            pidfd = None
            if isinstance(pid, int) and pid > 0:
                with contextlib.suppress(OSError):
                    pidfd = os.pidfd_open(pid)
            ours = pidfd is not None and isinstance(pid, int) and self._runs_here(pid, directory)
            guest = None
            if ours and pidfd is not None:
                guest = self._adoptable(record, directory, pidfd)
            if guest is not None:
                with self._lock:
                    self._guests[guest.vm.vmid] = guest
                    self._counts["adopted"] += 1
                log.info(
                    "adopted replica %s (pid %d, port %d)", guest.vm.vmid, guest.pid, guest.vm.port
                )
                continue
            if ours and pidfd is not None:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                _wait_exit(pidfd, 5.0)
                with self._lock:
                    self._counts["killed"] += 1
                log.warning(
                    "killed VM %s left by an earlier agent (pid %s): not serving",
                    directory.name,
                    pid,
                )
            if pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(pidfd)
            shutil.rmtree(directory, ignore_errors=True)

    @staticmethod
    def _runs_here(pid: int, directory: Path) -> bool:
        """Whether ``pid`` is a QEMU of this VM directory (not a reused pid)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return str(directory / "qmp.sock").encode() in cmdline

    def _adoptable(self, record: dict[str, Any], directory: Path, pidfd: int) -> _Guest | None:
        """The guest a VM's record describes if it was serving and still runs; else None."""
        try:
            mapping = [(int(h), int(g)) for h, g in record["port_mapping"]]
            vm = VM(
                vmid=str(record["vmid"]),
                ip=str(record["ip"]),
                port=mapping[0][0],
                request_id=str(record.get("request_id") or ""),
                created_unix=float(record["created_unix"]),
                pid=int(record["pid"]),
                port_mapping=mapping,
                image=str(record.get("image") or ""),
                start=str(record.get("start") or ""),
            )
        except (KeyError, TypeError, ValueError, IndexError):
            return None
        if not record.get("ready") or _exited(pidfd):
            return None
        monitor = Monitor(self._qmp, directory / "qmp.sock", f"vm-{vm.vmid[:8]}")
        try:
            monitor.connect(5.0)
            status = monitor.execute("query-status", timeout=5.0)
        except QmpError:
            monitor.close()
            return None
        if status.get("status") != "running":
            monitor.close()
            return None
        self._ports.claim(h for h, _ in mapping)
        return _Guest(vm, directory, vm.pid or 0, pidfd, None, monitor, ready=True)

    # -- the driver interface ----------------------------------------------------------------

    def _alive(self, guest: _Guest) -> bool:
        if not _exited(guest.pidfd):
            return True
        code = guest.proc.poll() if guest.proc is not None else None
        log.warning(
            "replica %s: QEMU (pid %d) exited (code %s): VM gone", guest.vm.vmid, guest.pid, code
        )
        self._kill(guest, guest.directory)
        return False

    def get(self, vmid: str) -> VM | None:
        """The live VM with this id, or None (a VM whose QEMU exited is dropped)."""
        with self._lock:
            guest = self._guests.get(vmid)
        if guest is None or not guest.ready or not self._alive(guest):
            return None
        return dataclasses.replace(guest.vm, port_mapping=list(guest.vm.port_mapping))

    def stop(self, vmid: str) -> bool:
        """Stop one VM (QMP ``quit``, SIGKILL if it lingers); False if unknown."""
        with self._lock:
            guest = self._guests.get(vmid)
        if guest is None:
            return False
        self._kill(guest, guest.directory, grace=2.0)
        log.info("replica %s: stopped (pid %d)", vmid, guest.pid)
        return True

    def list(self) -> list[VM]:
        """Serving VMs, oldest first; VMs whose QEMU exited are dropped."""
        with self._lock:
            guests = list(self._guests.values())
        live = [
            dataclasses.replace(g.vm, port_mapping=list(g.vm.port_mapping))
            for g in guests
            if g.ready and self._alive(g)
        ]
        live.sort(key=lambda v: v.created_unix)
        return live

    def has_snapshot(self, spec: VMSpec) -> bool:
        """Whether a create of ``spec`` would restore: a snapshot of its build exists."""
        module = image_module(spec.image, self.allow_images)
        image = self.images.image(module)
        m = self._machine(spec)
        key = self._snapshot_key(image, m, spec)
        return self.snapshots.find(_slot(module, m), key) is not None

    def stats(self) -> dict[str, Any]:
        """Starts by kind, adoptions, snapshots taken and refused (since this driver began)."""
        with self._lock:
            counts = dict(self._counts)
        return {**counts, "accel": self.accel, "snapshots": self.snapshots.stats()}

    def close(self) -> None:
        """Stop every VM (in parallel) and refuse new ones."""
        with self._lock:
            self._closed = True
            vmids = list(self._guests)
        if vmids:
            with ThreadPoolExecutor(max_workers=min(16, len(vmids))) as pool:
                list(pool.map(self.stop, vmids))
        self._qmp.close()
