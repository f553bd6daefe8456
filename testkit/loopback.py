"""HTTP calls from tests to servers on loopback: httpx's own functions, one TLS context.

``httpx.get()`` builds a client for the call, and the client a TLS context that loads the
CA bundle: 16 ms of CPU each call, even for an ``http://`` URL. A test that polls a URL
spent most of its CPU on that, on a machine whose two cores the suite keeps busy (the
servers it waits on were the ones kept waiting). These are httpx's functions with one
context, made once, passed as ``verify``: each call is otherwise the same - a client of
its own, a new connection, no cookies kept from an earlier call.
"""

from __future__ import annotations

import functools

import httpx

_TLS = httpx.create_ssl_context()

#: ``httpx.request``, ``get``, ``post`` and ``delete``, without a TLS context of their own
#: (partials keep httpx's signatures, so the type checker sees every argument)
request = functools.partial(httpx.request, verify=_TLS)
get = functools.partial(httpx.get, verify=_TLS)
post = functools.partial(httpx.post, verify=_TLS)
delete = functools.partial(httpx.delete, verify=_TLS)
Client = functools.partial(httpx.Client, verify=_TLS)
AsyncClient = functools.partial(httpx.AsyncClient, verify=_TLS)
