"""HTTP calls to backends with a total deadline and a bounded body.

A Lambdo host (or any HTTP backend) is someone else's server: it must not hang a
worker nor fill its memory (:mod:`workers.base.untrusted` says what else is checked). So
every call has a total deadline, not only a per-read one, and its body is read up to
``max_body`` (:data:`workers.base.untrusted.MAX_BODY`, 1 MiB, by default):
:func:`abounded_request` runs the whole call, body included, under ``asyncio.timeout``
on an ``httpx.AsyncClient``, so a host that drips a byte a second times out too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx

from config.redact import redact
from workers.base.errors import PermanentBackendError, TransientBackendError
from workers.base.untrusted import MAX_BODY


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

    def stream(self, client: httpx.AsyncClient, **kwargs: Any) -> Any:
        """The streamed request on ``client`` (identity encoding: the body read is the body)."""
        headers = {**kwargs.pop("headers", {}), "Accept-Encoding": "identity"}
        return client.stream(
            self.method,
            self.url,
            timeout=httpx.Timeout(self.timeout_s),
            headers=headers,
            **kwargs,
        )

    def grow(self, body: bytearray, chunk: bytes) -> None:
        """Add ``chunk`` to ``body``; :class:`PermanentBackendError` past ``max_body``."""
        body += chunk
        if len(body) > self.max_body:
            raise PermanentBackendError(
                f"{self.what} answered more than {self.max_body} bytes",
                node=self.node,
                code="too-large",
            )

    def failed(self, exc: httpx.HTTPError) -> TransientBackendError:
        """The error a timeout or transport failure of this call raises."""
        # A connection never made carried nothing to the node; anything later may have.
        unsent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
        if isinstance(exc, httpx.TimeoutException):
            return TransientBackendError(
                f"{self.what} timed out after {self.timeout_s:g}s",
                node=self.node,
                code="timeout",
                nothing_done=unsent,
            )
        return TransientBackendError(
            f"{self.what} failed: {type(exc).__name__}: {redact(str(exc), self.secrets)}",
            node=self.node,
            code="transport",
            nothing_done=unsent,
        )


async def abounded_request(
    client: httpx.AsyncClient, call: HttpCall, **kwargs: Any
) -> httpx.Response:
    """One HTTP call that ends within ``call.timeout_s`` in total, its body read up to
    ``call.max_body``.

    Timeouts and transport trouble raise :class:`TransientBackendError`, a bigger body
    :class:`PermanentBackendError`.
    """
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
        headers=[
            (k, v)
            for k, v in response.headers.raw
            if k.lower() not in (b"content-encoding", b"transfer-encoding")
        ],
        content=bytes(body),
        request=response.request,
    )
