"""A stored call run through the gateway's own request flow, in the process that runs the attempt.

An attempt of an asynchronous call (:mod:`workers.invocations`) is served as a caller's
request to ``/function/NAME[/PATH]`` would be, by the same code: each worker process
keeps one :class:`~workers.gateway.app.GatewayApp` of its own (:class:`Replay`) on its
event loop (:mod:`workers.backends.inflight`), started as ``corral gateway`` starts one -
its claims held across attempts, renewed and given back, cold starts shared with every
other waiter through the store, spawns carried out on the queue it is handed, the
function's demand reported for the autoscaler, ready notices listened to. It serves no
socket: :meth:`Replay.run` hands it the stored request as an ASGI request (the method,
raw path, query, the stored headers plus ``X-Call-Id`` and ``X-Call-Attempt``, the
caller's address, the body) and keeps what it answers (:class:`Capture`): the status,
the headers and up to ``CORRAL_CALLS_ANSWER_MAX`` bytes of the body. The gateway's own
answers (429, 502, 503, 504) come back the same way; an answer that breaks off is no
answer; a function removed since the call was accepted is a final "no answer" (its call
dead at once: the gateway's 404 would read as the function's own). With a gateway token
set, the replayed request carries it (in this process only: it is never stored, and
never forwarded).

:func:`run_attempt` runs one attempt from a task's thread, within the task's soft time
limit: an attempt still running then is cancelled - the flow gives its environment back
as for a caller who went away - and counts as no answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from urllib.parse import unquote_to_bytes

from config.settings import Settings, reveal
from workers.backends import inflight
from workers.base import timelimits
from workers.base.errors import InputError
from workers.dispatch import TaskQueue
from workers.gateway.app import GatewayApp, build_app
from workers.gateway.asgi import Message, Scope
from workers.invocations.attempts import Answer, Attempt
from workers.observability import tracing
from workers.store.db import Database

log = logging.getLogger(__name__)

MARGIN_S = 2.0  # of the task's soft time limit, kept for recording the attempt's verdict
ERROR_LINE = 200  # characters of a retried answer's first line kept in the call's error


class Capture:
    """An ASGI ``send`` that keeps the answer: status, headers, and the body up to a limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False
        self.complete = False

    async def send(self, message: Message) -> None:
        """Keep one message of the answer."""
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunk = bytes(message.get("body", b""))
            room = self.limit - self.size
            if len(chunk) > room:
                chunk, self.truncated = chunk[: max(0, room)], True
            if chunk:
                self.chunks.append(chunk)
                self.size += len(chunk)
            if not message.get("more_body", False):
                self.complete = True

    def answer(self) -> Answer:
        """What the attempt got."""
        if self.status is None:
            return Answer(None, error="no answer")
        if not self.complete:
            return Answer(None, error=f"the answer broke off after its status ({self.status})")
        body = b"".join(self.chunks)
        headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in self.headers)
        error = None
        if self.status == 429 or self.status >= 500:
            line = body.split(b"\n", 1)[0][:ERROR_LINE].decode("utf-8", "replace")
            error = f"answered {self.status}" + (f": {line}" if line.isprintable() and line else "")
        return Answer(self.status, headers, body, self.truncated, error)


def scope_of(attempt: Attempt, settings: Settings, traceparent: dict[str, str] | None) -> Scope:
    """The ASGI request of an attempt: the stored request, to ``/function/NAME``."""
    request = attempt.request
    raw_path = b"/function/" + attempt.function.encode() + request.path.encode("latin-1")
    headers: list[tuple[bytes, bytes]] = []
    token = reveal(settings.gateway_token)
    if token is not None:  # first: the one the token check reads
        headers.append((b"authorization", f"Bearer {token}".encode()))
    carried = {k.lower() for k in (traceparent or {})}
    for key, value in request.headers:
        if key.lower() not in carried:
            headers.append((key.encode("latin-1"), value.encode("latin-1")))
    headers += [(k.encode(), v.encode()) for k, v in (traceparent or {}).items()]
    headers += [
        (b"x-call-id", attempt.call_id.encode()),
        (b"x-call-attempt", str(attempt.number).encode()),
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.scheme,
        "path": unquote_to_bytes(raw_path).decode("latin-1"),
        "raw_path": raw_path,
        "root_path": "",
        "query_string": request.query.encode("latin-1"),
        "headers": headers,
        "client": (request.client, 0) if request.client else None,
        "server": None,
    }


class Replay:
    """A gateway of this process's own, serving stored calls through the request flow."""

    def __init__(self, db: Database, settings: Settings, queue: TaskQueue) -> None:
        self.db = db
        self.settings = settings
        self.pid = os.getpid()
        self.app: GatewayApp = build_app(db, settings, queue)
        self._lifespan = self.app.lifespan(self.app.site)
        self.ready: asyncio.Future[None] = asyncio.ensure_future(self._lifespan.__aenter__())

    async def close(self) -> None:
        """Give back every claim held, stop the demand reports and the store threads."""
        with contextlib.suppress(Exception):
            await self.ready
            await self._lifespan.__aexit__(None, None, None)

    async def run(self, attempt: Attempt) -> Answer:
        """Serve one attempt; what it got (a function removed since: no attempt can serve it)."""
        await asyncio.shield(self.ready)
        try:
            await self.app.gateway.catalog.get(attempt.function)
        except InputError as exc:  # its 404 would read as the function's own answer
            return Answer(None, error=f"the function is gone: {exc}", final=True)
        scope = scope_of(attempt, self.settings, tracing.carrier())
        capture = Capture(self.settings.calls_answer_max)
        over = asyncio.Event()
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": attempt.request.body, "more_body": False}
            await over.wait()  # nobody goes away: the request's own deadlines end it
            return {"type": "http.disconnect"}

        try:
            await self.app(scope, receive, capture.send)
        finally:
            over.set()
        return capture.answer()


_current: Replay | None = None  # this process's replay (read and set on its loop only)


async def _replay(db: Database, settings: Settings, queue: TaskQueue) -> Replay:
    """This process's replay for these settings (made and started on first use)."""
    global _current
    replay = _current
    if replay is None or replay.pid != os.getpid() or replay.settings is not settings:
        _current = None
        if replay is not None and replay.pid == os.getpid():  # new settings (tests)
            await replay.close()
        replay = _current = Replay(db, settings, queue)
    try:
        await asyncio.shield(replay.ready)
    except Exception:
        if _current is replay:
            _current = None  # the next attempt starts another
        raise
    return replay


async def _run(db: Database, settings: Settings, queue: TaskQueue, attempt: Attempt) -> Answer:
    replay = await _replay(db, settings, queue)
    return await replay.run(attempt)


def run_attempt(db: Database, settings: Settings, queue: TaskQueue, attempt: Attempt) -> Answer:
    """Run one attempt through this process's replay, within the running task's time."""
    deadline = timelimits.current()
    left = deadline.left() if deadline is not None else settings.task_soft_time_limit_s
    budget = left - MARGIN_S
    if budget <= 0:
        return Answer(None, error="no time left in the task for an attempt")
    started = time.monotonic()
    future = inflight.submit(_run(db, settings, queue, attempt))
    try:
        return future.result(budget)
    except concurrent.futures.TimeoutError:
        future.cancel()  # the flow gives its environment back, as for a caller gone
        return Answer(
            None,
            error=f"no answer within the task's time ({time.monotonic() - started:.1f}s, "
            "CORRAL_TASK_SOFT_TIME_LIMIT_S)",
        )


async def _close_replay(_resources: object = None) -> None:
    global _current
    replay, _current = _current, None
    if replay is not None and replay.pid == os.getpid():
        await replay.close()


def current() -> Replay | None:
    """This process's replay, if it has one (started by an attempt, not yet closed)."""
    replay = _current
    return replay if replay is not None and replay.pid == os.getpid() else None


def close() -> None:
    """Close this process's replay, if it has one: its claims given back (a worker stopping)."""
    if _current is None:
        return
    try:
        inflight.run(_close_replay(), timeout=10)
    except Exception as exc:  # the claims' leases expire by themselves
        log.warning("could not close the calls' gateway: %s", exc)


inflight.on_reset(_close_replay)
