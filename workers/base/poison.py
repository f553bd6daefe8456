"""Poison messages: tasks killed at their hard time limit, counted per task id; given up at 3.

A message whose task hangs on every delivery - a lock that is never freed, an agent call
that never returns, a bug - is killed at its hard time limit each time it runs, and
without a count it would come back and be killed again for ever (in a thread pool taking
its whole worker down each time). So whoever kills a task at its hard limit counts the
kill in the broker's Redis, under the task's id (a retry and a redelivery of one message
carry the same id), and hands the message back at once:

* a thread-pool worker's supervisor (``corral worker``, :mod:`stack.worker`) counts the
  task that outlived its limit, kills the worker and puts every message the worker held
  back on its queue (:func:`workers.broker.restore`);
* a prefork pool's parent counts the child's task billiard killed and rejects its message
  with requeue (:class:`workers.celery.CorralRequest`; Celery would acknowledge it, and
  its operation would wait for redrive).

A message delivered again after :data:`MAX_KILLS` kills is not run: the task base
(:class:`workers.celery.CorralTask`) acknowledges it and fails its operation with
:func:`given_up`'s reason. Only a redelivered message is looked up (one ``GET``), and a
count lives :data:`KEEP_S`. Redis unreachable: the kill is not counted (the message
comes back all the same, and is counted at its next kill).
"""

from __future__ import annotations

import logging

import redis

KEY_PREFIX = "corral:kills:"
MAX_KILLS = 3
KEEP_S = 24 * 3600


def _key(task_id: str) -> str:
    return KEY_PREFIX + task_id


def count_kill(client: redis.Redis, task_id: str) -> int:
    """Count one more kill of ``task_id`` at its hard limit; how many there have been."""
    pipe = client.pipeline()
    pipe.incr(_key(task_id))
    pipe.expire(_key(task_id), KEEP_S)
    killed, _ = pipe.execute()
    return int(killed)


def kills(client: redis.Redis, task_id: str) -> int:
    """How many times ``task_id`` was killed at its hard limit (in the last :data:`KEEP_S`)."""
    value = client.get(_key(task_id))
    return int(value) if isinstance(value, bytes | str | int) else 0


def given_up(killed: int) -> str:
    """The reason a message killed ``killed`` times is not run again."""
    return (
        f"killed at its hard time limit {killed} times (CORRAL_TASK_TIME_LIMIT_S); "
        "given up, its message acknowledged"
    )


def count_kill_quietly(client: redis.Redis | None, task_id: str) -> None:
    """:func:`count_kill`, logged; never raises (the message comes back all the same)."""
    if client is None:
        return
    try:
        killed = count_kill(client, task_id)
    except Exception as exc:  # counted at its next kill
        logging.getLogger(__name__).warning("could not count the kill of task %s: %s", task_id, exc)
    else:
        logging.getLogger(__name__).warning(
            "task %s killed at its hard time limit (%d times)", task_id, killed
        )
