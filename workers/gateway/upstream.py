"""The upstream side: one client per replica, the forwarded request, the answer relayed.

:meth:`Upstreams.forward` sends one request to a claimed replica and streams its answer
back to the caller, one chunk behind (the status line with the first chunk): the
environment is handed back (``done``) *before* the last chunk is sent, so a caller that
sees its answer complete can be sure the environment is free again for its next request.

* **Clients**: one ``httpx.AsyncClient`` per replica address (httpcore's pool scans all
  of its connections on every request, so small pools cost less than one big one),
  closed once unused for ``UPSTREAM_IDLE_S`` with no claim held on its replica. No
  client keeps cookies: a replica's cookies are its callers', never the gateway's.
* **Header rules**: hop-by-hop headers are not forwarded either way; the gateway's own
  token stays with it; ``X-Forwarded-For`` / ``-Host`` / ``-Proto`` are set by it.
* **Failures**: a replica that refuses connections for ``CONNECT_GRACE_S`` (a moment of
  refusal is a server still starting), or breaks the exchange before its response
  headers, is a :class:`ReplicaFailed` (the claim not handed back: the caller retires
  the replica); no complete answer within ``CORRAL_GATEWAY_TIMEOUT_S`` is a 504, any
  other HTTP error a 502, and an answer that breaks after its status line went out is
  :class:`BrokenOff` (nothing more can be said to the caller).
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from config.settings import Settings
from workers.gateway.asgi import Answer, Message, Scope, Send
from workers.replicas.claims import Claimed

PREFIX = "/function/"
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
UPSTREAM_IDLE_S = 60.0  # a replica's client unused this long (and no claim on it) is closed
CONNECT_GRACE_S = 2.0  # a refused connection is tried again this long before it counts


class ReplicaFailed(Exception):
    """The replica could not be reached, or broke the exchange before answering."""


class BrokenOff(Exception):
    """The answer stopped after its status line was sent: nothing more can be said."""


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


class Relay:
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


class Upstreams:
    """The clients of the replicas this gateway forwards to, and the forwarding itself."""

    def __init__(self, settings: Settings, token: bytes | None) -> None:
        self.settings = settings
        self._token = token
        self._clients: dict[str, Upstream] = {}
        self._tls: ssl.SSLContext | None = None

    async def forward(self, scope: Scope, claimed: Claimed, body: bytes, send: Send,
                      done: Callable[[], None]) -> None:
        """Send the request to the claimed replica and stream its answer back.

        ``done`` is called once the environment may go back (before the last chunk),
        or on any way out but :class:`ReplicaFailed` (then the claim is the caller's to
        retire). Raises :class:`ReplicaFailed`, :class:`Answer` 400 / 502 / 504 or
        :class:`BrokenOff`.
        """
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
            done()
            raise Answer(400, f"cannot forward this request: {exc}") from None
        deadline = self.settings.gateway_timeout_s
        relay = Relay(send)
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
            done()  # before the last chunk: free when the client sees it
            await relay.finish()
        finally:
            upstream.users -= 1
            if holding:
                done()

    def _upstream(self, address: str) -> Upstream:
        """The client for one replica address (made on first use)."""
        upstream = self._clients.get(address)
        if upstream is None:
            timeout = self.settings.gateway_timeout_s
            if self._tls is None:  # one for all clients (making one costs a millisecond)
                self._tls = httpx.create_ssl_context()
            upstream = self._clients[address] = Upstream(httpx.AsyncClient(
                timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                follow_redirects=False, trust_env=False, verify=self._tls, cookies=NoCookies(),
            ))
        upstream.last_used = time.monotonic()
        return upstream

    def sweep(self, wanted: set[str]) -> list[Any]:
        """Close the clients of replicas unused for a while, but those in ``wanted``."""
        idle_since = time.monotonic() - UPSTREAM_IDLE_S
        closing = []
        for address, upstream in list(self._clients.items()):
            if address not in wanted and not upstream.users and upstream.last_used < idle_since:
                del self._clients[address]
                closing.append(upstream.client.aclose())
        return closing

    async def close(self) -> None:
        """Close every client."""
        clients, self._clients = list(self._clients.values()), {}
        for upstream in clients:
            await upstream.client.aclose()

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
