"""Asynchronous calls: a request stored, queued, run at least once, and one terminal record.

The model
---------
``POST /async-function/NAME[/PATH]`` on the gateway (:mod:`workers.gateway.calls`) stores
the request as the gateway would forward it - method, raw path, query, headers, body,
the caller's address - as a *call* row, sends a ``corral.invoke`` message naming the
call on the ``corral.invocations`` queue, and answers ``202 Accepted`` with the call's id
(``X-Call-Id``, 128 random bits: the id is what lets its holder read the answer). The
row is written, and committed, before the message is sent: the store is the record of
the call, the message only a reminder to run it.

A worker runs each attempt through the gateway's own request flow
(:mod:`workers.gateway.stored`): admission, claims, a cold start shared with every other
waiter, the demand the autoscaler reads. An attempt is started by one conditional UPDATE
(:func:`workers.invocations.attempts.begin`): the call must be queued, due for a retry,
or running under an attempt whose lease lapsed (its worker is gone), and its attempts
and age must not be spent. The attempt number goes up by one each time, and the replica
sees it (``X-Call-Attempt``) with the call's id (``X-Call-Id``), so a function can tell
a second execution from a first. What an attempt gets decides the rest
(:func:`~workers.invocations.attempts.finish`):

* an answer that is not retried (any status but 429 and 5xx) -> *succeeded*, the answer
  kept (its body up to ``CORRAL_CALLS_ANSWER_MAX`` bytes);
* no answer (the replica unreachable, the exchange broken, the gateway's own 502, 503,
  504), 429 or 5xx -> *retrying* after a backoff (exponential with equal jitter, a
  ``Retry-After`` honoured), while the function's attempts and age allow; else *dead*,
  with the last answer and the error.

**Exactly one terminal record.** *succeeded* and *dead* are written by UPDATEs
conditional on the call being open, so whichever attempt comes first writes the one
record and every later write finds it written. A success is kept from any attempt (an
answer that landed is never thrown away); a retry or a death only by the attempt that
holds the call (its owner token), so an attempt that lost its lease cannot undo the
one that took over.

**At least once.** Messages are acknowledged after their task ran; a worker killed
mid-attempt leaves its message to the broker's visibility timeout and its call running
under a lease (the task's hard time limit). The calls' sweep
(:mod:`workers.invocations.sweep`, on beat) sends a call's message again whenever the
call has not moved by its ``resend_at`` - a message lost with a broker restart, a
worker that died, a retry whose delayed message went with its worker - so no call waits
on a message that will never come. A message delivered twice, at once or late, starts
nothing: the conditional UPDATE admits one attempt. Ordering is not promised.

**Idempotency keys.** An ``Idempotency-Key`` header names the call: a unique constraint
on (function, key) in the store, not a check-then-insert, makes a second request with
the key return the first call's id (within ``CORRAL_CALLS_IDEMPOTENCY_WINDOW_S``), and
nothing runs again.

**Dead letters, retention.** A dead call is kept with its last answer and error;
``corral calls redrive`` opens it again (same id, a fresh budget of attempts and age).
Finished calls are purged ``CORRAL_CALLS_KEEP_S`` after they finished, or beyond
``CORRAL_CALLS_KEEP_MAX`` of them (:func:`workers.invocations.records.purge`).

**Callbacks.** With ``X-Callback-Url`` the answer is POSTed there once the call is over,
signed (an HMAC over the timestamp, the call id and the body), retried with backoff, to
hosts of an operator's allow-list only, never to corral's own listeners, its nodes or
the replicas' networks: the name is resolved once, every address checked, and the
connection made to the address checked (:mod:`workers.invocations.callbacks`).

The modules: :mod:`~workers.invocations.records` (accepting a call, reading, redriving,
purging), :mod:`~workers.invocations.attempts` (an attempt from start to verdict),
:mod:`~workers.invocations.callbacks`, :mod:`~workers.invocations.sweep`,
:mod:`~workers.invocations.stats` (what the exporter reads) and
:mod:`~workers.invocations.queue` (the port calls are sent through). Nothing here
imports Celery: the tasks (``tasks/invocations.py``) hand it a
:class:`~workers.invocations.queue.CallQueue`.
"""
