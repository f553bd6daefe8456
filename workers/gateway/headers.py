"""Header rules for forwarding, as nginx and Envoy apply them by default.

Toward the replica (:func:`request_head` builds the whole request head, one write):

* **Hop-by-hop headers** (RFC 9110 7.6.1: ``Connection``, ``Keep-Alive``, ``TE``,
  ``Trailer``, ``Transfer-Encoding``, ``Upgrade``, ``Proxy-*``) and every header
  *named in* ``Connection:`` belong to the caller's connection to the gateway and are
  not forwarded; nor are ``Host`` (the replica's own), ``Content-Length`` (set from the
  body the gateway forwards), ``Expect`` (the gateway has the body already) and, when
  the gateway has a token, ``Authorization`` (the gateway's token stays with it).
* **X-Forwarded-For / -Proto / -Host** are set by the gateway: the peer's address,
  the scheme it was reached by, the ``Host`` the caller asked for. The incoming ones,
  and ``Forwarded`` and ``X-Real-IP``, are believed only from a peer in
  ``CORRAL_GATEWAY_TRUSTED_PROXIES`` (CIDRs; none by default, loopback included): from
  such a proxy, ``X-Forwarded-For`` is kept with the peer appended, ``-Proto`` and
  ``-Host`` are kept, ``Forwarded`` and ``X-Real-IP`` pass; from anyone else those
  five are replaced or dropped.
* Everything else goes as sent, in order: no header is added (a caller that sent no
  ``Accept-Encoding`` gets no compressed answer it did not ask for).
* The request target is the caller's **raw** path after ``/function/NAME``, byte for
  byte, and its query: ``%2F`` and ``%3F`` reach the replica as sent.

Toward the caller (:func:`response_headers`): the replica's headers but hop-by-hop
ones and those named in its ``Connection:``; each ``Set-Cookie`` scoped to the function
(:func:`scoped_cookie`). Every function shares the gateway's origin, so a cookie a
replica sets with ``Path=/`` would otherwise go to every other function on it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from config.settings import parse_networks

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
PREFIX = b"/function/"  # where the gateway serves each function (workers.gateway.upstream)
FROM_PROXIES = frozenset(
    {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"forwarded", b"x-real-ip"}
)


class Trusted:
    """The proxies whose forwarding headers the gateway believes."""

    def __init__(self, networks: str) -> None:
        self.networks = parse_networks(networks)
        self._seen: dict[str, bool] = {}

    def __contains__(self, peer: str) -> bool:
        known = self._seen.get(peer)
        if known is None:
            try:
                address = ipaddress.ip_address(peer)
            except ValueError:
                known = False  # a unix socket, or no address at all
            else:
                known = any(address in net for net in self.networks)
            if len(self._seen) < 4096:
                self._seen[peer] = known
        return known


def connection_named(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """The header names listed in ``Connection:`` headers (lower case)."""
    named: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            named.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return named


def request_head(  # noqa: PLR0913 - one request's parts, the rest by name
    scope: Any,
    target: bytes,
    netloc: bytes,
    body: bytes,
    *,
    token: bytes | None,
    trusted: Trusted,
) -> bytes:
    """The request line and headers to send the replica (the body goes after them)."""
    peer = scope.get("client")
    peer_host = str(peer[0]) if peer else ""
    from_proxy = bool(peer_host) and peer_host in trusted
    raw: list[tuple[bytes, bytes]] = scope["headers"]
    named = connection_named(raw)
    lines = [scope["method"].encode("ascii"), b" ", target, b" HTTP/1.1\r\nhost: ", netloc, b"\r\n"]
    dropped: dict[bytes, bytes] = {}  # the first value of each header not passed on as is
    forwarded_for: list[bytes] = []
    for key, value in raw:
        k = key.lower()
        if k == b"x-forwarded-for" and from_proxy:
            forwarded_for.append(value)
        elif (
            k in NOT_FORWARDED
            or k in named
            or (k in FROM_PROXIES and not from_proxy)
            or k in (b"x-forwarded-proto", b"x-forwarded-host")
            or (k == b"authorization" and token is not None)
        ):  # the token stays here
            dropped.setdefault(k, value)
        else:
            lines += [key, b": ", value, b"\r\n"]
    if peer_host:
        forwarded_for.append(peer_host.encode("ascii", "replace"))
    if forwarded_for:
        lines += [b"x-forwarded-for: ", b", ".join(forwarded_for), b"\r\n"]
    believed = dropped if from_proxy else {}
    proto = believed.get(b"x-forwarded-proto") or str(scope.get("scheme", "http")).encode()
    lines += [b"x-forwarded-proto: ", proto, b"\r\n"]
    host = believed.get(b"x-forwarded-host") or dropped.get(b"host")
    if host:
        lines += [b"x-forwarded-host: ", host, b"\r\n"]
    if body or b"content-length" in dropped or b"transfer-encoding" in dropped:
        lines += [b"content-length: ", str(len(body)).encode(), b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)


def response_headers(raw: list[tuple[bytes, bytes]], function: str) -> list[tuple[bytes, bytes]]:
    """The replica's headers to send the caller: all but hop-by-hop and Connection-named,
    cookies scoped to ``function``."""
    named = connection_named(raw)
    dropped = HOP_BY_HOP | named if named else HOP_BY_HOP
    kept = []
    for key, value in raw:
        lower = key.lower()
        if lower in dropped:
            continue
        kept.append((key, scoped_cookie(value, function) if lower == b"set-cookie" else value))
    return kept


def scoped_cookie(value: bytes, function: str) -> bytes:
    """A ``Set-Cookie`` value with its ``Path`` under ``/function/NAME`` and no ``Domain``.

    ``Path=/x`` becomes ``Path=/function/NAME/x``; none (or one not starting with ``/``)
    ``Path=/function/NAME``, which a browser matches for ``/function/NAME`` and below,
    never for another function (RFC 6265 5.1.4). A ``Domain`` would widen the cookie to
    other hosts: dropped. The rest (name, value, other attributes) is kept as sent.
    """
    pair, *attributes = value.split(b";")
    prefix = PREFIX + function.encode("ascii")
    path = prefix
    kept = [pair]
    for attribute in attributes:
        name, _, given = attribute.partition(b"=")
        name = name.strip().lower()
        if name == b"path":
            given = given.strip()
            if given.startswith(b"/") and given != b"/":
                path = prefix + given
        elif name != b"domain":
            kept.append(attribute)
    kept.append(b" Path=" + path)
    return b";".join(kept)
