"""Beat's passes are numbered as they are sent; one a later pass already covered is skipped.

No clock decides it: a worker that comes back to a pile of passes queued while it was
away runs the first and skips the rest, and the next pass sent runs again.
"""

from __future__ import annotations

import re

import pytest
import redis

from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from tests.fixtures import Env, sqlite_only
from workers import beat_passes
from workers.celery import app

PILE = 5


@sqlite_only  # no store: one run is enough
def test_a_pass_sent_before_one_that_started_is_superseded(broker_env: Env) -> None:
    client = redis.Redis.from_url(broker_env.settings.broker_url)
    numbers = [beat_passes.number(client, "corral.autoscale") for _ in range(PILE)]
    assert numbers == list(range(1, PILE + 1))
    assert not beat_passes.superseded(client, "corral.autoscale", numbers[0])  # runs, covers all
    assert [beat_passes.superseded(client, "corral.autoscale", n) for n in numbers[1:]] == [
        True
    ] * (PILE - 1)
    later = beat_passes.number(client, "corral.autoscale")
    assert not beat_passes.superseded(client, "corral.autoscale", later)  # sent after: runs
    assert not beat_passes.superseded(client, "corral.reap_pass", 1)  # kinds apart


@pytest.mark.slow
@pytest.mark.timeout(120)
@sqlite_only  # the pile is the broker's; the passes' work is not what is shown
def test_a_worker_back_to_a_pile_of_passes_runs_one(
    broker_env: Env, worker_processes: list[WorkerProcess]
) -> None:
    for _ in range(PILE):  # sent while no worker runs: numbered, queued
        app.send_task("corral.reap_pass")
    worker = WorkerProcess(broker_env.tmp)
    worker_processes.append(worker.start())
    done = re.compile(r"Task corral\.reap_pass\[[^\]]+\] succeeded in [^:]+: (.*)")
    eventually(
        lambda: len(done.findall(worker.tail(200))) == PILE, 60, "the pile", detail=worker.tail
    )
    results = done.findall(worker.tail(200))
    assert sum("superseded" in result for result in results) == PILE - 1, results
    ran = [result for result in results if "superseded" not in result]
    assert len(ran) == 1 and "'skipped': False" in ran[0], ran
