"""The QEMU machine a replica runs in: the binary, the accelerator, and the command line.

The model
---------
Every replica is one ``qemu-system-x86_64 -M microvm`` process: no firmware (the kernel's
PVH entry), no PCI, no disks; virtio-mmio devices only. What it is given:

* **network**: a virtio-net card on QEMU's user-mode network with ``restrict=on`` (the
  guest reaches nothing outside; QEMU answers only its own DHCP/ARP) and one
  ``hostfwd`` per guest port from ``127.0.0.1:HOSTPORT`` (or the replica IP the agent
  serves on): replicas are reachable where corral expects them and nowhere else;
* **control**: a virtio serial port ``corral`` whose host end is a unix socket in the
  VM's private directory (the identity channel of :mod:`agents.qemu.guest`), and QMP on
  another unix socket there;
* **console**: the serial console into a 64 KiB ring buffer inside QEMU (read over QMP
  when a guest fails), so a guest cannot fill the host's disk with output;
* **confinement**: QEMU's seccomp sandbox (no exec, no privilege changes) and, when the
  agent runs as root, ``-runas`` an unprivileged user once QEMU has opened its files and
  sockets: the emulator faces the guest, and a guest is an attacker.

**Accelerator.** KVM when a probe shows it boots this kernel (a guest that prints a
marker and powers off), else TCG, QEMU's software emulator. Some hosts (nested,
paravirtual KVM) have a ``/dev/kvm`` that cannot run a stock guest kernel: the probe
finds that out once per host boot (cached in ``CACHE/accel.json`` by the host's boot id,
the QEMU and the kernel). Under TCG the kernel gets three timer arguments without which
microvm never calibrates its clocks (``tsc_early_khz``, ``tsc=reliable``,
``lapic_timer_period``) and a CPU model with RDRAND (``-cpu max``), which lets the
guest's CRNG start at once instead of after seconds of jitter.

:class:`Machine` is the part of the command line a snapshot depends on (accelerator, CPU
model, memory, CPUs, kernel arguments, QEMU's version); :meth:`Machine.key` goes into
every snapshot's key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from agents.qemu.cache import lock_file
from agents.qemu.image import Cpio
from agents.qemu.kernel import Kernel

__all__ = [
    "ACCELS",
    "Machine",
    "Qemu",
    "QemuError",
    "host_tsc_khz",
    "probe_accel",
]

log = logging.getLogger(__name__)

ACCELS = ("auto", "kvm", "tcg")
CONSOLE_BYTES = 64 * 1024
_PROBE_MARKER = "corral-accel-probe-ok"
#: Kernel arguments every guest gets (``quiet``: a serial console costs a VM exit per byte).
BASE_ARGS = "console=ttyS0 panic=-1 quiet cryptomgr.notests ipv6.disable=1"
TCG_TIMER_ARGS = "tsc=reliable lapic_timer_period=4000000"
#: TCG's translation cache (MiB). QEMU's own default lets it grow to 1 GiB; a guest that
#: boots and serves one function fills a few tens (a booted VM's PSS: 259 MiB with the
#: default, 212 with this).
TCG_CACHE_MIB = 32
#: The VM's devices (a snapshot restores only into the same ones: part of its key).
DEVICES = (
    "virtio-net-device,netdev=n0",
    "virtio-serial-device",
    "virtserialport,chardev=ctl,name=corral",
)
#: QEMU's seccomp filter: no obsolete system calls, no fork or exec, no scheduler or
#: CPU-affinity changes; and no set*uid unless QEMU must drop root itself (``-runas``,
#: after which it has no privilege to regain). A guest that breaks out of the emulator
#: lands in a process that can do little.
SANDBOX = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"


class QemuError(RuntimeError):
    """QEMU is missing or cannot run here."""


def host_tsc_khz() -> int:
    """The host's TSC frequency in kHz (what a TCG guest's ``rdtsc`` counts in)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return round(float(line.split(":", 1)[1]) * 1000)
    raise QemuError("cannot read the host's TSC frequency from /proc/cpuinfo (--qemu-tsc-khz)")


@dataclass(frozen=True)
class Qemu:
    """A QEMU binary and its version line."""

    binary: Path
    version: str
    digest: str

    @classmethod
    def find(cls, binary: str | None = None) -> Qemu:
        """``qemu-system-x86_64`` from ``PATH`` (or ``binary``); QemuError if absent."""
        path = shutil.which(binary or "qemu-system-x86_64")
        if path is None:
            raise QemuError(
                f"{binary or 'qemu-system-x86_64'} not found (apt-get install qemu-system-x86)"
            )
        try:
            out = subprocess.run(  # noqa: S603 - the QEMU binary, asked its version
                [path, "--version"], capture_output=True, text=True, timeout=30, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise QemuError(f"{path} --version failed: {exc}") from None
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()[:16]
        return cls(Path(path), out.splitlines()[0].strip() if out else "unknown", digest)

    @property
    def key(self) -> str:
        """The version line and the binary's digest: what a snapshot was made by."""
        return f"{self.version} ({self.digest})"


@dataclass(frozen=True)
class Machine:
    """The parts of a VM's command line that a snapshot must match."""

    qemu: str  # Qemu.key
    accel: str  # "kvm" or "tcg"
    cpu_model: str
    mem_mb: int
    cpus: int
    append: str  # kernel arguments
    devices: str = ""  # the device arguments (DEVICES)

    def key(self) -> dict[str, object]:
        """As a dict (stored with a snapshot, compared field by field)."""
        return asdict(self)


def machine(qemu: Qemu, accel: str, mem_mb: int, cpus: int, tsc_khz: int | None) -> Machine:
    """The machine of one VM."""
    devices = " ".join(DEVICES)
    if accel == "kvm":
        return Machine(qemu.key, "kvm", "host", mem_mb, cpus, BASE_ARGS, devices)
    append = f"{BASE_ARGS} tsc_early_khz={tsc_khz or host_tsc_khz()} {TCG_TIMER_ARGS}"
    return Machine(qemu.key, "tcg", "max", mem_mb, cpus, append, devices)


def command(  # noqa: PLR0913 - one VM's parts, by name
    qemu: Qemu,
    m: Machine,
    kernel: Path,
    initrd: Path,
    directory: Path,
    forwards: list[tuple[str, int, int]],
    *,
    incoming_fd: int | None = None,
    run_as: str | None = None,
) -> list[str]:
    """The argv of one VM (``forwards``: host address, host port, guest port; ``run_as``: the
    user QEMU becomes once it has opened what it needs)."""
    hostfwd = ",".join(f"hostfwd=tcp:{h}:{hp}-:{gp}" for h, hp, gp in forwards)
    argv = [
        str(qemu.binary),
        "-sandbox",
        SANDBOX if run_as else f"{SANDBOX},elevateprivileges=deny",
        "-name",
        "corral-vm,debug-threads=off",
        "-M",
        "microvm,x-option-roms=off",
        "-accel",
        m.accel if m.accel != "tcg" else f"tcg,tb-size={TCG_CACHE_MIB}",
        "-cpu",
        m.cpu_model,
        "-m",
        str(m.mem_mb),
        "-smp",
        str(m.cpus),
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-netdev",
        f"user,id=n0,restrict=on,{hostfwd}" if hostfwd else "user,id=n0,restrict=on",
        "-chardev",
        f"socket,id=ctl,path={directory / 'ctl.sock'},server=on,wait=off",
        *(arg for device in DEVICES for arg in ("-device", device)),
        "-chardev",
        f"ringbuf,id=con,size={CONSOLE_BYTES}",
        "-serial",
        "chardev:con",
        "-qmp",
        f"unix:{directory / 'qmp.sock'},server=on,wait=off",
    ]
    if incoming_fd is None:
        argv += ["-kernel", str(kernel), "-initrd", str(initrd), "-append", m.append]
    else:  # the snapshot holds the booted kernel: QEMU need not load (and copy) it again
        argv += ["-incoming", f"fd:{incoming_fd}"]
    if run_as:
        argv += ["-runas", run_as]
    return argv


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return "unknown"


def _probe_initrd(busybox: Path, out: Path) -> None:
    """A tiny initramfs whose init prints the marker and powers off."""
    with open(out, "wb") as fh:
        cpio = Cpio(fh)
        cpio.file("bin/busybox", busybox.read_bytes(), 0o755)
        init = f"#!/bin/busybox sh\n/bin/busybox echo {_PROBE_MARKER}\n/bin/busybox poweroff -f\n"
        cpio.file("init", init.encode(), 0o755)
        cpio.close()


def _kvm_boots(qemu: Qemu, kernel: Kernel, busybox: Path, timeout: float) -> tuple[bool, str]:
    """Whether a KVM guest of this kernel reaches its init; and why not."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is absent or not accessible"
    with tempfile.TemporaryDirectory(prefix="corral-accel-") as scratch:
        initrd = Path(scratch) / "probe.cpio"
        _probe_initrd(busybox, initrd)
        argv = [
            str(qemu.binary),
            *("-M", "microvm,x-option-roms=off", "-accel", "kvm", "-cpu", "host"),
            *("-m", "256", "-smp", "1", "-nodefaults", "-no-user-config", "-nographic"),
            *("-no-reboot", "-kernel", str(kernel.vmlinux), "-initrd", str(initrd)),
            *("-append", "console=ttyS0 panic=-1 quiet", "-serial", "stdio"),
        ]
        try:
            done = subprocess.run(  # noqa: S603 - the QEMU binary with a fixed probe argv
                argv, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return False, f"a KVM guest did not reach its init within {timeout:g}s"
        except OSError as exc:
            return False, f"cannot run {qemu.binary}: {exc}"
    if _PROBE_MARKER in done.stdout:
        return True, "a KVM guest booted"
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
    return False, f"a KVM guest failed (exit {done.returncode}: {' '.join(tail)})"


def probe_accel(
    cache: Path, qemu: Qemu, kernel: Kernel, busybox: Path, timeout: float = 15.0
) -> tuple[str, str]:
    """``("kvm" | "tcg", why)``: KVM if a guest boots under it here (cached per host boot)."""
    key = {"boot_id": _boot_id(), "qemu": qemu.key, "kernel": kernel.key}
    path = cache / "accel.json"
    with lock_file(cache / ".accel.lock"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            saved = json.loads(path.read_text())
            if saved["key"] == key:
                return str(saved["accel"]), f"{saved['why']} (probed earlier this boot)"
        works, why = _kvm_boots(qemu, kernel, busybox, timeout)
        accel = "kvm" if works else "tcg"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "accel": accel, "why": why}))
        tmp.replace(path)
    return accel, why
