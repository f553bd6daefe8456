"""Real microVMs against processes: what a replica costs on the qemu driver, on this machine.

Run: ``python -m bench.vms [-n 5] [--restores 10] [--burst 4] [--fit 8]``

In one run, the same function (``examples.hello``) on two drivers of the reference agent:

* **process** (the baseline): each replica a Python process on the host;
* **qemu**: each replica a QEMU microVM booting Debian's cloud kernel, its Python runtime
  and the function - under TCG here (software emulation: this machine's ``/dev/kvm``
  cannot run a stock guest kernel; the driver's probe decides, and the run says which).

For each, what the ``agent_call`` stage of a cold start is made of, straight at the driver
(no control plane in the way):

* **cold start to first answer** (``-n`` starts, p50 and p99): ``start`` until the first
  ``GET /`` is answered. For QEMU, a cold boot (snapshots off);
* **restore to first answer** (``--restores``): QEMU from its build's snapshot, the warm
  start; aims: p50 at most 0.5 s, and at most a fifth of the cold boot's p50;
* with each, the **CPU** the replica's process used to get there (QEMU's, or the
  function's process): what a start costs whatever else runs on the machine;
* **destroy**: ``stop`` until the process (QEMU) is gone;
* **PSS per replica**: proportional set size of the process (QEMU) serving, idle
  (``/proc/PID/smaps_rollup``), after a cold boot and after a restore;
* **starts per second**: ``--burst`` starts at once, until all answer (restores for QEMU);
* **how many idle replicas fit**: ``--fit`` replicas started and kept (never more than
  leave three quarters of the machine's available memory free: other work shares it);
  their PSS and CPU use while idle, and the count that would fill the available memory.

Firecracker's published figures are the anchor for a real KVM host: at most 125 ms from
its InstanceStart call to the guest's ``/sbin/init``, at most 5 MiB of VMM memory
overhead (its SPECIFICATION.md), up to 150 microVMs started per second per host (NSDI
2020). docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from agents.drivers import VM, ProcessDriver, VMDriver, VMSpec
from agents.qemu.driver import QemuDriver, default_cache
from bench.options import add_counts

IMAGE = "examples.hello"
RESTORE_AIM_S = 0.5
RESTORE_RATIO_AIM = 0.2
FIRECRACKER = (
    "Firecracker (published, KVM, i3.metal): <= 125 ms InstanceStart to guest /sbin/init; "
    "<= 5 MiB VMM overhead per VM; up to 150 microVMs/s per host"
)


def answers(port: int) -> bool:
    """Whether ``GET /`` on 127.0.0.1:port is answered."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def start_answered(driver: VMDriver, timeout: float = 300.0) -> tuple[VM, float]:
    """Start one replica; it and the seconds until its first answer."""
    started = time.perf_counter()
    vm = driver.start(VMSpec(image=IMAGE, mem_mb=256))
    deadline = time.monotonic() + timeout
    while not answers(vm.port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica {vm.vmid} never answered")
        time.sleep(0.005)
    return vm, time.perf_counter() - started


def destroy(driver: VMDriver, vm: VM) -> float:
    """Stop one replica; the seconds until its process is gone."""
    started = time.perf_counter()
    driver.stop(vm.vmid)
    return time.perf_counter() - started


def pss_kib(pid: int | None) -> int:
    """The proportional set size of ``pid`` in KiB (0 if unknown)."""
    if pid is None:
        return 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int | None) -> float:
    """User and system CPU seconds ``pid`` has used."""
    if pid is None:
        return 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def mem_available_kib() -> int:
    """``MemAvailable`` of /proc/meminfo, in KiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Figures:
    """What one driver's replicas cost."""

    name: str
    cold: list[float] = field(default_factory=list)
    restore: list[float] = field(default_factory=list)
    cold_cpu: list[float] = field(default_factory=list)  # CPU seconds the replica used to get there
    restore_cpu: list[float] = field(default_factory=list)
    destroy: list[float] = field(default_factory=list)
    pss_cold: list[int] = field(default_factory=list)
    pss_restore: list[int] = field(default_factory=list)
    rate: float = 0.0
    rate_what: str = ""
    fit_count: int = 0
    fit_pss: list[int] = field(default_factory=list)
    idle_cpu: float = 0.0  # share of one core per idle replica
    fits: int = 0  # replicas the available memory would hold


def burst(driver: VMDriver, k: int) -> float:
    """``k`` starts at once; starts per second until all answered."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=k) as pool:
        made = list(pool.map(lambda _: start_answered(driver)[0], range(k)))
    took = time.perf_counter() - started
    for vm in made:
        driver.stop(vm.vmid)
    return k / took


def fit(driver: VMDriver, figures: Figures, bound: int, available: int) -> None:
    """Keep up to ``bound`` idle replicas (leaving 3/4 of ``available`` free): PSS, CPU."""
    kept: list[VM] = []
    try:
        for _ in range(bound):
            if figures.fit_pss and sum(figures.fit_pss) + max(figures.fit_pss) > available // 4:
                break
            vm, _ = start_answered(driver)
            kept.append(vm)
            figures.fit_pss.append(pss_kib(vm.pid))
        figures.fit_count = len(kept)
        before = {vm.vmid: cpu_seconds(vm.pid) for vm in kept}
        time.sleep(5.0)  # idle: what the replicas use doing nothing
        used = sum(cpu_seconds(vm.pid) - before[vm.vmid] for vm in kept)
        figures.idle_cpu = used / 5.0 / max(1, len(kept))
        figures.fit_pss = [pss_kib(vm.pid) for vm in kept]  # settled, after the idle wait
        mean = statistics.mean(figures.fit_pss) if figures.fit_pss else 0
        figures.fits = int(available / mean) if mean else 0
    finally:
        for vm in kept:
            driver.stop(vm.vmid)


def measure(
    name: str,
    make: Callable[[bool], VMDriver],
    args: argparse.Namespace,
    available: int,
    *,
    restores: bool,
) -> Figures:
    """Every figure of one driver (``make(snapshots)`` makes it)."""
    figures = Figures(name)
    cold = make(False)
    try:
        for _ in range(args.n):
            vm, took = start_answered(cold)
            figures.cold.append(took)
            figures.cold_cpu.append(cpu_seconds(vm.pid))
            figures.pss_cold.append(pss_kib(vm.pid))
            figures.destroy.append(destroy(cold, vm))
        if not restores:
            figures.rate = burst(cold, args.burst)
            figures.rate_what = "starts"
            fit(cold, figures, args.fit, available)
    finally:
        cold.close()
    if not restores:
        return figures
    warm = make(True)
    try:
        vm, _ = start_answered(warm)  # a boot of the build, and its snapshot (or a restore)
        warm.stop(vm.vmid)
        for _ in range(args.restores):
            vm, took = start_answered(warm)
            if vm.start != "restore":
                raise RuntimeError(f"a warm start was a {vm.start!r}, not a restore")
            figures.restore.append(took)
            figures.restore_cpu.append(cpu_seconds(vm.pid))
            figures.pss_restore.append(pss_kib(vm.pid))
            figures.destroy.append(destroy(warm, vm))
        figures.rate = burst(warm, args.burst)
        figures.rate_what = "restores"
        fit(warm, figures, args.fit, available)
    finally:
        warm.close()
    return figures


def _s(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{pct(values, 0.5):7.3f}s {pct(values, 0.99):7.3f}s"


def _mib(values: list[int]) -> str:
    return f"{statistics.median(values) / 1024:7.1f}" if values else "      -"


def report(process: Figures, qemu: Figures, accel: str) -> bool:
    """Print both drivers' figures side by side; whether the aims are met."""
    rows = [
        ("cold start to first answer (p50 p99)", _s(process.cold), _s(qemu.cold)),
        ("restore to first answer (p50 p99)", "-", _s(qemu.restore)),
        ("  CPU it used getting there (p50 p99)", _s(process.cold_cpu), _s(qemu.cold_cpu)),
        ("  CPU a restore used (p50 p99)", "-", _s(qemu.restore_cpu)),
        ("destroy (p50 p99)", _s(process.destroy), _s(qemu.destroy)),
        (
            "PSS per replica, MiB (cold | restored)",
            _mib(process.pss_cold),
            f"{_mib(qemu.pss_cold)} | {_mib(qemu.pss_restore)}",
        ),
        (
            f"starts per second ({process.rate_what} | {qemu.rate_what})",
            f"{process.rate:7.2f}",
            f"{qemu.rate:7.2f}",
        ),
        (
            "idle replicas kept: PSS MiB each",
            f"{process.fit_count} x{_mib(process.fit_pss)}",
            f"{qemu.fit_count} x{_mib(qemu.fit_pss)}",
        ),
        (
            "idle CPU per replica (% of a core)",
            f"{process.idle_cpu * 100:7.2f}",
            f"{qemu.idle_cpu * 100:7.2f}",
        ),
        ("would fit in available memory", f"{process.fits:7d}", f"{qemu.fits:7d}"),
    ]
    print(f"\n{'':42} {'process':>17} {'qemu (' + accel + ')':>25}")
    for label, left, right in rows:
        print(f"{label:42} {left:>17} {right:>25}")
    cold50, restore50 = pct(qemu.cold, 0.5), pct(qemu.restore, 0.5)
    ratio = restore50 / cold50 if cold50 else float("inf")
    met_abs, met_ratio = restore50 <= RESTORE_AIM_S, ratio <= RESTORE_RATIO_AIM
    pss = statistics.median(qemu.pss_restore) / max(1, statistics.median(process.pss_cold))
    print(
        f"\nqemu cold boot / process cold start (p50): {cold50 / pct(process.cold, 0.5):.1f}x; "
        f"PSS of a restored VM / a process: {pss:.1f}x"
    )
    verdict = {True: "met", False: "MISSED"}
    print(
        f"restore p50 {restore50:.3f}s: {verdict[met_abs]} (aim <= {RESTORE_AIM_S}s); "
        f"restore / cold boot {ratio:.2f}: {verdict[met_ratio]} (aim <= {RESTORE_RATIO_AIM})"
    )
    print(FIRECRACKER)
    return met_abs and met_ratio


@contextlib.contextmanager
def _state() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cq-bench-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Measure both drivers; 1 if an aim is missed."""
    parser = argparse.ArgumentParser(prog="python -m bench.vms", description=__doc__)
    add_counts(
        parser,
        {
            "-n": (5, "cold starts of each driver"),
            "--restores": (10, "restores from the snapshot"),
            "--burst": (4, "starts at once for the rate"),
            "--fit": (8, "idle replicas kept at most"),
        },
    )
    parser.add_argument("--accel", choices=["auto", "kvm", "tcg"], default="auto")
    parser.add_argument("--cache", type=Path, default=None, help="the qemu driver's cache")
    args = parser.parse_args(argv)
    available = mem_available_kib()
    load = os.getloadavg()[0]
    with _state() as state:
        process = measure(
            "process", lambda _snapshots: ProcessDriver(), args, available, restores=False
        )
        accel = ["?"]

        def qemu(snapshots: bool) -> VMDriver:
            driver = QemuDriver(
                cache=args.cache or default_cache(),
                state=state / ("warm" if snapshots else "cold"),
                accel=args.accel,
                snapshots=snapshots,
                boot_timeout=300.0,
            )
            accel[0] = driver.accel.upper()
            return driver

        vms = measure("qemu", qemu, args, available, restores=True)
    met = report(process, vms, accel[0])
    print(
        f"{args.n} cold starts, {args.restores} restores, bursts of {args.burst}, up to "
        f"{args.fit} idle kept; {os.cpu_count()} cores, load average {load:.1f} at the start, "
        f"{available >> 10} MiB available"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
