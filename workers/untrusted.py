"""What corral accepts from the network: checks on agents' replies, and secrets kept out of text.

Node agents and Lambdo hosts are other people's servers; a broken or hostile one must
not be able to make corral store garbage, hang a worker, or fill its memory. So:

* a vmid must match ``[A-Za-z0-9._:-]{1,128}`` (:func:`check_vmid`) and is
  percent-encoded wherever it goes into a URL (:func:`vmid_path`);
* an agent's ``ip`` must parse as an IP address (:func:`check_ip`);
* a replica's address must be one its node may give out: inside the node's replica
  networks, and never one of the control plane's own listeners (registry, gateway,
  metrics exporter, Flower, broker, database) (:func:`check_replica_address`), or the
  gateway would forward callers wherever an agent pointed it;
* an HTTP reply body is read up to :data:`MAX_BODY` (1 MiB) and every HTTP call has
  a total deadline, not only a per-read one (:func:`bounded_request` over
  :class:`DeadlineTransport`: each socket read and write is clipped to what is left
  of the call's deadline, so a host that drips a byte a second times out too);
* text that came back from an agent has the call's secrets and credential-shaped strings
  masked before it is stored or logged (:func:`config.redact.redact`, the one redaction);
* a token or AWS keys about to travel in plain text off loopback log a warning
  (:func:`warn_plaintext`, once per peer).
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import logging
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpcore
import httpx

from agents.runtime import is_loopback
from config.redact import redact
from workers.errors import PermanentBackendError, TransientBackendError

__all__ = [
    "IP", "LOOPBACK", "MAX_BODY", "VMID_RE", "DeadlineTransport", "HttpCall", "Listeners",
    "Network", "abounded_request", "bounded_request", "check_ip", "check_replica_address",
    "check_vmid", "host_ips", "listen_networks", "parse_networks", "vmid_path",
    "warn_plaintext",
]

log = logging.getLogger(__name__)

VMID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_BODY = 1 << 20


def check_vmid(vmid: object, node: str | None = None) -> str:
    """``vmid`` if it is a well-formed VM id; PermanentBackendError otherwise."""
    if not vmid:
        raise PermanentBackendError("answered an empty vmid", node=node)
    if not isinstance(vmid, str) or not VMID_RE.fullmatch(vmid) or set(vmid) == {"."}:
        shown = repr(vmid)[:60]
        raise PermanentBackendError(
            f"answered a malformed vmid {shown} (expected [A-Za-z0-9._:-]{{1,128}})", node=node
        )
    return vmid


def vmid_path(vmid: str) -> str:
    """``vmid`` percent-encoded as one URL path segment."""
    return quote(vmid, safe="")


def check_ip(ip: object, node: str | None = None) -> str:
    """``ip`` as a canonical IP address string; PermanentBackendError if it is not one."""
    try:
        return str(ipaddress.ip_address(str(ip).strip("[]")))
    except ValueError:
        raise PermanentBackendError(
            f"answered {str(ip)[:60]!r} as its ip, which is not an IP address", node=node
        ) from None


# -- replica addresses ------------------------------------------------------------------

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IP = ipaddress.IPv4Address | ipaddress.IPv6Address
#: (network, port) pairs a replica may never be at
Listeners = frozenset[tuple[Network, int]]
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def parse_networks(cidrs: Iterable[str]) -> list[Network]:
    """CIDRs (``10.0.0.0/24``, a bare IP) as networks; ValueError naming a malformed one."""
    found = []
    for cidr in cidrs:
        try:
            found.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{cidr!r} is not a network (expected CIDR, e.g. 10.0.0.0/24)"
                             ) from None
    return found


def host_ips(host: str) -> set[IP]:
    """The IPs ``host`` stands for: itself if it is one, else what it resolves to (maybe none)."""
    host = host.strip().strip("[]")
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return set()
    return {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}


def _single(ip: IP) -> Network:
    return ipaddress.ip_network(ip)


def listen_networks(host: str) -> list[Network]:
    """Where a server bound to ``host`` can be reached: loopback for a loopback or wildcard
    bind (plus this machine's own addresses for a wildcard), else the host's IPs."""
    host = host.strip().strip("[]")
    if host in ("", "0.0.0.0", "::", "*"):  # noqa: S104 - recognised, not bound
        own = host_ips(socket.gethostname()) | host_ips("localhost")
        return [*LOOPBACK, *(_single(ip) for ip in own)]
    ips = host_ips(host)
    if any(ip.is_loopback for ip in ips):
        return list(LOOPBACK)
    return [_single(ip) for ip in ips]


def check_replica_address(
    host: str, port: int, networks: Iterable[Network], listeners: Listeners,
    node: str | None = None,
) -> None:
    """Refuse (PermanentBackendError ``untrusted``) a replica address its node may not give.

    Every IP ``host`` stands for must be inside one of ``networks``, and ``host:port``
    must not be one of ``listeners`` (the control plane's own servers).
    """
    ips = host_ips(host)
    networks = list(networks)
    where = f"{host}:{port}"
    if not ips:
        raise PermanentBackendError(f"answered replica address {where}, which does not resolve",
                                    node=node, code="untrusted")
    for ip in ips:
        if not any(ip.version == net.version and ip in net for net in networks):
            shown = ", ".join(str(n) for n in networks) or "none"
            raise PermanentBackendError(
                f"answered replica address {where}, outside the node's replica networks "
                f"({shown}; `corral nodes add --replica-network`)", node=node, code="untrusted")
        if any(port == lport and ip.version == net.version and ip in net
               for net, lport in listeners):
            raise PermanentBackendError(
                f"answered replica address {where}, one of corral's own listeners",
                node=node, code="untrusted")


# -- total deadlines for HTTP ----------------------------------------------------------

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


# -- plain text off loopback -----------------------------------------------------------

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_plaintext(host: str, what: str) -> None:
    """Warn once per (host, what) that ``what`` goes in plain text to a non-loopback ``host``."""
    if is_loopback(host):
        return
    with _warned_lock:
        if (host, what) in _warned:
            return
        _warned.add((host, what))
    log.warning("%s travel(s) in plain text to %s: use TLS or a private network", what, host)
