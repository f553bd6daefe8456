"""Child processes that never outlive the agent that started them.

Every replica and CPU hog is a real OS process that:

* runs in its own session and process group (``start_new_session=True``), so stopping it
  signals the whole group, including anything it forked;
* asks the kernel to SIGKILL it when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``
  through ctypes, before exec), so even a SIGKILLed agent leaves nothing behind.

One Linux subtlety shapes this module: the "parent" that PDEATHSIG watches is the
*thread* that forked the child, not the process. Agents handle requests on pool threads
(gRPC's, the Lambdo host's) that may end, so a child forked there would be killed the
moment its thread did. All forks therefore go through a single
long-lived spawner thread (:func:`spawn`), which lives as long as the agent process.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

from config.processes import end_group, pid_exists

__all__ = ["is_alive", "kill_group", "spawn"]

log = logging.getLogger(__name__)

# No ``preexec_fn``: forking a threaded process (gRPC's pools and fork handlers) and
# running Python in the child before exec can deadlock or crash (seen here: SIGSEGV).
# Instead the child is a plain fork+exec of a small launcher script, which sets
# PDEATHSIG on itself and then becomes the real command (see ``agents/_launch.py``).
_LAUNCHER = str(Path(__file__).resolve().with_name("_launch.py"))


def _launch_argv(argv: Sequence[str], parent_pid: int) -> list[str]:
    """Wrap ``argv`` in the PDEATHSIG launcher (``python -m``/``-c`` run in place)."""
    argv = list(argv)
    head = [sys.executable, _LAUNCHER, str(parent_pid)]
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return [*head, "module", *argv[2:]]
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-c":
        return [*head, "code", *argv[2:]]
    return [*head, "exec", *argv]


_Job = tuple[Future[subprocess.Popen[bytes]], list[str], dict[str, str], str | None]


class _Spawner:
    """One daemon thread that performs every fork, so PDEATHSIG tracks a thread that stays."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def _ensure_thread(self) -> None:
        with self._lock:
            # After a fork, the spawner thread of the parent does not exist in the child.
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._jobs = queue.SimpleQueue()
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, args=(self._jobs,), name="corral-spawner", daemon=True
                )
                self._thread.start()

    def _run(self, jobs: queue.SimpleQueue[_Job]) -> None:
        while True:
            fut, argv, env, cwd = jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                proc = subprocess.Popen(  # noqa: S603 - argv of an allow-listed image, no shell
                    _launch_argv(argv, os.getpid()),
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    close_fds=True,
                )
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(proc)

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None
    ) -> subprocess.Popen[bytes]:
        self._ensure_thread()
        fut: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((fut, list(argv), dict(env), cwd))
        return fut.result()


_SPAWNER = _Spawner()


def spawn(
    argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own process group, tied to this process by PDEATHSIG."""
    return _SPAWNER.spawn(argv, env, cwd)


def kill_group(proc: subprocess.Popen[bytes], grace: float = 2.0) -> int | None:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds, and reap it.

    For a child already reaped, only what it left is killed, and only while its pid is
    free: its group id may be another process's by now (:func:`config.processes.end_group`).
    A VM that ignored SIGTERM is logged."""
    code, lingered = end_group(proc, grace)
    if lingered and grace > 0:
        log.warning("pid %d ignored SIGTERM for %.1fs; sent SIGKILL", proc.pid, grace)
    return code


def is_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (Linux ``/proc``; ``kill(pid, 0)`` elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    except OSError:
        return pid_exists(pid)
    # The state letter follows the parenthesised command name, which may contain spaces.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")
