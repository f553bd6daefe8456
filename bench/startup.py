"""Start-up: does ``corral`` cost little more than importing what a command needs, and does
``corral worker`` start and stop about as fast as a plain Celery worker?

Run: ``python -m bench.startup [-n 21] [--workers 7]``

Each command runs ``-n`` times as a fresh process, the way a user types it (the
``corral`` script of this interpreter, stdout captured), against a migrated SQLite
store in a temporary directory and no broker. Beside each, in the same run, its
**baseline**: a fresh interpreter that only imports the third-party packages the
command needs. ``corral --help`` needs argparse; ``corral nodes list`` needs
SQLAlchemy's ORM, pydantic-settings (the settings), the SQLite driver and rich (its
table on a terminal). The figure is the ratio of the medians (and of the fastest
runs, less sensitive to a busy machine); the aim is at most 1.5. The rest of a
command's time is corral's own modules and its work (building the parser of every
command, one query): ``python -X importtime -m corral.cli nodes list`` shows where it
goes. ``tests/corral/cli/test_startup.py`` checks what the commands import.

The worker rows (``--workers`` runs each, 0: none) start ``corral worker`` - as operators
run it: the supervisor and its Celery worker, corral's default pool - on a Redis of the
run's own, and beside it, taking turns, the **baseline**: ``celery -A bench.plain worker``,
a plain Celery app as its users run it (the default pool). Each run is timed from launch
to the worker's ``ready.`` line, then from SIGTERM (a warm shutdown) to its exit, and
charged the CPU-seconds of every process it ran. A worker killed at a hard limit is
started again (``stack/worker.py``), and every test with a worker starts one: both
figures are a fault's price and the suite's. The aim is a start at most twice the plain
worker's: corral's loads as well what the plain app has no need of (SQLAlchemy and the
store's models, pydantic's settings, the agents' gRPC and HTTP clients).
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.options import add_counts
from testkit.services import RedisServer

AIM = 1.5
WORKER_AIM = 2.0  # corral worker's start / the plain Celery worker's (see above)
ROOT = Path(__file__).resolve().parent.parent
CORRAL = Path(sys.executable).with_name("corral")
# command line -> what a fresh interpreter imports to stand for what the command needs
COMMANDS = {
    "corral --help": "import argparse",
    "corral nodes list": "import sqlalchemy.orm, pydantic_settings, sqlite3, rich.table",
}


@dataclass(frozen=True)
class Runs:
    """Wall-clock seconds of repeated runs of one command line."""

    seconds: list[float]

    @property
    def median(self) -> float:
        """The median run."""
        return statistics.median(self.seconds)

    @property
    def fastest(self) -> float:
        """The fastest run."""
        return min(self.seconds)


def once(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    """Seconds one run of ``argv`` took; it must succeed."""
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, timeout=60)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.decode()[-500:]}")
    return took


def timed(
    command: list[str], base: list[str], n: int, env: dict[str, str], cwd: Path
) -> tuple[Runs, Runs]:
    """``n`` runs of a command and of its baseline, taking turns so both meet the same load."""
    once(command, env, cwd)  # warm the page cache and the bytecode
    once(base, env, cwd)
    pairs = [(once(command, env, cwd), once(base, env, cwd)) for _ in range(n)]
    return Runs([c for c, _ in pairs]), Runs([b for _, b in pairs])


@dataclass(frozen=True)
class WorkerRuns:
    """Start (launch to ``ready.``) and stop (SIGTERM to exit) seconds, and CPU-seconds."""

    start: Runs
    stop: Runs
    cpu: Runs


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def worker_once(argv: list[str], env: dict[str, str], log: Path) -> tuple[float, float, float]:
    """Start a worker, wait for ``ready.``, stop it warm: the three figures of one run."""
    cpu = _children_cpu()
    log.unlink(missing_ok=True)
    with log.open("wb") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        while b" ready." not in log.read_bytes():
            if proc.poll() is not None or time.perf_counter() - started > 60:
                raise RuntimeError(f"{' '.join(argv)} did not start: {log.read_text()[-500:]}")
            time.sleep(0.005)
        ready = time.perf_counter() - started
        asked = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        stopped = time.perf_counter() - asked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return ready, stopped, _children_cpu() - cpu


def worker_timed(n: int, env: dict[str, str], tmp: Path) -> tuple[WorkerRuns, WorkerRuns]:
    """``n`` runs of ``corral worker`` and of the plain Celery worker, taking turns."""
    quiet = ["-l", "INFO", "--without-gossip", "--without-mingle"]
    ours = [str(CORRAL), "worker", *quiet]
    plain = [sys.executable, "-m", "celery", "-A", "bench.plain", "worker", *quiet]
    runs: dict[str, list[tuple[float, float, float]]] = {"ours": [], "plain": []}
    worker_once(ours, env, tmp / "worker.log")  # warm the page cache
    for _ in range(n):
        runs["ours"].append(worker_once(ours, env, tmp / "worker.log"))
        runs["plain"].append(worker_once(plain, env, tmp / "plain.log"))
    ours_runs, plain_runs = (
        WorkerRuns(*(Runs([run[i] for run in runs[who]]) for i in range(3)))
        for who in ("ours", "plain")
    )
    return ours_runs, plain_runs


def main(argv: list[str] | None = None) -> int:
    """Time each command against its baseline and print the ratios; 1 if an aim is missed."""
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__)
    add_counts(
        parser,
        {
            "-n": (21, "runs of each command line and of its baseline, taking turns"),
            "--workers": (7, "starts and stops of each worker, taking turns (0: none)"),
        },
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="corral-bench-startup-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        env.update(
            CORRAL_STATE_DIR=f"{tmp}/state",
            CORRAL_BROKER_URL="redis://127.0.0.1:1/0",
            CORRAL_DATABASE_URL=f"sqlite:///{tmp}/corral.sqlite",
            PYTHONPATH=str(ROOT),
        )
        subprocess.run(
            [str(CORRAL), "db", "upgrade"],
            env=env,
            cwd=tmp,
            check=True,
            capture_output=True,
            timeout=120,
        )
        print(
            f"{'command':<20} {'median':>8} {'fastest':>8} {'baseline':>9} "
            f"{'(fastest)':>9} {'ratio':>6} {'(fastest)':>9}"
        )
        met = True
        for line, needs in COMMANDS.items():
            command, base = timed(
                [str(CORRAL), *line.split()[1:]],
                [sys.executable, "-c", needs],
                args.n,
                env,
                Path(tmp),
            )
            ratio, fastest = command.median / base.median, command.fastest / base.fastest
            met &= ratio <= AIM
            print(
                f"{line:<20} {command.median * 1000:6.0f}ms {command.fastest * 1000:6.0f}ms "
                f"{base.median * 1000:7.0f}ms {base.fastest * 1000:7.0f}ms "
                f"{ratio:6.2f} {fastest:9.2f}  {'met' if ratio <= AIM else 'MISSED'}"
                f" (aim <= {AIM})"
            )
        if args.workers > 0:
            met &= _print_workers(args.workers, env, Path(tmp))
        load = os.getloadavg()[0]
        print(
            f"{args.n} runs of each command, {args.workers} of each worker; load average {load:.1f}"
        )
    return 0 if met else 1


def _print_workers(n: int, env: dict[str, str], tmp: Path) -> bool:
    """Time the workers on a Redis of their own and print their rows; whether the aim is met."""
    redis = RedisServer(tmp / "redis")
    redis.start()
    try:
        env = {
            **env,
            "CORRAL_BROKER_URL": redis.url,
            "BENCH_BROKER_URL": redis.url,
            "BENCH_RESULT_BACKEND": redis.url_for(1),
        }
        ours, plain = worker_timed(n, env, tmp)
    finally:
        redis.stop()
    print(f"\n{'worker (medians)':<28} {'start':>7} {'stop':>7} {'CPU-s':>7}")
    for name, runs in (("corral worker", ours), ("celery -A bench.plain worker", plain)):
        print(
            f"{name:<28} {runs.start.median * 1000:5.0f}ms {runs.stop.median * 1000:5.0f}ms "
            f"{runs.cpu.median:7.2f}"
        )
    ratio = ours.start.median / plain.start.median
    print(
        f"{'ratio (corral / plain)':<28} {ratio:7.2f} "
        f"{ours.stop.median / plain.stop.median:7.2f} {ours.cpu.median / plain.cpu.median:7.2f}"
        f"  start {'met' if ratio <= WORKER_AIM else 'MISSED'} (aim <= {WORKER_AIM})"
    )
    return ratio <= WORKER_AIM


if __name__ == "__main__":
    sys.exit(main())
