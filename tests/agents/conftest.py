"""Fixtures for the agent tests: agents with real drivers (QEMU too), a recording registry."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agents import MemoryDriver, ProcessDriver, RunningAgent, serve_fcdaemon
from agents.qemu.driver import QemuDriver, default_cache
from protos import fcdaemon_grpc
from tests.agents.helpers import RecordingRegistry, start_registry
from tests.requirements import QEMU, unmet


@pytest.fixture
def registry() -> Iterator[tuple[str, RecordingRegistry]]:
    """A recording registry on loopback: (address, servicer)."""
    server, address, servicer = start_registry()
    yield address, servicer
    server.stop(0).wait()


@pytest.fixture
def process_agent() -> Iterator[RunningAgent]:
    """A node agent whose replicas are real processes."""
    running = serve_fcdaemon(driver=ProcessDriver())
    yield running
    running.stop()


@pytest.fixture
def memory_agent() -> Iterator[RunningAgent]:
    """A node agent whose VMs are records."""
    running = serve_fcdaemon(driver=MemoryDriver())
    yield running
    running.stop()


def stub_for(running: RunningAgent) -> fcdaemon_grpc.FcServiceStub:
    """A FcService stub on a fresh channel to ``running``."""
    return fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(running.address))


@pytest.fixture
def process_stub(process_agent: RunningAgent) -> fcdaemon_grpc.FcServiceStub:
    """Stub for :func:`process_agent`."""
    return stub_for(process_agent)


@pytest.fixture
def memory_stub(memory_agent: RunningAgent) -> fcdaemon_grpc.FcServiceStub:
    """Stub for :func:`memory_agent`."""
    return stub_for(memory_agent)


# -- the qemu driver: real guests -----------------------------------------------------------

#: How long a guest may take to serve in these tests: TCG boots on 2 shared, busy cores.
QEMU_BOOT_S = 150.0


@pytest.fixture(scope="session")
def qemu_cache() -> Path:
    """The qemu driver's cache, shared by every test and run (the kernel is fetched once,
    images built once per build); skips the test where QEMU or busybox is missing (fails it
    where QEMU is required: :mod:`tests.requirements`)."""
    missing = [
        what
        for what, found in (
            (
                "qemu-system-x86_64 (apt-get install qemu-system-x86)",
                shutil.which("qemu-system-x86_64"),
            ),
            ("busybox (apt-get install busybox-static)", shutil.which("busybox")),
            ("dpkg-deb", shutil.which("dpkg-deb")),
        )
        if not found
    ]
    if missing:
        unmet(QEMU, f"the qemu driver needs {', '.join(missing)}")
    return default_cache()


def kill_processes_naming(directory: Path) -> list[int]:
    """SIGKILL every process whose command line names ``directory``; their pids."""
    needle = str(directory).encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except OSError:
            continue
    return killed


@pytest.fixture
def qemu_state() -> Iterator[Path]:
    """A state directory for one test's VMs (short: unix socket paths live in it); any
    process left naming it is killed at the end."""
    path = Path(tempfile.mkdtemp(prefix="cq-", dir="/tmp"))
    yield path
    kill_processes_naming(path)
    shutil.rmtree(path, ignore_errors=True)


MakeQemuDriver = Callable[..., QemuDriver]


@pytest.fixture
def make_qemu_driver(
    qemu_cache: Path, qemu_state: Path, tmp_path: Path
) -> Iterator[MakeQemuDriver]:
    """Make qemu drivers on this test's state directory and snapshot store (TCG: the same
    on every host); every one is closed at the end.

    The kernel and images come from the shared cache; the snapshots do not: a test that
    spoils a snapshot must not spoil it for the same test of another suite running beside
    this one (cis51: two suites at once, one restored the other's broken snapshot)."""
    made: list[QemuDriver] = []

    def make(**options: Any) -> QemuDriver:
        settings: dict[str, Any] = {
            "cache": qemu_cache,
            "state": qemu_state,
            "snapshot_dir": tmp_path / "snapshots",
            "accel": "tcg",
            "boot_timeout": QEMU_BOOT_S,
            **options,
        }
        driver = QemuDriver(**settings)
        made.append(driver)
        return driver

    yield make
    for driver in made:
        driver.close()
