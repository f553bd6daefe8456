"""Host-wide port claims: what one agent process claims, another does not hand out."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.drivers import DriverError, PortAllocator
from agents.portlocks import HostPorts, host_ports

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
# Above Linux's ephemeral ports (to 60999) and the agents' ranges: no other test's agent
# or connection takes these while this test looks at them.
QUIET_RANGE = (61000, 64999)

HOLDER = """
import sys
from agents.portlocks import host_ports
ports = host_ports()
print(ports.take(int(sys.argv[1])), flush=True)
sys.stdin.read()  # hold until the test closes our stdin
"""


def _bindable_pair() -> int:
    """A port P of the quiet range where P and P + 1 can both be bound now."""
    for _ in range(50):
        port = random.randint(QUIET_RANGE[0], QUIET_RANGE[1] - 1)
        try:
            for p in (port, port + 1):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    pytest.skip("found no two free neighbouring ports")


@pytest.fixture
def holder() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Another process that claimed port P (and holds it until its stdin closes)."""
    port = _bindable_pair()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(port)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().strip() == "True"  # it holds P now
        yield proc, port
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def test_a_port_another_process_claimed_is_skipped_though_nothing_listens_on_it(
    holder: tuple[subprocess.Popen[str], int],
) -> None:
    """Two agent processes once both probed a port free; one replica lost the bind."""
    proc, port = holder
    alloc = PortAllocator(port, port + 1)
    assert alloc.allocate() == port + 1  # P binds fine, but another agent claimed it
    with pytest.raises(DriverError, match=f"host port {port} is in use"):
        alloc.allocate(port)
    alloc.release([port + 1])
    assert proc.stdin is not None
    proc.stdin.close()  # the holder exits: the kernel lets go of its claims
    proc.wait(timeout=10)
    assert alloc.allocate(port) == port
    alloc.release([port])


def test_a_released_port_is_free_for_another_process_and_an_adopted_one_is_not() -> None:
    port = _bindable_pair()
    alloc = PortAllocator(port, port)
    assert alloc.allocate() == port

    def other_takes() -> str:
        run = subprocess.run(
            [sys.executable, "-c", HOLDER, str(port)],
            cwd=ROOT,
            input="",
            capture_output=True,
            text=True,
            timeout=20,
        )
        return run.stdout.strip()

    assert other_takes() == "False"  # claimed here, before any replica binds it
    alloc.release([port])
    assert other_takes() == "True"
    alloc.claim([port])  # a VM adopted after a restart listens there
    assert other_takes() == "False"
    alloc.release([port])
    assert other_takes() == "True"


def test_one_process_has_one_claims_file_that_is_its_users() -> None:
    ports = host_ports()
    assert ports is host_ports() and ports.shared
    info = ports.path.stat()
    assert info.st_uid == os.getuid() and info.st_mode & 0o077 == 0


def test_a_claims_file_that_is_a_link_is_not_used(tmp_path: Path) -> None:
    """Another user's link in the shared temporary directory cannot steer our claims."""
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / "claims.lock"
    link.symlink_to(target)
    ports = HostPorts(link)
    assert not ports.shared
    assert ports.take(61000) and ports.take(61000)  # the bind probe alone decides
    ports.give(61000)
