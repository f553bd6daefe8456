"""Callbacks: a finished call's answer POSTed to its ``X-Callback-Url``, signed, never inward.

What is sent: the call's stored answer body, with its ``Content-Type`` and
``X-Call-Id``, ``X-Call-Status`` (succeeded or dead), ``X-Function-Status`` (the
answer's status code, when there is one), ``X-Call-Attempts``, and the signature:
``X-Corral-Timestamp`` (Unix seconds) and ``X-Corral-Signature: v1=<hex>``, the
HMAC-SHA256 under ``CORRAL_CALLBACK_KEY`` of ``"<timestamp>.<call id>." + body``
(:func:`sign`; a receiver checks it with :func:`verify`, and refuses old timestamps).
A delivery is retried with backoff on no answer, 429 and 5xx, up to
``CORRAL_CALLBACK_ATTEMPTS``; any other answer but 2xx fails it for good. Delivery is
at least once: a receiver deduplicates by ``X-Call-Id``.

Where it may go (no server-side request forgery):

1. **When the call is accepted** (:func:`check_url`): ``http`` or ``https``, no
   credentials in the URL, a key to sign with, and a host on the operator's allow-list
   (``CORRAL_CALLBACK_HOSTS``: names, ``*.domain`` for any name below it, IPs, CIDRs);
   an IP in the URL must be inside an allowed network. Anything else is refused then
   (400), and nothing is queued.
2. **When it is delivered** (:func:`destination`): the host is resolved once, and every
   address it resolves to is checked - never one of corral's own listeners (registry,
   gateway, metrics, Flower, broker, database: :func:`workers.backends.networks.control_plane`),
   never a node's address nor inside a node's replica networks, never unspecified or
   multicast; and a name (not an IP the allow-list names) never leads to loopback,
   link-local or reserved addresses. Then the connection is made to the address checked
   (the URL's host sent as ``Host`` and as TLS SNI, the certificate verified for it), so
   a name that resolves elsewhere a moment later changes nothing. Redirects are not
   followed; no proxy from the environment is used. A refused destination fails the
   callback at once (recorded on the call).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

import httpx
import redis
from sqlalchemy import select, update

from config.settings import Settings, parse_hosts, reveal
from netplumb.addresses import ip_of, join_hostport
from workers.backends.networks import control_plane, default_networks
from workers.base import clock
from workers.base.errors import InputError
from workers.base.untrusted import IP, parse_networks
from workers.invocations import stats
from workers.invocations.attempts import backoff_s
from workers.invocations.records import StoredAnswer
from workers.observability import tracing
from workers.store.db import Database
from workers.store.models import Call, Node

log = logging.getLogger(__name__)

URL_MAX = 2048
TOLERANCE_S = 300  # how old a signed timestamp a receiver should accept (verify's default)
TIMESTAMP = "x-corral-timestamp"
SIGNATURE = "x-corral-signature"


class CallbackRefused(InputError):
    """A callback URL corral will not send to."""


@dataclass(frozen=True)
class Url:
    """A callback URL checked against the allow-list: its parts."""

    scheme: str
    host: str  # a name (lower case) or an IP, without brackets
    port: int
    target: str  # path and query, as sent
    by_name: bool  # the host is a name (resolved when it is delivered)


def check_url(url: str, settings: Settings) -> Url:
    """The parts of an allowed callback URL; :class:`CallbackRefused` says why not."""
    if reveal(settings.callback_key) is None:
        raise CallbackRefused("callbacks are off here: CORRAL_CALLBACK_KEY is not set")
    if len(url) > URL_MAX or not url.isascii() or not url.isprintable() or " " in url:
        raise CallbackRefused(f"X-Callback-Url must be a URL of at most {URL_MAX} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise CallbackRefused("X-Callback-Url is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CallbackRefused("X-Callback-Url must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise CallbackRefused("X-Callback-Url may not carry credentials")
    host = parts.hostname.lower().rstrip(".")
    names, networks = parse_hosts(settings.callback_hosts)
    ip = ip_of(host)
    if ip is not None:
        allowed = any(ip.version == net.version and ip in net for net in networks)
    else:
        allowed = any(_name_matches(host, pattern) for pattern in names)
    if not allowed:
        raise CallbackRefused(
            f"callback host {host!r} is not allowed (CORRAL_CALLBACK_HOSTS lists the hosts "
            "callbacks may go to)"
        )
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    default = 443 if parts.scheme == "https" else 80
    return Url(parts.scheme, str(ip) if ip else host, port or default, target, ip is None)


def _name_matches(host: str, pattern: str) -> bool:
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def sign(key: str, timestamp: int, call_id: str, body: bytes) -> str:
    """The ``X-Corral-Signature`` of a callback: ``v1=`` and the HMAC-SHA256 in hex."""
    signed = f"{timestamp}.{call_id}.".encode() + body
    return "v1=" + hmac.new(key.encode(), signed, hashlib.sha256).hexdigest()


def verify(  # noqa: PLR0913 - what was received, the rest by name
    key: str,
    timestamp: str,
    signature: str,
    call_id: str,
    body: bytes,
    *,
    tolerance_s: float = TOLERANCE_S,
    at: float | None = None,
) -> bool:
    """Whether a callback's signature is ``key``'s and its timestamp within ``tolerance_s``."""
    if not timestamp.isdigit():
        return False
    at = clock.epoch() if at is None else at
    if abs(at - int(timestamp)) > tolerance_s:
        return False
    return hmac.compare_digest(sign(key, int(timestamp), call_id, body), signature)


# -- where it may go ------------------------------------------------------------------


def destination(db: Database, settings: Settings, url: Url) -> IP:
    """The one address to connect to for ``url``: resolved once, every address checked."""
    if url.by_name:
        try:
            infos = socket.getaddrinfo(url.host, url.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise CallbackRefused(f"callback host {url.host!r} does not resolve: {exc}") from None
        found = [_plain(str(info[4][0]).split("%", 1)[0]) for info in infos]
    else:
        found = [_plain(url.host)]
    if not found:
        raise CallbackRefused(f"callback host {url.host!r} has no address")
    _, allowed = parse_hosts(settings.callback_hosts)
    for ip in found:
        why = _refusal(db, settings, ip, url.port, named=url.by_name, allowed=allowed)
        if why is not None:
            raise CallbackRefused(f"callback to {url.host} ({ip}:{url.port}) refused: {why}")
    return found[0]


def _plain(text: str) -> IP:
    ip = ipaddress.ip_address(text)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return mapped or ip


def _refusal(  # noqa: PLR0913 - one address and what it is checked against
    db: Database,
    settings: Settings,
    ip: IP,
    port: int,
    *,
    named: bool,
    allowed: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...],
) -> str | None:
    """Why ``ip:port`` may not receive a callback (None: it may)."""
    if ip.is_unspecified or ip.is_multicast:
        return "not a unicast address"
    inward = ip.is_loopback or ip.is_link_local or ip.is_reserved
    if named and inward and not any(ip.version == n.version and ip in n for n in allowed):
        return "a name may not lead to a loopback, link-local or reserved address"
    for net, listen_port in control_plane(settings):
        if port == listen_port and ip.version == net.version and ip in net:
            return "one of corral's own listeners"
    shared = parse_networks(c for c in settings.replica_networks.split(",") if c.strip())
    if any(ip.version == net.version and ip in net for net in shared):
        return "inside the replicas' networks (CORRAL_REPLICA_NETWORKS)"
    with db.read() as s:
        nodes = s.execute(select(Node.name, Node.kind, Node.address, Node.replica_networks)).all()
    for name, kind, address, configured in nodes:
        nets = (
            parse_networks(configured) if configured else default_networks(kind, address, settings)
        )
        if ip_of(address) == ip or any(ip.version == n.version and ip in n for n in nets):
            return f"node {name}'s address or replica networks"
    return None


# -- delivery -------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """How one delivery went: the callback's state, and when to try again (``retry``)."""

    state: str  # delivered, failed, retry, skipped
    note: str = ""
    countdown: float = 0.0


@dataclass(frozen=True)
class _Snapshot:
    call_id: str
    url: str
    status: str
    attempts: int
    answer: StoredAnswer
    delivery: int
    trace: dict[str, str] | None


_clients: dict[int, httpx.Client] = {}
_clients_lock = threading.Lock()


def _client(settings: Settings) -> httpx.Client:
    """This process's HTTP client for callbacks (no proxy from the environment, no redirect)."""
    with _clients_lock:
        client = _clients.get(os.getpid())
        if client is None:
            client = _clients[os.getpid()] = httpx.Client(
                timeout=settings.callback_timeout_s, follow_redirects=False, trust_env=False
            )
        return client


def deliver(
    db: Database, settings: Settings, call_id: str, *, counters: redis.Redis | None = None
) -> Delivery:
    """Deliver a finished call's pending callback once; what became of it."""
    snap = _take(db, settings, call_id)
    if snap is None:
        return Delivery("skipped", "no callback pending")
    with tracing.span(
        "call.callback",
        kind="client",
        parent=tracing.context_of(snap.trace),
        attributes={"corral.call_id": call_id, "corral.callback_delivery": snap.delivery},
    ):
        status: int | None = None
        try:
            url = check_url(snap.url, settings)
            ip = destination(db, settings, url)
            status = _post(settings, url, ip, snap)
        except CallbackRefused as exc:
            outcome = Delivery("failed", str(exc))
        except httpx.HTTPError as exc:
            outcome = _again(settings, snap, f"no answer: {type(exc).__name__}: {exc}")
        else:
            outcome = _judged(settings, snap, status)
    _record(db, settings, snap, outcome, status)
    if counters is not None and outcome.state in ("delivered", "failed"):
        try:
            stats.count(counters, f"callback_{outcome.state}")
        except redis.RedisError as exc:
            log.warning("could not count a callback: %s", exc)
    return outcome


def _judged(settings: Settings, snap: _Snapshot, status: int) -> Delivery:
    """What a receiver's answer makes of a delivery: 2xx delivered, 429 and 5xx again."""
    if 200 <= status < 300:
        return Delivery("delivered")
    if status == 429 or status >= 500:
        return _again(settings, snap, f"the receiver answered {status}")
    return Delivery("failed", f"the receiver answered {status}")


def _take(db: Database, settings: Settings, call_id: str) -> _Snapshot | None:
    """Count one more delivery of a pending callback; what to send."""
    with db.transaction() as s:
        call = s.get(Call, call_id, with_for_update=True)
        if call is None or call.callback_state != "pending" or not call.callback_url:
            return None
        call.callback_attempts += 1
        resend = settings.callback_timeout_s + settings.calls_resend_s
        call.callback_at = clock.now() + timedelta(seconds=resend)
        return _Snapshot(
            call_id=call.id,
            url=call.callback_url,
            status=str(call.status),
            attempts=call.attempts,
            answer=StoredAnswer.of(call),
            delivery=call.callback_attempts,
            trace=call.trace,
        )


def _again(settings: Settings, snap: _Snapshot, why: str) -> Delivery:
    """Retry a delivery after a backoff, unless its attempts are spent."""
    if snap.delivery >= settings.callback_attempts:
        return Delivery("failed", f"gave up after {snap.delivery} deliveries: {why}")
    return Delivery("retry", why, countdown=backoff_s(settings, snap.delivery))


def _post(settings: Settings, url: Url, ip: IP, snap: _Snapshot) -> int:
    """POST the answer to ``ip`` (checked), as ``url``'s host; the receiver's status."""
    timestamp = int(clock.epoch())
    key = reveal(settings.callback_key) or ""
    content_type = next(
        (v for k, v in snap.answer.headers if k.lower() == "content-type"),
        "application/octet-stream",
    )
    netloc = url.host if url.port == (443 if url.scheme == "https" else 80) else None
    host_header = netloc or join_hostport(url.host, url.port)
    headers = {
        "host": host_header,
        "content-type": content_type,
        "x-call-id": snap.call_id,
        "x-call-status": snap.status,
        "x-call-attempts": str(snap.attempts),
        TIMESTAMP: str(timestamp),
        SIGNATURE: sign(key, timestamp, snap.call_id, snap.answer.body),
    }
    if snap.answer.status is not None:
        headers["x-function-status"] = str(snap.answer.status)
    extensions = {"sni_hostname": url.host} if url.scheme == "https" and url.by_name else {}
    address = f"{url.scheme}://{join_hostport(str(ip), url.port)}{url.target}"
    with _client(settings).stream(
        "POST", address, content=snap.answer.body, headers=headers, extensions=extensions
    ) as answer:
        return answer.status_code  # its body is not read


def _record(
    db: Database, settings: Settings, snap: _Snapshot, outcome: Delivery, status: int | None
) -> None:
    """Write how this delivery went, unless a later delivery of the callback began meanwhile."""
    state = "pending" if outcome.state == "retry" else outcome.state
    at = clock.now()
    next_at = (
        at + timedelta(seconds=outcome.countdown + settings.calls_resend_s)
        if outcome.state == "retry"
        else None
    )
    with db.transaction() as s:
        s.execute(
            update(Call)
            .where(
                Call.id == snap.call_id,
                Call.callback_state == "pending",
                Call.callback_attempts == snap.delivery,
            )
            .values(
                callback_state=state,
                callback_status=status,
                callback_error=outcome.note or None,
                callback_at=next_at,
            )
        )
