"""``corral worker``: a Celery worker under a supervisor that enforces its tasks' hard time limits.

``corral worker [OPTIONS]`` runs ``celery -A workers worker [OPTIONS]`` as its child and
stays outside it. Celery enforces a hard time limit only in its prefork pool (billiard's
parent kills the child); in a thread pool nothing inside the process can end a thread
stuck in a C call, and an exception raised into it would land anywhere
(:mod:`workers.timelimits`). So the worker reports every task it starts - which thread,
which task, how long it may run - and every task it ends, over a pipe to this process;
this process keeps the deadlines and, when one passes with its task still running:

1. writes one line naming the task to its stderr with ``os.write`` (no ``logging``, no
   lock: nothing here can be left holding one);
2. SIGKILLs the worker's process group (the worker and any pool processes);
3. starts the worker again. The killed worker's messages were never acknowledged and
   come back after the broker's visibility timeout (every task may run twice).

A worker that ends by itself ends this command with its exit status (``corral up`` and
compose restart it as they restart any service). SIGTERM, SIGINT, SIGQUIT, SIGHUP,
SIGUSR1 and SIGUSR2 are passed on to the worker (SIGTERM: Celery's warm shutdown; the
hard limits are enforced until it is over). The worker is in a process group of its own
and gets ``PR_SET_PDEATHSIG`` = SIGKILL: if this supervisor dies, so does the worker,
and with no supervisor no thread-pool worker runs unwatched. Running as PID 1 (a
container), this process also reaps whatever orphans the worker leaves.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from stack.supervisor import die_with_parent
from workers import timelimits

POLL_S = 0.2  # how often a worker's exit is noticed when no report arrives
MAX_BUFFER = 64 * 1024  # unparsed report bytes kept; a line longer than this is dropped
MAX_TRACKED = 10_000  # tasks tracked at once (a worker runs a few dozen)
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


def _own_group_and_die_with_parent() -> None:
    os.setpgid(0, 0)
    die_with_parent()


def celery_argv(options: Sequence[str]) -> list[str]:
    """The worker command ``corral worker`` supervises."""
    return [sys.executable, "-m", "celery", "-A", "workers", "worker", *options]


def pool_option(options: Sequence[str]) -> str | None:
    """The pool ``-P`` / ``--pool`` names in ``options``, if any (the last one wins)."""
    found = None
    for i, option in enumerate(options):
        if option in ("-P", "--pool") and i + 1 < len(options):
            found = options[i + 1]
        elif option.startswith("--pool="):
            found = option.removeprefix("--pool=")
        elif option.startswith("-P") and len(option) > 2:
            found = option[2:]
    return found


def worker_env(options: Sequence[str]) -> dict[str, str]:
    """The worker's environment: this one, with ``-P prefork`` made to mean prefork.

    Celery's command line cannot tell ``-P prefork`` from no ``-P`` at all, and takes the
    app's configured pool for both: with corral's default (threads), ``-P prefork`` would
    quietly run threads. The pool asked for on the command line is therefore also passed
    as ``CORRAL_WORKER_POOL``, the setting that configures it.
    """
    env = dict(os.environ)
    if pool_option(options) == "prefork":
        env["CORRAL_WORKER_POOL"] = "prefork"
    return env


def _say(text: str) -> None:
    """One line to stderr in one ``os.write``: no logging, no lock."""
    with contextlib.suppress(OSError):
        os.write(2, f"corral worker: {text}\n".encode(errors="replace"))


@dataclass
class _Running:
    """One worker process, its pipe and the tasks it reported running."""

    proc: subprocess.Popen[bytes]
    reports: int  # the pipe's read end
    tasks: dict[str, tuple[float, float, str]] = field(default_factory=dict)  # key: due, hard, task
    buffer: bytes = b""
    status: int | None = None
    closed: bool = False  # every write end is closed: the worker and its children are gone

    def read(self) -> None:
        """Take in what the worker reported since the last read."""
        try:
            chunk = os.read(self.reports, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.closed = True
            return
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        if len(self.buffer) > MAX_BUFFER:
            self.buffer = b""
        for line in lines:
            report = timelimits.parse(line)
            if report is None:
                continue
            if report.event == "end":
                self.tasks.pop(report.key, None)
            elif len(self.tasks) < MAX_TRACKED or report.key in self.tasks:
                due = time.monotonic() + report.hard_s
                self.tasks[report.key] = (due, report.hard_s, report.task)

    def overdue(self) -> tuple[float, str] | None:
        """The hard limit and name of a task past its hard limit, if any."""
        at = time.monotonic()
        for due, hard, task in self.tasks.values():
            if at >= due:
                return hard, task
        return None

    def wait_s(self) -> float:
        """How long to wait for a report before looking again."""
        nearest = min((due for due, _, _ in self.tasks.values()), default=float("inf"))
        return max(0.0, min(POLL_S, nearest - time.monotonic()))

    def kill(self) -> None:
        """SIGKILL the worker's process group and wait for the worker to end."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        while self.status is None:
            _reap(self)
            if self.status is None:
                time.sleep(0.01)

    def close(self) -> None:
        """Close the pipe's read end."""
        with contextlib.suppress(OSError):
            os.close(self.reports)


def _reap(worker: _Running) -> None:
    """Collect ended children (the worker, and orphans when this is PID 1) without blocking."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == worker.proc.pid:
            worker.status = os.waitstatus_to_exitcode(status)
            worker.proc.returncode = worker.status


def _start(options: Sequence[str]) -> _Running:
    """Start the worker with the write end of a fresh report pipe."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    env = {**worker_env(options), timelimits.WATCH_FD_ENV: f"{write_end}:{os.getpid()}"}
    try:
        proc = subprocess.Popen(  # noqa: S603 - corral's own worker command
            celery_argv(options),
            env=env,
            pass_fds=(write_end,),
            preexec_fn=_own_group_and_die_with_parent,  # safe: this process has one thread
        )
    finally:
        os.close(write_end)  # the worker holds it now: its end is the pipe's end
    return _Running(proc, read_end)


class _Signals:
    """Signals passed on to the current worker; the stopping ones remembered."""

    def __init__(self) -> None:
        self.stopping = False
        self.worker: _Running | None = None

    def install(self) -> None:
        """Handle every forwarded signal."""
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if signum in STOPPING:
            self.stopping = True
        worker = self.worker
        if worker is not None and worker.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.proc.pid, signum)


def supervise(options: Sequence[str]) -> int:
    """Run the worker with ``options`` until it ends by itself; its exit status."""
    signals = _Signals()
    signals.install()
    restarts = 0
    while True:
        worker = signals.worker = _start(options)
        try:
            outlived = _watch(worker)
        finally:
            worker.close()
        if outlived is None or signals.stopping:
            status = worker.status if worker.status is not None else 1
            return status if status >= 0 else 128 - status
        restarts += 1
        hard, task = outlived
        _say(f"worker started again (#{restarts}) after task {task} outlived {hard:g}s")


def _watch(worker: _Running) -> tuple[float, str] | None:
    """Watch one worker until it ends (None) or a task outlives its hard limit (killed)."""
    while True:
        if worker.closed:
            time.sleep(worker.wait_s())
        else:
            ready, _, _ = select.select([worker.reports], [], [], worker.wait_s())
            if ready:
                worker.read()
        overdue = worker.overdue()
        if overdue is not None:
            hard, task = overdue
            _say(
                f"task {task} outlived its hard time limit of {hard:g}s: killing the worker "
                f"(pid {worker.proc.pid}); its messages come back after the visibility timeout"
            )
            worker.kill()
            return overdue
        _reap(worker)
        if worker.status is not None:
            return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stack.worker [celery worker options]``."""
    return supervise(sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    raise SystemExit(main())
