"""corral's own processes for tests and benchmarks: ``corral worker``, ``celery beat``, listeners.

:class:`WorkerProcess` runs ``corral worker`` - ``celery -A workers worker`` under its
supervisor, as operators run it (the app's own pool, threads, unless asked for prefork) -
as a child process, which a test can SIGKILL and replace; :func:`start_beat` runs
``celery -A workers beat`` (by :mod:`workers.command`, as ``corral up`` does). Both take
their settings from the environment, on top of :data:`FAST`: retries and RPC deadlines
short enough that a test's faults are met within its waits. :func:`start_listening` runs
a command that listens on port 0 and says where.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from config.celery import QUEUES
from testkit.eventually import eventually
from workers.base import timelimits

ROOT = Path(__file__).resolve().parent.parent
FAST = {
    "CORRAL_RETRY_BACKOFF_S": "0.01",
    "CORRAL_RETRY_BACKOFF_MAX_S": "0.05",
    "CORRAL_RETRY_MAX": "3",
    "CORRAL_RPC_TIMEOUT_S": "2",
    "CORRAL_CREATE_TIMEOUT_S": "2",
    "CORRAL_LAMBDO_TIMEOUT_S": "2",
    "CORRAL_HEALTH_TIMEOUT_S": "0.5",
    # a worker's warm stop waits for its BRPOP in flight: a second at every stop, else
    "CORRAL_BROKER_POLL_S": "0.1",
}


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (its files are closed)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class WorkerProcess:
    """``corral worker`` (a Celery worker and its supervisor) as a child process."""

    def __init__(  # noqa: PLR0913 - options by name
        self,
        log_dir: Path,
        *,
        concurrency: int = 2,
        pool: str | None = None,
        extra_env: dict[str, str] | None = None,
        name: str = "w1",
        include: str | None = None,
        log_pipe: bool = False,
    ) -> None:
        """``pool``: ``-P`` (None: the app's own); ``include``: test task modules to load.

        ``log_pipe``: the worker's stdout and stderr are a pipe this process copies to the
        log file, and can stop reading (:meth:`stalled`), as a stuck log shipper does.
        """
        self.log_path = log_dir / f"worker-{name}.log"
        self.concurrency = concurrency
        self.pool = pool
        self.name = name
        self.include = include
        self.log_pipe = log_pipe
        self.env = {**os.environ, **FAST, **(extra_env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._asked = False  # a warm shutdown was asked for
        self._reading = threading.Event()  # the log pipe is being read
        self._reading.set()
        self._copier: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> WorkerProcess:
        """Start the worker and wait until it says it is ready."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._asked = False
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "corral.cli",
                "worker",
                *(["-P", self.pool] if self.pool else []),
                *(["--include", self.include] if self.include else []),
                "-c",
                str(self.concurrency),
                "-l",
                "INFO",
                "-n",
                f"{self.name}@%h",
                "-Q",
                ",".join(QUEUES),
                "--without-gossip",
                "--without-mingle",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE if self.log_pipe else self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if self.proc.stdout is not None:
            self._copier = threading.Thread(
                target=self._copy_log, args=(self.proc.stdout, self._log), daemon=True
            )
            self._copier.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited early:\n{self.tail()}")
            if b" ready." in self.log_path.read_bytes():
                return self
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready after {timeout}s:\n{self._stacks_and_kill()}")

    def _stacks_and_kill(self) -> str:
        """A worker that did not start: its threads' stacks into its log, then SIGKILL; the tail.

        Killed here because the test never got it to kill: left running, it would take
        the next tests' messages from the broker they share (one such start once failed
        the three tests after it).
        """
        tail = self.stacks()
        self.kill()
        return tail

    def stacks(self) -> str:
        """The worker's and its pool processes' thread stacks, written into its log; the tail.

        A failed wait's detail: where a worker that went silent is stuck (cis617).
        """
        worker = self.worker_pid()
        if worker is not None:  # the worker and its pool processes write their stacks
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker, timelimits.STACKS_SIGNAL)
            sizes = [-1]

            def written() -> bool:  # the log has stopped growing
                sizes.append(self.log_path.stat().st_size)
                return sizes[-1] == sizes[-2]

            with contextlib.suppress(AssertionError):
                eventually(written, 5, "the stacks", poll=0.3)
        return self.tail(200)

    def _copy_log(self, pipe: IO[bytes], log: IO[bytes]) -> None:
        """Copy the worker's output to its log while reading is not stalled, until it ends."""
        fd = pipe.fileno()
        while True:
            self._reading.wait()
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            try:
                log.write(chunk)
                log.flush()
            except ValueError:  # the log was closed (the worker stopped): nothing to keep
                return

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        """Stop reading the worker's log pipe for the body (``log_pipe`` workers)."""
        assert self.log_pipe, "a worker started with log_pipe=True"
        self._reading.clear()
        try:
            yield
        finally:
            self._reading.set()

    def unread_log_bytes(self) -> int:
        """Bytes the worker wrote to its log pipe that nobody has read yet."""
        assert self.proc is not None and self.proc.stdout is not None
        pending = array.array("i", [0])
        fcntl.ioctl(self.proc.stdout.fileno(), termios.FIONREAD, pending)
        return pending[0]

    def tree(self) -> set[int]:
        """The pids of the Celery worker the supervisor runs and of its pool processes."""
        worker = self.worker_pid()
        if worker is None:
            return set()
        try:
            children = Path(f"/proc/{worker}/task/{worker}/children").read_text().split()
        except OSError:
            children = []
        return {worker, *(int(pid) for pid in children)}

    def succeeded(self, task: str) -> int:
        """How many runs of ``task`` (``corral.reap_pass``...) the worker logged as succeeded."""
        pattern = re.compile(rf"Task {re.escape(task)}\[[^\]]+\] succeeded")
        return len(pattern.findall(self.log_path.read_text(errors="replace")))

    def more_runs(self, task: str, n: int, timeout: float = 30.0) -> None:
        """Wait until the worker has run ``task`` ``n`` more times (passes beat sends)."""
        start = self.succeeded(task)
        eventually(
            lambda: self.succeeded(task) >= start + n,
            timeout,
            f"{n} more runs of {task}",
            detail=self.tail,
        )

    def tail(self, n: int = 60) -> str:
        """The last lines of the worker's log (and, for a ``log_pipe`` worker, its pipe's state)."""
        try:
            text = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            text = ""
        if self.log_pipe and self.proc is not None and self.proc.poll() is None:
            copier = self._copier is not None and self._copier.is_alive()
            try:
                unread: int | str = self.unread_log_bytes()
            except (OSError, ValueError) as exc:  # the pipe closed meanwhile
                unread = f"unknown ({exc})"
            pipe = f"{unread} bytes unread in the log pipe, copier alive: {copier}"
            text += f"\n[{pipe}, reading: {self._reading.is_set()}]"
        return text

    def worker_pid(self) -> int | None:
        """The pid of the Celery worker the supervisor runs now (None: none)."""
        if self.proc is None:
            return None
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return None
        pids = [int(pid) for pid in children.split()]
        return pids[0] if pids else None

    def kill(self) -> None:
        """SIGKILL the worker, its pool processes and its supervisor at once (a crash); return
        once they are all gone.

        The worker is not this process's child: only its supervisor can be waited for. A
        killed process closes its sockets late in its exit, after its memory is torn down,
        and until then Redis may hand its BRPOP the next test's message (cis627: a spawn
        sent 0.45 s after a prefork worker's kill never reached its queue).
        """
        if self.proc is not None and self.proc.poll() is None:
            tree = self.tree()
            worker = self.worker_pid()
            if worker is not None:  # the worker's own process group: it and its pool
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker, signal.SIGKILL)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            eventually(lambda: not any(alive(pid) for pid in tree), 10, "the killed worker's end")

    def ask_to_stop(self) -> None:
        """Begin a warm shutdown (SIGTERM) without waiting for it: :meth:`stop` waits."""
        if self.proc is not None and self.proc.poll() is None and not self._asked:
            self.proc.send_signal(signal.SIGTERM)
            self._asked = True

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM), SIGKILL if it does not finish in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.ask_to_stop()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        finally:
            self._log.close()


def start_beat(tmp: Path, name: str, extra_env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``celery -A workers beat`` as a child process (log and schedule under ``tmp``)."""
    log = (tmp / f"beat-{name}.log").open("wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.command",
            "beat",
            "-l",
            "INFO",
            "--max-interval",
            "1",
            "-s",
            str(tmp / f"beat-{name}.schedule"),
        ],
        cwd=ROOT,
        # PYTHONFAULTHANDLER: a SIGABRT writes every thread's stack to the log (a test whose
        # beat never starts asks for them: see tests/tasks/test_maintenance.py)
        env={**os.environ, **FAST, **extra_env, "PYTHONFAULTHANDLER": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


#: Takes every descriptor a process may open, at a soft limit of 64 (``held``; ``errno``: why
#: the last open failed).
_EXHAUST = """
import os, resource
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError as exc:
    errno = exc.errno
"""


def run_without_descriptors(before: str, after: str) -> subprocess.CompletedProcess[str]:
    """Run Python ``before``, then ``after`` once the process holds every descriptor it may.

    ``after`` sees ``held``, the descriptors taken (``os.close(held.pop())`` frees one), and
    ``errno``, the error of the open that found none free.
    """
    script = "\n".join((before, _EXHAUST, after))
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


#: what a listener of corral's says once it listens (``fcdaemon listening on 127.0.0.1:PORT``)
LISTENING = re.compile(r"listening on (\S+:\d+)")


def start_listening(
    argv: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, timeout: float = 60
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``argv`` (listening on port 0), output to ``log_path``; it and its ``HOST:PORT``.

    Port 0, not a port found free a moment before: another process may bind that one
    first, and a probe of the port then reaches that process (cis473: a gRPC call answered
    by another suite's HTTP server) - only the listener's own words say where it is.
    """
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def said() -> str | None:
        found = LISTENING.search(log_path.read_text(errors="replace"))
        if found is None and proc.poll() is not None:
            raise AssertionError(f"{argv} ended before it listened:\n{log_path.read_text()}")
        return found[1] if found else None

    try:
        address = eventually(said, timeout, f"`{' '.join(argv[1:])}` to say where it listens")
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    assert address is not None  # (eventually returns a truthy value)
    return proc, address
