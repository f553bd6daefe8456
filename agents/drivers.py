"""VM drivers: how a reference agent turns "start a replica" into something that runs.

An agent speaks a wire protocol (fcdaemon gRPC, Lambdo HTTP) and delegates the VMs
themselves to a :class:`VMDriver`. A driver starts a replica from a :class:`VMSpec`,
stops it, lists what is running, and stops everything on close. The driver is the
truth about what runs: ``list()`` never reports a replica that has died.

Two drivers ship here:

* :class:`MemoryDriver` - a VM is only a record. Nothing runs and nothing listens;
  it is for tests and benchmarks of the control plane, so it is fast and thread-safe.
* :class:`ProcessDriver` - a replica is a real OS process standing in for a microVM:
  its own process group, killed with the agent (see :mod:`agents.procs`), serving
  HTTP on ``127.0.0.1:$PORT`` (``$HOST`` is the address to bind). The image names a
  Python module to run as ``python -m MODULE``, and only from an allow-list: the
  :mod:`examples` package (``examples.hello`` or ``hello``) and the modules named with
  ``allow_images`` (``--allow-image MODULE``). An image is never a command line: the
  name arrives over the network, and running it through a shell would hand anyone who
  can reach the agent a shell on the node. For the same reason a replica starts with a
  clean environment: the function's variables, checked by :mod:`netplumb.guest_env`
  (no ``PYTHONPATH``, ``LD_PRELOAD``, ``BASH_ENV``...), and what the driver sets
  itself, never the agent's own.

A third, :class:`agents.qemu.driver.QemuDriver` (``--driver qemu``, in :mod:`agents.qemu`),
runs each replica as a QEMU microVM booting a real Linux guest, with snapshot warm starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import logging
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agents.portlocks import host_ports
from agents.procs import kill_group, spawn
from config.processes import exited
from netplumb import guest_env
from netplumb.addresses import is_wildcard, split_hostport
from netplumb.guest_env import parse_env_args

__all__ = [
    "FAKE_PORT_RANGE",
    "VM",
    "BadSpec",
    "DriverError",
    "ImageNotFound",
    "MemoryDriver",
    "PortAllocator",
    "ProcessDriver",
    "VMDriver",
    "VMSpec",
    "add_driver_arguments",
    "check_module_name",
    "driver_from_args",
    "image_module",
    "parse_env_args",
    "resolve_command",
    "validate_ports",
]

log = logging.getLogger(__name__)


class DriverError(RuntimeError):
    """A driver could not start or stop a VM (the agent answers an internal error)."""


class BadSpec(DriverError):
    """The spec asks for what the agent refuses (bad input, not a crash): 400, INVALID_ARGUMENT."""


class ImageNotFound(BadSpec):
    """The spec's image names nothing this driver can run (bad input, not a crash)."""


@dataclass
class VM:
    """A running replica as a driver reports it."""

    vmid: str
    ip: str
    port: int
    request_id: str
    created_unix: float
    pid: int | None
    #: (host port, guest port) pairs; the first pair is the function's port.
    port_mapping: list[tuple[int, int]] = field(default_factory=list)
    image: str = ""
    #: How the VM came to be, where the driver says: "boot" (a cold boot) or "restore"
    #: (from a snapshot); "" for drivers without the distinction (process, memory).
    start: str = ""


@dataclass
class VMSpec:
    """What to start: the fcdaemon CreateRequest / Lambdo body, normalised."""

    image: str
    kernel: str = ""
    initrd: str = ""
    kernel_args: str = ""
    vm_type: str = "osv"
    cpu: int = 1
    mem_mb: int = 512
    #: Function environment; ``--env=K=V`` tokens of ``kernel_args`` are merged in
    #: (explicit entries win).
    env: dict[str, str] = field(default_factory=dict)
    guest_port: int = 8080
    request_id: str = ""
    #: Further guest ports to map to host ports (Lambdo ``requestedPorts[1:]``).
    extra_guest_ports: tuple[int, ...] = ()
    #: Host port wanted for a guest port (Lambdo ``/start`` port mappings).
    host_ports: dict[int, int] = field(default_factory=dict)
    #: The vmid to use; empty means the driver picks ``uuid4().hex``.
    vmid: str = ""
    #: Variables the agent itself gives the guest (its registry, its report token): set by
    #: the agent, never from a request, so not checked like ``env``.
    agent_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.env = {**parse_env_args(self.kernel_args), **self.env}

    def checked_env(self) -> dict[str, str]:
        """The function's environment if every variable may reach a guest; BadSpec otherwise."""
        try:
            return guest_env.check(self.env)
        except ValueError as exc:
            raise BadSpec(f"environment: {exc}") from None

    @property
    def guest_ports(self) -> list[int]:
        """All guest ports, the function's own first."""
        return [self.guest_port, *self.extra_guest_ports]


@runtime_checkable
class VMDriver(Protocol):
    """What an agent needs from whatever actually runs VMs."""

    def start(self, spec: VMSpec) -> VM:
        """Start one replica and return it; raise :class:`DriverError` on failure."""
        ...

    def stop(self, vmid: str) -> bool:
        """Stop a replica; False if the vmid is unknown (already gone)."""
        ...

    def list(self) -> list[VM]:
        """The replicas running now, oldest first."""
        ...

    def close(self) -> None:
        """Stop every replica and release the driver's resources."""
        ...


def validate_ports(spec: VMSpec) -> list[int]:
    """The spec's guest ports, the function's first; ImageNotFound if one is invalid."""
    ports = spec.guest_ports
    for port in ports:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ImageNotFound(f"invalid guest port {port!r}")
    if len(set(ports)) != len(ports):
        raise ImageNotFound(f"duplicate guest ports in {ports}")
    return ports


# Ports claimed by any allocator of this process, so two agents in one process (tests,
# the local stack) never hand out the same port before either child has bound it;
# agents in other processes see the claim through agents.portlocks.
_CLAIMED: set[int] = set()
_CLAIMED_LOCK = threading.Lock()


class PortAllocator:
    """Hands out host ports from ``[low, high]``, skipping ports already in use."""

    def __init__(
        self,
        low: int,
        high: int,
        host: str = "127.0.0.1",
        *,
        check_bind: bool = True,
    ) -> None:
        """``check_bind`` probes each candidate with a bind on ``host`` (off for fake ports)."""
        if not 0 < low <= high < 65536:
            raise ValueError(f"bad port range {low}-{high}")
        self.low, self.high, self.host = low, high, host
        self._check_bind = check_bind
        # Real ports are shared process-wide, and claimed host-wide (other agent processes
        # of this user see the claim before the replica binds); fake ones only here.
        self._claimed = _CLAIMED if check_bind else set()
        self._lock = _CLAIMED_LOCK if check_bind else threading.Lock()
        self._host = host_ports() if check_bind else None
        # Start at a random point so separate agent processes rarely race for a port.
        self._next = random.randint(low, high)  # noqa: S311 - a starting point, not a secret

    def _take(self, port: int) -> bool:
        """Claim a port no one here holds: host-wide first, then a bind must succeed."""
        if self._host is None:
            return True
        if not self._host.take(port):
            return False  # another agent process claimed it; its replica may not bind yet
        if self._bindable(port):
            return True
        self._host.give(port)
        return False

    def _bindable(self, port: int) -> bool:
        host = "0.0.0.0" if is_wildcard(self.host) else self.host  # noqa: S104 - probes the host the operator chose
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
        return True

    def allocate(self, want: int | None = None) -> int:
        """Claim ``want`` (in the range and free) or the next free port of the range."""
        with self._lock:
            if want:
                if not self.low <= want <= self.high:  # a caller may not pick any port of the host
                    raise BadSpec(
                        f"host port {want} is outside this host's range {self.low}-{self.high}"
                    )
                if want in self._claimed or not self._take(want):
                    raise DriverError(f"host port {want} is in use")
                self._claimed.add(want)
                return want
            size = self.high - self.low + 1
            for _ in range(size):
                port = self._next
                self._next = self.low if port >= self.high else port + 1
                if port in self._claimed or not self._take(port):
                    continue
                self._claimed.add(port)
                return port
        raise DriverError(f"no free host port in {self.low}-{self.high}")

    def map(self, guest_ports: Iterable[int], wanted: dict[int, int]) -> list[tuple[int, int]]:
        """A host port for each guest port (``wanted[guest]`` if given): (host, guest) pairs;
        on failure none stays claimed."""
        mapping: list[tuple[int, int]] = []
        try:
            for g in guest_ports:
                mapping.append((self.allocate(wanted.get(g)), g))
        except DriverError:
            self.release(h for h, _ in mapping)
            raise
        return mapping

    def claim(self, ports: Iterable[int]) -> None:
        """Mark ports as taken by what already listens on them (a VM adopted after a restart)."""
        with self._lock:
            for port in ports:
                self._claimed.add(port)
                if self._host is not None:
                    self._host.take(port)  # its VM listens there: no one else can have it

    def release(self, ports: Iterable[int]) -> None:
        """Give ports back."""
        with self._lock:
            for port in ports:
                if port in self._claimed and self._host is not None:
                    self._host.give(port)
                self._claimed.discard(port)


#: Host ports a :class:`MemoryDriver` hands out by default (nothing listens on them).
FAKE_PORT_RANGE = (20000, 29999)


class MemoryDriver:
    """VMs as records only: nothing runs; for tests and benchmarks."""

    def __init__(
        self, port_range: tuple[int, int] | None = FAKE_PORT_RANGE, ip: str = "127.0.0.1"
    ) -> None:
        """Unique fake host ports from ``port_range``, as a real host gives (no two VMs share
        one, and none is a guest port such as 8080 that corral's own gateway may listen on);
        with ``port_range=None`` a VM's port is its guest port."""
        self.ip = ip
        self._ports = (
            PortAllocator(*port_range, check_bind=False) if port_range is not None else None
        )
        self._vms: dict[str, VM] = {}
        self._lock = threading.Lock()

    def start(self, spec: VMSpec) -> VM:
        """Record a new VM."""
        if not spec.image:
            raise ImageNotFound("empty image name")
        spec.checked_env()
        guest_ports = validate_ports(spec)
        if self._ports is None:
            mapping = [(g, g) for g in guest_ports]
        else:
            mapping = self._ports.map(guest_ports, spec.host_ports)
        vm = VM(
            vmid=spec.vmid or uuid.uuid4().hex,
            ip=self.ip,
            port=mapping[0][0],
            request_id=spec.request_id,
            created_unix=time.time(),
            pid=None,
            port_mapping=mapping,
            image=spec.image,
        )
        with self._lock:
            if vm.vmid in self._vms:
                raise DriverError(f"vmid {vm.vmid} already exists")
            self._vms[vm.vmid] = vm
        return dataclasses.replace(vm, port_mapping=list(mapping))

    def get(self, vmid: str) -> VM | None:
        """The VM with this id, or None."""
        with self._lock:
            vm = self._vms.get(vmid)
        return dataclasses.replace(vm, port_mapping=list(vm.port_mapping)) if vm else None

    def stop(self, vmid: str) -> bool:
        """Forget a VM; False if unknown."""
        with self._lock:
            vm = self._vms.pop(vmid, None)
        if vm is None:
            return False
        if self._ports is not None:
            self._ports.release(h for h, _ in vm.port_mapping)
        return True

    def list(self) -> list[VM]:
        """All recorded VMs, oldest first."""
        with self._lock:
            vms = list(self._vms.values())
        return [dataclasses.replace(v, port_mapping=list(v.port_mapping)) for v in vms]

    def close(self) -> None:
        """Forget every VM."""
        with self._lock:
            vms = list(self._vms.values())
            self._vms.clear()
        if self._ports is not None:
            for vm in vms:
                self._ports.release(h for h, _ in vm.port_mapping)


_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
EXAMPLES = "examples"


def _import_root(module: str) -> str:
    """The directory a guest needs on its PYTHONPATH to import ``module`` as the agent does."""
    top = module.split(".", 1)[0]
    spec = importlib.util.find_spec(top)
    if spec is not None and spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).resolve().parent)
    if spec is not None and spec.origin and spec.has_location:
        return str(Path(spec.origin).resolve().parent)
    raise ImageNotFound(f"module {top!r} is not importable")


def check_module_name(name: str) -> str:
    """``name`` if it is a dotted Python module name; raise ValueError otherwise."""
    if not _MODULE_RE.fullmatch(name):
        raise ValueError(f"{name!r} is not a Python module name")
    return name


def image_module(image: str, allowed: Iterable[str] = ()) -> str:
    """The allowed module an image names (``hello`` is ``examples.hello``), or ImageNotFound."""
    name = image.strip().removesuffix(":latest")
    if not name:
        raise ImageNotFound("empty image name")
    if not _MODULE_RE.fullmatch(name):
        raise ImageNotFound(
            f"image {image!r} refused: an image is a Python module name, never a command line"
        )
    allow = set(allowed)
    module = name if "." in name or name in allow else f"{EXAMPLES}.{name}"
    if not module.startswith(EXAMPLES + ".") and module not in allow:
        raise ImageNotFound(
            f"image {image!r} refused: not an examples.* module and not allowed with --allow-image"
        )
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImageNotFound(f"image {image!r}: no module {module!r}")
    return module


def resolve_command(image: str, allowed: Iterable[str] = ()) -> tuple[list[str], str]:
    """The argv running an allowed image, and the directory its module is imported from."""
    module = image_module(image, allowed)
    return [sys.executable, "-m", module], _import_root(module)


@dataclass
class _Replica:
    vm: VM
    proc: subprocess.Popen[bytes]


class ProcessDriver:
    """Each replica is a real process serving HTTP on its host port, dying with the agent."""

    def __init__(  # noqa: PLR0913 - keyword-only options with defaults
        self,
        port_range: tuple[int, int] = (20000, 29999),
        *,
        bind_host: str = "127.0.0.1",
        advertise_ip: str | None = None,
        ready_timeout: float = 0.0,
        stop_grace: float = 2.0,
        env: dict[str, str] | None = None,
        allow_images: Iterable[str] = (),
    ) -> None:
        """``ready_timeout`` > 0 makes ``start`` wait until the port accepts connections.

        ``allow_images`` names modules beyond ``examples.*`` that an image may run;
        ``env`` is added to every guest's environment as is (the operator's, never a
        request's: a request's variables pass :mod:`netplumb.guest_env` first).
        """
        self.allow_images = frozenset(check_module_name(m) for m in allow_images)
        self.bind_host = bind_host
        if advertise_ip:
            self.ip = advertise_ip
        else:
            self.ip = "127.0.0.1" if is_wildcard(bind_host) else bind_host
        self.ready_timeout = ready_timeout
        self.stop_grace = stop_grace
        self._env = dict(env or {})
        self._ports = PortAllocator(*port_range, host=bind_host)
        self._replicas: dict[str, _Replica] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _child_env(self, spec: VMSpec, vmid: str, port: int, root: str) -> dict[str, str]:
        """The guest's whole environment: the function's (checked) and the agent's own settings.

        Never this process's environment: it holds the agent's tokens (and, under
        ``corral up``, the operator's keys).
        """
        own = {"PORT": str(port), "HOST": self.bind_host, "VMID": vmid}
        extra = self._env.get("PYTHONPATH")  # the operator's, from the command line
        own["PYTHONPATH"] = root if not extra else root + os.pathsep + extra
        return guest_env.guest_environment(
            spec.checked_env(), {**self._env, **spec.agent_env, **own}
        )

    def start(self, spec: VMSpec) -> VM:
        """Allocate host ports and start the image's process on the first one."""
        if self._closed:
            raise DriverError("driver is closed")
        argv, root = resolve_command(spec.image, self.allow_images)
        spec.checked_env()
        guest_ports = validate_ports(spec)
        vmid = spec.vmid or uuid.uuid4().hex
        mapping = self._ports.map(guest_ports, spec.host_ports)
        try:
            env = self._child_env(spec, vmid, mapping[0][0], root)
            proc = spawn(argv, env)
        except OSError as exc:
            self._ports.release(h for h, _ in mapping)
            raise DriverError(f"cannot start {spec.image!r}: {exc}") from exc
        except BaseException:
            self._ports.release(h for h, _ in mapping)
            raise
        vm = VM(
            vmid=vmid,
            ip=self.ip,
            port=mapping[0][0],
            request_id=spec.request_id,
            created_unix=time.time(),
            pid=proc.pid,
            port_mapping=mapping,
            image=spec.image,
        )
        with self._lock:
            self._replicas[vmid] = _Replica(vm, proc)
            closed = self._closed
        if closed:  # close() raced with us: do not leave this one behind
            self.stop(vmid)
            raise DriverError("driver is closed")
        log.debug("replica %s: pid %d, %s on port %d", vmid, proc.pid, spec.image, vm.port)
        if self.ready_timeout > 0 and not self._wait_ready(vm, proc, self.ready_timeout):
            self.stop(vmid)
            raise DriverError(
                f"replica of {spec.image!r} did not listen on port {vm.port} "
                f"within {self.ready_timeout:.1f}s"
            )
        return dataclasses.replace(vm, port_mapping=list(mapping))

    def _wait_ready(self, vm: VM, proc: subprocess.Popen[bytes], timeout: float) -> bool:
        host = "127.0.0.1" if is_wildcard(self.bind_host) else self.bind_host
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if exited(proc):
                return False
            with contextlib.suppress(OSError), socket.create_connection((host, vm.port), 0.5):
                return True
            time.sleep(0.02)
        return False

    def get(self, vmid: str) -> VM | None:
        """The live VM with this id, or None."""
        with self._lock:
            rep = self._replicas.get(vmid)
        if rep is None:
            return None
        if exited(rep.proc):  # unreaped: its group's stragglers can still be killed safely
            self._forget_dead(vmid)
            return None
        return dataclasses.replace(rep.vm, port_mapping=list(rep.vm.port_mapping))

    def _forget_dead(self, vmid: str) -> None:
        with self._lock:
            rep = self._replicas.pop(vmid, None)
        if rep is None:
            return
        log.warning(
            "replica %s (pid %d) exited with code %s", vmid, rep.proc.pid, rep.proc.returncode
        )
        kill_group(rep.proc, grace=0.0)  # reap, and kill anything it left in its group
        self._ports.release(h for h, _ in rep.vm.port_mapping)

    def stop(self, vmid: str) -> bool:
        """Kill the replica's process group (SIGTERM, then SIGKILL) and reap it."""
        with self._lock:
            rep = self._replicas.pop(vmid, None)
        if rep is None:
            return False
        code = kill_group(rep.proc, grace=self.stop_grace)
        self._ports.release(h for h, _ in rep.vm.port_mapping)
        log.info("replica %s: stopped (pid %d, exit %s)", vmid, rep.proc.pid, code)
        return True

    def list(self) -> list[VM]:
        """Live replicas, oldest first; replicas whose process exited are reaped and dropped."""
        with self._lock:
            reps = list(self._replicas.values())
        live: list[VM] = []
        for rep in reps:
            if not exited(rep.proc):
                live.append(dataclasses.replace(rep.vm, port_mapping=list(rep.vm.port_mapping)))
            else:
                self._forget_dead(rep.vm.vmid)
        live.sort(key=lambda v: v.created_unix)
        return live

    def close(self) -> None:
        """Stop every replica (in parallel) and refuse new ones."""
        with self._lock:
            self._closed = True
            vmids = list(self._replicas)
        if not vmids:
            return
        with ThreadPoolExecutor(max_workers=min(16, len(vmids))) as pool:
            list(pool.map(self.stop, vmids))


def add_driver_arguments(  # noqa: PLR0913 - keyword-only options with defaults
    parser: argparse.ArgumentParser,
    port_range: tuple[int, int],
    *,
    vms: str,
    port_help: str,
    image_source: str,
    qemu: bool = False,
) -> None:
    """Add ``--driver``, ``--port-range`` and ``--allow-image`` to an agent's parser (and,
    with ``qemu``, the ``qemu`` driver and its ``--qemu-*`` options)."""
    parser.add_argument(
        "--driver",
        choices=["process", "memory", "qemu"] if qemu else ["process", "memory"],
        default="process",
        help=f"process: {vms} are real processes; memory: records only"
        + ("; qemu: QEMU microVMs booting a Linux guest" if qemu else ""),
    )
    parser.add_argument(
        "--port-range",
        default="{}-{}".format(*port_range),
        help=f"{port_help} (default %(default)s)",
    )
    parser.add_argument(
        "--allow-image",
        action="append",
        default=[],
        metavar="MODULE",
        help=f"also let {image_source} run this Python module (repeatable; examples.* always may)",
    )
    if qemu:
        group = parser.add_argument_group("qemu driver")
        group.add_argument(
            "--qemu-cache",
            metavar="DIR",
            help="kernel, images, snapshots (default $CORRAL_QEMU_CACHE or ~/.cache/corral/qemu)",
        )
        group.add_argument(
            "--qemu-state",
            metavar="DIR",
            help="the VMs' sockets and records; an agent restarted on the same directory "
            "adopts its running VMs (default CACHE/run/LISTEN-PORT)",
        )
        group.add_argument(
            "--qemu-accel",
            choices=["auto", "kvm", "tcg"],
            default="auto",
            help="auto (default): KVM if a probe boots a guest with it, else TCG",
        )
        group.add_argument(
            "--qemu-boot-timeout",
            type=float,
            default=25.0,
            metavar="S",
            help="a guest not serving this long after its create is killed (default 25)",
        )
        group.add_argument(
            "--qemu-no-snapshots",
            action="store_true",
            help="always boot cold: no snapshot is taken or restored",
        )


def _qemu_driver(
    parser: argparse.ArgumentParser, args: argparse.Namespace, bind: str, **options: Any
) -> VMDriver:
    """The ``qemu`` driver ``--qemu-*`` describes; exits 1 with the reason if it cannot run."""
    from agents.qemu import driver as qemu

    cache = Path(args.qemu_cache) if args.qemu_cache else qemu.default_cache()
    try:
        listen_port = str(split_hostport(str(args.listen))[1])
    except ValueError:
        listen_port = "default"
    state = Path(args.qemu_state) if args.qemu_state else cache / "run" / listen_port
    try:
        return qemu.QemuDriver(
            args.port_range,
            cache=cache,
            state=state,
            bind_host=bind,
            advertise_ip=options.get("advertise_ip"),
            accel=args.qemu_accel,
            boot_timeout=args.qemu_boot_timeout,
            snapshots=not args.qemu_no_snapshots,
            allow_images=args.allow_image,
        )
    except ValueError as exc:
        parser.error(f"--allow-image: {exc}")
    except (RuntimeError, OSError) as exc:  # QEMU, the kernel or a guest runtime missing
        parser.exit(1, f"{parser.prog}: qemu driver: {exc}\n")


def driver_from_args(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    memory: Callable[[], VMDriver],
    **process_options: Any,
) -> VMDriver:
    """The driver ``--driver`` asks for: processes (or QEMU VMs) bound to ``args.host``
    (or to ``--replica-ip``, where the agent has it), or ``memory()``."""
    if args.driver not in ("process", "qemu"):
        return memory()
    bind = getattr(args, "replica_ip", None) or (
        "0.0.0.0" if is_wildcard(args.host) else args.host  # noqa: S104 - --listen's own host
    )
    if args.driver == "qemu":
        return _qemu_driver(parser, args, bind, **process_options)
    try:
        return ProcessDriver(
            args.port_range, bind_host=bind, allow_images=args.allow_image, **process_options
        )
    except ValueError as exc:
        parser.error(f"--allow-image: {exc}")
