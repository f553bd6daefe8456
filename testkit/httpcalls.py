"""One-off HTTP calls of the tests (``httpx.get`` and the like), without a CA bundle read per call.

``httpx.get(url)`` makes a client for the one call, and the client a TLS context: it
reads and parses every CA certificate of the machine (``SSL_CERT_FILE``, or certifi's
bundle) even for ``http://`` - some 20 ms of CPU each time. The tests call corral's
listeners that way thousands of times, most of them in loops that wait for a condition.
These functions (and :func:`client`, for a test's own client) are httpx's, given one
TLS context made once per process (the same default verification) unless the call names
its own ``verify``; each call still has a client, and so a connection, of its own, as
before.
"""

from __future__ import annotations

import functools
import ssl
from contextlib import AbstractContextManager
from typing import Any

import httpx


@functools.cache
def _tls() -> ssl.SSLContext:
    """The default verifying TLS context httpx would make, made once."""
    return ssl.create_default_context()


def request(method: str, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
    """``httpx.request``."""
    kwargs.setdefault("verify", _tls())
    return httpx.request(method, url, **kwargs)


def get(url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
    """``httpx.get``."""
    return request("GET", url, **kwargs)


def post(url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
    """``httpx.post``."""
    return request("POST", url, **kwargs)


def delete(url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
    """``httpx.delete``."""
    return request("DELETE", url, **kwargs)


def client(**kwargs: Any) -> httpx.Client:
    """``httpx.Client``: for a test's many calls on its own connections."""
    kwargs.setdefault("verify", _tls())
    return httpx.Client(**kwargs)


def stream(
    method: str, url: str | httpx.URL, **kwargs: Any
) -> AbstractContextManager[httpx.Response]:
    """``httpx.stream``."""
    kwargs.setdefault("verify", _tls())
    return httpx.stream(method, url, **kwargs)


__all__ = ["client", "delete", "get", "post", "request", "stream"]
