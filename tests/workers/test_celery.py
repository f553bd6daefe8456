"""The task base class: its retry backoff (exponential, capped, equal jitter), its time limits,
and where a task runs - declared by the worker's pool or by a caller that carries it out."""

from __future__ import annotations

import concurrent.futures
import contextvars
import json
import time

import pytest
from celery.exceptions import Reject
from kombu.message import Message

from config.celery import celery_config
from config.settings import load_settings
from tasks.queues import Call, carry_out
from tasks.replicas import release_orphan
from testkit.eventually import eventually
from tests.faults import limit_tasks
from tests.fixtures import NO_BROKER, Env
from tests.helpers import broker_state
from workers import leases
from workers.base import timelimits
from workers.celery import CorralRequest, CorralTask, Runs, app, backoff_s, budgeted, runs
from workers.replicas.owners import Budget


def test_each_wait_is_half_to_all_of_its_doubling_capped_ceiling() -> None:
    settings = load_settings(retry_backoff_s=0.5, retry_backoff_max_s=30)
    for retries in range(10):
        ceiling = min(30.0, 0.5 * 2**retries)
        waits = [backoff_s(settings, retries) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (retries, min(waits))
        # jittered: spread over the range, not one value (0.8^200 odds of a false alarm)
        assert min(waits) < 0.6 * ceiling and max(waits) > 0.9 * ceiling


def test_the_retries_of_a_budget_span_at_least_half_their_ceilings() -> None:
    # Equal, not full, jitter: five retries give an agent that is down at least
    # 0.25 + 0.5 + 1 + 2 + 4 = 7.75 s to come back before the task gives up.
    settings = load_settings(retry_backoff_s=0.5, retry_backoff_max_s=30, retry_max=5)
    for _ in range(200):
        assert sum(backoff_s(settings, r) for r in range(settings.retry_max)) >= 7.75


def test_a_zero_backoff_retries_at_once() -> None:
    settings = load_settings(retry_backoff_s=0, retry_backoff_max_s=0)
    assert backoff_s(settings, 3) == 0


# -- time limits: Celery's soft limit off, corral's deadline checked at safe points ------------

SHORT_LIMITS = {
    "task_soft_time_limit_s": "1.2",
    "task_time_limit_s": "3",
    "retry_max": "0",
    "rpc_timeout_s": "0.1",
    "create_timeout_s": "0.1",
    "lambdo_timeout_s": "0.1",
}


def test_celerys_soft_limit_is_off_even_for_a_message_that_asks_for_one() -> None:
    settings = load_settings()
    assert celery_config(settings)["task_soft_time_limit"] is None
    assert celery_config(settings)["task_time_limit"] == settings.task_time_limit_s
    sent = app.amqp.as_task_v2(
        "a1b2", "corral.test.probe", args=("t",), kwargs={}, time_limit=90, soft_time_limit=60
    )
    message = Message(  # type: ignore[no-untyped-call]
        body=json.dumps(sent.body),
        headers=sent.headers,
        content_type="application/json",
        content_encoding="utf-8",
    )
    request = CorralRequest(message, app=app, task=limit_tasks.probe)
    assert request.time_limits == (90, None)  # what the pool enforces: the hard limit only
    assert request.request_dict["timelimit"] == [90, 60]  # the task's deadline still sees it


def test_a_task_past_its_deadline_ends_at_a_safe_point_without_failing_or_wedging(
    corral_env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    corral_env.set(**SHORT_LIMITS)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # as a gateway carries one out
        churn = Call(limit_tasks.churn, (7,))
        outcome = pool.submit(contextvars.copy_context().run, carry_out, churn)
        assert outcome.result(timeout=30) == {"error": "soft time limit"}
        assert pool.submit(timelimits.current).result() is None  # the thread lives on, free
    assert "ran into its soft time limit with no retries left" in caplog.text
    with corral_env.db.read() as s:  # and the store is free: nothing held, nothing leaked
        assert leases.first_seen(s, "churn-7", "reader", 60) is not None
    pool_ = corral_env.db.engine.pool
    assert pool_.checkedout() == 0  # type: ignore[attr-defined]


def test_a_tasks_time_counts_from_its_call_with_its_checks_before_the_body(
    corral_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prefork pool's hard limit counts from just before the call: checks that take time
    # (a redelivered message's kills looked up in Redis) come out of the task's time, or
    # its waits, cut to the time it thinks is left, end past the pool's kill (cis609).
    corral_env.set(task_soft_time_limit_s="40", task_time_limit_s="60")

    def slow_kills(_: CorralTask) -> int:
        time.sleep(0.3)
        return 0

    monkeypatch.setattr(CorralTask, "_kills", slow_kills)
    result = limit_tasks.where.apply(("checks",)).get(timeout=30)
    assert 0 < result["left"] <= 40 - 0.3


# -- where a task runs: declared, never guessed --------------------------------------------


def test_a_task_carried_out_here_runs_inline_by_the_deadline_it_was_given(
    corral_env: Env,
) -> None:
    corral_env.set(task_soft_time_limit_s="40", task_time_limit_s="60")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a gateway's thread, not main
        got = pool.submit(
            contextvars.copy_context().run, carry_out, Call(limit_tasks.where, ("t",))
        )
        result = got.result(timeout=30)
    assert result["runs"] == "inline" and 30 < result["left"] <= 40
    assert runs() is Runs.INLINE and timelimits.current() is None  # nothing left declared


def test_a_worker_declares_its_pool_and_its_tasks_run_there(
    thread_worker: Env, caplog: pytest.LogCaptureFixture
) -> None:
    # A thread pool: each task is reported to its supervisor (none here: nothing written).
    sent = limit_tasks.where.apply_async(("pool",), queue="corral.maintenance")
    eventually(
        lambda: "where pool: reported" in caplog.text,
        20,
        "the task in the pool",
        detail=lambda: f"task {sent.id}; {broker_state(thread_worker.settings.broker_url)}",
    )
    # In the same process, a task its caller carries out is inline all the same.
    assert carry_out(Call(limit_tasks.where, ("here",)))["runs"] == "inline"


# -- a retry the broker will not take gives the message back -----------------------------------


def test_a_retry_the_broker_refuses_gives_the_message_back_before_the_hard_limit(
    corral_env: Env,
) -> None:
    # Celery drops a message whose retry it could not publish (Reject, requeue=False):
    # a release_orphan lost that way left its VM running on an agent that cannot list
    # its VMs, where nothing else would release it. Here the broker refuses every
    # connection; kombu's retries alone take about 20 s.
    corral_env.set(broker_url=NO_BROKER, eager="0")
    task = release_orphan
    hard_s = 3.0
    budget = Budget(time.monotonic(), 1.0, hard_s, 0.5)
    task.push_request(
        id="t-1", args=["node", "vm-1"], kwargs={}, retries=0, is_eager=False, called_directly=False
    )
    try:
        with budgeted(budget), pytest.raises(Reject) as rejected:
            task.retry(countdown=1, max_retries=5)
    finally:
        task.pop_request()
    assert rejected.value.requeue is True  # given back, never dropped
    assert time.monotonic() - budget.started < hard_s
