"""Host and port strings: the one parser every corral server, client and agent uses.

Addresses come in four shapes, and IPv6 makes each of them ambiguous to a naive
``rsplit(":")``:

* ``HOST:PORT`` and ``[V6]:PORT`` - a listen address, an fcdaemon node's address
  (:func:`split_hostport`, strict; :func:`join_hostport` writes them back, bracketing
  an IPv6 host);
* ``scheme://HOST:PORT/path`` - a Lambdo host, a replica, a broker URL;
* a bare host: a name, an IPv4 address, ``[V6]`` or an unbracketed IPv6 address.

:func:`host_of` takes any of them and returns the host alone, never in brackets, so
the host can be compared, resolved or checked (:func:`is_loopback`, :func:`is_wildcard`)
whichever shape it arrived in. A gRPC server names its caller as ``ipv4:1.2.3.4:5`` or
``ipv6:[::1]:5``; :func:`peer_ip` takes the IP out of that.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote

__all__ = [
    "WILDCARD_HOSTS",
    "host_of",
    "ip_literal",
    "is_loopback",
    "is_wildcard",
    "join_hostport",
    "peer_ip",
    "split_hostport",
]

#: Hosts that mean "every interface" when a server binds them (compared without brackets).
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})  # noqa: S104 - recognised, not bound


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


def ip_literal(host: str) -> str | None:
    """``host`` as a normal IP string (an IPv4-mapped IPv6 address as IPv4); None if no IP."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def peer_ip(peer: str) -> str | None:
    """The IP of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``); None if unknown."""
    family, _, rest = unquote(peer or "").partition(":")
    if family not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    return ip_literal(host_of(rest))
