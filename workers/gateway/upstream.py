"""The upstream side: the replicas' connections, the forwarded request, the answer relayed.

:meth:`Upstreams.forward` sends one request to a claimed replica and streams its answer
back to the caller, one chunk behind (the status line with the first chunk): the
environment is handed back (``done``) the moment the replica's whole answer has arrived,
so always *before* the last chunk is sent - a caller that sees its answer complete can
be sure the environment is free again for its next request.

* **Connections**: one :class:`workers.gateway.http1.Pool` of kept-alive HTTP/1.1
  connections per replica address (:mod:`workers.gateway.http1`: the request goes out
  as built, nothing added), swept once unused for ``UPSTREAM_IDLE_S`` with no claim
  held on its replica. No cookie is ever kept: a replica's cookies are its callers'.
* **Header rules and the raw path**: :mod:`workers.gateway.headers`.
* **Slow callers**: up to ``CORRAL_GATEWAY_READ_AHEAD`` bytes of an answer (in memory)
  are read from the replica ahead of the caller, so an answer that fits frees its
  environment as soon as the replica has sent it, whatever the caller does; all
  answers together hold at most ``CORRAL_GATEWAY_READ_AHEAD_BUDGET`` (past it, an
  answer is read only while its caller waits for more); and each piece must be taken
  by the caller within ``CORRAL_GATEWAY_SEND_TIMEOUT_S``, or the answer is cut off
  (and the environment of a larger answer goes back then).
* **Hostile answers** (:mod:`workers.gateway.http1`): a head over
  ``CORRAL_GATEWAY_ANSWER_HEAD_MAX`` bytes or ``CORRAL_GATEWAY_ANSWER_HEAD_LINES``
  lines (interim heads included), trailers or chunk framing over the same bytes, or a
  ``101``, is refused with a 502; a head not complete within
  ``CORRAL_GATEWAY_ANSWER_HEAD_TIMEOUT_S`` of its first byte, with a 504. The
  connection is closed, the refusal counted (``corral_gateway_answers_refused_total``),
  and the replica kept: it answered, and would answer the same to a second one.
* **Cookies**: a replica's ``Set-Cookie`` is scoped to its function: its ``Path`` goes
  under ``/function/NAME`` (none: ``/function/NAME``) and its ``Domain`` is dropped
  (:func:`workers.gateway.headers.scoped_cookie`), so a browser sends one function's
  cookies to that function only, though all share the gateway's origin.
* **Failures**: a replica that refuses connections for ``CONNECT_GRACE_S`` (a moment of
  refusal is a server still starting), or breaks the exchange before its response
  headers, is a :class:`ReplicaFailed` (the claim not handed back: the caller retires
  the replica); no complete answer within ``CORRAL_GATEWAY_TIMEOUT_S`` is a 504, an
  answer that is not HTTP a 502, and an answer that breaks after its status line went
  out is :class:`BrokenOff` (nothing more can be said to the caller). A connection the
  gateway cannot make for want of a file descriptor (EMFILE, ENFILE) is its own 503
  with ``Retry-After``: the claim goes back and the replica is not suspected.
* **Descriptors**: the connections to all replicas together stay within
  :attr:`Upstreams.sockets` (the gateway sets its cap to its connection cap, which its
  descriptor limit bounds: ``workers.gateway.app``); at the cap a new one first closes
  an idle one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import NoReturn
from urllib.parse import quote

from config.settings import Settings
from workers.gateway import http1
from workers.gateway.asgi import NO_DESCRIPTOR, RETRY_AFTER_S, Answer, Message, Scope, Send
from workers.gateway.headers import Trusted, request_head, response_headers
from workers.gateway.metrics import GatewayMetrics
from workers.replicas.claims import Claimed

log = logging.getLogger(__name__)

PREFIX = "/function/"
RAW_PREFIX = PREFIX.encode()
UPSTREAM_IDLE_S = 60.0  # a replica's pool unused this long (and no claim on it) is closed
CONNECT_GRACE_S = 2.0  # a refused connection is tried again this long before it counts
# ...every millisecond for the first 100 ms (a replica still starting is reached within a
# millisecond of listening: a cold start's first byte), then less and less often, at most
# every 10 ms; some 50 us of a refused connect each.
REFUSED_PAUSE_S = (0.001, 0.01)
REFUSED_FAST_S = 0.1
EXHAUSTED_LOG_S = 10.0  # descriptors exhausted: said in the log at most this often


class ReplicaFailed(Exception):
    """The replica could not be reached, or broke the exchange before answering."""


class BrokenOff(Exception):
    """The answer stopped after its status line was sent: nothing more can be said."""


def target_of(scope: Scope) -> bytes:
    """The request target for the replica: the raw path after ``/function/NAME``, and query."""
    raw = scope.get("raw_path") or quote(scope["path"]).encode("ascii")
    rest = raw[len(RAW_PREFIX) :].partition(b"/")[2]
    query = scope.get("query_string", b"")
    return b"/" + rest + (b"?" + query if query else b"")


_VISIBLE = bytes(range(0x21, 0x7F))


def _sendable(target: bytes) -> bool:
    """True when every byte of the target is a visible ASCII character."""
    return not target.translate(None, _VISIBLE)  # nothing left once they are taken out


class _Once:
    """Call ``fn`` the first time only (or never, once cancelled)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()

    def cancel(self) -> None:
        """Never call it."""
        self.fn = None


class CallerTooSlow(Exception):
    """The caller did not take a piece of its answer within the send timeout."""


class Relay:
    """An upstream answer streamed to the client one chunk behind.

    The last chunk is held back until :meth:`finish`, so the gateway has returned its
    claim first: the environment is free by the time the client sees the answer end.
    Each piece must be taken by the caller within ``timeout_s`` (:class:`CallerTooSlow`).
    """

    def __init__(
        self, send: Send, timeout_s: float, task: asyncio.Task[object] | None, function: str
    ) -> None:
        self._send = send
        self.function = function  # whose cookies the answer may set
        self.timeout_s = timeout_s
        self.answering = False  # the response has started: an error can only break it off
        self.last = b""
        self.sending_since = 0.0  # while a send waits for the caller: when it began
        self.too_slow = False
        self.expired = False  # no complete answer within the gateway's timeout
        self.task = task

    def expire(self) -> None:
        """The answer's time is up: cancel the request (the exchange says 504 or breaks off)."""
        if self.task is not None and not self.too_slow and not self.expired:
            self.expired = True
            self.task.cancel()

    async def send(self, message: Message) -> None:
        """Send one message; :meth:`Upstreams.watch` cuts off a caller that takes too long."""
        self.sending_since = time.monotonic()
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if not self.too_slow or self.task is None:
                raise
            self.task.uncancel()
            raise CallerTooSlow(
                f"the caller took no part of its answer for {self.timeout_s:g}s"
            ) from None
        finally:
            self.sending_since = 0.0

    def overdue(self, now: float) -> bool:
        """Cancel the request if its send has waited past the timeout; True if so."""
        if (
            self.sending_since
            and now - self.sending_since > self.timeout_s
            and self.task is not None
            and not self.too_slow
            and not self.expired
        ):
            self.too_slow = True
            self.task.cancel()
        return self.too_slow

    async def stream(self, exchange: http1.Exchange) -> None:
        """Relay every chunk but the last."""
        start = {
            "type": "http.response.start",
            "status": exchange.status,
            "headers": response_headers(exchange.headers, self.function),
        }
        while (chunk := await exchange.chunk()) is not None:
            if not chunk:
                continue
            if not self.answering:
                self.answering = True
                await self.send(start)
            if self.last:
                await self.send(
                    {"type": "http.response.body", "body": self.last, "more_body": True}
                )
            self.last = chunk
        if not self.answering:
            self.answering = True
            await self.send(start)

    async def finish(self) -> None:
        """Send the last chunk."""
        await self.send({"type": "http.response.body", "body": self.last, "more_body": False})


class Upstreams:
    """The connections to the replicas this gateway forwards to, and the forwarding itself."""

    def __init__(
        self, settings: Settings, token: bytes | None, metrics: GatewayMetrics | None = None
    ) -> None:
        self.settings = settings
        self._token = token
        self.trusted = Trusted(settings.gateway_trusted_proxies)
        self.metrics = metrics or GatewayMetrics()
        self.limits = http1.Limits(
            head_bytes=settings.gateway_answer_head_max,
            head_lines=settings.gateway_answer_head_lines,
            head_timeout_s=settings.gateway_answer_head_timeout_s,
            read_ahead=settings.gateway_read_ahead,
        )
        self.budget = http1.Budget(settings.gateway_read_ahead_budget)  # shared by all pools
        self.sockets = http1.Sockets()  # the connections of all pools, within a cap
        self._exhausted_at = -EXHAUSTED_LOG_S
        self.metrics.read_ahead.set_function(lambda: self.budget.held)
        self._pools: dict[str, http1.Pool] = {}
        self._relays: set[Relay] = set()  # answers being relayed now
        # The serving loop (set by the gateway when it starts, else on first use): asking
        # asyncio for it costs a getpid() system call on Python 3.11.
        self.loop: asyncio.AbstractEventLoop | None = None

    async def forward(
        self, scope: Scope, claimed: Claimed, body: bytes, send: Send, done: Callable[[], None]
    ) -> None:
        """Send the request to the claimed replica and stream its answer back.

        ``done`` is called once, when the environment may go back (the replica's answer
        is complete), or on any way out but :class:`ReplicaFailed` (then the claim is
        the caller's to retire). Raises :class:`ReplicaFailed`, :class:`Answer` 400 /
        502 / 504 or :class:`BrokenOff`.
        """
        once = _Once(done)
        try:
            pool = self._pool(claimed.address)
        except ValueError as exc:
            raise ReplicaFailed(str(exc)) from None
        target = target_of(scope)
        if not _sendable(target):
            once()
            raise Answer(400, "cannot forward this request: its path is not plain ASCII")
        head = request_head(
            scope, target, pool.netloc, body, token=self._token, trusted=self.trusted
        )
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        relay = Relay(
            send, self.settings.gateway_send_timeout_s, asyncio.current_task(loop), claimed.function
        )
        deadline = self.settings.gateway_timeout_s
        self._relays.add(relay)
        try:
            try:
                await self._exchange(
                    loop, pool, head, (body, scope["method"] == "HEAD"), relay, once
                )
            except (TimeoutError, http1.Broken) as exc:
                what = (
                    f"no complete answer within {deadline:g}s"
                    if isinstance(exc, TimeoutError)
                    else str(exc)
                )
                status = 504 if isinstance(exc, TimeoutError) else 502
                if isinstance(exc, http1.Rejected):
                    self.metrics.refused.labels(claimed.function, exc.reason).inc()
                    status = exc.status
                if relay.answering:
                    raise BrokenOff(
                        f"replica {claimed.replica_id} broke off its answer: {what}"
                    ) from None
                raise Answer(status, f"replica of {claimed.function}: {what}") from None
            finally:
                once()  # given back already if the whole answer had arrived
            await relay.finish()
        except CallerTooSlow as exc:
            raise BrokenOff(f"answer of {claimed.function} cut off: {exc}") from None
        finally:
            self._relays.discard(relay)

    async def watch(self) -> None:
        """Forever: cut off callers that take no part of their answer within the timeout."""
        every = min(1.0, self.settings.gateway_send_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for relay in [r for r in self._relays if r.overdue(now)]:
                self._relays.discard(relay)

    async def _exchange(  # noqa: PLR0913 - one exchange's parts
        self,
        loop: asyncio.AbstractEventLoop,
        pool: http1.Pool,
        head: bytes,
        request: tuple[bytes, bool],  # the body, and whether the method is HEAD
        relay: Relay,
        once: _Once,
    ) -> None:
        """Send, wait for the answer's head, relay its body; ``once`` when it is complete.

        Raises ``TimeoutError`` when the answer is not complete within the gateway's
        timeout (one timer that cancels the request: ``asyncio.timeout`` would ask for
        the loop and the task again, a system call each on Python 3.11).
        """
        exchange: http1.Exchange | None = None
        pool.users += 1
        timer = loop.call_later(self.settings.gateway_timeout_s, relay.expire)
        try:
            exchange = await self._send(pool, head, *request)
            try:
                await exchange.head()
            except http1.Rejected:
                raise  # an answer, refused: the replica is not suspect
            except http1.Broken as exc:
                raise ReplicaFailed(str(exc)) from None
            exchange.when_complete(once)
            await relay.stream(exchange)
        except ReplicaFailed:
            once.cancel()  # the caller retires the replica with the claim
            raise
        except asyncio.CancelledError:
            if not relay.expired or relay.task is None:
                raise
            relay.task.uncancel()
            raise TimeoutError from None
        finally:
            timer.cancel()
            pool.users -= 1
            if exchange is not None:
                exchange.abandon()  # closes a connection whose answer was not read through

    def _pool(self, address: str | None) -> http1.Pool:
        """The connections to one replica address (made on first use)."""
        if not address:
            raise ValueError("the replica has no address")
        pool = self._pools.get(address)
        if pool is None:
            timeout = self.settings.gateway_timeout_s
            pool = self._pools[address] = http1.Pool(
                address, min(timeout, 5.0), self.limits, self.budget, self.sockets
            )
        return pool

    async def _send(
        self, pool: http1.Pool, head: bytes, body: bytes, head_only: bool
    ) -> http1.Exchange:
        """Send, trying a refused connection again for up to ``CONNECT_GRACE_S``.

        A replica can be Idle a moment before its server listens (an agent that answers
        CreateReplica as soon as the process runs); only a replica that keeps refusing
        is a failed one.
        """
        began = time.monotonic()
        give_up = began + CONNECT_GRACE_S
        pause, most = REFUSED_PAUSE_S
        while True:
            try:
                return await pool.send(head, body, head_only=head_only)
            except http1.Exhausted as exc:
                self._exhausted(exc)
            except http1.Broken as exc:
                at = time.monotonic()
                if not exc.refused or at + pause > give_up:
                    raise ReplicaFailed(str(exc)) from None
            await asyncio.sleep(pause)
            if at - began > REFUSED_FAST_S:
                pause = min(pause * 2, most)

    def _exhausted(self, exc: http1.Exhausted) -> NoReturn:
        """No descriptor to connect with: the gateway's own 503 (said in the log now and then)."""
        now = time.monotonic()
        if now - self._exhausted_at >= EXHAUSTED_LOG_S:
            self._exhausted_at = now
            log.warning("gateway: %s (answering 503 meanwhile)", exc)
        raise Answer(503, NO_DESCRIPTOR, {"retry-after": str(RETRY_AFTER_S)})

    def sweep(self, wanted: set[str]) -> None:
        """Close idle connections past their time, and pools unused but those in ``wanted``."""
        idle_since = time.monotonic() - UPSTREAM_IDLE_S
        for address, pool in list(self._pools.items()):
            pool.sweep()
            if address not in wanted and not pool.users and pool.last_used < idle_since:
                del self._pools[address]
                pool.close()

    async def close(self) -> None:
        """Close every connection."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
