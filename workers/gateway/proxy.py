"""The request flow: one request to ``/function/NAME[/PATH]``, from arrival to its claim's return.

A request goes through these steps, each with its own answer when it fails:

1. **Token.** With ``CORRAL_GATEWAY_TOKEN`` set, ``Authorization: Bearer <token>``
   is required (401 otherwise) and is not forwarded. A request that passes marks its
   connection as credentialed (:func:`netplumb.asgiserve.authenticated`).
2. **Function.** Its limits (:mod:`workers.gateway.catalog`); an unknown name -> 404.
   Both come before the body: neither costs a byte of it.
3. **Body** (:mod:`workers.gateway.bodies`). Read in full before anything is claimed,
   so a slow upload holds no environment; bounded per request (413), per peer and in
   all as it arrives (503), and in time: each piece, and a minimum rate (408).
4. **Admission** (:mod:`workers.gateway.admission`): beyond ``max_replicas x
   exec_envs`` requests the request queues; a full queue -> 429, no place within the
   cold-start timeout -> 503 with ``Retry-After``.
5. **Claim** (:mod:`workers.gateway.ledger`): an environment this gateway holds for
   the function, else one from the store, else a cold start; nothing within
   ``CORRAL_GATEWAY_COLD_START_TIMEOUT_S`` -> 503 with ``Retry-After``.
6. **Forward and stream back** (:mod:`workers.gateway.upstream`). A replica that
   cannot be reached or breaks the exchange before answering is retired as suspect
   (:meth:`workers.gateway.ledger.Ledger.retire`) and an idempotent request (GET,
   HEAD, OPTIONS, PUT, DELETE, TRACE) is tried once more on another replica;
   otherwise -> 502. No complete answer within ``CORRAL_GATEWAY_TIMEOUT_S`` -> 504
   (a slow replica is not retired).

The store unreachable at any step (cut off, restarting: an error that passes if tried
again) -> 503 with ``Retry-After``; any other store error is a bug, and a 500.

The environment is returned on every path out - error, timeout, and a client that goes
away (a watcher on the ASGI ``receive`` channel cancels the request; returning it is
synchronous, and a claim a cancelled store call still makes goes to the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.exc import DBAPIError

from config.settings import Settings, reveal
from netplumb import asgiserve
from workers.autoscale.idletimes import Recorder
from workers.base.errors import InputError, NotFound
from workers.base.redis_client import redis_client
from workers.dispatch import TaskQueue
from workers.gateway.admission import QueueFull, QueueTimeout
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
from workers.gateway.background import Background
from workers.gateway.bodies import CLOSE, Bodies
from workers.gateway.catalog import Catalog, FunctionInfo
from workers.gateway.haproxy.warm import WarmPath
from workers.gateway.ledger import Ledger
from workers.gateway.metrics import UNKNOWN, GatewayMetrics
from workers.gateway.traces import incoming, request_attributes
from workers.gateway.upstream import PREFIX, BrokenOff, ReplicaFailed, Upstreams
from workers.observability import tracing
from workers.replicas import notices
from workers.replicas.claims import NoIdleReplica
from workers.store.db import Database, is_transient

log = logging.getLogger(__name__)

__all__ = ["PREFIX", "Gateway"]

IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
SWEEP_S = 5.0  # how often unused upstream clients are looked for
WATCH_AFTER_S = 0.05  # a request running this long is watched for its client going away


class Gateway:
    """The request flow over its parts: catalog, ledger of claims, upstreams, metrics."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        queue: TaskQueue,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        """``queue``: where cold starts' spawns and suspects' deletes are asked for."""
        self.settings = settings
        self.metrics = metrics or GatewayMetrics()
        # SQLite takes one write at a time anyway: more threads only wait in its busy
        # handler (sleeps of up to 100 ms each), so they would add latency, not speed.
        self.background = Background(1 if db.is_sqlite else settings.gateway_store_threads)
        self.catalog = Catalog(db, self.background, settings.gateway_queue)
        self.ledger = Ledger(
            db, settings, self.background, queue, on_cold_start=self.metrics.cold_start
        )
        token = reveal(settings.gateway_token)
        self._token = f"Bearer {token}".encode() if token else None
        self.upstreams = Upstreams(settings, self._token, self.metrics)
        self.invocations = Recorder(settings.keepalive_bin_s)  # idle times, for keep-alive
        self.bodies = Bodies(
            settings.gateway_max_body,
            settings.gateway_body_budget,
            settings.gateway_read_timeout_s,
            per_peer=settings.gateway_body_per_peer,
            min_rate=settings.gateway_body_min_rate,
            grace_s=settings.gateway_body_grace_s,
            trusted=self.upstreams.trusted,
        )
        #: HAProxy in front of this gateway, carrying warm calls (None: the Python path alone).
        self.warm: WarmPath | None = None
        self._upkeep: list[asyncio.Task[None]] = []
        self._unlisten: Callable[[], None] = lambda: None
        # The serving loop, kept: asyncio.get_running_loop() costs a getpid() system call
        # on Python 3.11, and a request would make several.
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the upkeep of held claims and upstream clients (on the serving loop)."""
        self._upkeep = [
            asyncio.create_task(self.ledger.maintain()),
            asyncio.create_task(self._sweep_upstreams()),
            asyncio.create_task(self.upstreams.watch()),
        ]
        loop = self._loop = asyncio.get_running_loop()
        self.upstreams.loop = loop
        if self.warm is not None:
            self.warm.attach(self)
        self._unlisten = notices.listen_here(  # spawns carried out here: told at once
            lambda name: loop.call_soon_threadsafe(self.ledger.wake, name)
        )
        if redis_client(self.settings.broker_url) is not None:  # told of ready replicas
            self.ledger.told = True
            self._upkeep.append(
                asyncio.create_task(notices.listen(self.settings.broker_url, self.ledger.wake))
            )

    async def close(self) -> None:
        """Give back every claim held, close the clients and the store threads."""
        self._unlisten()
        for task in self._upkeep:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.warm is not None:  # what HAProxy holds comes back first
            await self.warm.close()
        await self.background.settle()
        await self.ledger.close()
        await self.upstreams.close()
        self.background.close()
        # uvicorn ends the process with the signal it caught (no atexit): send the spans now
        await asyncio.to_thread(tracing.flush)

    async def _sweep_upstreams(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.upstreams.sweep({c.address for c in self.ledger.held.values() if c.address})

    def authorized(self, scope: Scope) -> bool:
        """True when no token is set or the request carries it (its connection is then
        no longer anonymous: :func:`netplumb.asgiserve.authenticated`)."""
        if self._token is not None:
            sent = (header(scope, b"authorization") or "").encode("latin-1")
            if not hmac.compare_digest(sent, self._token):
                return False
        asgiserve.authenticated(scope)
        return True

    # -- one request -----------------------------------------------------------------------

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ``/function/...`` request (ASGI); a span of its own when tracing is on.

        The span (with the caller's ``traceparent`` and path) is opened only for a
        caller that passed the token check: one without the token makes none.
        """
        if tracing.tracer is None or not self.authorized(scope):
            await self._handle(scope, receive, send)
            return
        with tracing.span(
            f"{scope['method']} /function/{{name}}",
            kind="server",
            parent=incoming(scope),
            attributes=request_attributes(scope),
        ) as span:
            code = await self._handle(scope, receive, send)
            if span is not None:
                span.set_attribute("http.response.status_code", code)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> int:
        """Serve one request; the status code answered (499: the caller went away first)."""
        started = time.perf_counter()
        name = scope["path"][len(PREFIX) :].split("/", 1)[0]
        state = {"code": 0, "complete": False, "read": False}

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["code"] = message["status"]
            elif not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        try:
            try:
                if not self.authorized(scope):
                    raise Answer(
                        401, "missing or invalid gateway token", {"www-authenticate": "Bearer"}
                    )
                info = await self.catalog.get(name)  # before the body: a 404 reads none
                async with self.bodies.read(scope, receive) as body:
                    state["read"] = True
                    await self._watched(
                        self._admitted(scope, info, body, tracked),
                        receive,
                        lambda: bool(state["complete"]),
                    )
            except InputError as exc:  # unknown (catalog or store) or malformed name
                what = f"unknown function {name!r}" if isinstance(exc, NotFound) else str(exc)
                raise Answer(404, what) from None
            except NoIdleReplica as exc:  # timed out, or the cold start failed
                raise Answer(503, str(exc), {"retry-after": str(RETRY_AFTER_S)}) from None
            except DBAPIError as exc:
                error = str(exc.orig).split("\n")[0]
                if (unavailable := store_unavailable(error, transient=is_transient(exc))) is None:
                    raise
                raise unavailable from None
        except Answer as answer:
            extra = {} if state["read"] or not has_body(scope) else CLOSE  # body left unread
            await reply(tracked, answer.status, answer.message, {**answer.headers, **extra})
        except BrokenOff as exc:
            log.warning("gateway: %s", exc)
        except ClientGone:
            pass
        finally:
            label = name if name in self.catalog else UNKNOWN
            code = int(state["code"]) if state["complete"] else 499
            self.metrics.answered(label, code, time.perf_counter() - started)
        return code

    async def _watched(
        self, work: Awaitable[None], receive: Receive, complete: Callable[[], bool]
    ) -> None:
        """Run ``work``, cancelling it if the client disconnects before its answer is complete.

        ``work`` runs in this task (no task of its own: one hand-off less per request);
        a watcher task, started once the request has run for ``WATCH_AFTER_S`` (most are
        answered by then), cancels this one when the client goes away.
        """
        loop = self._loop or asyncio.get_running_loop()
        me = asyncio.current_task(loop)
        assert me is not None  # noqa: S101 - narrows for mypy after a check made above
        gone = False
        watcher: asyncio.Future[None] | None = None

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass  # the body was read already: only the disconnect is left
            if not complete():
                gone = True
                me.cancel()  # the client went away: stop, returning what the request holds

        def start() -> None:
            nonlocal watcher
            watcher = asyncio.ensure_future(watch())

        later = loop.call_later(WATCH_AFTER_S, start)
        try:
            await work
        except asyncio.CancelledError:
            if not gone:
                raise  # we were cancelled ourselves
            me.uncancel()
            raise ClientGone from None
        finally:
            later.cancel()
            if watcher is not None:
                watcher.cancel()

    async def _admitted(self, scope: Scope, info: FunctionInfo, body: bytes, send: Send) -> None:
        gate = self.catalog.gates[info.name]
        self.metrics.watch(info.name, gate)  # its in-flight and queued gauges
        timeout = self.settings.gateway_cold_start_timeout_s
        try:
            await gate.enter(timeout)
        except QueueFull:
            raise Answer(
                429, f"too many requests for {info.name}: the queue is full", {"retry-after": "1"}
            ) from None
        except QueueTimeout:
            raise Answer(
                503,
                f"no free environment of {info.name} within {timeout:g}s",
                {"retry-after": str(RETRY_AFTER_S)},
            ) from None
        self.invocations.started(info.name)  # keep-alive's idle times
        try:
            await self._call(scope, info, body, send)
        finally:
            self.invocations.ended(info.name)
            gate.leave()

    async def _call(self, scope: Scope, info: FunctionInfo, body: bytes, send: Send) -> None:
        """Claim, forward, stream back; one more replica for an idempotent request."""
        tries = 2 if scope["method"] in IDEMPOTENT else 1
        for attempt in range(tries):
            claimed = await self.ledger.acquire(info.name)
            cold = self.ledger.cold.pop(claimed.claim_id, None) if self.ledger.cold else None
            try:
                await self.upstreams.forward(
                    scope,
                    claimed,
                    body,
                    send if cold is None else cold.watch(send),
                    functools.partial(self.ledger.give_back, claimed),
                )
                return
            except ReplicaFailed as exc:
                await self.ledger.retire(claimed, str(exc))
                if attempt + 1 >= tries:
                    raise Answer(502, f"replica of {info.name} failed to answer: {exc}") from None
                log.info("gateway: retrying %s %s on another replica", scope["method"], info.name)
            finally:
                if cold is not None:  # its stages, off the request's path
                    self.background.soon(
                        self.background.store(cold.done, self.ledger.db, self.metrics.stage)
                    )
