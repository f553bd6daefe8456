"""Child processes and their groups: what agents, ``corral up`` and the settings share.

Standard library only, so an agent process (``agents.procs``), ``corral up``
(``stack.supervisor``) and the settings (a running ``corral up``'s state file names its
pid) share it without either loading the other's dependencies: an agent never imports
pydantic.

**A process group is signalled only while its id is surely ours.** A child started in a
session of its own leads a group whose id is its pid. Once the child has been reaped
(``Popen.poll`` or ``wait`` returned its status) and nothing of its group is left, the
kernel may give that number to any new process; on a host whose ``pid_max`` is 32768 and
that starts processes by the thousand, it soon does. A ``killpg`` sent then lands on a
stranger: once, by all signs, a test suite's PostgreSQL postmaster. So :func:`end_group`
sends its last SIGKILL to the group (for what the leader left behind: pool children,
replicas) while the leader is alive or a zombie, which keeps the id taken, and only then
reaps it. For a child someone already reaped, the id is still ours only while what it
left holds it, and then no process has that pid: a live process with it means the number
went to another, and nothing is sent. :func:`exited` asks whether a child ended without
reaping it, for callers that then end its group.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess

__all__ = ["end_group", "exited", "pid_exists"]


def pid_exists(pid: int) -> bool:
    """True if a process ``pid`` exists (a zombie too), even one owned by another user."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the child has ended, leaving it unreaped (its group id stays ours)."""
    if proc.returncode is not None:
        return True
    try:
        found = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped by another thread meanwhile
        return True
    return found is not None


def _wait_unreaped(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` s for the child to end, without reaping it; whether it did."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:  # reaped by another thread meanwhile
        return True
    try:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout))
    finally:
        os.close(pidfd)
    return bool(ready)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def end_group(proc: subprocess.Popen[bytes], grace: float) -> tuple[int | None, bool]:
    """SIGTERM a group-leading child's group, SIGKILL it after ``grace`` s, and reap the child.

    Returns the child's exit status and whether it outlived the SIGTERM. For a child
    reaped before the call, only what it left behind is killed, and only if its pid is
    free (see the module's docstring).
    """
    pgid = proc.pid
    if proc.returncode is not None:
        if not pid_exists(pgid):  # its stragglers hold the id, or nobody does
            _signal_group(pgid, signal.SIGKILL)
        return proc.returncode, False
    _signal_group(pgid, signal.SIGTERM)  # start_new_session: the child leads its group
    lingered = not _wait_unreaped(proc, grace)
    _signal_group(pgid, signal.SIGKILL)  # unreaped, the leader holds the id: the group is ours
    return proc.wait(), lingered
