"""What corral accepts from the network: checks on agents' replies, and secrets kept out of text.

Node agents and Lambdo hosts are other people's servers; a broken or hostile one must
not be able to make corral store garbage, hang a worker, or fill its memory. So:

* a vmid must match ``[A-Za-z0-9._:-]{1,128}`` (:func:`check_vmid`) and is
  percent-encoded wherever it goes into a URL (:func:`vmid_path`);
* an agent's ``ip`` must parse as an IP address (:func:`check_ip`), and so must the host
  of a node's address: corral never resolves a node's name or a replica's, since a
  name could later stand for another machine (:func:`~netplumb.addresses.ip_of`, no look-up);
* a replica's address must be one its node may give out: an IP inside the node's
  replica networks, and never one of the control plane's own listeners (registry,
  gateway, metrics exporter, Flower, broker, database) (:func:`check_replica_address`),
  or the gateway would forward callers wherever an agent pointed it;
* an HTTP reply body is read up to :data:`MAX_BODY` (1 MiB) and every HTTP call has
  a total deadline, not only a per-read one (:mod:`workers.backends.http_calls`, which the
  HTTP clients use; this module imports no HTTP library, so what only checks an id or
  an address - ``corral nodes list`` among them - does not load httpx);
* text that came back from an agent has the call's secrets and credential-shaped strings
  masked, and its control characters escaped (an ANSI or OSC sequence is shown, never
  played on an operator's terminal), before it is stored or logged
  (:func:`config.redact.redact`, the one pass such text goes through);
* a token or AWS keys about to travel in plain text off loopback log a warning
  (:func:`warn_plaintext`, once per peer).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading
from collections.abc import Iterable
from urllib.parse import quote

from netplumb.addresses import IP, host_of, ip_of, is_loopback, is_wildcard, join_hostport
from workers.base.errors import PermanentBackendError

__all__ = [
    "IP",
    "LOOPBACK",
    "MAX_BODY",
    "VMID_RE",
    "Listeners",
    "Network",
    "check_ip",
    "check_replica_address",
    "check_vmid",
    "host_ips",
    "listen_networks",
    "parse_networks",
    "vmid_path",
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
            raise ValueError(
                f"{cidr!r} is not a network (expected CIDR, e.g. 10.0.0.0/24)"
            ) from None
    return found


def host_ips(host: str) -> set[IP]:
    """The IPs ``host`` stands for: itself if it is one, else what it resolves to (maybe none).

    For corral's own listeners only (its settings); a node's or a replica's address is
    never resolved (:func:`~netplumb.addresses.ip_of`).
    """
    host = host_of(host)
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
    if is_wildcard(host):
        own = host_ips(socket.gethostname()) | host_ips("localhost")
        return [*LOOPBACK, *(_single(ip) for ip in own)]
    ips = host_ips(host)
    if any(ip.is_loopback for ip in ips):
        return list(LOOPBACK)
    return [_single(ip) for ip in ips]


def check_replica_address(
    host: str,
    port: int,
    networks: Iterable[Network],
    listeners: Listeners,
    node: str | None = None,
) -> None:
    """Refuse (PermanentBackendError ``untrusted``) a replica address its node may not give.

    ``host`` must be an IP (a name is never resolved) inside one of ``networks``, and
    ``host:port`` must not be one of ``listeners`` (the control plane's own servers).
    """
    ip = ip_of(host)
    networks = list(networks)
    where = join_hostport(host, port)
    if ip is None:
        raise PermanentBackendError(
            f"answered replica address {where[:80]!r}, which is not an IP address",
            node=node,
            code="untrusted",
        )
    if not any(ip.version == net.version and ip in net for net in networks):
        shown = ", ".join(str(n) for n in networks) or "none"
        raise PermanentBackendError(
            f"answered replica address {where}, outside the node's replica networks "
            f"({shown}; `corral nodes add --replica-network`)",
            node=node,
            code="untrusted",
        )
    if any(port == lport and ip.version == net.version and ip in net for net, lport in listeners):
        raise PermanentBackendError(
            f"answered replica address {where}, one of corral's own listeners",
            node=node,
            code="untrusted",
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
