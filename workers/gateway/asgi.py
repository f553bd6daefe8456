"""The ASGI vocabulary the gateway speaks, and its own plain-text answers.

A request is an ASGI ``scope`` (method, raw path, query, headers, client), a
``receive`` channel (body pieces, then ``http.disconnect``) and a ``send`` channel
(``http.response.start``, then ``http.response.body`` pieces). :class:`Answer` is
how any step of a request stops it with a status of the gateway's own (404, 413,
429, 502, 503, 504): the request flow catches it and :func:`reply` sends it.

A 503 says whose trouble it is. A store call that failed is the store's
(:func:`store_unavailable`) unless the gateway itself had no file descriptor free at the
time: a PostgreSQL connect or an SQLite file the driver could not open names no errno,
so the process is asked (:func:`netplumb.descriptors.none_free`), and the answer is then
the same as when a replica could not be connected to for want of one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from netplumb import descriptors

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

RETRY_AFTER_S = 5  # what a 503 tells its caller to wait
NO_DESCRIPTOR = "the gateway has no file descriptor free: try again"

log = logging.getLogger(__name__)


class Answer(Exception):
    """Stop handling a request and answer it with this status and message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def store_unavailable(error: str, *, transient: bool) -> Answer | None:
    """The 503 of a store call that failed with ``error``; None for an error of the request's own.

    With no descriptor free the answer is the gateway's own, whatever the error (SQLite's
    file it could not open is not ``transient``); otherwise a ``transient`` error is the
    store's, and any other is the caller's to raise.
    """
    retry = {"retry-after": str(RETRY_AFTER_S)}
    if descriptors.none_free():
        log.warning("gateway: no file descriptor free to reach the store: %s", error)
        return Answer(503, NO_DESCRIPTOR, retry)
    if not transient:
        return None
    log.warning("gateway: the store is unavailable: %s", error)
    return Answer(503, "the store is unavailable", retry)


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (``name`` in lower case), or None."""
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def has_body(scope: Scope) -> bool:
    """True when the request announces a body (a length over 0, or chunks)."""
    length = header(scope, b"content-length")
    if length is not None:
        return length.strip() not in ("", "0")
    return header(scope, b"transfer-encoding") is not None


async def reply(
    send: Send, status: int, message: str, headers: dict[str, str] | None = None
) -> None:
    """Answer with a one-line plain-text body."""
    body = (message + "\n").encode()
    raw = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
