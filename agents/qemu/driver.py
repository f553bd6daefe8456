"""The ``qemu`` driver: every replica a QEMU microVM booting a real Linux guest.

The model
---------
:class:`QemuDriver` is a :class:`~agents.drivers.VMDriver`: ``start`` returns once the
guest answers HTTP on its host port, so a create's answer means a replica that serves
(the agent's READY follows at once). Readiness is the agent's: the guest's network is
``restrict=on`` and reaches no registry. A start is one of two kinds, reported on the VM
(``VM.start``, the ``CreateReply.start`` extension, ``corral ops OP --json``):

* **boot**: QEMU boots the kernel with the image of the function's build
  (:mod:`agents.qemu.image`); the driver sends the guest the build's environment and the
  function starts (:mod:`agents.qemu.guest`). Once it answers, if the build has no
  snapshot yet, the driver takes one (:mod:`agents.qemu.migration`) and publishes it
  when this replica has answered as itself (:mod:`agents.qemu.snapshots`);
* **restore**: QEMU starts with ``-incoming`` on the build's snapshot and is ``cont``-ed:
  the function is already serving, waiting only for an identity.

Either way the driver then sends the guest its identity (``VMID``, the report token and
registry, fresh random bytes, the time: :mod:`agents.qemu.control`) and waits for its
port to answer. All of it within ``boot_timeout`` (the create deadline): a guest that is
not serving by then is killed, and the create fails with the tail of its console.

**What runs is what QEMU runs.** A VM whose QEMU process exited is gone: ``list`` and
``get`` drop it (its ports and directory are freed). Each VM has a directory in the
driver's state directory (QMP and control sockets, ``vm.json``); QEMU is not tied to the
agent's life, so an agent that crashes leaves its VMs running, and the next agent on the
same state directory **adopts** every VM that was serving and kills the rest
(:mod:`agents.qemu.guests`): nothing is left orphaned. A clean stop (``close``) stops
every VM, as the other drivers do.

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
import shutil
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
from agents.qemu import migration
from agents.qemu.cache import cache_secret, default_cache
from agents.qemu.control import Control, Phases, StartFailed
from agents.qemu.guests import (
    Guest,
    adopt_all,
    console_tail,
    exited,
    qemu_log,
    terminate,
    write_record,
)
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

MIN_MEM_MB, DEFAULT_MEM_MB = 128, 256
#: How often the port of a guest that has not said it listens is probed.
SERVING_POLL_S = 0.1
#: Unix socket paths must fit in ``sun_path`` (108 bytes).
_MAX_SOCKET_PATH = 100


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
    phases: Phases = field(default_factory=lambda: Phases())

    @property
    def kind(self) -> str:
        """``restore`` or ``boot``."""
        return "restore" if self.restore is not None else "boot"


def _slot(module: str, m: Machine) -> str:
    """A snapshot's slot: the image and the VM's shape (``examples.hello@256m1c``)."""
    return f"{module}@{m.mem_mb}m{m.cpus}c"


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
        snapshot_dir: Path | None = None,
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
            self.cache,
            max_snapshots=max_snapshots,
            max_bytes=max_snapshot_bytes,
            directory=snapshot_dir,
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
        self._guests: dict[str, Guest] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._counts = {"boot": 0, "restore": 0, "restore_failed": 0, "adopted": 0, "killed": 0}
        self._adopted: list[VM] = []
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
                    return self._start(dataclasses.replace(plan, restore=state, phases=Phases()))
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
            return self._start(dataclasses.replace(plan, phases=Phases()))
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
        holder: list[Guest] = []
        try:
            guest = self._bring_up(plan, directory, holder)
        except (StartFailed, QmpError, OSError) as exc:
            guest_or_none = holder[0] if holder else None
            tail = console_tail(guest_or_none) if guest_or_none is not None else ""
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
        write_record(guest)
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

    def _bring_up(self, plan: _Plan, directory: Path, holder: list[Guest]) -> Guest:
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
                return not exited(guest.pidfd)

            control = stack.enter_context(
                contextlib.closing(Control(directory / "ctl.sock", deadline))
            )
            if plan.restore is not None:
                migration.resume(monitor, deadline, alive)
                mark("loaded")
            else:
                control.send({"kind": "start", "env": self._start_env(plan.spec)}, deadline)
                self._wait_serving(guest, control, deadline, alive, mark)
                mark("serving")
                if staging is not None:
                    if not migration.save(monitor, staging, deadline):
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

    def _launch(self, plan: _Plan, directory: Path, holder: list[Guest]) -> Guest:
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
        guest = Guest(vm, directory, proc.pid, pidfd, proc)
        holder.append(guest)
        write_record(guest)
        with self._lock:
            self._guests[plan.vmid] = guest
        monitor = Monitor(self._qmp, directory / "qmp.sock", f"vm-{plan.vmid[:8]}")
        guest.monitor = monitor
        try:
            monitor.connect(10.0)
        except QmpError as exc:
            raise StartFailed(f"QEMU did not start: {qemu_log(directory)}") from exc
        return guest

    def _wait_serving(
        self,
        guest: Guest,
        control: Control,
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

    def _wait_answer(self, guest: Guest, deadline: float, alive: Callable[[], bool]) -> None:
        """Wait until the guest's port answers HTTP."""
        while not self._answers(guest, deadline, alive):
            time.sleep(0.01)

    def _answers(self, guest: Guest, deadline: float, alive: Callable[[], bool]) -> bool:
        """Whether the guest's port answers ``GET /`` now; StartFailed past the deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise StartFailed("timed out")
        if not alive():
            raise StartFailed("QEMU exited")
        host = "127.0.0.1" if is_wildcard(self.bind_host) else self.bind_host
        return http_answers(host, guest.vm.port, min(1.0, max(0.05, left)))

    # -- records, console, teardown ----------------------------------------------------------

    def _kill(self, guest: Guest | None, directory: Path, grace: float = 0.0) -> None:
        """Stop a VM's QEMU (``quit``, then SIGKILL after ``grace``), free its parts."""
        if guest is not None:
            with self._lock:
                if self._guests.get(guest.vm.vmid) is guest:
                    del self._guests[guest.vm.vmid]
                if guest.closed:
                    return
                guest.closed = True
            terminate(guest, grace)
            self._ports.release(h for h, _ in guest.vm.port_mapping)
        shutil.rmtree(directory, ignore_errors=True)

    # -- adoption ----------------------------------------------------------------------------

    def _adopt(self) -> None:
        """Adopt the serving VMs an earlier agent left in the state directory; kill the rest."""
        adopted, killed = adopt_all(self.state, self._qmp)
        self._adopted = [dataclasses.replace(g.vm) for g in adopted]
        for guest in adopted:
            self._ports.claim(h for h, _ in guest.vm.port_mapping)
            with self._lock:
                self._guests[guest.vm.vmid] = guest
            log.info(
                "adopted replica %s (pid %d, port %d)", guest.vm.vmid, guest.pid, guest.vm.port
            )
        with self._lock:
            self._counts["adopted"] += len(adopted)
            self._counts["killed"] += killed

    # -- the driver interface ----------------------------------------------------------------

    def _alive(self, guest: Guest) -> bool:
        if not exited(guest.pidfd):
            return True
        code = guest.proc.poll() if guest.proc is not None else None
        log.warning(
            "replica %s: QEMU (pid %d) exited (code %s): VM gone", guest.vm.vmid, guest.pid, code
        )
        self._kill(guest, guest.directory)
        return False

    def adopted(self) -> list[VM]:
        """The VMs adopted from an earlier agent as this driver started."""
        return list(self._adopted)

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
