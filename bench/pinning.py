"""CPU pinning for benchmarks: some process trees on some CPUs, everything else on the others.

In production the gateway has cores of its own: the replicas are microVMs on other
nodes and the callers are elsewhere. On one small machine every part of a benchmark
competes for the same cores, so a proxy's throughput is capped by what the processes
beside it spend. :class:`Pinning` reproduces the production split on one host: the
*pinned* processes (the gateway, with every thread it has, and any other proxy measured
in its place, such as bench.gateway's C relay) run on their own CPUs, and
this process with every other process it started (load generator, replicas, agent,
worker, Redis: their threads and their children, and what they start later, since
Linux hands a thread's affinity to what it creates) on the rest.

Affinity is per thread on Linux (``sched_setaffinity`` on a pid sets its main thread
only), so each process's threads are pinned one by one from ``/proc/PID/task``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil


def parse_cpus(text: str) -> set[int]:
    """CPUs from a list such as ``1``, ``2,3`` or ``4-7``."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (examples: 1, 2,3, 4-7)")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def split(spec: str | None) -> tuple[set[int], set[int]]:
    """The pinned process's CPUs and everyone else's, from ``spec`` (None: the last CPU)."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        raise ValueError(f"pinning needs at least 2 CPUs; this process may use {len(allowed)}")
    own = parse_cpus(spec) if spec else {max(allowed)}
    if not own <= allowed:
        raise ValueError(f"CPUs {sorted(own - allowed)} are not available here ({sorted(allowed)})")
    rest = allowed - own
    if not rest:
        raise ValueError("pinning leaves no CPU for the other processes")
    return own, rest


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(Path("/proc") / str(pid) / "task")]
    except FileNotFoundError:
        return []


def set_tree(proc: psutil.Process, cpus: set[int]) -> None:
    """Put every thread of ``proc`` and of its descendants on ``cpus``."""
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for each in procs:
        for tid in _threads(each.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.sched_setaffinity(tid, cpus)  # (a thread that ended meanwhile: skipped)


class Pinning:
    """Some process trees on their CPUs, this process and the rest of its tree on the others."""

    def __init__(self, pinned: dict[str, int], own: set[int], rest: set[int]) -> None:
        self.names = list(pinned)  # what the pinned processes are, for describe()
        self.pinned = [psutil.Process(pid) for pid in pinned.values()]
        self.own = own
        self.rest = rest
        self.everyone = os.sched_getaffinity(0)

    def _apply(self, pinned: set[int], others: set[int]) -> None:
        me = psutil.Process()
        for tid in _threads(me.pid):
            os.sched_setaffinity(tid, others)
        skip = {
            pid
            for proc in self.pinned
            for pid in (proc.pid, *(p.pid for p in proc.children(recursive=True)))
        }
        for child in me.children(recursive=False):
            if child.pid not in skip:
                set_tree(child, others)
        for proc in self.pinned:
            set_tree(proc, pinned)

    def __enter__(self) -> Pinning:
        self._apply(self.own, self.rest)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._apply(self.everyone, self.everyone)

    def describe(self) -> str:
        """Which CPUs are whose, in words."""
        return (
            f"{' and '.join(self.names)} on CPU {_show(self.own)}; client, replicas, agent, "
            f"worker and Redis on CPU {_show(self.rest)}"
        )


def _show(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
