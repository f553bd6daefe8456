"""One interface over the two kinds of node: fcdaemon agents (gRPC) and Lambdo hosts (HTTP).

:func:`create_vm` turns a function row into the request its node's protocol
needs and returns the VM id and the address the function is reached at;
:func:`release_vm` tears a VM down (False when it was already gone);
:func:`list_vms` asks a node for the VMs it runs (extension). Callers never look
at ``node.kind`` themselves.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from config.settings import Settings
from protos import fcdaemon_pb2
from workers.errors import PermanentBackendError
from workers.fcdaemon import AgentClient, TlsFiles
from workers.lambdo import LambdoClient
from workers.store.models import Function, Node

DEFAULT_GUEST_PORT = 8080


@dataclass(frozen=True)
class Vm:
    """A VM as corral records it: the agent's id and where the function answers."""

    vmid: str
    address: str


@dataclass(frozen=True)
class ListedVm:
    """A VM a node says it runs."""

    vmid: str
    request_id: str
    created_unix: float


def agent_client(node: Node, settings: Settings, *, shared: bool = True) -> AgentClient:
    """A gRPC client for an fcdaemon node (``shared=False``: on a channel of its own)."""
    tls = None
    if settings.agent_tls_ca:
        tls = TlsFiles(settings.agent_tls_ca, settings.agent_tls_cert, settings.agent_tls_key)
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


def create_vm(node: Node, fn: Function, request_id: str, settings: Settings) -> Vm:
    """Create one VM of ``fn`` on ``node``."""
    if node.kind == "lambdo":
        spawned = lambdo_client(node, settings).spawn(
            rootfs_id(fn), fn.rootfs or fn.image, [int(p) for p in fn.ports] or [DEFAULT_GUEST_PORT]
        )
        port = spawned.port_mapping.get(guest_port(fn))
        if port is None:
            raise PermanentBackendError(
                f"spawn mapped no host port to guest port {guest_port(fn)}", node=node.name
            )
        return Vm(spawned.vmid, f"http://{_host_of(node.address)}:{port}")
    created = agent_client(node, settings).create_replica(create_request(fn, request_id, settings))
    host = created.ip or _host_of(node.address)
    return Vm(created.vmid, f"http://{host}:{created.port or guest_port(fn)}")


def release_vm(node: Node, vmid: str, settings: Settings) -> bool:
    """Tear a VM down; False when the node says it was already gone."""
    if node.kind == "lambdo":
        return lambdo_client(node, settings).destroy(vmid)
    return agent_client(node, settings).release(vmid)


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
