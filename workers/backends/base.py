"""What every kind of node offers corral: the :class:`NodeBackend` interface, and the plain
data its calls take and give.

The model
---------
A *backend* is the code that speaks one kind of node's protocol (kombu's transports are
the model): :mod:`workers.backends.fcdaemon` speaks gRPC to node agents,
:mod:`workers.backends.lambdo` HTTP to Lambdo hosts. Each is one class behind this
interface, registered under its :class:`~workers.base.kinds.NodeKind` in one table
(:data:`BACKENDS`, loaded on first use by :func:`backend`), and callers reach them only through
:mod:`workers.backends`, which picks the backend by the node's kind: nothing else looks
at ``node.kind``.

A backend answers three kinds of question:

* **facts** about its nodes (class attributes): whether a create can carry a request id
  the node deduplicates, whether the node runs CPU hogs, whether its VMs live on a network
  of their node's (``CORRAL_REPLICA_NETWORKS``);
* **checks** on what users give (synchronous, no I/O): a node's address in canonical form,
  whether a function has what a replica on such a node needs;
* **calls** to a node (coroutines on the process's event loop,
  :mod:`workers.backends.inflight`): create, release, list, probe, hogs. Each has a
  deadline and raises :mod:`workers.base.errors` types; each backend has one async client.

Calls take a :class:`Target` (a node row as plain data, safe to hand to the loop's
thread) and answer with plain data: :class:`Created`, :class:`ListedVm`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from config import lazy
from config.settings import Settings
from workers.base.errors import InputError
from workers.base.kinds import NODE_KINDS, NodeKind
from workers.store.models import Function, Node

__all__ = [
    "BACKENDS",
    "VM_STARTS",
    "CreateCall",
    "Created",
    "ListedVm",
    "NodeBackend",
    "Target",
    "Vm",
    "backend",
    "guest_port",
    "target",
]

DEFAULT_GUEST_PORT = 8080


#: How a node may say its VM started (``CreateReply.start``): a cold boot, or a restore
#: from a snapshot. Anything else a node sends is dropped (nodes are not trusted).
VM_STARTS = ("boot", "restore")


@dataclass(frozen=True)
class Vm:
    """A VM as corral records it: the agent's id and where the function answers (and how
    it started, where its node says: one of :data:`VM_STARTS`, else "")."""

    vmid: str
    address: str
    start: str = ""


@dataclass(frozen=True)
class Created:
    """What a node answered to a create: the VM's id, and the host and port that reach its
    guest port as the node says (port 0: the guest port itself)."""

    vmid: str
    host: str
    port: int
    start: str = ""  # one of VM_STARTS, or "" (the node does not say)


@dataclass(frozen=True)
class ListedVm:
    """A VM a node says it runs: its id, the request id it was made for ("" where the node
    does not keep one: Lambdo hosts) and when it started (Unix seconds)."""

    vmid: str
    request_id: str
    created_unix: float


@dataclass(frozen=True)
class Target:
    """A node as a call needs it: plain data, safe to hand to the event loop's thread."""

    id: str
    name: str
    kind: NodeKind
    address: str


def target(node: Node) -> Target:
    """The call target of a node row."""
    return Target(node.id, node.name, NodeKind(node.kind), node.address)


@dataclass(frozen=True)
class CreateCall:
    """One create, ready to send: where, the protocol's request, and the guest port."""

    target: Target
    request: Any  # what the target's backend made of the function (create_request)
    guest_port: int


def guest_port(fn: Function) -> int:
    """The guest port clients reach the function on."""
    return int(fn.ports[0]) if fn.ports else DEFAULT_GUEST_PORT


class NodeBackend(Protocol):
    """How corral speaks to one kind of node (one implementation per :class:`NodeKind`)."""

    kind: ClassVar[NodeKind]
    #: A create carries corral's request id, which a node that can list its VMs
    #: deduplicates (so a create whose outcome is unknown may be sent again).
    keyed_creates: ClassVar[bool]
    #: Its nodes start and stop CPU-hog processes (:meth:`hogs`).
    runs_hogs: ClassVar[bool]
    #: Its VMs live on a network of their node's: ``CORRAL_REPLICA_NETWORKS`` is part
    #: of where their replicas may be (:mod:`workers.backends.networks`).
    on_node_network: ClassVar[bool]

    def normalize_address(self, address: str) -> str:
        """``address`` in canonical form; :class:`~workers.base.errors.InputError` if malformed."""

    def image_of_rootfs(self, rootfs: str | None) -> str:
        """The image a function deployed without one gets from its rootfs ("" if none)."""

    def check_function(self, values: Mapping[str, Any]) -> None:
        """Refuse (InputError) a function's columns that could never run on such a node."""

    def create_request(self, fn: Function, request_id: str, settings: Settings) -> Any:
        """The protocol's request for one replica of ``fn``."""

    async def create(self, call: CreateCall, settings: Settings) -> Created:
        """Send one create; the VM's id and where the node says it answers."""

    async def release(self, t: Target, vmid: str, settings: Settings) -> bool:
        """Tear one VM down; False when the node says it was already gone."""

    async def list_vms(self, t: Target, settings: Settings) -> list[ListedVm]:
        """The VMs the node runs; :class:`~workers.base.errors.Unsupported` if it cannot say."""

    async def probe(self, t: Target, settings: Settings) -> bool:
        """Whether the node answers its health probe (raises BackendError when unreachable)."""

    async def hogs(self, t: Target, action: str, n: int, settings: Settings) -> None:
        """Start (``action`` "start") or stop up to ``n`` CPU-hog processes on the node."""


#: Each kind of node's backend, as ``module:class`` (imported on first use).
BACKENDS: dict[NodeKind, str] = {
    NodeKind.FCDAEMON: "workers.backends.fcdaemon:FcdaemonBackend",
    NodeKind.LAMBDO: "workers.backends.lambdo:LambdoBackend",
}


@functools.cache
def _load(kind: NodeKind) -> NodeBackend:
    """The backend of ``kind``, imported now."""
    made: NodeBackend = lazy.attribute(BACKENDS[kind])()
    return made


def backend(kind: str) -> NodeBackend:
    """The backend of nodes of ``kind``; :class:`InputError` naming the kinds if unknown."""
    try:
        return _load(NodeKind(kind))
    except ValueError:
        raise InputError(
            f"unknown node kind {kind!r}; use one of {', '.join(NODE_KINDS)}"
        ) from None
