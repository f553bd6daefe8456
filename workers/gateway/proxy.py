"""The proxy: one request to ``/function/NAME[/PATH]``, from arrival to its claim's release.

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
5. **Claim** (:class:`workers.replicas.claims.ClaimAttempt`, each store step in the gateway's
   thread pool - ``CORRAL_GATEWAY_STORE_THREADS``, one on SQLite - waits with
   ``asyncio.sleep``): an Idle environment, else a cold start
   shared with every other waiter of the function, in this gateway or another; a
   spawn refused because the function is at its max waits for a release. Nothing
   ready within ``CORRAL_GATEWAY_COLD_START_TIMEOUT_S`` -> 503 with ``Retry-After``.
   The claim's ttl is the call timeout plus a margin, so a gateway that dies
   mid-request leaves claims the reaper gives back.
6. **Forward** with httpx's ``AsyncClient``: method, path, query, headers (without
   hop-by-hop ones, with ``X-Forwarded-*``) and body. A replica that refuses
   connections for ``CONNECT_GRACE_S`` (a moment of refusal is a server still
   starting), or breaks the exchange before its response headers -> its claim is given
   back and the replica retired as *suspect* (:func:`tasks.api.suspect`: Deleting at
   once, so no claim picks it again; a delete operation removes it), and an
   idempotent request (GET, HEAD, OPTIONS, PUT, DELETE, TRACE) is tried once more
   on another replica; otherwise -> 502. No complete answer within
   ``CORRAL_GATEWAY_TIMEOUT_S`` -> 504 (a slow replica is not retired).
7. **Stream** the response back as it arrives, one chunk behind (and the status
   line with the first chunk): the claim is released *before* the last chunk is
   sent, so a client that sees its response complete can be sure the environment is
   free again for its next request.

The claim is released on every path out - error, timeout, and a client that goes
away (a watcher on the ASGI ``receive`` channel cancels the request, and the
release runs shielded from that cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import httpx

from config.settings import Settings
from workers.errors import CorralError, NotFound
from workers.functions import get_function
from workers.gateway.admission import Gate, QueueFull, QueueTimeout
from workers.gateway.metrics import UNKNOWN, GatewayMetrics
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
CLAIM_MARGIN_S = 30.0  # a claim outlives the call timeout by this much
RETRY_AFTER_S = 5
CONNECT_GRACE_S = 2.0  # a refused connection is tried again this long before it counts


@dataclass(frozen=True)
class FunctionInfo:
    """What the gateway needs to know about a function."""

    name: str
    limit: int  # max_replicas x exec_envs: the most requests it can serve at once


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

    def release(self, claim_id: str, *, settings: Settings | None = None) -> Mapping[str, Any]:
        """Give back a claim's environment."""
        ...

    def suspect(self, claim_id: str, reason: str, *,
                settings: Settings | None = None) -> str | None:
        """Give back a claim and retire its replica as suspect; the delete's operation id."""
        ...


class Gateway:
    """The proxy's state: settings, the store thread pool, the upstream client, the gates."""

    def __init__(self, db: Database, settings: Settings, producer: Producer,
                 metrics: GatewayMetrics | None = None) -> None:
        self.db = db
        self.settings = settings
        self.producer = producer
        self.metrics = metrics or GatewayMetrics()
        self.gates: dict[str, Gate] = {}
        self._functions: dict[str, tuple[FunctionInfo, float]] = {}
        # SQLite takes one write at a time anyway: more threads only wait in its busy
        # handler (sleeps of up to 100 ms each), so they would add latency, not speed.
        threads = 1 if db.is_sqlite else settings.gateway_store_threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-store")
        self._client: httpx.AsyncClient | None = None
        self._background: set[asyncio.Future[Any]] = set()
        self._token = (f"Bearer {settings.gateway_token}".encode()
                       if settings.gateway_token else None)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the upstream client (on the serving loop)."""
        timeout = self.settings.gateway_timeout_s
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
            follow_redirects=False, trust_env=False,
        )

    async def close(self) -> None:
        """Finish pending releases, close the client and the thread pool."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
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
        """Run ``work``, cancelling it if the client disconnects before its answer is complete."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self._disconnected(receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not complete():
                task.cancel()  # the client went away: stop, releasing what the request holds
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientGone
            await task
        finally:
            watch.cancel()
            if not task.done():  # we were cancelled ourselves
                task.cancel()

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
        cached = self._functions.get(name)
        if cached is not None and time.monotonic() - cached[1] < FUNCTION_TTL_S:
            return cached[0]
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
            claimed = await self._claim(info)
            try:
                await self._forward(scope, claimed, body, send)
                return
            except ReplicaFailed as exc:
                await self._retire(claimed, str(exc))
                if attempt + 1 >= tries:
                    raise Answer(502, f"replica of {info.name} failed to answer: {exc}") from None
                log.info("gateway: retrying %s %s on another replica", scope["method"], info.name)

    async def _claim(self, info: FunctionInfo) -> Claimed:
        settings = self.settings
        attempt = ClaimAttempt(
            self.db, settings, info.name,
            cold_start_timeout=settings.gateway_cold_start_timeout_s,
            ttl_s=min(settings.gateway_timeout_s + CLAIM_MARGIN_S, 86_400.0),
            spawn=lambda name: self.producer.spawn(name, 1, settings=settings), wait_at_max=True,
        )
        cold = False
        try:
            while True:
                try:
                    got = await self._step(attempt)
                except NotFound:
                    raise Answer(404, f"unknown function {info.name!r}") from None
                except NoIdleReplica as exc:  # timed out, or the cold start failed
                    raise Answer(503, str(exc), {"retry-after": str(RETRY_AFTER_S)}) from None
                if isinstance(got, Claimed):
                    if cold:
                        self.metrics.cold_start(info.name, attempt.waited_s)
                    return got
                cold = True
                await asyncio.sleep(got)
        finally:
            if attempt.waiting:
                await self._shielded(attempt.close)

    async def _step(self, attempt: ClaimAttempt) -> Claimed | float:
        """One claim step; a claim it makes after this request was cancelled is released."""
        step = asyncio.ensure_future(self.store(attempt.step))
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            def orphan(done: asyncio.Future[Claimed | float]) -> None:
                if not done.cancelled() and done.exception() is None and \
                        isinstance(done.result(), Claimed):
                    got = done.result()
                    assert isinstance(got, Claimed)
                    self._keep(asyncio.ensure_future(self._release(got)))

            step.add_done_callback(orphan)
            raise

    async def _forward(self, scope: Scope, claimed: Claimed, body: bytes, send: Send) -> None:
        """Send the request to the claimed replica and stream its answer; release the claim.

        Raises :class:`ReplicaFailed` (the claim still held, for the caller to retire),
        :class:`Answer` 502 / 504 or :class:`BrokenOff` (the claim released).
        """
        assert self._client is not None, "Gateway.start() was not awaited"
        if not claimed.address:
            raise ReplicaFailed("the replica has no address")
        rest = scope["path"][len(PREFIX):].partition("/")[2]
        url = f"{claimed.address.rstrip('/')}/{rest}"
        query = scope.get("query_string", b"")
        if query:
            url += "?" + query.decode("latin-1")
        request = self._client.build_request(
            scope["method"], url, headers=self._upstream_headers(scope), content=body)
        deadline = self.settings.gateway_timeout_s
        holding, answering = True, False
        last = b""
        try:
            try:
                async with asyncio.timeout(deadline):
                    try:
                        response = await self._send(request)
                    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                            httpx.ReadError, httpx.WriteError) as exc:
                        holding = False  # the caller retires the replica with the claim
                        raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
                    except httpx.TimeoutException:
                        raise TimeoutError from None
                    start = {"type": "http.response.start", "status": response.status_code,
                             "headers": self._downstream_headers(response)}
                    try:
                        async for chunk in response.aiter_raw():
                            if not chunk:
                                continue
                            if not answering:
                                answering = True
                                await send(start)
                            if last:  # one chunk behind: the last goes after the release
                                await send({"type": "http.response.body", "body": last,
                                            "more_body": True})
                            last = chunk
                    finally:
                        await response.aclose()
            except (TimeoutError, httpx.HTTPError) as exc:
                timed_out = isinstance(exc, TimeoutError)
                what = (f"no complete answer within {deadline:g}s" if timed_out
                        else f"{type(exc).__name__}: {exc}")
                if answering:
                    raise BrokenOff(f"replica {claimed.replica_id} broke off its answer: "
                                    f"{what}") from None
                raise Answer(504 if timed_out else 502,
                             f"replica of {claimed.function}: {what}") from None
            holding = False
            await self._release(claimed)  # before the last chunk: free when the client sees it
            if not answering:
                await send(start)
            await send({"type": "http.response.body", "body": last, "more_body": False})
        finally:
            if holding:
                await self._release(claimed)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """Send, trying a refused connection again for up to ``CONNECT_GRACE_S``.

        A replica can be Idle a moment before its server listens (an agent that answers
        CreateReplica as soon as the process runs); only a replica that keeps refusing
        is a failed one.
        """
        assert self._client is not None
        give_up = time.monotonic() + CONNECT_GRACE_S
        pause = 0.01
        while True:
            try:
                return await self._client.send(request, stream=True)
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

    async def _release(self, claimed: Claimed) -> None:
        await self._shielded(self.producer.release, claimed.claim_id, settings=self.settings)

    async def _retire(self, claimed: Claimed, reason: str) -> None:
        log.warning("gateway: replica %s of %s is suspect: %s", claimed.replica_id,
                    claimed.function, reason)
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
        task.add_done_callback(self._background.discard)
        return task

    @staticmethod
    async def _reply(send: Send, status: int, message: str,
                     headers: dict[str, str] | None = None) -> None:
        body = (message + "\n").encode()
        raw = [(b"content-type", b"text/plain; charset=utf-8"),
               (b"content-length", str(len(body)).encode())]
        raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body, "more_body": False})
