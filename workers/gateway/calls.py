"""Asynchronous calls at the gateway: ``POST /async-function/NAME[/PATH]`` and ``GET /calls/ID``.

``POST /async-function/NAME[/PATH]`` (the one method OpenFaaS accepts there; another is
405) goes through the same first steps as a call to ``/function/`` - the token (401),
the function (404, before a byte of the body is read), the body within the gateway's
bounds (413, 408, 503) - then:

* ``X-Callback-Url`` must be allowed (:func:`workers.invocations.callbacks.check_url`) and
  ``Idempotency-Key`` well formed, else 400; both are checked before the body is read;
* with ``CORRAL_CALLS_QUEUE_MAX`` messages waiting in ``corral.invocations`` already, 429
  with ``Retry-After`` (checked with the body in hand: the check, the write and the send
  are one hop to the store's threads);
* the request is stored as this gateway would forward it (:func:`stored_request`: the
  forwarding rules of :mod:`workers.gateway.headers` - hop-by-hop headers and those
  ``Connection`` names, ``Expect``, the gateway's token never kept; corral's own
  ``X-Call-*``, ``X-Callback-Url`` and ``Idempotency-Key`` not forwarded), its message
  sent, and only then answered ``202 Accepted``: ``X-Call-Id``, ``Location:
  /calls/ID`` and ``{"id": ..., "status": ...}``. A message that cannot be sent takes
  its call back out, and the answer is 503. A key that names a call already answers
  that call's id, ``Idempotent-Replayed: true``, and sends nothing.

``GET /calls/ID`` (or HEAD; the token as for any call) answers 404 for an id it does not
know; while the call is open, 202 and the call as JSON; once it is over, the stored
answer itself - its status, headers and body - with ``X-Call-Id``, ``X-Call-Status``,
``X-Call-Attempts`` (and ``X-Call-Answer-Truncated: true`` when its body was cut); a
dead call with no answer at all, 502 and the call as JSON. Every answer carries
``X-Call-Status``.

With tracing on, the acceptance is a SERVER span whose context the call keeps: every
attempt's span, in whichever worker, and the callback's, are in its trace.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from urllib.parse import quote

from sqlalchemy.exc import DBAPIError

from config.settings import reveal
from workers.base.errors import BrokerError, InputError, NotFound
from workers.gateway.asgi import (
    RETRY_AFTER_S,
    Answer,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    has_body,
    header,
    reply,
    store_unavailable,
)
from workers.gateway.bodies import CLOSE
from workers.gateway.headers import HOP_BY_HOP, connection_named
from workers.gateway.metrics import UNKNOWN
from workers.gateway.proxy import Gateway
from workers.gateway.traces import incoming
from workers.invocations import callbacks, records
from workers.invocations.queue import CallQueue
from workers.invocations.records import Accepted, CallView, StoredAnswer, StoredRequest
from workers.observability import metric_catalog as catalog
from workers.observability import tracing
from workers.store.db import Database, is_transient
from workers.store.models import Call, CallStatus

log = logging.getLogger(__name__)

ASYNC_PREFIX = "/async-function/"
CALLS_PREFIX = "/calls/"
PREFIXES = (ASYNC_PREFIX, CALLS_PREFIX)
#: Request headers addressed to corral, never stored nor forwarded.
CORRAL_HEADERS = frozenset({b"x-call-id", b"x-call-attempt", b"x-callback-url", b"idempotency-key"})
#: Headers of a stored answer not replayed as they were (the body's framing is the gateway's).
NOT_REPLAYED = HOP_BY_HOP | {b"content-length"}


def stored_request(scope: Scope, body: bytes, *, token: bool) -> StoredRequest:
    """The request as it will be forwarded to the function later: method, raw path, headers.

    ``token``: the gateway has one (then the caller's ``Authorization`` is the gateway's).
    """
    raw: list[tuple[bytes, bytes]] = scope["headers"]
    named = connection_named(raw)
    kept: list[tuple[str, str]] = []
    framed = False
    for key, value in raw:
        low = key.lower()
        if low in (b"content-length", b"transfer-encoding"):
            framed = True  # the body's framing: the replay sets its own length
        if (
            low in HOP_BY_HOP
            or low in named
            or low in (b"content-length", b"expect")
            or low in CORRAL_HEADERS
            or (low == b"authorization" and token)
        ):
            continue
        kept.append((key.decode("latin-1"), value.decode("latin-1")))
    if framed or body:
        kept.append(("content-length", str(len(body))))
    target = scope.get("raw_path") or quote(scope["path"]).encode("ascii")
    _, sep, rest = target[len(ASYNC_PREFIX) :].partition(b"/")
    client = scope.get("client")
    return StoredRequest(
        method=scope["method"],
        path=("/" + rest.decode("latin-1")) if sep else "",
        query=scope.get("query_string", b"").decode("latin-1"),
        headers=tuple(kept),
        body=body,
        client=str(client[0]) if client else None,
        scheme=str(scope.get("scheme", "http")),
    )


@dataclass(frozen=True)
class _Shown:
    """A call as read for ``GET /calls/ID``: its view, and its stored answer."""

    view: CallView
    status: CallStatus
    attempts: int
    answer: StoredAnswer


class Full(Exception):
    """The calls' queue is full: answer 429."""


class CallsFront:
    """The gateway's routes for asynchronous calls, beside its proxy."""

    def __init__(self, gateway: Gateway, db: Database, queue: CallQueue) -> None:
        self.gateway = gateway
        self.db = db
        self.queue = queue
        self.settings = gateway.settings
        self._token = reveal(self.settings.gateway_token) is not None
        registry = gateway.metrics.registry
        self.answered = catalog.GATEWAY_CALLS.counter(registry)
        self.accept_seconds = catalog.GATEWAY_CALL_ACCEPT_SECONDS.histogram(registry)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request under ``/async-function/`` or ``/calls/`` (ASGI)."""
        if scope["path"].startswith(ASYNC_PREFIX):
            if tracing.tracer is None or not self.gateway.authorized(scope):
                await self._accept(scope, receive, send)
                return
            with tracing.span(
                "POST /async-function/{name}",
                kind="server",
                parent=incoming(scope),
                attributes={
                    "http.request.method": scope["method"],
                    "url.path": scope["path"],
                    "http.route": "/async-function/{name}",
                },
            ) as span:
                code = await self._accept(scope, receive, send)
                if span is not None:
                    span.set_attribute("http.response.status_code", code)
        else:
            await self._show(scope, send)

    # -- POST /async-function/NAME ---------------------------------------------------------

    async def _accept(self, scope: Scope, receive: Receive, send: Send) -> int:
        """Store and queue one call; the status answered."""
        started = time.perf_counter()
        name = scope["path"][len(ASYNC_PREFIX) :].split("/", 1)[0]
        read = False
        code = 0
        try:
            self._check(scope)
            try:
                await self.gateway.catalog.get(name)  # before the body: a 404 reads none
            except InputError as exc:
                what = f"unknown function {name!r}" if isinstance(exc, NotFound) else str(exc)
                raise Answer(404, what) from None
            key, callback = self._names(scope)
            async with self.gateway.bodies.read(scope, receive) as body:
                read = True
                request = stored_request(scope, body, token=self._token)
                accepted = await self._store(name, request, key, callback)
            code = 202
            await _json(
                send,
                202,
                {"id": accepted.call_id, "status": accepted.status.value},
                _accepted_headers(accepted),
            )
            self.accept_seconds.observe(time.perf_counter() - started)
        except Answer as answer:
            code = answer.status
            extra = {} if read or not has_body(scope) else CLOSE  # its body left unread
            await reply(send, answer.status, answer.message, {**answer.headers, **extra})
        except ClientGone:
            code = 499
        finally:
            label = name if name in self.gateway.catalog else UNKNOWN
            self.answered.labels(label, str(code)).inc()
        return code

    def _check(self, scope: Scope) -> None:
        if not self.gateway.authorized(scope):
            raise Answer(401, "missing or invalid gateway token", {"www-authenticate": "Bearer"})
        if scope["method"] != "POST":
            raise Answer(405, "an asynchronous call is a POST", {"allow": "POST"})

    def _names(self, scope: Scope) -> tuple[str | None, str | None]:
        """The request's ``Idempotency-Key`` and ``X-Callback-Url``, checked (400 otherwise)."""
        try:
            key = records.check_key(header(scope, b"idempotency-key"))
            callback = header(scope, b"x-callback-url")
            if callback is not None:
                callbacks.check_url(callback, self.settings)
        except InputError as exc:
            raise Answer(400, str(exc)) from None
        return key, callback

    def _room(self) -> None:
        """429 when the calls' queue holds ``CORRAL_CALLS_QUEUE_MAX`` messages already."""
        try:
            waiting = self.queue.backlog()
        except Exception as exc:  # cannot tell: the send decides
            log.warning("gateway: could not read the calls' backlog: %s", exc)
            return
        if waiting is not None and waiting >= self.settings.calls_queue_max:
            raise Full(f"too many calls waiting ({waiting}): try again later")

    async def _store(
        self, name: str, request: StoredRequest, key: str | None, callback: str | None
    ) -> Accepted:
        """Check there is room, write the call and send its message: one hop to the store's
        threads, finished even if the caller goes away meanwhile."""
        trace = tracing.carrier()
        try:
            return await self.gateway.background.shielded(
                self._write_and_send, name, request, key, callback, trace
            )
        except NotFound:
            raise Answer(404, f"unknown function {name!r}") from None
        except Full as exc:
            raise Answer(429, str(exc), {"retry-after": str(RETRY_AFTER_S)}) from None
        except BrokerError as exc:
            raise Answer(503, str(exc), {"retry-after": str(RETRY_AFTER_S)}) from None
        except InputError as exc:
            raise Answer(400, str(exc)) from None
        except DBAPIError as exc:
            error = str(exc.orig).split("\n")[0]
            if (unavailable := store_unavailable(error, transient=is_transient(exc))) is None:
                raise
            raise unavailable from None

    def _write_and_send(
        self,
        name: str,
        request: StoredRequest,
        key: str | None,
        callback: str | None,
        trace: dict[str, str] | None,
    ) -> Accepted:
        self._room()
        accepted = records.accept(
            self.db, self.settings, name, request, key=key, callback=callback, trace=trace
        )
        if accepted.replayed:
            return accepted
        try:
            self.queue.send(accepted.call_id)
        except Exception as exc:  # the broker is down: the call was never queued
            records.withdraw(self.db, accepted.call_id)
            raise BrokerError(f"could not queue the call: {type(exc).__name__}: {exc}") from None
        return accepted

    # -- GET /calls/ID --------------------------------------------------------------------

    async def _show(self, scope: Scope, send: Send) -> None:
        try:
            if not self.gateway.authorized(scope):
                raise Answer(
                    401, "missing or invalid gateway token", {"www-authenticate": "Bearer"}
                )
            if scope["method"] not in ("GET", "HEAD"):
                raise Answer(405, "a call is read with GET", {"allow": "GET, HEAD"})
            call_id = scope["path"][len(CALLS_PREFIX) :]
            try:
                shown = await self.gateway.background.store(self._load, call_id)
            except NotFound:
                raise Answer(404, "unknown call") from None
        except Answer as answer:
            await reply(send, answer.status, answer.message, answer.headers)
            return
        head = scope["method"] == "HEAD"
        status = {"x-call-status": shown.status.value, "x-call-id": shown.view["id"]}
        if not shown.status.finished:
            await _json(send, 202, dict(shown.view), status, head=head)
        elif shown.answer.status is None:
            await _json(send, 502, dict(shown.view), status, head=head)
        else:
            await _replay(send, shown, status, head=head)

    def _load(self, call_id: str) -> _Shown:
        with self.db.read() as s:
            call: Call = records.get_call(s, call_id)
            return _Shown(
                records.call_view(call),
                CallStatus(call.status),
                call.attempts,
                StoredAnswer.of(call),
            )


def _accepted_headers(accepted: Accepted) -> dict[str, str]:
    headers = {"x-call-id": accepted.call_id, "location": f"{CALLS_PREFIX}{accepted.call_id}"}
    if accepted.replayed:
        headers["idempotent-replayed"] = "true"
    return headers


async def _json(
    send: Send, status: int, data: dict[str, object], headers: dict[str, str], *, head: bool = False
) -> None:
    body = (json.dumps(data, sort_keys=True) + "\n").encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.encode(), v.encode()) for k, v in headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    message: Message = {"type": "http.response.body", "body": b"" if head else body}
    await send(message)


async def _replay(send: Send, shown: _Shown, extra: dict[str, str], *, head: bool) -> None:
    """Answer with a finished call's stored answer."""
    answer = shown.answer
    raw = [
        (k.encode("latin-1"), v.encode("latin-1"))
        for k, v in answer.headers
        if k.lower().encode("latin-1") not in NOT_REPLAYED
    ]
    raw.append((b"content-length", str(len(answer.body)).encode()))
    extra = {**extra, "x-call-attempts": str(shown.attempts)}
    if answer.truncated:
        extra["x-call-answer-truncated"] = "true"
    raw += [(k.encode(), v.encode()) for k, v in extra.items()]
    assert answer.status is not None  # noqa: S101 - narrowed by the caller
    await send({"type": "http.response.start", "status": answer.status, "headers": raw})
    await send({"type": "http.response.body", "body": b"" if head else answer.body})
