"""Ending a child's process group: its stragglers die, and nobody else's group is signalled."""

from __future__ import annotations

import os
import select
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from config.processes import end_group, exited, pid_exists
from stack.supervisor import stop_process
from testkit.eventually import eventually

pytestmark = pytest.mark.timeout(60)


def _state(pid: int) -> str:
    """The process's state letter in /proc (``Z``: a zombie), or ``-`` if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "-"
    return stat[stat.rfind(")") + 2]


def _ends_within(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    """Whether the process ends within ``seconds`` (a signal sent to it is acted on in
    milliseconds: a second without an end is none sent)."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        return bool(select.select([pidfd], [], [], seconds)[0])
    finally:
        os.close(pidfd)


def _leader(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, start_new_session=True)


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """Another group leader: what a reaped child's pid may have become."""
    proc = _leader("sleep", "600")
    yield proc
    proc.kill()
    proc.wait()


def _reaped_as(stranger: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """A child that ended and was reaped, whose pid the kernel then gave to ``stranger``."""
    child = _leader("true")
    child.wait(30)
    child.pid = stranger.pid  # what pid reuse does, without waiting for the counter to wrap
    return child


def test_a_reaped_childs_group_id_that_went_to_another_process_is_not_signalled(
    stranger: subprocess.Popen[bytes],
) -> None:
    child = _reaped_as(stranger)
    assert end_group(child, 0.2) == (0, False)
    assert stop_process(child, 0.2, group=True) == 0
    assert not _ends_within(stranger, 1.0)  # before: SIGTERM and SIGKILL to its group


def test_a_reaped_childs_stragglers_are_killed_while_they_hold_its_group_id(
    tmp_path: Path,
) -> None:
    leader = subprocess.Popen(  # exits at once; its child, in its group, ignores SIGTERM
        ["/bin/sh", "-c", "sh -c 'trap \"\" TERM; echo $$ > left; exec sleep 600' & exit 0"],
        cwd=tmp_path,
        start_new_session=True,
    )
    left_file = tmp_path / "left"
    eventually(lambda: left_file.exists() and left_file.read_text(), 30, "the straggler")
    left = int(left_file.read_text())
    leader.wait(30)
    assert not pid_exists(leader.pid)  # the straggler holds the id as its group's, not a pid
    assert end_group(leader, 0.2) == (0, False)
    eventually(lambda: _state(left) in ("-", "Z"), 30, "the straggler to be killed")


def test_a_live_leader_is_termed_then_killed_with_its_group_and_reaped(tmp_path: Path) -> None:
    proc = _leader("/bin/sh", "-c", f"trap '' TERM; touch {tmp_path}/ready; exec sleep 600")
    eventually((tmp_path / "ready").exists, 30, "the leader to trap SIGTERM")
    code, lingered = end_group(proc, 0.2)
    assert (code, lingered) == (-9, True)
    assert proc.returncode == -9 and _state(proc.pid) == "-"  # reaped


def test_exited_leaves_the_child_unreaped_so_its_id_stays_taken() -> None:
    proc = _leader("sleep", "600")
    assert not exited(proc)
    proc.kill()
    eventually(lambda: exited(proc), 30, "the child's end")
    assert proc.returncode is None and _state(proc.pid) == "Z"  # a zombie: the pid is held
    assert end_group(proc, 0.2) == (-9, False)
    assert exited(proc)  # and after reaping
