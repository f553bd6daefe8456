"""The proxy: one request to ``/function/NAME[/PATH]``, from arrival to returning its claim.

A request goes through these steps, each with its own answer when it fails:

1. **Token.** With ``CORRAL_GATEWAY_TOKEN`` set, ``Authorization: Bearer <token>``
   is required (401 otherwise) and is not forwarded.
2. **Body.** Read in full before anything is claimed, so a slow upload holds no
   environment; over ``CORRAL_GATEWAY_MAX_BODY`` bytes (announced or counted) -> 413.
3. **Function.** Its limits come from the store, cached for a few seconds; an
   unknown name -> 404.
4. **Admission** (:mod:`workers.gateway.admission`): beyond ``max_replicas x
   exec_envs`` requests the request queues; a full queue -> 429, no place within the
   cold-start timeout -> 503 with ``Retry-After``.
5. **Claim.** An environment this gateway holds for the function already
   (:mod:`workers.gateway.pool`: claims are leases, kept between requests) - no store
   call at all. With none free, one store call claims an environment for every request
   of the function waiting in this gateway (:func:`workers.replicas.claims.claim_many`); if the
   store has none Idle, each waiting request runs :class:`workers.replicas.claims.ClaimAttempt`
   (each store step in the gateway's thread pool - ``CORRAL_GATEWAY_STORE_THREADS``,
   one on SQLite - waits with ``asyncio.sleep``): a cold start shared with every other
   waiter of the function, in this gateway or another, and a spawn refused because the
   function is at its max waits for a release; an environment another request of this
   gateway returns meanwhile serves it first. Nothing within
   ``CORRAL_GATEWAY_COLD_START_TIMEOUT_S`` -> 503 with ``Retry-After``. Every claim is
   a lease of ``CORRAL_GATEWAY_CLAIM_TTL_S`` that the gateway renews while it holds it,
   so a gateway that dies leaves claims the reaper gives back.
6. **Forward** with httpx's ``AsyncClient``: method, path, query, headers (without
   hop-by-hop ones, with ``X-Forwarded-*``) and body. A replica that refuses
   connections for ``CONNECT_GRACE_S`` (a moment of refusal is a server still
   starting), or breaks the exchange before its response headers -> its claim is given
   back (with every other claim this gateway holds on it) and the replica retired as
   *suspect* (:func:`tasks.api.suspect`: Deleting at
   once, so no claim picks it again; a delete operation removes it), and an
   idempotent request (GET, HEAD, OPTIONS, PUT, DELETE, TRACE) is tried once more
   on another replica; otherwise -> 502. No complete answer within
   ``CORRAL_GATEWAY_TIMEOUT_S`` -> 504 (a slow replica is not retired).
7. **Stream** the response back as it arrives, one chunk behind (and the status
   line with the first chunk): the environment goes back to the function's pool
   *before* the last chunk is sent, so a client that sees its response complete can be
   sure the environment is free again for its next request. The pool gives it back to
   the store once it has been unused for ``CORRAL_GATEWAY_KEEP_S``.

The environment is returned on every path out - error, timeout, and a client that goes
away (a watcher on the ASGI ``receive`` channel cancels the request; returning it is
synchronous, and a claim a cancelled store call still makes goes to the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http.cookiejar
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import httpx

from config.settings import Settings
from workers.errors import CorralError, NotFound
from workers.functions import get_function
from workers.gateway.admission import Gate, QueueFull, QueueTimeout
from workers.gateway.metrics import UNKNOWN, GatewayMetrics
from workers.gateway.pool import Pool
from workers.replicas import claims
from workers.replicas.claims import ClaimAttempt, Claimed, NoIdleReplica
from workers.store.db import Database

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
T = TypeVar("T")

PREFIX = "/function/"
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
FUNCTION_TTL_S = 2.0  # how long a function's limits are cached
UPSTREAM_IDLE_S = 60.0  # a replica's client unused this long (and no claim on it) is closed
CLAIM_BATCH = 16  # environments one store call claims at most
RENEW_MAX_S = 2.0  # held claims are renewed (and checked) at least this often
RETRY_AFTER_S = 5
CONNECT_GRACE_S = 2.0  # a refused connection is tried again this long before it counts


@dataclass(frozen=True)
class FunctionInfo:
    """What the gateway needs to know about a function."""

    name: str
    limit: int  # max_replicas x exec_envs: the most requests it can serve at once


class NoCookies(http.cookiejar.CookieJar):
    """A cookie jar that keeps nothing: a replica's cookies are its callers', never the gateway's.

    httpx's client stores every ``Set-Cookie`` it sees and sends it with later requests
    to the same host - one caller's session would go out with another caller's request.
    """

    def extract_cookies(self, response: Any, request: Any) -> None:
        """Keep nothing."""

    def add_cookie_header(self, request: Any) -> None:
        """Add nothing."""


@dataclass
class Upstream:
    """The HTTP client for one replica, and how many requests use it now."""

    client: httpx.AsyncClient
    users: int = 0
    last_used: float = 0.0


class Answer(Exception):
    """Stop handling a request and answer it with this status and message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class ReplicaFailed(Exception):
    """The replica could not be reached, or broke the exchange before answering."""


class BrokenOff(Exception):
    """The answer stopped after its status line was sent: nothing more can be said."""


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


class Producer(Protocol):
    """What the gateway asks of the producer API; the ``tasks.api`` module is one.

    The gateway sits below ``tasks`` (it is logic, in ``workers``), so the command that
    starts it hands it the producer API instead of the gateway importing it.
    """

    def spawn(self, function: str, count: int = 1, *, settings: Settings | None = None) -> str:
        """Ask for ``count`` new replicas of ``function``; the operation id."""
        ...

    def suspect(self, claim_id: str, reason: str, *,
                settings: Settings | None = None) -> str | None:
        """Give back a claim and retire its replica as suspect; the delete's operation id."""
        ...


class _Relay:
    """An upstream answer streamed to the client one chunk behind.

    The last chunk is held back until :meth:`finish`, so the gateway can return its
    claim first: the environment is free by the time the client sees the answer end.
    """

    def __init__(self, send: Send) -> None:
        self.send = send
        self.answering = False  # the response has started: an error can only break it off
        self.start: Message = {}
        self.last = b""

    async def stream(self, response: httpx.Response, headers: list[tuple[bytes, bytes]]) -> None:
        """Relay every chunk but the last; the response is closed in any case."""
        self.start = {"type": "http.response.start", "status": response.status_code,
                      "headers": headers}
        try:
            async for chunk in response.aiter_raw():
                if not chunk:
                    continue
                if not self.answering:
                    self.answering = True
                    await self.send(self.start)
                if self.last:
                    await self.send({"type": "http.response.body", "body": self.last,
                                     "more_body": True})
                self.last = chunk
        finally:
            await response.aclose()

    async def finish(self) -> None:
        """Send the start (for an empty body) and the last chunk."""
        if not self.answering:
            await self.send(self.start)
        await self.send({"type": "http.response.body", "body": self.last, "more_body": False})


class Gateway:
    """The proxy's state: settings, the store thread pool, the upstream client, the gates."""

    def __init__(self, db: Database, settings: Settings, producer: Producer,
                 metrics: GatewayMetrics | None = None) -> None:
        self.db = db
        self.settings = settings
        self.producer = producer
        self.metrics = metrics or GatewayMetrics()
        self.gates: dict[str, Gate] = {}
        self.pools: dict[str, Pool] = {}
        self.held: dict[str, Claimed] = {}  # every claim this gateway holds, idle or in use
        # Claims in use that must not go back to their pool: True = release them when
        # their request ends (replica retired or unusable), False = forget them (the
        # store no longer has them).
        self._unpooled: dict[str, bool] = {}
        self._maintainer: asyncio.Task[None] | None = None
        self._functions: dict[str, tuple[FunctionInfo, float]] = {}
        self._refreshing: set[str] = set()
        # SQLite takes one write at a time anyway: more threads only wait in its busy
        # handler (sleeps of up to 100 ms each), so they would add latency, not speed.
        threads = 1 if db.is_sqlite else settings.gateway_store_threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-store")
        # One upstream client per replica address: httpcore's pool scans all of its
        # connections on every request, so small pools cost less than one big one.
        self._upstreams: dict[str, Upstream] = {}
        self._tls: ssl.SSLContext | None = None
        self._started = False
        self._background: set[asyncio.Future[Any]] = set()
        self._token = (f"Bearer {settings.gateway_token}".encode()
                       if settings.gateway_token else None)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start renewing held claims (on the serving loop)."""
        self._started = True
        self._maintainer = asyncio.create_task(self._maintain())

    async def close(self) -> None:
        """Give back every claim held, close the client and the thread pool."""
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintainer
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for pool in self.pools.values():
            pool.drain()
        if self.held:
            held, self.held = list(self.held), {}
            try:
                await self.store(claims.release_many, self.db, self.settings, held)
            except Exception as exc:  # the store is away: the leases expire by themselves
                log.warning("gateway: could not give back %d claims at shutdown: %s",
                            len(held), exc)
        upstreams, self._upstreams = list(self._upstreams.values()), {}
        for upstream in upstreams:
            await upstream.client.aclose()
        self._pool.shutdown(wait=True)

    async def store(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a (synchronous) store call in the gateway's thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def authorized(self, scope: Scope) -> bool:
        """True when no token is set or the request carries it."""
        if self._token is None:
            return True
        sent = (_header(scope, b"authorization") or "").encode("latin-1")
        return hmac.compare_digest(sent, self._token)

    # -- one request -----------------------------------------------------------------------

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ``/function/...`` request (ASGI)."""
        started = time.perf_counter()
        name = scope["path"][len(PREFIX):].split("/", 1)[0]
        state = {"code": 0, "complete": False}

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["code"] = message["status"]
            elif not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        try:
            if not self.authorized(scope):
                raise Answer(401, "missing or invalid gateway token",
                             {"www-authenticate": "Bearer"})
            body = await self._read_body(scope, receive)
            await self._watched(self._serve(scope, body, tracked, name), receive,
                                lambda: bool(state["complete"]))
        except Answer as answer:
            await self._reply(tracked, answer.status, answer.message, answer.headers)
        except ClientGone:
            pass
        finally:
            label = name if name in self._functions else UNKNOWN
            self.metrics.answered(label, int(state["code"]) if state["complete"] else 499,
                                  time.perf_counter() - started)

    async def _watched(self, work: Awaitable[None], receive: Receive,
                       complete: Callable[[], bool]) -> None:
        """Run ``work``, cancelling it if the client disconnects before its answer is complete.

        ``work`` runs in this task (no task of its own: one hand-off less per request);
        a watcher task cancels this one when the client goes away.
        """
        me = asyncio.current_task()
        assert me is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            await self._disconnected(receive)
            if not complete():
                gone = True
                me.cancel()  # the client went away: stop, returning what the request holds

        watcher = asyncio.ensure_future(watch())
        try:
            await work
        except asyncio.CancelledError:
            if not gone:
                raise  # we were cancelled ourselves
            me.uncancel()
            raise ClientGone from None
        finally:
            watcher.cancel()

    async def _disconnected(self, receive: Receive) -> None:
        """Return when the client disconnects (its body was read already)."""
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _serve(self, scope: Scope, body: bytes, send: Send, name: str) -> None:
        """Find the function and serve the request."""
        try:
            info = await self._function(name)
            await self._admitted(scope, info, body, send)
        except Answer as answer:
            await self._reply(send, answer.status, answer.message, answer.headers)
        except BrokenOff as exc:
            log.warning("gateway: %s", exc)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.settings.gateway_max_body
        announced = _header(scope, b"content-length")
        if announced is not None and announced.isdigit() and int(announced) > limit:
            raise Answer(413, f"request body over {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise Answer(413, f"request body over {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _function(self, name: str) -> FunctionInfo:
        """The function's limits: cached; a stale entry is served while one refresh runs."""
        cached = self._functions.get(name)
        if cached is None:
            return await self._lookup(name)
        if time.monotonic() - cached[1] >= FUNCTION_TTL_S and name not in self._refreshing:
            self._refreshing.add(name)
            self._keep(asyncio.ensure_future(self._refresh(name)))
        return cached[0]

    async def _refresh(self, name: str) -> None:
        try:
            await self._lookup(name)
        except Answer:
            pass  # removed: forgotten, so the next request for it is answered 404
        except Exception as exc:  # the store is away: keep the old limits, try again later
            log.warning("gateway: could not refresh function %s: %s", name, exc)
        finally:
            self._refreshing.discard(name)

    async def _lookup(self, name: str) -> FunctionInfo:
        try:
            info = await self.store(self._load_function, name)
        except NotFound:
            self._functions.pop(name, None)
            raise Answer(404, f"unknown function {name!r}") from None
        except CorralError as exc:  # a malformed name
            raise Answer(404, str(exc)) from None
        self._functions[name] = (info, time.monotonic())
        gate = self.gates.get(name)
        if gate is None:
            self.gates[name] = Gate(info.limit, self.settings.gateway_queue)
        elif gate.limit != info.limit:
            gate.resize(info.limit, self.settings.gateway_queue)
        return info

    def _load_function(self, name: str) -> FunctionInfo:
        with self.db.read() as s:
            fn = get_function(s, name)
            return FunctionInfo(fn.name, max(1, fn.max_replicas * fn.exec_envs))

    async def _admitted(self, scope: Scope, info: FunctionInfo, body: bytes, send: Send) -> None:
        gate = self.gates[info.name]
        timeout = self.settings.gateway_cold_start_timeout_s
        try:
            await gate.enter(timeout)
        except QueueFull:
            self.metrics.load(info.name, gate.active, gate.queued)
            raise Answer(429, f"too many requests for {info.name}: the queue is full",
                         {"retry-after": "1"}) from None
        except QueueTimeout:
            self.metrics.load(info.name, gate.active, gate.queued)
            raise Answer(503, f"no free environment of {info.name} within {timeout:g}s",
                         {"retry-after": str(RETRY_AFTER_S)}) from None
        finally:
            self.metrics.load(info.name, gate.active, gate.queued)
        try:
            await self._call(scope, info, body, send)
        finally:
            gate.leave()
            self.metrics.load(info.name, gate.active, gate.queued)

    async def _call(self, scope: Scope, info: FunctionInfo, body: bytes, send: Send) -> None:
        """Claim, forward, stream back; one more replica for an idempotent request."""
        tries = 2 if scope["method"] in IDEMPOTENT else 1
        for attempt in range(tries):
            claimed = await self._acquire(info)
            try:
                await self._forward(scope, claimed, body, send)
                return
            except ReplicaFailed as exc:
                await self._retire(claimed, str(exc))
                if attempt + 1 >= tries:
                    raise Answer(502, f"replica of {info.name} failed to answer: {exc}") from None
                log.info("gateway: retrying %s %s on another replica", scope["method"], info.name)

    def _pool_of(self, name: str) -> Pool:
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = Pool()
        return pool

    async def _acquire(self, info: FunctionInfo) -> Claimed:
        """An environment for one request: from the pool, else the store (cold start included)."""
        pool = self._pool_of(info.name)
        got = pool.take()
        if got is not None:
            return got
        place = pool.wait()
        try:
            while not place.done():
                refill = pool.refilling or self._refill(pool, info)
                both: set[asyncio.Future[Any]] = {place, refill}
                await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
                if not place.done() and refill.done() and not refill.result():
                    return await self._claim_or_wait(info, place)  # nothing Idle in the store
            return place.result()
        except BaseException:
            mine = pool.unwait(place)
            if mine is not None:
                self._return(mine)
            raise
        finally:
            pool.unwait(place)

    def _refill(self, pool: Pool, info: FunctionInfo) -> asyncio.Future[bool]:
        """One store call claiming an environment for each request in line; True: got them all."""
        count = max(1, min(CLAIM_BATCH, pool.wanted))

        async def run() -> bool:
            try:
                got = await self.store(lambda: claims.claim_many(
                    self.db, self.settings, info.name, count,
                    ttl_s=self.settings.gateway_claim_ttl_s))
            except NoIdleReplica:
                got = []
            except NotFound:
                raise Answer(404, f"unknown function {info.name!r}") from None
            finally:
                pool.refilling = None
            for claimed in got:
                self._adopt(claimed)
            return len(got) >= count

        task = self._keep(asyncio.ensure_future(run()))
        pool.refilling = task
        return task

    async def _claim_or_wait(self, info: FunctionInfo, place: asyncio.Future[Claimed]) -> Claimed:
        """Claim through the store (a cold start if need be) unless the pool serves us first."""
        work = self._keep(asyncio.ensure_future(self._claim(info)))
        try:
            both: set[asyncio.Future[Any]] = {place, work}
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()  # a claim it still makes goes to the pool
            raise
        if not place.done():
            return work.result()
        if not work.done():
            work.cancel()
        elif not work.cancelled() and work.exception() is None:
            self._return(work.result())  # both at once: the spare one goes to the pool
        return place.result()

    def _adopt(self, claimed: Claimed) -> None:
        """A claim this gateway got from the store: hold it and put it in its pool."""
        self.held[claimed.claim_id] = claimed
        self._pool_of(claimed.function).give(claimed)

    def _return(self, claimed: Claimed) -> None:
        """A request is done with its environment: back to the pool, or released."""
        discard = self._unpooled.pop(claimed.claim_id, None)
        if claimed.claim_id not in self.held:
            return  # given back already (shutdown)
        if discard is False:
            del self.held[claimed.claim_id]  # the store no longer has it
            return
        pool = self._pool_of(claimed.function)
        if discard or (self.settings.gateway_keep_s <= 0 and not pool.wanted):
            self._release_soon([claimed])
        else:
            pool.give(claimed)

    def _release_soon(self, released: list[Claimed]) -> None:
        """Stop holding these claims and give them back to the store in the background."""
        for claimed in released:
            self.held.pop(claimed.claim_id, None)
        ids = [c.claim_id for c in released]
        if ids:
            self._keep(asyncio.ensure_future(self._release_ids(ids)))

    async def _release_ids(self, ids: list[str]) -> None:
        try:
            await self.store(claims.release_many, self.db, self.settings, ids)
        except Exception as exc:  # the store is away: the leases expire by themselves
            log.warning("gateway: could not give back %d claims: %s", len(ids), exc)

    async def _maintain(self) -> None:
        """Forever: give back claims unused for the keep window; renew the rest in time."""
        keep = self.settings.gateway_keep_s
        ttl = self.settings.gateway_claim_ttl_s
        renew_every = min(ttl / 3, RENEW_MAX_S)
        tick = min(renew_every, max(0.05, keep / 2)) if keep > 0 else renew_every
        renew_at = time.monotonic() + renew_every
        while True:
            await asyncio.sleep(tick)
            self._release_soon([c for pool in self.pools.values() for c in pool.expired(keep)])
            self._close_unused_upstreams()
            if time.monotonic() < renew_at or not self.held:
                continue
            renew_at = time.monotonic() + renew_every
            ids = list(self.held)
            try:
                usable = await self.store(claims.renew, self.db, ids, ttl)
            except Exception as exc:  # the store is away: try again next tick
                log.warning("gateway: could not renew %d claims: %s", len(ids), exc)
                renew_at = time.monotonic()
                continue
            self._apply_renewal(ids, usable)

    def _apply_renewal(self, ids: list[str], usable: dict[str, bool]) -> None:
        """Drop claims the store no longer has; give back those of unusable replicas."""
        gone = {cid for cid in ids if cid not in usable and cid in self.held}
        bad = {cid for cid, ok in usable.items() if not ok and cid in self.held}
        for pool in self.pools.values():
            for claimed in pool.drop(gone):
                del self.held[claimed.claim_id]
            self._release_soon(pool.drop(bad))
        for cid in gone & self.held.keys():  # in use: forget them when their request ends
            self._unpooled[cid] = False
        for cid in bad & self.held.keys():  # in use: give them back when their request ends
            self._unpooled[cid] = True
        if gone:
            log.warning("gateway: %d held claims were given back behind its back", len(gone))

    async def _claim(self, info: FunctionInfo) -> Claimed:
        settings = self.settings
        attempt = ClaimAttempt(
            self.db, settings, info.name,
            cold_start_timeout=settings.gateway_cold_start_timeout_s,
            ttl_s=settings.gateway_claim_ttl_s,
            spawn=lambda name: self.producer.spawn(name, 1, settings=settings), wait_at_max=True,
        )
        cold = False
        got: Claimed | float | None = None
        try:
            while True:
                try:
                    got = await self._step(attempt)
                except NotFound:
                    raise Answer(404, f"unknown function {info.name!r}") from None
                except NoIdleReplica as exc:  # timed out, or the cold start failed
                    raise Answer(503, str(exc), {"retry-after": str(RETRY_AFTER_S)}) from None
                if isinstance(got, Claimed):
                    self.held[got.claim_id] = got
                    if cold:
                        self.metrics.cold_start(info.name, attempt.waited_s)
                    return got
                cold = True
                await asyncio.sleep(got)
        finally:
            if attempt.waiting:
                try:
                    await self._shielded(attempt.close)
                except asyncio.CancelledError:
                    if isinstance(got, Claimed):  # cancelled with a claim in hand: keep it
                        self._return(got)
                    raise

    async def _step(self, attempt: ClaimAttempt) -> Claimed | float:
        """One claim step; a claim it makes after this request was cancelled goes to the pool."""
        step = asyncio.ensure_future(self.store(attempt.step))
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            def orphan(done: asyncio.Future[Claimed | float]) -> None:
                if not done.cancelled() and done.exception() is None and \
                        isinstance(done.result(), Claimed):
                    got = done.result()
                    assert isinstance(got, Claimed)
                    self._adopt(got)

            step.add_done_callback(orphan)
            raise

    async def _forward(self, scope: Scope, claimed: Claimed, body: bytes, send: Send) -> None:
        """Send the request to the claimed replica and stream its answer; return the claim.

        Raises :class:`ReplicaFailed` (the claim still held, for the caller to retire),
        :class:`Answer` 502 / 504 or :class:`BrokenOff` (the claim returned).
        """
        assert self._started, "Gateway.start() was not awaited"
        if not claimed.address:
            raise ReplicaFailed("the replica has no address")
        upstream = self._upstream(claimed.address)
        rest = scope["path"][len(PREFIX):].partition("/")[2]
        url = f"{claimed.address.rstrip('/')}/{rest}"
        query = scope.get("query_string", b"")
        if query:
            url += "?" + query.decode("latin-1")
        try:
            request = upstream.client.build_request(
                scope["method"], url, headers=self._upstream_headers(scope), content=body)
        except httpx.InvalidURL as exc:  # e.g. a %00 in the path: the caller's, not the replica's
            self._return(claimed)
            raise Answer(400, f"cannot forward this request: {exc}") from None
        deadline = self.settings.gateway_timeout_s
        relay = _Relay(send)
        holding = True
        upstream.users += 1
        try:
            try:
                async with asyncio.timeout(deadline):
                    try:
                        response = await self._send(upstream.client, request)
                    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                            httpx.ReadError, httpx.WriteError) as exc:
                        holding = False  # the caller retires the replica with the claim
                        raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
                    except httpx.TimeoutException:
                        raise TimeoutError from None
                    await relay.stream(response, self._downstream_headers(response))
            except (TimeoutError, httpx.HTTPError) as exc:
                what = (f"no complete answer within {deadline:g}s" if isinstance(exc, TimeoutError)
                        else f"{type(exc).__name__}: {exc}")
                if relay.answering:
                    raise BrokenOff(f"replica {claimed.replica_id} broke off its answer: "
                                    f"{what}") from None
                raise Answer(504 if isinstance(exc, TimeoutError) else 502,
                             f"replica of {claimed.function}: {what}") from None
            holding = False
            self._return(claimed)  # before the last chunk: free when the client sees it
            await relay.finish()
        finally:
            upstream.users -= 1
            if holding:
                self._return(claimed)

    def _upstream(self, address: str) -> Upstream:
        """The client for one replica address (made on first use)."""
        upstream = self._upstreams.get(address)
        if upstream is None:
            timeout = self.settings.gateway_timeout_s
            if self._tls is None:  # one for all clients (making one costs a millisecond)
                self._tls = httpx.create_ssl_context()
            upstream = self._upstreams[address] = Upstream(httpx.AsyncClient(
                timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                follow_redirects=False, trust_env=False, verify=self._tls, cookies=NoCookies(),
            ))
        upstream.last_used = time.monotonic()
        return upstream

    def _close_unused_upstreams(self) -> None:
        """Close the clients of replicas unused for a while that it holds no claim on."""
        wanted = {c.address for c in self.held.values()}
        idle_since = time.monotonic() - UPSTREAM_IDLE_S
        for address, upstream in list(self._upstreams.items()):
            if address not in wanted and not upstream.users and upstream.last_used < idle_since:
                del self._upstreams[address]
                self._keep(asyncio.ensure_future(upstream.client.aclose()))

    async def _send(self, client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
        """Send, trying a refused connection again for up to ``CONNECT_GRACE_S``.

        A replica can be Idle a moment before its server listens (an agent that answers
        CreateReplica as soon as the process runs); only a replica that keeps refusing
        is a failed one.
        """
        give_up = time.monotonic() + CONNECT_GRACE_S
        pause = 0.01
        while True:
            try:
                return await client.send(request, stream=True)
            except httpx.ConnectError:
                if time.monotonic() + pause > give_up:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _upstream_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        client = scope.get("client")
        host = b""
        for key, value in scope["headers"]:
            k = key.lower()
            if k == b"host":
                host = value
                continue
            if k in (b"content-length", b"x-forwarded-for", b"x-forwarded-host",
                     b"x-forwarded-proto") or k.decode("latin-1") in HOP_BY_HOP:
                continue
            if k == b"authorization" and self._token is not None:
                continue  # the gateway's own token stays here
            out.append((key, value))
        if client:
            out.append((b"x-forwarded-for", str(client[0]).encode()))
        if host:
            out.append((b"x-forwarded-host", host))
        out.append((b"x-forwarded-proto", str(scope.get("scheme", "http")).encode()))
        return out

    @staticmethod
    def _downstream_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in response.headers.raw
                if k.decode("latin-1").lower() not in HOP_BY_HOP]

    async def _retire(self, claimed: Claimed, reason: str) -> None:
        """Give back a failed replica's claim and delete the replica; drop its other claims."""
        log.warning("gateway: replica %s of %s is suspect: %s", claimed.replica_id,
                    claimed.function, reason)
        self.held.pop(claimed.claim_id, None)
        self._unpooled.pop(claimed.claim_id, None)
        self._release_soon(self._pool_of(claimed.function).drop_replica(claimed.replica_id))
        for other in self.held.values():  # in use: given back when their requests end
            if other.replica_id == claimed.replica_id:
                self._unpooled[other.claim_id] = True
        try:
            await self._shielded(self.producer.suspect, claimed.claim_id, f"suspect: {reason}",
                                 settings=self.settings)
        except CorralError as exc:  # the broker is down: the stuck sweep finishes the delete
            log.warning("gateway: could not queue the delete of %s: %s", claimed.replica_id, exc)

    async def _shielded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a store call that must complete even if this request is cancelled meanwhile."""
        return await asyncio.shield(self._keep(
            asyncio.ensure_future(self.store(lambda: fn(*args, **kwargs)))))

    def _keep(self, task: asyncio.Future[T]) -> asyncio.Future[T]:
        """Track a background task until it ends (``close`` waits for the rest)."""
        self._background.add(task)
        task.add_done_callback(self._settled)
        return task

    def _settled(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # whoever needed it saw it; nobody else must be told

    @staticmethod
    async def _reply(send: Send, status: int, message: str,
                     headers: dict[str, str] | None = None) -> None:
        body = (message + "\n").encode()
        raw = [(b"content-type", b"text/plain; charset=utf-8"),
               (b"content-length", str(len(body)).encode())]
        raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body, "more_body": False})
