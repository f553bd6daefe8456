"""HTTP calls to backends with a total deadline and a bounded body.

A Lambdo host (or any HTTP backend) is someone else's server: it must not hang a
worker nor fill its memory (:mod:`workers.untrusted` says what else is checked). So
every call has a total deadline, not only a per-read one, and its body is read up to
``max_body`` (:data:`workers.untrusted.MAX_BODY`, 1 MiB, by default):
:func:`bounded_request` over a :class:`DeadlineTransport` clips each socket read and
write to what is left of the call's deadline, so a host that drips a byte a second
times out too; :func:`abounded_request` does the same on an ``httpx.AsyncClient``
under ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx

from config.redact import redact
from workers.errors import PermanentBackendError, TransientBackendError
from workers.untrusted import MAX_BODY

__all__ = ["DeadlineTransport", "HttpCall", "abounded_request", "bounded_request"]


_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "corral_http_deadline", default=None
)


def _clip(timeout: float | None, exc: type[Exception]) -> float | None:
    deadline = _deadline.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise exc("the call's total deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    """A socket stream whose every read and write ends by the call's deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _clip(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _clip(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(
            ssl_context, server_hostname, _clip(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    """The default network backend, with streams clipped to the call's deadline."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_tcp(
            host, port, _clip(timeout, httpcore.ConnectTimeout), local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None
                            ) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_unix_socket(
            path, _clip(timeout, httpcore.ConnectTimeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class DeadlineTransport(httpx.HTTPTransport):
    """An httpx transport on which :func:`bounded_request` calls end by their deadline."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pool._network_backend = _Backend()


@contextmanager
def _deadline_of(seconds: float) -> Iterator[float]:
    at = time.monotonic() + seconds
    token = _deadline.set(at)
    try:
        yield at
    finally:
        _deadline.reset(token)


@dataclass(frozen=True)
class HttpCall:
    """One HTTP call to a backend: what it asks, how it is named in errors, and its bounds."""

    method: str
    url: str
    timeout_s: float  # the whole call, body included
    what: str  # names the call in errors ("spawn", "destroy")
    node: str | None = None
    max_body: int = MAX_BODY
    #: what this call sends that must never come back in an error (its token)
    secrets: tuple[str, ...] = field(default=(), repr=False)

    def stream(self, client: httpx.Client | httpx.AsyncClient, **kwargs: Any) -> Any:
        """The streamed request on ``client`` (identity encoding: the body read is the body)."""
        headers = {**kwargs.pop("headers", {}), "Accept-Encoding": "identity"}
        return client.stream(
            self.method, self.url, timeout=httpx.Timeout(self.timeout_s), headers=headers,
            **kwargs,
        )

    def grow(self, body: bytearray, chunk: bytes) -> None:
        """Add ``chunk`` to ``body``; :class:`PermanentBackendError` past ``max_body``."""
        body += chunk
        if len(body) > self.max_body:
            raise PermanentBackendError(
                f"{self.what} answered more than {self.max_body} bytes",
                node=self.node, code="too-large",
            )

    def failed(self, exc: httpx.HTTPError) -> TransientBackendError:
        """The error a timeout or transport failure of this call raises."""
        # A connection never made carried nothing to the node; anything later may have.
        unsent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
        if isinstance(exc, httpx.TimeoutException):
            return TransientBackendError(
                f"{self.what} timed out after {self.timeout_s:g}s", node=self.node,
                code="timeout", nothing_done=unsent)
        return TransientBackendError(
            f"{self.what} failed: {type(exc).__name__}: {redact(str(exc), self.secrets)}",
            node=self.node, code="transport", nothing_done=unsent,
        )


def bounded_request(client: httpx.Client, call: HttpCall, **kwargs: Any) -> httpx.Response:
    """One HTTP call that ends within ``call.timeout_s`` in total, its body read up to
    ``call.max_body``.

    Timeouts and transport trouble raise :class:`TransientBackendError`, a bigger body
    :class:`PermanentBackendError`. The client should use a :class:`DeadlineTransport`
    (elsewhere only the per-read timeout holds).
    """
    try:
        with _deadline_of(call.timeout_s) as deadline, call.stream(client, **kwargs) as response:
            body = bytearray()
            for chunk in response.iter_raw():
                call.grow(body, chunk)
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the call's total deadline passed")
            return _buffered(response, body)
    except httpx.HTTPError as exc:
        raise call.failed(exc) from None


async def abounded_request(
    client: httpx.AsyncClient, call: HttpCall, **kwargs: Any
) -> httpx.Response:
    """:func:`bounded_request` on an ``httpx.AsyncClient`` (the deadline: ``asyncio.timeout``)."""
    try:
        async with asyncio.timeout(call.timeout_s), call.stream(client, **kwargs) as response:
            body = bytearray()
            async for chunk in response.aiter_raw():
                call.grow(body, chunk)
            return _buffered(response, body)
    except TimeoutError:
        raise call.failed(httpx.ReadTimeout("total deadline")) from None
    except httpx.HTTPError as exc:
        raise call.failed(exc) from None


def _buffered(response: httpx.Response, body: bytearray) -> httpx.Response:
    """The streamed ``response`` as a plain one holding ``body``."""
    return httpx.Response(
        response.status_code,
        headers=[(k, v) for k, v in response.headers.raw
                 if k.lower() not in (b"content-encoding", b"transfer-encoding")],
        content=bytes(body),
        request=response.request,
    )
