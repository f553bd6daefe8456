"""One VM as the driver holds it: its QEMU process, its record on disk, its monitor.

The model
---------
A :class:`Guest` is what corral sees (a :class:`~agents.drivers.VM`) and what runs it: a
QEMU process, known by a **pidfd** (``os.pidfd_open``) so that neither a check nor a kill
can reach another process that reused the pid; the VM's directory (its QMP and control
sockets, QEMU's own log, and ``vm.json``, the **record** a later agent reads); its QMP
monitor. A guest the driver started has its ``Popen`` too (to reap it); one adopted from
an earlier agent has only the pidfd.

A record says whether the VM had served (``ready``): only such a VM is adopted
(:func:`adopt`), and only while its QEMU is the one recorded (its command line names the
VM's directory) and answers QMP as running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.drivers import VM
from agents.qemu.control import printable
from agents.qemu.qmp import Monitor, QmpError, QmpLoop

log = logging.getLogger(__name__)

__all__ = [
    "Guest",
    "adopt",
    "adopt_all",
    "console_tail",
    "exited",
    "kill",
    "qemu_log",
    "read_record",
    "runs_here",
    "terminate",
    "wait_exit",
    "write_record",
]


@dataclass
class Guest:
    """One VM: what corral sees (``vm``) and what runs it."""

    vm: VM
    directory: Path
    pid: int
    pidfd: int
    proc: subprocess.Popen[bytes] | None  # None: adopted from an earlier agent
    monitor: Monitor | None = None
    ready: bool = False  # serving: listed, and adopted by the next agent
    closed: bool = False


def exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (a pidfd polls readable then)."""
    return wait_exit(pidfd, 0.0)


def wait_exit(pidfd: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the process behind ``pidfd`` to exit; whether it did."""
    try:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout))
    except (OSError, ValueError):
        return True
    return bool(ready)


def kill(pidfd: int) -> None:
    """SIGKILL the process behind ``pidfd`` and wait (a little) for it to go."""
    with contextlib.suppress(ProcessLookupError, OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    wait_exit(pidfd, 5.0)


def terminate(guest: Guest, grace: float) -> None:
    """End a guest's QEMU: QMP ``quit``, SIGKILL after ``grace`` seconds; reap it."""
    if guest.monitor is not None:
        if grace > 0 and not exited(guest.pidfd):
            with contextlib.suppress(QmpError):
                guest.monitor.execute("quit", timeout=grace)
        guest.monitor.close()
    if not wait_exit(guest.pidfd, grace):
        kill(guest.pidfd)
    if guest.proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            guest.proc.wait(1.0)
    with contextlib.suppress(OSError):
        os.close(guest.pidfd)


def read_record(directory: Path) -> dict[str, Any]:
    """A VM directory's ``vm.json`` ({} if missing or unreadable)."""
    try:
        data = json.loads((directory / "vm.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(guest: Guest) -> None:
    """Write (replace) the guest's ``vm.json``."""
    vm = guest.vm
    data = {
        "vmid": vm.vmid,
        "request_id": vm.request_id,
        "image": vm.image,
        "ip": vm.ip,
        "port_mapping": vm.port_mapping,
        "created_unix": vm.created_unix,
        "pid": guest.pid,
        "start": vm.start,
        "ready": guest.ready,
    }
    tmp = guest.directory / "vm.json.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(guest.directory / "vm.json")


def runs_here(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is a QEMU of this VM directory (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(directory / "qmp.sock").encode() in cmdline


def adopt(record: dict[str, Any], directory: Path, pidfd: int, qmp: QmpLoop) -> Guest | None:
    """The guest a VM's record describes if it had served and its QEMU still runs; else None."""
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
    if not record.get("ready") or exited(pidfd):
        return None
    monitor = Monitor(qmp, directory / "qmp.sock", f"vm-{vm.vmid[:8]}")
    try:
        monitor.connect(5.0)
        status = monitor.execute("query-status", timeout=5.0)
    except QmpError:
        monitor.close()
        return None
    if status.get("status") != "running":
        monitor.close()
        return None
    return Guest(vm, directory, vm.pid or 0, pidfd, None, monitor, ready=True)


def adopt_all(state: Path, qmp: QmpLoop) -> tuple[list[Guest], int]:
    """The serving VMs an earlier agent left in ``state``, adopted; the rest killed (how
    many) and every directory not adopted removed."""
    adopted: list[Guest] = []
    killed = 0
    for directory in sorted(p for p in state.iterdir() if p.is_dir()):
        record = read_record(directory)
        pid = record.get("pid")
        pidfd = None
        if isinstance(pid, int) and pid > 0:
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(pid)
        if pidfd is not None and isinstance(pid, int) and runs_here(pid, directory):
            guest = adopt(record, directory, pidfd, qmp)
            if guest is not None:
                adopted.append(guest)
                continue
            kill(pidfd)
            killed += 1
            log.warning(
                "killed VM %s left by an earlier agent (pid %s): not serving", directory.name, pid
            )
        if pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(pidfd)
        shutil.rmtree(directory, ignore_errors=True)
    return adopted, killed


def console_tail(guest: Guest, chars: int = 1500) -> str:
    """The end of the guest's console (untrusted: printable ASCII only, bounded)."""
    if guest.monitor is None or exited(guest.pidfd):
        return ""
    try:
        text = guest.monitor.execute(
            "ringbuf-read", {"device": "con", "size": 65536, "format": "utf8"}, timeout=2.0
        )
    except QmpError:
        return ""
    return printable(str(text), chars)


def qemu_log(directory: Path) -> str:
    """The end of QEMU's own log in a VM's directory (what it said before it failed)."""
    with contextlib.suppress(OSError):
        text = (directory / "qemu.log").read_bytes()[-2000:].decode("utf-8", "replace")
        return printable(text, 2000) or "no output"
    return "no output"
