"""``corral worker``: a Celery worker under a supervisor that enforces its tasks' hard time limits.

``corral worker [OPTIONS]`` runs ``celery -A workers worker [OPTIONS]`` as its child (as
``python -m workers.command worker``: the same command without Celery's other commands and
plugins, :mod:`workers.command`) and stays outside it. Celery enforces a hard time limit
only in its prefork pool (billiard's parent kills the child); in a thread pool nothing
inside the process can end a thread stuck in a C call, and an exception raised into it
would land anywhere
(:mod:`workers.base.timelimits`). So the worker reports, over a pipe to this process, every
task it starts - which thread, which task, how long it may run - and ends, and every
message it takes from the broker and acknowledges (its delivery tag). This process keeps
the deadlines and, when one passes with its task still running:

1. asks the worker for every thread's stack (:data:`~workers.base.timelimits.STACKS_SIGNAL`:
   Python's faulthandler writes them to the worker's stderr, in C, taking no lock) and
   SIGKILLs the worker's process group (the worker and any pool processes)
   :data:`STACKS_S` later, whatever the worker does meanwhile: the log says where the
   task was stuck, and nothing delays the kill longer;
2. writes one line naming the task to its stderr, without blocking: ``os.write`` (no
   ``logging``, no lock) on a descriptor of its own that does not wait - a line that
   does not fit in a stalled pipe is dropped, and the kill stands;
3. counts the kill of that task in the broker's Redis (:mod:`workers.base.poison`: a message
   killed three times is given up when it comes back, its operation failed) and puts
   every message the worker held, unacknowledged, back on its queue at once
   (:func:`workers.broker.restore`, kombu's own restore by delivery tag), so the killed
   worker's other tasks run again within seconds instead of after the visibility
   timeout;
4. starts the worker again.

A worker that ends by itself has what it held put back the same way (after a warm
shutdown Celery has done it already), and ends this command with its exit status
(``corral up`` and compose restart it as they restart any service). SIGTERM, SIGINT,
SIGQUIT, SIGHUP, SIGUSR1 and SIGUSR2 are passed on to the worker (SIGTERM: Celery's warm
shutdown; the hard limits are enforced until it is over). The worker is in a process
group of its own and gets ``PR_SET_PDEATHSIG`` = SIGKILL: if this supervisor dies, so
does the worker, and with no supervisor no thread-pool worker runs unwatched (its
messages then come back after the visibility timeout). Running as PID 1 (a container),
this process also reaps whatever orphans the worker leaves.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from stack.supervisor import die_with_parent
from workers.base import timelimits

POLL_S = 0.2  # how often the deadlines are looked at (and, without a pidfd, the worker's exit)
STACKS_S = 0.2  # how long a worker past a hard limit has to write its stacks before the kill
MAX_BUFFER = 64 * 1024  # unparsed report bytes kept; a line longer than this is dropped
MAX_TRACKED = 10_000  # tasks, or held messages, tracked at once (a worker runs a few dozen)
MAX_SAY = 4096  # one line to stderr: PIPE_BUF, so a pipe takes it whole or not at all
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
    return [sys.executable, "-m", "workers.command", "worker", *options]


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


class _Stderr:
    """This process's stderr, written without ever waiting.

    A pipe (compose, a log shipper, a test harness) is written through a descriptor of its own
    opened non-blocking - the worker shares the pipe but not this descriptor's flags - so a
    line that does not fit is dropped and counted; anything else (a file, a terminal) is
    written only when ``poll`` says it takes a line now.
    """

    def __init__(self) -> None:
        self.fd = 2
        self.dropped = 0
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(2).st_mode):
                self.fd = os.open("/proc/self/fd/2", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)

    def write(self, data: bytes) -> bool:
        """Write ``data`` (at most :data:`MAX_SAY` bytes) whole, now, or not at all."""
        try:
            if self.fd == 2:
                poller = select.poll()
                poller.register(2, select.POLLOUT)
                if not poller.poll(0):
                    raise BlockingIOError
            os.write(self.fd, data[:MAX_SAY])
        except OSError:  # full (BlockingIOError), or gone: the line is dropped
            self.dropped += 1
            return False
        return True


_stderr: _Stderr | None = None


def _say(text: str) -> None:
    """One line to stderr in one ``os.write``: no logging, no lock, never a wait."""
    global _stderr
    if _stderr is None:
        _stderr = _Stderr()
    dropped = _stderr.dropped
    note = f" ({dropped} line(s) of this supervisor dropped before)" if dropped else ""
    if _stderr.write(f"corral worker: {text}{note}\n".encode(errors="replace")):
        _stderr.dropped = 0


@dataclass(frozen=True)
class _Task:
    """A task the worker reported running: when its hard limit falls, the limit, its name[id]."""

    due: float
    hard_s: float
    task: str
    task_id: str  # "" if the report carried none


@dataclass
class _Running:
    """One worker process, its pipe, the tasks it runs and the messages it holds."""

    proc: subprocess.Popen[bytes]
    reports: int  # the pipe's read end
    tasks: dict[str, _Task] = field(default_factory=dict)  # key: the task's thread
    held: dict[str, str] = field(default_factory=dict)  # delivery tag -> name[id]
    buffer: bytes = b""
    status: int | None = None
    closed: bool = False  # every write end is closed: the worker and its children are gone
    exited: int | None = None  # a pidfd: readable once the worker has exited (Linux 5.3+)

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
            if report is not None:
                self._take(report)

    def _take(self, report: timelimits.Report) -> None:
        match report.event:
            case "end":
                self.tasks.pop(report.key, None)
            case "start" if len(self.tasks) < MAX_TRACKED or report.key in self.tasks:
                due = time.monotonic() + report.hard_s
                self.tasks[report.key] = _Task(due, report.hard_s, report.task, report.task_id)
            case "got":
                if len(self.held) >= MAX_TRACKED:  # the oldest is forgotten: back by the sweep
                    del self.held[next(iter(self.held))]
                self.held[report.key] = report.task
            case "done":
                self.held.pop(report.key, None)

    def drain(self) -> None:
        """Read what is left in the pipe of a worker that is gone."""
        while not self.closed:
            ready, _, _ = select.select([self.reports], [], [], 0)
            if not ready:
                return
            self.read()

    def overdue(self) -> list[_Task]:
        """The tasks past their hard limit."""
        at = time.monotonic()
        return [task for task in self.tasks.values() if at >= task.due]

    def wait_s(self) -> float:
        """How long to wait for a report before looking again."""
        nearest = min((task.due for task in self.tasks.values()), default=float("inf"))
        return max(0.0, min(POLL_S, nearest - time.monotonic()))

    def dump_stacks(self) -> None:
        """Ask the worker to write its threads' stacks; give it :data:`STACKS_S` to."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, timelimits.STACKS_SIGNAL)
            time.sleep(STACKS_S)

    def kill(self) -> None:
        """SIGKILL the worker's process group and wait for the worker to end."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        while self.status is None:
            _reap(self)
            if self.status is None:
                time.sleep(0.01)

    def wait(self) -> None:
        """Wait for a report, the worker's exit or the next look (:meth:`wait_s`), then read."""
        watched = [] if self.closed else [self.reports]
        if self.exited is not None:  # the exit itself wakes the wait, not the next look
            watched.append(self.exited)
        if not watched:
            time.sleep(self.wait_s())
            return
        ready, _, _ = select.select(watched, [], [], self.wait_s())
        if self.reports in ready:
            self.read()

    def close(self) -> None:
        """Close the pipe's read end (and the pidfd)."""
        for fd in (self.reports, self.exited):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


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
    exited = None
    with contextlib.suppress(AttributeError, OSError):  # no pidfd: the wait polls
        exited = os.pidfd_open(proc.pid)
    return _Running(proc, read_end, exited=exited)


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
            worker.drain()
        finally:
            worker.close()
        _hand_back(worker, outlived)
        if not outlived or signals.stopping:
            status = worker.status if worker.status is not None else 1
            return status if status >= 0 else 128 - status
        restarts += 1
        _say(
            f"worker started again (#{restarts}) after task {outlived[0].task} outlived "
            f"{outlived[0].hard_s:g}s"
        )


def _watch(worker: _Running) -> list[_Task]:
    """Watch one worker until it ends (no task) or tasks outlive their hard limit (killed)."""
    while True:
        worker.wait()
        overdue = worker.overdue()
        if overdue:
            worker.dump_stacks()  # at most STACKS_S, then the kill
            worker.kill()  # nothing below may delay it
            for task in overdue:
                _say(
                    f"task {task.task} outlived its hard time limit of {task.hard_s:g}s: "
                    f"killed the worker (pid {worker.proc.pid})"
                )
            return overdue
        _reap(worker)
        if worker.status is not None:
            return []


def _hand_back(worker: _Running, outlived: list[_Task]) -> None:
    """Count the kills of the tasks that outlived their limit; put what the worker held back.

    Best effort: without Redis, a kill goes uncounted and the messages come back after the
    visibility timeout, as they did before.
    """
    if not outlived and not worker.held:
        return
    try:
        from config.celery import celery_config
        from config.settings import get_settings
        from workers import broker
        from workers.base import poison
        from workers.base.redis_client import redis_client

        settings = get_settings()
        client = redis_client(settings.broker_url)
        for task in outlived:
            if client is not None and task.task_id:
                killed = poison.count_kill(client, task.task_id)
                _say(f"task {task.task} killed at its hard time limit {killed} time(s)")
        if worker.held and client is not None:
            options = celery_config(settings)["broker_transport_options"]
            back = broker.restore(settings.broker_url, list(worker.held), options)
            if back:
                _say(f"{back} message(s) the worker held put back on their queues")
    except Exception as exc:  # the supervisor goes on: it says why
        from config.redact import redact

        _say(
            f"could not hand the worker's messages back ({type(exc).__name__}: "
            f"{redact(str(exc))[:200]}): they come back after the visibility timeout"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stack.worker [celery worker options]``."""
    return supervise(sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    raise SystemExit(main())
