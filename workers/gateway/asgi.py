"""The ASGI vocabulary the gateway speaks, and its own plain-text answers.

A request is an ASGI ``scope`` (method, raw path, query, headers, client), a
``receive`` channel (body pieces, then ``http.disconnect``) and a ``send`` channel
(``http.response.start``, then ``http.response.body`` pieces). :class:`Answer` is
how any step of a request stops it with a status of the gateway's own (404, 413,
429, 502, 503, 504): the request flow catches it and :func:`reply` sends it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

RETRY_AFTER_S = 5  # what a 503 tells its caller to wait


class Answer(Exception):
    """Stop handling a request and answer it with this status and message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


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
