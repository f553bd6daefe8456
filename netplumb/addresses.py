"""Host and port strings: the one parser every corral server, client and agent uses.

Addresses come in four shapes, and IPv6 makes each of them ambiguous to a naive
``rsplit(":")``:

* ``HOST:PORT`` and ``[V6]:PORT`` - a listen address (:func:`split_hostport`, which
  takes any host text; :func:`join_hostport` writes them back, bracketing an IPv6 host);
* ``HOST[:PORT]`` typed by an operator - an fcdaemon node, a GPU server, an AvA manager
  (:func:`parse_hostport`: the host must be a name, an IPv4 address or a bracketed IPv6
  address, the port 1-65535 or the caller's default);
* ``scheme://HOST[:PORT]/path`` - a Lambdo host, a replica, a broker or database URL
  (:func:`parse_url`: the scheme one of the caller's, the port its default if omitted);
* a bare host: a name, an IPv4 address, ``[V6]`` or an unbracketed IPv6 address.

The checking parsers raise :class:`ValueError` with a message that names what was being
parsed and the shape expected (``invalid agent address 'x y': expected HOST:PORT``);
callers in the control plane re-raise it as their own input error, unchanged.

:func:`host_of` takes any of them and returns the host alone, never in brackets, so
the host can be compared, resolved or checked (:func:`is_loopback`, :func:`is_wildcard`)
whichever shape it arrived in. A gRPC server names its caller as ``ipv4:1.2.3.4:5`` or
``ipv6:[::1]:5``; :func:`peer_ip` takes the IP out of that.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

__all__ = [
    "HTTP_PORTS",
    "IP",
    "MAX_PORT",
    "WILDCARD_HOSTS",
    "UrlAddress",
    "host_of",
    "ip_literal",
    "ip_of",
    "is_loopback",
    "is_wildcard",
    "join_hostport",
    "parse_hostport",
    "parse_url",
    "peer_ip",
    "split_hostport",
]

#: Hosts that mean "every interface" when a server binds them (compared without brackets).
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})  # noqa: S104 - recognised, not bound
#: An IP address, either version.
IP = ipaddress.IPv4Address | ipaddress.IPv6Address
#: HTTP's schemes and their default ports.
HTTP_PORTS = {"http": 80, "https": 443}
#: The highest TCP port.
MAX_PORT = 65535
#: A host name (or an IPv4 address, which is written alike).
_NAME = r"[A-Za-z0-9._\-]{1,253}"
_NAME_RE = re.compile(_NAME)
#: ``HOST[:PORT]``: a name or IPv4 address, or an IPv6 address in brackets; a port of digits.
_HOSTPORT_RE = re.compile(
    rf"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>{_NAME}))(?::(?P<port>\d{{1,5}}))?"
)


class UrlAddress(NamedTuple):
    """Where a URL points: its scheme (without a ``+driver``), host (no brackets) and port."""

    scheme: str
    host: str
    port: int

    @property
    def hostport(self) -> str:
        """``host:port``, an IPv6 host in brackets."""
        return join_hostport(self.host, self.port)


def host_of(address: str) -> str:
    """The host of ``address`` (``host``, ``host:port``, ``[v6]:port``, bare v6, or a URL)."""
    rest = address.strip()
    if "://" in rest:
        rest = rest.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    if rest.count(":") == 1:  # host:port (two or more colons: an unbracketed IPv6 address)
        return rest.split(":", 1)[0]
    return rest


def split_hostport(address: str) -> tuple[str, int]:
    """``HOST:PORT`` / ``[v6]:PORT`` as (host without brackets, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def parse_hostport(
    address: str, default_port: int | None = None, what: str = "address"
) -> tuple[str, int]:
    """``HOST[:PORT]`` checked, as (host without brackets, port); ValueError naming ``what``."""
    text = address.strip() if isinstance(address, str) else ""
    m = _HOSTPORT_RE.fullmatch(text)
    port = int(m["port"]) if m and m["port"] else default_port
    valid = m is not None and port is not None and 0 < port <= MAX_PORT
    if m and m["v6"] is not None and not _is_ip(m["v6"], 6):
        valid = False
    if not valid or m is None or port is None:
        shape = "HOST:PORT" if default_port is None else "HOST[:PORT]"
        if text.count(":") > 1 and not text.startswith("["):
            shape += " (an IPv6 host in brackets: [::1]:50051)"
        raise ValueError(f"invalid {what} {address!r}: expected {shape}")
    return m["v6"] if m["v6"] is not None else m["name"], port


def parse_url(
    url: str, default_ports: Mapping[str, int], what: str = "URL", *, bare: bool = False
) -> UrlAddress:
    """``scheme://HOST[:PORT]...`` checked, the port the scheme's default if omitted; with
    ``bare`` nothing may follow but ``/``. ValueError naming ``what`` and the schemes."""
    schemes = "|".join(default_ports)
    problem = ValueError(f"invalid {what} {url!r}: expected {schemes}://HOST[:PORT]")
    text = url.strip() if isinstance(url, str) else ""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise problem from None
    scheme = parts.scheme.lower().split("+", 1)[0]
    host = parts.hostname or ""
    if (
        "://" not in text
        or scheme not in default_ports
        or port == 0
        or not (_NAME_RE.fullmatch(host) or _is_ip(host))
        or (bare and (parts.path not in ("", "/") or parts.query or parts.fragment))
        or (bare and "@" in parts.netloc)
    ):
        raise problem
    return UrlAddress(scheme, host, port or default_ports[scheme])


def _is_ip(text: str, version: int | None = None) -> bool:
    """Whether ``text`` is an IP address and nothing more (of ``version`` if given)."""
    try:
        return version in (None, ipaddress.ip_address(text).version)
    except ValueError:
        return False


def join_hostport(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (``[::1]:8080``)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IPs (``127.0.0.0/8``, ``::1``); wildcards are not."""
    host = host_of(host)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """True for a host that binds every interface (``0.0.0.0``, ``::``, ``[::]``, ``*``, empty)."""
    return host.strip().strip("[]") in WILDCARD_HOSTS


def ip_of(address: str) -> IP | None:
    """The IP an address's host is written as (any shape :func:`host_of` takes); None for a
    name, never looked up. An IPv4-mapped IPv6 address is its IPv4 address."""
    try:
        ip = ipaddress.ip_address(host_of(address))
    except ValueError:
        return None
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return mapped or ip


def ip_literal(host: str) -> str | None:
    """``host`` as a normal IP string (:func:`ip_of` written out); None if no IP."""
    ip = ip_of(host)
    return None if ip is None else str(ip)


def peer_ip(peer: str) -> str | None:
    """The IP of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``); None if unknown."""
    family, _, rest = unquote(peer or "").partition(":")
    if family not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    return ip_literal(host_of(rest))
