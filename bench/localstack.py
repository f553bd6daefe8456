"""The control plane a gateway benchmark runs against, each part a process on this machine.

:func:`local_stack` starts an embedded Redis, a migrated store (a fresh SQLite file, or
PostgreSQL with ``--postgres``), one reference fcdaemon agent whose replicas are real
processes, and one ``corral worker`` (its users' command, its own pool), each with its
log in the run's temporary directory; :meth:`LocalStack.start` starts more (the
gateways). Everything it started is stopped when the block ends. This process's
settings are the run's (its broker, its store), so ``corral.api`` reaches them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.options import store_for
from config.celery import QUEUES
from config.settings import get_settings, reset_settings
from stack.supervisor import stop_process
from testkit.services import RedisServer, free_port
from workers.celery import configure
from workers.store.db import get_database
from workers.store.migrate import upgrade

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
AGENT = [PY, "-m", "agents.fcdaemon", "--driver", "process", "--log-level", "WARNING"]
WORKER = [PY, "-m", "stack.worker", "-l", "WARNING", "--without-gossip", "--without-mingle"]
GATEWAY = [PY, "-m", "corral.cli", "gateway"]


@dataclass
class LocalStack:
    """The parts running: their processes, the store, the agent's port, the environment."""

    tmp: Path
    env: dict[str, str]
    db: Any
    agent_port: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, argv: list[str], **extra: str) -> subprocess.Popen[bytes]:
        """Start a process of the run (its log: ``NAME.log``), with ``extra`` settings."""
        log = (self.tmp / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv, cwd=ROOT, env={**self.env, **extra}, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """Stop every process started, the last first."""
        for proc in reversed(self.procs):
            proc.terminate()  # all at once: they stop together
        for proc in reversed(self.procs):
            stop_process(proc, 15)


@contextlib.contextmanager
def local_stack(
    args: argparse.Namespace, prefix: str, settings: dict[str, str] | None = None
) -> Iterator[LocalStack]:
    """Redis, a migrated store, a process agent and a worker, for the block's time.

    ``settings`` are ``CORRAL_*`` variables of the run's own, for every process.
    """
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    redis = RedisServer(tmp / "redis")
    redis.start()
    db_url, pg_server = store_for(args, tmp)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")},
        "CORRAL_BROKER_URL": redis.url_for(0),
        "CORRAL_RESULT_BACKEND": redis.url_for(1),
        "CORRAL_DATABASE_URL": db_url,
        "CORRAL_STATE_DIR": str(tmp / "state"),
        "PYTHONPATH": str(ROOT),
        **(settings or {}),
    }
    os.environ.update({k: v for k, v in env.items() if k.startswith("CORRAL_")})
    reset_settings()  # settings read on import are not this run's
    configure(get_settings())  # this run's broker
    running = LocalStack(tmp, env, None)
    try:
        running.db = get_database(db_url)
        upgrade(running.db)
        running.agent_port = free_port()
        running.start("agent", [*AGENT, "--listen", f"127.0.0.1:{running.agent_port}"])
        running.start("worker", [*WORKER, "-Q", ",".join(QUEUES)])
        yield running
    finally:
        running.stop()
        redis.stop()
        if pg_server is not None:
            pg_server.stop()
