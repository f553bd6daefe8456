"""Beat's housekeeping passes are numbered as they are sent; one a later pass covered is skipped.

Celery's ``expires`` stamps a message with the sender's wall clock and has the worker
judge it by its own: a worker 8 s ahead of beat dropped every health and autoscale pass,
one 600 s ahead every pass, and idle replicas were never reaped. So passes carry no
expiry (``config.celery.beat_schedule``): each is leased and idempotent, and running
one late does no harm. What the expiry was for - a worker back after a while must not
work through the pile of passes that queued meanwhile - is done by number, on no clock:

* as a pass is sent (by beat, or by anyone else), it takes the next number of
  its kind from the broker's Redis (``HINCRBY``) and carries it in a message header
  (:data:`HEADER`; :func:`number`, from ``workers.celery``'s ``before_task_publish``);
* as it starts, one Lua script compares its number with the highest one *covered* of
  its kind (:func:`superseded`): a number at or below it was sent before a pass of its
  kind that has started since, and which does this one's work - it is skipped; any other
  runs, and covers every number sent so far.

A pile of 1800 autoscale passes queued while no worker ran costs one pass and 1799
skips of one round trip each; a pass that waited in a busy queue behind a later one
that ran is skipped, and the next one sent runs. A pass with no number (Redis away when
it was sent, or its task called directly) runs; so does one whose check fails.
"""

from __future__ import annotations

from typing import cast

import redis

HEADER = "corral_pass"  # the message header a pass's number travels in
SENT_KEY = "corral:passes:sent"  # hash: task name -> the last number sent
COVERED_KEY = "corral:passes:covered"  # hash: task name -> the highest number covered

# KEYS: sent, covered; ARGV: task name, this pass's number. 1: run (and cover), 0: skip.
_SUPERSEDED = """
local covered = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local mine = tonumber(ARGV[2])
if mine <= covered then return 0 end
local sent = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or ARGV[2])
if sent < mine then sent = mine end
redis.call('HSET', KEYS[2], ARGV[1], sent)
return 1
"""


def number(client: redis.Redis, task: str) -> int:
    """The next number of a pass of ``task`` being sent."""
    return int(client.hincrby(SENT_KEY, task, 1))


def superseded(client: redis.Redis, task: str, mine: int) -> bool:
    """Whether pass number ``mine`` of ``task`` is covered by one that started; if not, cover."""
    runs = cast(int, client.eval(_SUPERSEDED, 2, SENT_KEY, COVERED_KEY, task, str(mine)))
    return int(runs) == 0
