"""What a gRPC caller may hold before and after it is known: the guard of corral's gRPC servers.

The model
---------
A call arrives as headers (its metadata: the bearer token), then its request message,
then the client's half-close. A server that takes a thread for a call when the headers
arrive gives that thread to anyone who sends headers and never a message: 32 such calls
held every thread of an agent or of the registry, before any token was checked. So the
guard works on the server's event loop (:class:`grpc.aio.ServerInterceptor`, run when
the headers arrive) and a call reaches a thread only once its message is in hand:

* **the credential, from the headers alone.** The bearer token (compared in constant
  time) makes a caller *trusted*; a guest's report token (the registry's ``report``
  rule) makes it a *reporter*; a caller without either may only ask the open services
  (``grpc.health.v1``: *anonymous*); anything else is answered UNAUTHENTICATED at once,
  its message never waited for nor read. A server without a token trusts every caller;
* **calls in flight, per kind of caller** (:class:`Limits`): trusted callers per peer
  IP; reporters per report token (one guest) and all together, a few, so guests cannot
  take the threads agents need; anonymous callers per peer IP and all together. A call
  past its cap is answered RESOURCE_EXHAUSTED at once (corral's clients retry it). A call
  holds its place until its handler's thread is done with it, so a caller that gives up
  on a slow call cannot start another in its place;
* **a deadline for the request message** (``message_timeout_s``): a call whose message
  has not arrived by then is answered DEADLINE_EXCEEDED and forgotten;
* then the handler: a synchronous one (the servicers corral has) runs on the server's
  thread pool with a :class:`ThreadContext` (``abort`` raises; the guard sends the
  status), an ``async`` one (the health service) on the loop, never on the pool;
* **never begun past its deadline**: a call whose client's deadline passed before a
  thread took it (a server behind its work) is answered DEADLINE_EXCEEDED and its
  handler never runs. Its client has given up and may already have sent the next call
  in its place: corral's node slots lapse 2 s after a call's deadline, and a create begun
  later than that would be one more than the node's bound (cis635: 5 creates at once
  on an agent bound to 4, in a process starved for seconds).

:class:`~netplumb.grpcserve.GuardedServer` runs a server with this guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import grpc.aio

from netplumb.addresses import peer_ip

__all__ = [
    "OPEN_SERVICES",
    "CallAborted",
    "Guard",
    "Limits",
    "NotBegun",
    "ThreadContext",
    "bearer_of",
]

log = logging.getLogger("netplumb.grpcguard")

#: Services any caller may ask, token or not (a health check needs no secret).
OPEN_SERVICES = ("/grpc.health.v1.Health/",)

#: The loop's view of a call (requests and replies of any message type).
Context = grpc.aio.ServicerContext[Any, Any]

#: Seconds between two warnings about refused calls of one reason.
WARN_EVERY_S = 60.0


@dataclass(frozen=True)
class Limits:
    """What callers may hold on one server, and how long a call may take to send its message."""

    message_timeout_s: float = 10.0
    """A call whose request message has not arrived this long after its headers: refused."""
    calls_per_peer: int = 128
    """Calls in flight from one peer IP with the token (running or waiting for a thread)."""
    report_calls: int = 8
    """Calls in flight from all callers with a report token (guests), together."""
    report_calls_per_token: int = 2
    """Calls in flight with one report token (one guest)."""
    open_calls: int = 32
    """Calls in flight to the open services (health) from callers without the token, together."""
    open_calls_per_peer: int = 8
    """...of those, from one peer IP."""


def bearer_of(metadata: Any) -> str:
    """The bearer value of a call's ``authorization`` metadata ("" if none)."""
    sent = str(dict(metadata or ()).get("authorization", ""))
    scheme, _, value = sent.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


class CallAborted(Exception):
    """Raised by :meth:`ThreadContext.abort`: the guard ends the call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code = code
        self.details = details


class NotBegun(CallAborted):
    """A call whose deadline passed before a thread took it: its handler never ran."""


def _begin(behavior: Callable[[Any, Any], Any], request: Any, context: ThreadContext) -> Any:
    """Run a synchronous handler on a pool thread, unless its caller's deadline has passed."""
    if not context.is_active():
        raise NotBegun(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "the call's deadline passed before the server began it: nothing was done",
        )
    return behavior(request, context)


class ThreadContext:
    """The servicer context a synchronous handler gets on the pool.

    The part of :class:`grpc.ServicerContext` corral's servicers use: ``abort`` raises
    :class:`CallAborted` and the guard sends the status from the loop; the metadata and
    the peer were read there when the call began.
    """

    def __init__(self, metadata: tuple[Any, ...], peer: str, deadline: float | None) -> None:
        """The call's metadata, its peer and its deadline (``time.monotonic``; None: none)."""
        self._metadata = metadata
        self._peer = peer
        self._deadline = deadline

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """End the call with ``code`` and ``details`` (raises)."""
        raise CallAborted(code, details)

    def invocation_metadata(self) -> tuple[Any, ...]:
        """The call's metadata."""
        return self._metadata

    def peer(self) -> str:
        """The caller, as gRPC names it (``ipv4:1.2.3.4:5``)."""
        return self._peer

    def time_remaining(self) -> float | None:
        """Seconds left before the client's deadline (None: it set none)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        """True while the client's deadline has not passed."""
        return self._deadline is None or time.monotonic() < self._deadline


@dataclass(frozen=True)
class _Caller:
    """Who a call is from, as far as its caps go: the counters it takes and their caps."""

    caps: tuple[tuple[tuple[str, ...], int], ...]


class Guard(grpc.aio.ServerInterceptor):
    """The credential check, caps on calls in flight and the message deadline (module doc)."""

    def __init__(
        self,
        token: str | None,
        pool: futures.Executor,
        *,
        what: str = "agent",
        report: Callable[[str], str | None] | None = None,
        limits: Limits = Limits(),
    ) -> None:
        """Expect ``authorization: Bearer <token>`` (a refusal names the ``what`` token).

        ``report(bearer)`` names the VM a guest's report token speaks for (None: it is
        not one); such callers are let through with the reporters' caps, and the servicer
        limits what they may do. Synchronous handlers run on ``pool``.
        """
        self._expected = f"Bearer {token}".encode() if token else None
        self._report = report
        self._pool = pool
        self.limits = limits
        self._refusal = f"missing or invalid {what} token"
        #: Calls in flight by counter (on the loop only: no lock).
        self.held: Counter[tuple[str, ...]] = Counter()
        self._refused: Counter[str] = Counter()
        self._warned_at: dict[str, float] = {}

    # -- who is calling ----------------------------------------------------------------

    def _classify(self, method: str, metadata: Sequence[Any]) -> str | None:
        """The caller's kind: trusted, ``report:<bearer>``, open, or None (refused now)."""
        if self._expected is None:
            return "trusted"
        sent = str(dict(metadata).get("authorization", ""))
        if hmac.compare_digest(sent.encode(), self._expected):
            return "trusted"
        if self._report is not None:
            bearer = bearer_of(metadata)
            if self._report(bearer) is not None:
                return "report:" + bearer
        if method.startswith(OPEN_SERVICES):
            return "open"
        return None

    def _caller(self, kind: str, peer: str) -> _Caller:
        limits = self.limits
        if kind == "trusted":
            return _Caller(((("trusted", peer), limits.calls_per_peer),))
        if kind == "open":
            return _Caller(
                (
                    (("open",), limits.open_calls),
                    (("open", peer), limits.open_calls_per_peer),
                )
            )
        return _Caller(
            (
                (("report",), limits.report_calls),
                (("report", kind), limits.report_calls_per_token),
            )
        )

    def _take(self, caller: _Caller) -> bool:
        if any(self.held[key] >= cap for key, cap in caller.caps):
            return False
        for key, _ in caller.caps:
            self.held[key] += 1
        return True

    def _give_back(self, caller: _Caller) -> None:
        for key, _ in caller.caps:
            self.held[key] -= 1
            if self.held[key] <= 0:
                del self.held[key]

    def _note_refusal(self, reason: str, peer: str) -> None:
        """Count a refusal; a WARNING at most every :data:`WARN_EVERY_S` per reason."""
        self._refused[reason] += 1
        now = time.monotonic()
        if now - self._warned_at.get(reason, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned_at[reason] = now
            log.warning(
                "refused %d gRPC call(s) since the last warning: %s (latest from %s)",
                self._refused.pop(reason),
                reason,
                peer,
            )

    # -- the interceptor ---------------------------------------------------------------

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        """Refuse a call without a credential now; guard the handler of any other."""
        method = str(handler_call_details.method)
        kind = self._classify(method, handler_call_details.invocation_metadata or ())
        if kind is None:
            return grpc.stream_unary_rpc_method_handler(self._deny)
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # unknown method (UNIMPLEMENTED); corral serves no client streams
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self._guarded(kind, handler.unary_stream, streaming=True),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_unary_rpc_method_handler(
            self._guarded(kind, handler.unary_unary, streaming=False),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def _deny(self, requests: AsyncIterator[Any], context: Context) -> Any:
        """Answer UNAUTHENTICATED without reading the call's message."""
        self._note_refusal(self._refusal, context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refusal)

    def _guarded(self, kind: str, behavior: Any, *, streaming: bool) -> Any:
        """``behavior`` (a unary-request handler) behind the caps and the message deadline."""

        async def call(requests: AsyncIterator[Any], context: Context) -> Any:
            peer = context.peer()
            caller = self._caller(kind, peer_ip(peer) or peer)
            if not self._take(caller):
                reason = f"too many calls in flight ({kind.split(':', 1)[0]} callers)"
                self._note_refusal(reason, peer)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            handed = False  # once the pool has the work, its end gives the place back
            try:
                request = await self._message(requests, context)
                if streaming:
                    return await self._stream(behavior, request, context)
                if inspect.iscoroutinefunction(behavior):
                    return await behavior(request, context)
                handed = True
                return await self._on_pool(behavior, request, context, caller)
            finally:
                if not handed:
                    self._give_back(caller)

        return call

    async def _message(self, requests: AsyncIterator[Any], context: Context) -> Any:
        """The call's one request message, if it arrives within the deadline."""
        timeout = self.limits.message_timeout_s
        try:
            return await asyncio.wait_for(anext(requests), timeout)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no request message within {timeout:g} s"
            )
        except StopAsyncIteration:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "a unary call needs one request message"
            )

    async def _stream(self, behavior: Any, request: Any, context: Context) -> None:
        """A server-streaming handler on the loop (the health service's Watch)."""
        if inspect.isasyncgenfunction(behavior):
            async for reply in behavior(request, context):
                await context.write(reply)
        elif inspect.iscoroutinefunction(behavior):
            await behavior(request, context)  # writes with context.write itself
        else:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no synchronous streams here")

    async def _on_pool(self, behavior: Any, request: Any, context: Context, caller: _Caller) -> Any:
        """Run a synchronous handler on the pool; its caller's place is held until it ends."""
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        metadata = tuple(context.invocation_metadata() or ())
        sync_context = ThreadContext(metadata, context.peer(), deadline)
        try:
            work = self._pool.submit(_begin, behavior, request, sync_context)
        except RuntimeError:  # the pool is shut down: the server is stopping
            self._give_back(caller)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping")

        def done(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to give back
                loop.call_soon_threadsafe(self._give_back, caller)

        # a client that gives up does not stop the thread: the place is held until it ends
        work.add_done_callback(done)
        try:
            return await asyncio.wrap_future(work)
        except CallAborted as aborted:
            if isinstance(aborted, NotBegun):
                self._note_refusal("deadline passed before the call was begun", context.peer())
            await context.abort(aborted.code, aborted.details)
