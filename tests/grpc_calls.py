"""gRPC calls as an attacker makes them: headers sent, the request message never.

A unary call is headers, one message and a half-close. :func:`half_sent` opens calls
that send the headers (the method, the caller's metadata) and then nothing, as a
client-streaming call whose request iterator waits: what a server does with such a call
before its message arrives is what the caller can make it hold.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import grpc

Metadata = tuple[tuple[str, str], ...]


@contextlib.contextmanager
def half_sent(
    address: str, method: str, count: int, metadata: Metadata = ()
) -> Iterator[list[grpc.Future[Any]]]:
    """``count`` calls to ``method`` at ``address`` that never send their message.

    Yields their futures (a call the server answers is done); on exit every call is
    cancelled and its channel closed.
    """
    channel = grpc.insecure_channel(address)
    stream: grpc.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(
        method, request_serializer=bytes, response_deserializer=bytes
    )
    release = threading.Event()

    def silence() -> Iterator[bytes]:
        release.wait()  # never yields: the server gets the headers and nothing else
        yield from ()

    calls: list[grpc.Future[Any]] = [
        stream.future(silence(), metadata=metadata, timeout=120) for _ in range(count)
    ]
    try:
        yield calls
    finally:
        for call in calls:
            call.cancel()
        release.set()
        channel.close()


def code_of(call: grpc.Future[Any]) -> grpc.StatusCode | None:
    """The status a finished call got (None while it runs, OK if it succeeded, CANCELLED if
    its caller gave up)."""
    if not call.done():
        return None
    if call.cancelled():
        return grpc.StatusCode.CANCELLED
    error = call.exception()
    if error is None:
        return grpc.StatusCode.OK
    return error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
