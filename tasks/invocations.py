"""Asynchronous calls' tasks: an attempt, a callback's delivery, and the calls' sweep.

``corral.invoke`` and ``corral.call_callback`` go to the ``corral.invocations`` queue
(``config.celery``), which workers of its own consume (``corral worker -Q
corral.invocations``), so a backlog of calls never delays the control plane's work; they
are ordinary tasks, with events, so Flower shows each attempt. ``corral.calls_pass``
is beat's sweep (housekeeping: no events). Each task calls the plain logic of
:mod:`workers.invocations` and sends what it hands back: a retry after its backoff, a
callback to deliver. Every task may run twice: the call's row decides
(:func:`workers.invocations.attempts.begin`).

An attempt runs through this process's own gateway (:mod:`workers.gateway.stored`),
whose cold starts are carried out on a few threads here (:class:`tasks.queues.HereFirst`)
or sent to the spawn queue. :class:`CeleryCalls` is the
:class:`~workers.invocations.queue.CallQueue` everyone sends calls through
(:data:`CALLS`): the gateway, these tasks, the sweep, ``corral calls redrive``.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import partial
from typing import Any

from celery import signals

from config.celery import INVOCATIONS
from config.settings import get_settings
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from workers.base.redis_client import redis_client
from workers.celery import CorralTask, app
from workers.gateway import stored
from workers.invocations import attempts, callbacks, sweep
from workers.invocations.attempts import Outcome, Verdict
from workers.observability.exporter import PRIORITY_SEP, PRIORITY_STEPS

log = logging.getLogger(__name__)


def _held(countdown: float) -> float | None:
    """A countdown a worker may hold the message for (``Settings.longest_countdown_s``): a
    longer wait is cut to it; an attempt's early message finds its call not due yet and is
    sent again for the rest, an early callback is delivered that much sooner."""
    held = min(countdown, get_settings().longest_countdown_s)
    return held if held > 0 else None


class CeleryCalls:
    """Calls' messages sent as Celery tasks on ``corral.invocations``."""

    def send(self, call_id: str, countdown: float = 0.0) -> None:
        """Send the message that runs an attempt of the call."""
        invoke.apply_async((call_id,), countdown=_held(countdown))

    def send_callback(self, call_id: str, countdown: float = 0.0) -> None:
        """Send the message that delivers the call's callback."""
        call_callback.apply_async((call_id,), countdown=_held(countdown))

    def backlog(self) -> int | None:
        """Messages waiting in ``corral.invocations`` (kombu's list and its priority lists)."""
        client = redis_client(get_settings().broker_url)
        if client is None:
            return None
        with client.pipeline(transaction=False) as pipe:
            for step in PRIORITY_STEPS:
                pipe.llen(INVOCATIONS if step == 0 else f"{INVOCATIONS}{PRIORITY_SEP}{step}")
            return sum(int(n) for n in pipe.execute())


CALLS = CeleryCalls()

_here: HereFirst | None = None
_here_pid = 0
_here_lock = threading.Lock()


def _spawns() -> HereFirst:
    """This process's queue for the cold starts of its attempts (made on first use)."""
    global _here, _here_pid
    with _here_lock:
        if _here is None or _here_pid != os.getpid():
            _here, _here_pid = HereFirst(QUEUE), os.getpid()
        return _here


def _follow(call_id: str, outcome: Outcome) -> None:
    """Send what an attempt left: its retry, its callback (the sweep sends them if this fails)."""
    try:
        if outcome.verdict == Verdict.RETRY or (
            outcome.verdict == Verdict.SKIPPED and outcome.countdown
        ):
            CALLS.send(call_id, outcome.countdown)
        if outcome.callback:
            CALLS.send_callback(call_id)
    except Exception as exc:
        log.warning("call %s: could not send its next message (the sweep will): %s", call_id, exc)


@app.task(bind=True, name="corral.invoke")
def invoke(self: CorralTask, call_id: str) -> dict[str, Any]:
    """Run one attempt of an asynchronous call through this process's gateway."""
    settings = self.settings
    runner = partial(stored.run_attempt, self.db, settings, _spawns())
    outcome = attempts.run(
        self.db,
        settings,
        call_id,
        self.budget.own_until(),
        runner,
        counters=redis_client(settings.broker_url),
    )
    _follow(call_id, outcome)
    return {"call_id": call_id, "verdict": outcome.verdict.value, "note": outcome.note}


@app.task(bind=True, name="corral.call_callback")
def call_callback(self: CorralTask, call_id: str) -> dict[str, Any]:
    """Deliver a finished call's callback once; sent again after a backoff if it may be."""
    settings = self.settings
    delivery = callbacks.deliver(
        self.db, settings, call_id, counters=redis_client(settings.broker_url)
    )
    if delivery.state == "retry":
        try:
            CALLS.send_callback(call_id, delivery.countdown)
        except Exception as exc:
            log.warning(
                "call %s: could not send its callback again (the sweep will): %s", call_id, exc
            )
    return {"call_id": call_id, "state": delivery.state, "note": delivery.note}


@app.task(bind=True, name="corral.calls_pass", send_events=False)
def calls_pass(self: CorralTask) -> dict[str, Any]:
    """Beat's calls' sweep (every ``CORRAL_CALLS_SWEEP_INTERVAL_S``): lost messages, old calls."""
    return sweep.sweep(self.db, self.settings, CALLS).as_dict()


@signals.worker_shutdown.connect
def _give_back(**_: Any) -> None:
    """A worker stopping gives back the claims its calls' gateway holds."""
    stored.close()
