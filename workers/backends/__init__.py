"""One interface over the kinds of node: fcdaemon agents (gRPC) and Lambdo hosts (HTTP).

Each kind of node has one backend (:class:`~workers.backends.base.NodeBackend`), named in
one table, :data:`BACKENDS`, by its :class:`~workers.base.kinds.NodeKind` and loaded on first
use (kombu's transport aliases are the model); :func:`backend` picks it. Callers never
look at ``node.kind`` themselves: they call the functions here, or ask the node's
backend a fact (``backend(node.kind).runs_hogs``).

:func:`create_call` turns a function row into the request its node's protocol needs,
as plain data (:class:`CreateCall`) that can cross to the process's event loop;
:func:`send_create` sends it and returns the VM id and the address the function is
reached at, the one place a reply's address is checked
(:mod:`workers.backends.networks`); :func:`send_release` tears a VM down (False when it
was already gone). Both run on :mod:`workers.backends.inflight`'s loop, their callers
holding one of the node's call slots (leased fleet-wide:
:mod:`workers.backends.node_slots`), so the per-node and per-process bounds hold for
every create and release; :func:`arelease` takes the slot itself. :func:`release_vm`,
:func:`list_vms`, :func:`probe` and :func:`hogs` are for synchronous code: each runs
its call on that loop and waits.

Importing this package loads no client and no Redis: the backends are imported when
first picked, so what only reads or checks nodes stays light.
"""

from __future__ import annotations

from config.settings import Settings
from workers.backends import inflight
from workers.backends.base import (
    BACKENDS,
    CreateCall,
    ListedVm,
    NodeBackend,
    Target,
    Vm,
    backend,
    guest_port,
    target,
)
from workers.backends.networks import replica_address
from workers.store.models import Function, Node

__all__ = [
    "BACKENDS",
    "CreateCall",
    "ListedVm",
    "NodeBackend",
    "Target",
    "Vm",
    "arelease",
    "backend",
    "create_call",
    "guest_port",
    "hogs",
    "list_vms",
    "probe",
    "release_vm",
    "send_create",
    "send_release",
    "target",
]


def create_call(node: Node, fn: Function, request_id: str, settings: Settings) -> CreateCall:
    """What to send ``node`` for one replica of ``fn``."""
    request = backend(node.kind).create_request(fn, request_id, settings)
    return CreateCall(target(node), request, guest_port(fn))


async def send_create(call: CreateCall, settings: Settings) -> Vm:
    """Send one create (the caller holds the node's call slot); may raise BackendError."""
    t = call.target
    created = await backend(t.kind).create(call, settings)
    # the one place a reply becomes a Vm: its address checked (workers.backends.networks)
    address = await replica_address(t, created.host, created.port or call.guest_port, settings)
    return Vm(created.vmid, address, created.start)


async def send_release(t: Target, vmid: str, settings: Settings) -> bool:
    """Send one release (the caller holds the node's call slot); False: already gone."""
    return await backend(t.kind).release(t, vmid, settings)


async def arelease(t: Target, vmid: str, settings: Settings) -> bool:
    """Tear one VM down, inside one of its node's call slots; False: already gone."""
    # Redis, loaded on first use: what only reads nodes (``corral nodes list``) imports
    # this package, never a client nor the slot source.
    from workers.backends import node_slots

    async with inflight.slot(
        t.id, settings.node_max_inflight, settings.max_inflight, node_slots.source(settings)
    ):
        return await send_release(t, vmid, settings)


def release_vm(node: Node, vmid: str, settings: Settings) -> bool:
    """Tear a VM down (from synchronous code); False when the node says it was already gone."""
    return inflight.run(arelease(target(node), vmid, settings))


def list_vms(node: Node, settings: Settings) -> list[ListedVm]:
    """The VMs ``node`` runs; raises :class:`workers.base.errors.Unsupported` if it cannot say."""
    t = target(node)
    return inflight.run(backend(t.kind).list_vms(t, settings))


def probe(node: Node, settings: Settings) -> bool:
    """Whether the node answers its health probe."""
    t = target(node)
    return inflight.run(backend(t.kind).probe(t, settings))


def hogs(node: Node, action: str, n: int, settings: Settings) -> None:
    """Start (``action`` "start") or stop up to ``n`` CPU-hog processes on ``node``."""
    t = target(node)
    inflight.run(backend(t.kind).hogs(t, action, n, settings))
