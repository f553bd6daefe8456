"""Code run in child processes by the PostgreSQL tests (kept light to import under spawn)."""

from __future__ import annotations

import os
import threading
from typing import Any

from config.settings import get_settings
from workers.replicas.claims import NoIdleReplica, claim
from workers.store.db import Database

THREADS = 4


def claimer(url: str, name: str, ready: Any, out: Any) -> None:
    """In a fresh process: THREADS threads claim at once through a fresh Database."""
    db = Database(url)
    settings = get_settings()
    with db.read() as s:  # connect before the race starts
        s.connection()
    barrier = threading.Barrier(THREADS)
    results: list[tuple[str, str]] = []
    lock = threading.Lock()

    def one() -> None:
        barrier.wait()
        try:
            got = ("ok", claim(db, settings, name).replica_id)
        except NoIdleReplica as exc:
            got = ("none", str(exc))
        except Exception as exc:  # reported to the parent, which fails the test
            got = ("error", f"{type(exc).__name__}: {exc}")
        with lock:
            results.append(got)

    ready.wait()
    threads = [threading.Thread(target=one) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    out.put(results)
    out.close()
    out.join_thread()  # the results are in the pipe
    db.dispose()
    os._exit(0)  # skip interpreter teardown: this child has nothing else to clean up
