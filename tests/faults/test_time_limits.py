"""Time limits that cannot wedge a worker, with real ``corral worker`` processes in both pools.

Nothing is raised into a running thread: a task past its soft limit stops at the next
safe point (here: the start of a store transaction), so a hundred soft limits landing in
tasks that log and use the store without pause leave no handler lock held, no pool
connection checked out and no session idle in a transaction. A task stuck where no safe
point comes is ended from outside at its hard limit: billiard's parent kills a prefork
child, ``corral worker``'s supervisor kills and restarts a thread-pool worker, saying
which task it was.
"""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

import pytest
from sqlalchemy import select, text

from agents.drivers import VMSpec
from corral import api
from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from tests.faults.conftest import POOL_PER_STORE
from tests.fixtures import Env, StartAgents, postgres_only
from tests.helpers import broker_drained, deploy_fn
from workers.backends import node_slots
from workers.base.redis_client import redis_client
from workers.celery import app
from workers.store.models import Node

TASKS = "tests.faults.limit_tasks"
# The worker's limits: soft 1.2 s (agent calls of 0.1 s fit in it), hard 3 s; no retries,
# so each soft limit ends its task with one line; messages of a killed worker back after 8 s.
LIMITS = {
    "CORRAL_TASK_SOFT_TIME_LIMIT_S": "1.2",
    "CORRAL_TASK_TIME_LIMIT_S": "3",
    "CORRAL_VISIBILITY_TIMEOUT_S": "8",
    "CORRAL_RETRY_MAX": "0",
    "CORRAL_RPC_TIMEOUT_S": "0.1",
    "CORRAL_CREATE_TIMEOUT_S": "0.1",
    "CORRAL_LAMBDO_TIMEOUT_S": "0.1",
}
SOFT_LIMITS = 100
# The churners run ten at a time, each with limits of its own (in its message): a soft
# limit of 0.5 s (they call no agent) and a hard one of 6 s, still below the visibility
# timeout. SQLite's write lock is not fair - a waiter polls for it, at most every 100 ms
# - so among ten busy writers one can wait seconds for its turn; at 3 s it could be
# killed before its soft limit came. The stuck tasks keep the worker's 3 s.
CHURNERS = 10
CHURN_LIMITS = {"soft_time_limit": 0.5, "time_limit": 6}
OUT_OF_TIME = "ran into its soft time limit with no retries left"
CHURN_KILLED = re.compile(  # a churner ended at its hard limit (by the supervisor, or billiard)
    r"corral\.test\.churn\[[^\]]+\] outlived|exceeded for corral\.test\.churn"
)
POOLS = pytest.mark.parametrize("pool", ["threads", "prefork"])


def _env(env: Env, extra: dict[str, str]) -> None:
    env.set(**{k[len("CORRAL_") :].lower(): v for k, v in extra.items()})


def _log(worker: WorkerProcess) -> str:
    return worker.log_path.read_text(errors="replace")


def _idle_in_transaction(env: Env) -> int:
    """Sessions of the store idle inside a transaction (PostgreSQL), or 1 if SQLite is locked."""
    if env.db.is_sqlite:
        path = env.db.url.removeprefix("sqlite:///")
        conn = sqlite3.connect(path, timeout=1.0, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")  # fails if a leaked transaction holds the lock
            conn.execute("ROLLBACK")
        except sqlite3.OperationalError:
            return 1
        finally:
            conn.close()
        return 0
    with env.db.read() as s:
        return int(
            s.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND state LIKE 'idle in transaction%'"
                )
            )
        )


def _churning_worker(
    env: Env, started: list[WorkerProcess], pool: str, *, log_pipe: bool = False
) -> WorkerProcess:
    """A started worker for the churners (``LIMITS``, the test tasks) in ``pool``."""
    _env(env, LIMITS)
    worker = WorkerProcess(
        env.tmp, concurrency=CHURNERS, pool=pool, extra_env=LIMITS, include=TASKS, log_pipe=log_pipe
    )
    started.append(worker.start())
    return worker


def _probe(worker: WorkerProcess, tag: str) -> list[int]:
    """Run the probe task; the checked-out counts it logged (it could log: no lock held)."""
    app.send_task("corral.test.probe", args=(tag,))
    pattern = re.compile(rf"probe {tag}: pid \d+ checked out (\d+)")
    found = eventually(
        lambda: pattern.findall(_log(worker)),
        60,
        f"probe {tag} to log",
        detail=worker.stacks,  # (cis617: a worker that went silent; where it is stuck)
    )
    return [int(n) for n in found]


def _stuck_and_ended(worker: WorkerProcess, pool: str, marker: Path, starts: int) -> None:
    """Send a task that blocks for good; see its hard limit end it (the ``starts``th worker)."""
    before = worker.worker_pid()
    sent = app.send_task("corral.test.stuck", args=(str(marker),))
    if pool == "threads":  # the supervisor kills the worker and starts it again
        line = f"task corral.test.stuck[{sent.id}] outlived its hard time limit of 3s"
        eventually(lambda: line in _log(worker), 60, "the kill", detail=worker.tail)
        # its stack, written before the kill, says where it was stuck
        assert re.search(r"File \S+limit_tasks\.py\S*, line \d+ in stuck", _log(worker))
        eventually(lambda: worker.worker_pid() not in (None, before), 30, "a new worker")
        eventually(
            lambda: _log(worker).count(" ready.") == starts, 60, "the restart", detail=worker.tail
        )
    else:  # billiard's parent kills the child and forks another
        line = f"Hard time limit (3.0s) exceeded for corral.test.stuck[{sent.id}]"
        eventually(lambda: line in _log(worker), 60, "the kill", detail=worker.tail)
        eventually(
            lambda: _log(worker).count("exited with 'signal 9 (SIGKILL)'") == starts - 1,
            30,
            "the child's end",
            detail=worker.tail,
        )


@pytest.mark.slow
@pytest.mark.long(25)
@pytest.mark.timeout(400)
@POOLS
def test_a_hundred_soft_limits_in_busy_tasks_wedge_nothing_and_every_hard_limit_fires(
    broker_env: Env, worker_processes: list[WorkerProcess], tmp_path: Path, pool: str
) -> None:
    worker = _churning_worker(broker_env, worker_processes, pool)

    for n in range(SOFT_LIMITS):
        app.send_task("corral.test.churn", args=(n,), **CHURN_LIMITS)

    def churned() -> bool:
        log = _log(worker)
        killed = CHURN_KILLED.search(log)  # its soft limit never came: it will never be counted
        assert killed is None, f"a churn task met its hard limit: {killed}\n{worker.tail()}"
        return log.count(OUT_OF_TIME) >= SOFT_LIMITS

    eventually(
        churned,
        120,
        f"{SOFT_LIMITS} tasks to meet their soft limit",
        poll=0.5,
        detail=worker.tail,
    )
    log = _log(worker)
    assert log.count(OUT_OF_TIME) == SOFT_LIMITS
    assert "Traceback" not in log and "SoftTimeLimitExceeded" not in log, worker.tail(100)
    if pool == "prefork":  # after each task, in its own process: nothing left checked out
        after = re.findall(r"after a task: pid \d+ checked out (\d+)", log)
        assert len(after) == SOFT_LIMITS and set(after) == {"0"}, after
    assert _probe(worker, "soft") == [0]  # and a pool thread (or child) can still log
    assert _idle_in_transaction(broker_env) == 0

    # Two tasks stuck in a C call, one after the other: each is ended at its hard limit.
    for k in (1, 2):
        _stuck_and_ended(worker, pool, tmp_path / f"stuck-{k}", starts=k + 1)
        assert _probe(worker, f"hard{k}") == [0]
    assert worker.proc is not None and worker.proc.poll() is None  # still serving
    assert _idle_in_transaction(broker_env) == 0


STALL_S = 12  # how long the log's reader stops reading: the fault itself, not a wait
FULL_PIPE = 60_000  # unread bytes of a full pipe (64 KiB) less a page: writers wait now


@pytest.mark.slow
@pytest.mark.long(20)
@pytest.mark.timeout(300)
@POOL_PER_STORE
def test_a_12_s_stall_of_the_log_pipe_kills_nothing(
    broker_env: Env, worker_processes: list[WorkerProcess], pool: str
) -> None:
    worker = _churning_worker(broker_env, worker_processes, pool, log_pipe=True)
    tree = worker.tree()  # the worker and its pool processes: a kill changes them
    with worker.stalled():
        # churners that log without pause, for longer than the stall, past their hard limit
        for n in range(20 * CHURNERS):
            app.send_task("corral.test.churn", args=(n,), **CHURN_LIMITS)
        eventually(lambda: worker.unread_log_bytes() >= FULL_PIPE, 60, "the log pipe to fill")
        time.sleep(STALL_S)
        assert worker.tree() == tree, "the worker or a pool process was killed in the stall"
    eventually(lambda: broker_drained(broker_env), 120, "every churner to end", detail=worker.tail)
    log = _log(worker)
    assert worker.tree() == tree, worker.tail(100)
    assert CHURN_KILLED.search(log) is None, worker.tail(100)
    assert "Traceback" not in log, worker.tail(100)
    assert _probe(worker, "after") == [0]  # every thread logs again
    assert _idle_in_transaction(broker_env) == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
@postgres_only  # a row lock another transaction holds
@POOLS
def test_a_spawn_waiting_on_a_node_lock_ends_the_wait_before_its_hard_limit_and_finishes(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess], pool: str
) -> None:
    """A lock wait past the hard limit was what no soft limit could interrupt (psycopg waits
    in C): the worker was killed. Its timeouts are cut to the time left now: the wait ends,
    the task is retried, and the spawn finishes once the lock is free, with no kill."""
    limits = {
        **LIMITS,
        "CORRAL_TASK_SOFT_TIME_LIMIT_S": "2",
        "CORRAL_TASK_TIME_LIMIT_S": "4",
        "CORRAL_RETRY_MAX": "3",
        "CORRAL_RPC_TIMEOUT_S": "0.5",
        "CORRAL_CREATE_TIMEOUT_S": "0.5",
        "CORRAL_LAMBDO_TIMEOUT_S": "0.5",
        "CORRAL_DB_LOCK_TIMEOUT_S": "30",  # a lock wait alone would outlast the task
        "CORRAL_DB_STATEMENT_TIMEOUT_S": "0",  # off: only the time left bounds it
    }
    _env(broker_env, limits)
    (agent,) = start_agents(1, env=broker_env)
    deploy_fn(broker_env)
    worker = WorkerProcess(broker_env.tmp, concurrency=2, extra_env=limits, pool=pool)
    worker_processes.append(worker.start())
    tree = worker.tree()
    with broker_env.db.transaction() as s:  # every node's row, locked past the hard limit
        s.execute(text("SELECT id FROM nodes FOR UPDATE"))
        op = api.spawn("hello", 2)
        eventually(
            lambda: "hit a transient database error" in _log(worker),
            60,
            "the spawn's lock wait to end before its hard limit",
            detail=worker.tail,
        )
    view = api.wait(op, timeout=60)  # retried: the lock is free now
    assert (view["status"], view["done"], view["failed"]) == ("succeeded", 2, 0), view
    # two creates (one more call of one of them, past its 0.5 s on a loaded machine, is
    # the same request id, which this agent deduplicates) and two VMs
    assert len({c.requestId for c in agent.agent.calls_of("CreateReplica")}) == 2
    assert len(agent.driver.list()) == 2
    log = _log(worker)
    assert "outlived its hard time limit" not in log and "Hard time limit" not in log, log
    assert worker.tree() == tree  # nothing was killed


@pytest.mark.slow
@pytest.mark.timeout(120)
@POOL_PER_STORE
def test_a_release_waiting_for_its_nodes_call_slot_ends_the_wait_at_its_soft_limit(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess], pool: str
) -> None:
    """The partition run (cis493): releases of orphans on an isolated agent waited for its
    call slots, held by calls that never answered, until their hard limit killed the
    worker and every task it ran. The wait ends at the soft limit and the task is retried;
    once the slot is free the release is done, with no kill."""
    limits = {**LIMITS, "CORRAL_RETRY_MAX": "20", "CORRAL_NODE_MAX_INFLIGHT": "1"}
    _env(broker_env, limits)
    (agent,) = start_agents(1, env=broker_env)
    vm = agent.driver.start(VMSpec(image="examples.hello"))  # a VM no replica took
    with broker_env.db.read() as s:
        node_id = s.scalars(select(Node.id)).one()
    redis = redis_client(broker_env.settings.broker_url)
    assert redis is not None
    now_s, _us = redis.time()  # a lease lapses at its score, in ms of Redis's clock
    redis.zadd(node_slots.key(node_id), {"a call that never answered": (now_s + 600) * 1000})
    worker = WorkerProcess(broker_env.tmp, concurrency=2, extra_env=limits, pool=pool)
    worker_processes.append(worker.start())
    tree = worker.tree()
    app.send_task("corral.release_orphan", args=(node_id, vm.vmid))
    eventually(
        lambda: _log(worker).count("an agent call cut off") >= 2,
        30,
        "the release's slot waits to end at its soft limit, twice",
        detail=worker.tail,
    )
    assert vm.vmid in {v.vmid for v in agent.driver.list()}  # nothing was sent meanwhile
    redis.zrem(node_slots.key(node_id), "a call that never answered")
    eventually(lambda: agent.driver.list() == [], 30, "the release", detail=worker.tail)
    log = _log(worker)
    assert "outlived its hard time limit" not in log and "Hard time limit" not in log, log
    assert worker.tree() == tree  # nothing was killed
