"""Node identity: which caller may register a node, refresh it, or move it elsewhere.

Whoever holds the registry token may call ``RegisterNode`` (agents do; so could a guest
that got hold of it). A node's address decides where corral sends the agent token and
functions' AWS keys, so registering is not enough to *be* a node. The rules:

* **The peer, not the claim.** The ``ip`` a caller claims must be an IP address - never
  a host name, which could resolve to the caller today and to another machine tomorrow
  - and the one its gRPC connection comes from (:func:`check_claim`). The node's
  address is that IP from then on; nothing about it is ever resolved.
* **A credential.** An agent that knows corral's extension sends ``credential`` (empty
  on its first registration); the registry then issues the node a random credential
  (:func:`issue`; only its SHA-256 is stored) that every later registration of that
  node must present. A seed agent sends no credential field and never gets one: its
  node is pinned to the host it registered from, and only a caller from that host
  may refresh it.
* **A healthy node is never re-pointed.** A registration that would change a node's
  address is refused while the node is healthy, whoever asks. Once its old address
  has failed its health checks, its own agent (the credential, or for a node without
  one a caller from its host) may move it; each such move is logged as a WARNING and
  recorded on the node (``corral nodes list`` shows it).
* **Recovery.** An agent that lost its credential (a restart) is let back in from
  the node's own host once the node is unhealthy, and gets a new credential.

:func:`admit` applies these to one registration and says what to do; the registry
service turns a refusal into PERMISSION_DENIED (identity not shown) or
FAILED_PRECONDITION (the node is healthy).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
from dataclasses import dataclass

from netplumb.addresses import ip_of
from workers.base.errors import CorralError, InputError
from workers.store.models import Node

log = logging.getLogger(__name__)


class NotThatNode(CorralError):
    """The caller has not shown it is the node it names (answered PERMISSION_DENIED)."""


class NotAnIp(InputError):
    """The claimed ``ip`` is a host name (answered INVALID_ARGUMENT)."""


class StillHealthy(CorralError):
    """The node is healthy at another address; it is not re-pointed (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class Caller:
    """Who is registering: the gRPC peer's IP (None: unknown) and the credential it sent.

    ``credential`` is None when the request has no credential field (a seed agent),
    ``""`` when the agent asks for one, else the credential it was issued.
    """

    peer: str | None
    credential: str | None


@dataclass(frozen=True)
class Admission:
    """What a registration may do: move the node (from where), and issue a credential."""

    repoint_from: str | None
    issue: bool


def digest(credential: str) -> str:
    """The stored form of a credential (SHA-256, hex)."""
    return hashlib.sha256(credential.encode()).hexdigest()


def issue() -> tuple[str, str]:
    """A new credential and its digest."""
    credential = secrets.token_urlsafe(32)
    return credential, digest(credential)


def check_claim(ip: str, peer: str | None) -> str:
    """The claimed ``ip`` in canonical form; refused if it is not an IP address, or not the
    address the caller calls from."""
    try:
        literal = ip_of(str(ipaddress.ip_address(ip.strip("[]"))))  # an IP, nothing more
    except ValueError:
        raise NotAnIp(
            f"RegisterNode's ip must be an IP address, got {ip[:64]!r}: a node is known by "
            "the IP it calls from (the agent's --advertise-ip), never by a name that could "
            "later stand for another machine (behind NAT: docs/operations.md)"
        ) from None
    if peer is not None and ip_of(peer) != literal:  # None: a Unix socket, no peer IP
        raise NotThatNode(f"RegisterNode claims ip {ip[:64]!r} but calls from {peer}")
    return str(literal)


def _from_host(node: Node, peer: str | None) -> bool:
    """Whether ``peer`` is the IP of ``node``'s address (a host name matches no peer)."""
    here = ip_of(node.address)
    return peer is not None and here is not None and ip_of(peer) == here


def admit(node: Node, address: str, caller: Caller) -> Admission:
    """Whether ``caller`` may register ``node`` at ``address``; raises if it may not."""
    has = node.credential_hash is not None
    shown = bool(
        has
        and caller.credential
        and hmac.compare_digest(digest(caller.credential), str(node.credential_hash))
    )
    if has and caller.credential and not shown:
        raise NotThatNode(f"wrong credential for node {node.external_id!r}")
    from_host = _from_host(node, caller.peer)
    moves = node.address != address
    recovering = has and not shown and from_host and not node.healthy
    if has and not (shown or recovering or (from_host and not moves)):
        raise NotThatNode(
            f"node {node.external_id!r} has a credential; present it (an agent that lost it "
            "is let back in from the node's host once the node is unhealthy)"
        )
    if not has and not from_host:
        raise NotThatNode(
            f"node {node.external_id!r} registered from {node.address} without a credential: "
            "only its own host may refresh it"
        )
    if moves and node.healthy:
        raise StillHealthy(
            f"node {node.external_id!r} is registered at another address and is healthy; "
            "it is not re-pointed until that address fails its health checks"
        )
    # a credential goes to an agent that asks: for a node without one, and on recovery
    issue_one = caller.credential is not None and not shown and (not has or recovering)
    return Admission(repoint_from=node.address if moves else None, issue=issue_one)
