"""Child processes of ``corral up``: started with logs, watched, stopped in order.

Each child runs in its own session (so a terminal's Ctrl-C reaches only
``corral up``, which then stops the children in the right order) and gets
``PR_SET_PDEATHSIG`` = SIGKILL, so even if ``corral up`` itself is killed no child
outlives it: set after exec by util-linux's ``setpriv --pdeathsig`` (so ``subprocess``
can vfork: Python run between fork and exec in a process with threads, gRPC's among
them, can crash the child), by a ``preexec_fn`` where there is no ``setpriv``.
Stopping sends SIGTERM to the child's process group, waits, then SIGKILLs whatever is
left of the group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from config.processes import end_group

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before exec: be SIGKILLed when the parent dies (Linux)."""
    parent = os.getppid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def with_parent_death(argv: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` and the ``preexec_fn`` that make a child be SIGKILLed when its parent dies."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return argv, die_with_parent
    return [setpriv, "--pdeathsig", "KILL", "--", *argv], None


def stop_process(
    proc: subprocess.Popen[bytes], timeout: float = 10.0, *, group: bool = False
) -> int | None:
    """Stop a child: SIGTERM, SIGKILL after ``timeout`` s; its exit status (None if unreaped).

    With ``group`` the signals go to its process group (a child started in a session of
    its own, as :class:`Child` starts them), and the SIGKILL goes whatever the leader did,
    for the group's stragglers: pool children, replicas, hogs; for a child already reaped,
    only while its pid is free (its group id may be another process's by now:
    :func:`config.processes.end_group`). corral up, testkit and the benchmarks stop
    their children with this; an agent's VMs are stopped by
    :func:`agents.procs.kill_group` (an agent imports nothing of the stack)."""
    if group:
        return end_group(proc, timeout)[0]
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    return proc.returncode


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    _log: object = field(default=None, repr=False)

    def start(self) -> None:
        """Start (or restart) the process, appending to its log."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open while the child runs
        self._log = log
        argv, preexec = with_parent_death(self.argv)
        self.proc = subprocess.Popen(  # noqa: S603 - corral's own commands (stack.up)
            argv,
            env=self.env,
            cwd=self.cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec,
        )
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it lingers."""
        if self.proc is None:
            return
        stop_process(self.proc, timeout, group=True)
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]

    def tail(self, lines: int = 20) -> str:
        """The end of the child's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Supervisor:
    """Starts children (one by one, or several at once), restarts ones that die, stops them in
    reverse order."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.children: list[Child] = []
        self.say = say

    def start(
        self, child: Child, ready: Callable[[], bool] | None = None, timeout: float = 60.0
    ) -> Child:
        """Start a child and wait until ``ready()`` says it serves."""
        self.launch(child)
        self.wait_ready([(child, ready, timeout)])
        return child

    def launch(self, child: Child) -> Child:
        """Start a child without waiting for it (:meth:`wait_ready` does)."""
        self.children.append(child)
        child.start()
        return child

    def wait_ready(self, waits: list[tuple[Child, Callable[[], bool] | None, float]]) -> None:
        """Wait until each child's ``ready()`` says it serves, within its timeout from its start.

        A child that exits first, or is not ready in time, raises (naming it, with its log's end).
        """
        todo = [(child, ready, timeout) for child, ready, timeout in waits if ready is not None]
        while todo:
            for child, ready, timeout in list(todo):
                if ready is not None and ready():
                    todo.remove((child, ready, timeout))
                elif not child.alive:
                    raise RuntimeError(f"{child.name} exited at start:\n{child.tail()}")
                elif time.monotonic() > child.started_at + timeout:
                    tail = child.tail()
                    raise TimeoutError(f"{child.name} not ready after {timeout:g}s:\n{tail}")
            if todo:
                time.sleep(0.1)

    def watch_once(self) -> None:
        """Restart any child that died (at most once every 5 s each)."""
        for child in self.children:
            if not child.alive and time.monotonic() - child.started_at > 5:
                code = child.proc.returncode if child.proc else None
                child.restarts += 1
                self.say(
                    f"{child.name} exited ({code}); restarting (#{child.restarts}); "
                    f"log: {child.log_path}"
                )
                child.start()

    def stop_all(self) -> None:
        """Stop every child, last started first."""
        for child in reversed(self.children):
            if child.proc is not None:
                self.say(f"stopping {child.name}")
                child.stop()
