"""One interface over the two kinds of node: fcdaemon agents (gRPC) and Lambdo hosts (HTTP).

:func:`create_call` turns a function row into the request its node's protocol
needs, as plain data (:class:`CreateCall`) that can cross to the process's event
loop; :func:`acreate` sends it and returns the VM id and the address the function
is reached at; :func:`arelease` tears a VM down (False when it was already gone).
Both run on :mod:`workers.backends.inflight`'s loop, each inside one of the node's call
slots (leased fleet-wide: :mod:`workers.backends.node_slots`), so the per-node and
per-process bounds hold for every create and release;
:func:`create_vm` and :func:`release_vm` are the same for one call from
synchronous code. :func:`list_vms` asks a node for the VMs it runs (extension).
Callers never look at ``node.kind`` themselves.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from config.settings import Settings
from protos import fcdaemon_pb2
from workers.backends import inflight, node_slots
from workers.backends.fcdaemon import AgentClient, AsyncAgentClient, TlsFiles
from workers.backends.lambdo import AsyncLambdoClient, LambdoClient
from workers.backends.networks import replica_address
from workers.errors import PermanentBackendError
from workers.store.models import Function, Node

DEFAULT_GUEST_PORT = 8080


@dataclass(frozen=True)
class Vm:
    """A VM as corral records it: the agent's id and where the function answers."""

    vmid: str
    address: str


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
    kind: str
    address: str


def target(node: Node) -> Target:
    """The call target of a node row."""
    return Target(node.id, node.name, node.kind, node.address)


@dataclass(frozen=True)
class CreateCall:
    """One create, ready to send: where, the protocol's request, and the guest port."""

    target: Target
    request: Any  # fcdaemon: a CreateRequest; lambdo: (rootfs id, location, ports)
    guest_port: int


def _tls(settings: Settings) -> TlsFiles | None:
    if settings.agent_tls_ca:
        return TlsFiles(settings.agent_tls_ca, settings.agent_tls_cert, settings.agent_tls_key)
    return None


def agent_client(node: Node, settings: Settings, *, shared: bool = True) -> AgentClient:
    """A gRPC client for an fcdaemon node (``shared=False``: on a channel of its own)."""
    tls = _tls(settings)
    return AgentClient(
        node.address,
        node=node.name,
        timeout_s=settings.rpc_timeout_s,
        create_timeout_s=settings.create_timeout_s,
        token=settings.agent_token,
        tls=tls,
        shared=shared,
    )


def lambdo_client(node: Node, settings: Settings) -> LambdoClient:
    """An HTTP client for a Lambdo host."""
    return LambdoClient(
        node.address,
        node=node.name,
        timeout_s=settings.lambdo_timeout_s,
        token=settings.lambdo_token,
    )


def kernel_args(fn: Function) -> str:
    """The function's kernel arguments with its env appended as ``--env=K=V``."""
    parts = [fn.kernel_args] if fn.kernel_args else []
    parts += [shlex.quote(f"--env={k}={v}") for k, v in sorted(fn.env.items())]
    return " ".join(parts)


def create_request(fn: Function, request_id: str, settings: Settings) -> Any:
    """The ``fcdaemon.CreateRequest`` for one replica of ``fn``."""
    return fcdaemon_pb2.CreateRequest(
        kernelImagePath=fn.kernel,
        kernelArgs=kernel_args(fn),
        imageName=fn.image,
        imageStoragePrefix=fn.image_storage or settings.image_storage,
        inetDev=fn.inet_dev or settings.inet_dev,
        nameServer=fn.name_server or settings.name_server,
        awsAccessKeyID=fn.aws_access_key_id or settings.aws_access_key_id or "",
        awsSecretAccessKey=fn.aws_secret_access_key or settings.aws_secret_access_key or "",
        cpu=fn.cpu,
        mem=fn.mem_mb,
        numReplica=1,
        vmType=fn.vm_type,
        initrdPath=fn.initrd,
        requestId=request_id,
        guestPort=guest_port(fn),
    )


def guest_port(fn: Function) -> int:
    """The guest port clients reach the function on."""
    return int(fn.ports[0]) if fn.ports else DEFAULT_GUEST_PORT


def rootfs_id(fn: Function) -> str:
    """Lambdo's image id: ``<function id>_<build version>``, new on every deploy."""
    return f"{fn.id}_{fn.build_version}"


def _host_of(url: str) -> str:
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0].rsplit(":", 1)[0]


def create_call(node: Node, fn: Function, request_id: str, settings: Settings) -> CreateCall:
    """What to send ``node`` for one replica of ``fn``."""
    request: Any
    if node.kind == "lambdo":
        ports = [int(p) for p in fn.ports] or [DEFAULT_GUEST_PORT]
        request = (rootfs_id(fn), fn.rootfs or fn.image, ports)
    else:
        request = create_request(fn, request_id, settings)
    return CreateCall(target(node), request, guest_port(fn))


def _async_agent(t: Target, settings: Settings) -> AsyncAgentClient:
    return AsyncAgentClient(
        t.address, node=t.name, timeout_s=settings.rpc_timeout_s,
        create_timeout_s=settings.create_timeout_s, token=settings.agent_token,
        tls=_tls(settings))


def _async_lambdo(t: Target, settings: Settings) -> AsyncLambdoClient:
    return AsyncLambdoClient(
        t.address, node=t.name, timeout_s=settings.lambdo_timeout_s, token=settings.lambdo_token)


async def send_create(call: CreateCall, settings: Settings) -> Vm:
    """Send one create (the caller holds the node's call slot); may raise BackendError."""
    t = call.target
    if t.kind == "lambdo":
        spawned = await _async_lambdo(t, settings).aspawn(*call.request)
        port = spawned.port_mapping.get(call.guest_port)
        if port is None:
            raise PermanentBackendError(
                f"spawn mapped no host port to guest port {call.guest_port}", node=t.name
            )
        vmid, host = spawned.vmid, _host_of(t.address)
    else:
        created = await _async_agent(t, settings).create_replica(call.request)
        vmid, host, port = created.vmid, created.ip or _host_of(t.address), created.port
    # the one place a reply becomes a Vm: its address checked (workers.backends.networks)
    return Vm(vmid, await replica_address(t, host, port or call.guest_port, settings))


async def send_release(t: Target, vmid: str, settings: Settings) -> bool:
    """Send one release (the caller holds the node's call slot); False: already gone."""
    if t.kind == "lambdo":
        return await _async_lambdo(t, settings).adestroy(vmid)
    return await _async_agent(t, settings).release(vmid)


async def acreate(call: CreateCall, settings: Settings) -> Vm:
    """Create one VM, inside one of its node's call slots."""
    async with inflight.slot(call.target.id, settings.node_max_inflight, settings.max_inflight,
                             node_slots.source(settings)):
        return await send_create(call, settings)


async def arelease(t: Target, vmid: str, settings: Settings) -> bool:
    """Tear one VM down, inside one of its node's call slots; False: already gone."""
    async with inflight.slot(t.id, settings.node_max_inflight, settings.max_inflight,
                             node_slots.source(settings)):
        return await send_release(t, vmid, settings)


def create_vm(node: Node, fn: Function, request_id: str, settings: Settings) -> Vm:
    """Create one VM of ``fn`` on ``node`` (from synchronous code)."""
    return inflight.run(acreate(create_call(node, fn, request_id, settings), settings))


def release_vm(node: Node, vmid: str, settings: Settings) -> bool:
    """Tear a VM down; False when the node says it was already gone."""
    return inflight.run(arelease(target(node), vmid, settings))


def list_vms(node: Node, settings: Settings) -> list[ListedVm]:
    """The VMs ``node`` runs; raises :class:`workers.errors.Unsupported` if it cannot say."""
    if node.kind == "lambdo":
        return [
            ListedVm(v.vmid, "", v.created_unix) for v in lambdo_client(node, settings).list_vms()
        ]
    return [
        ListedVm(v.vmid, v.request_id, v.created_unix)
        for v in agent_client(node, settings).list_replicas()
    ]


def probe(node: Node, settings: Settings) -> bool:
    """Whether the node answers its health probe."""
    if node.kind == "lambdo":
        lambdo_client(node, settings).probe()
        return True
    client = agent_client(node, settings, shared=False)
    try:
        return client.health()
    finally:
        client.close()
