"""The fcdaemon backend: node agents speaking ``fcdaemon.FcService`` over gRPC.

:class:`FcdaemonBackend` is the :class:`~workers.backends.base.NodeBackend` for node
agents; :class:`AgentClient` its one client, on ``grpc.aio`` channels that live on the
process's event loop (:mod:`workers.backends.inflight`): one shared channel per agent
address per process, made there on first use and closed when the loop is reset (a
prefork child never shares one with its parent), plus a channel of its own for each
health probe. Synchronous callers run a call on that loop (``inflight.run``).

Every call carries a deadline; gRPC status codes become :mod:`workers.base.errors`
types: UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED and ABORTED are
retryable, NOT_FOUND on release means the VM is already gone, UNIMPLEMENTED means
the agent lacks an extension, anything else is permanent.
AWS keys travel in the request and appear in no error message or log line.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from config.redact import redact
from config.settings import Settings, reveal
from netplumb.addresses import host_of, join_hostport, parse_hostport
from protos import fcdaemon_grpc, fcdaemon_pb2
from workers.backends import inflight
from workers.backends.base import (
    VM_STARTS,
    CreateCall,
    Created,
    ListedVm,
    NodeBackend,
    Target,
    guest_port,
)
from workers.base.errors import (
    BackendError,
    InputError,
    PermanentBackendError,
    TransientBackendError,
    Unsupported,
    VmGone,
)
from workers.base.kinds import NodeKind
from workers.base.untrusted import check_ip, check_vmid, warn_plaintext
from workers.store.models import Function

RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for TLS to agents: CA to trust, and optionally a client certificate."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None


@dataclass(frozen=True)
class CreatedVm:
    """What an agent answered to CreateReplica: the VM's id, its IP, and the host port that
    reaches its guest port (0: the guest port itself)."""

    vmid: str
    ip: str
    port: int
    #: How it started, where the agent says (``CreateReply.start``): "boot", "restore" or "".
    start: str = field(default="", kw_only=True)


@dataclass(frozen=True)
class AgentVm(CreatedVm):
    """One VM an agent reports through the ListReplicas extension."""

    request_id: str
    created_unix: float


#: The longest a channel waits before connecting again after a failure (gRPC's default is 120 s).
MAX_RECONNECT_BACKOFF_S = 2.0


def new_channel(address: str, tls: TlsFiles | None = None) -> Any:
    """A new ``grpc.aio`` channel to ``address``, to be made on the event loop that uses it."""
    options = [
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.enable_retries", 0),
        ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000)),
    ]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes(),
        private_key=tls.key.read_bytes() if tls.key else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert else None,
    )
    return grpc.aio.secure_channel(address, creds, options=options)


def _error(exc: grpc.RpcError, node: str, what: str, secrets: tuple[str, ...] = ()) -> BackendError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = redact((exc.details() if hasattr(exc, "details") else str(exc)) or "", secrets)
    message = f"{what} failed: {code.name}: {detail}"
    if code in RETRYABLE_CODES:
        return TransientBackendError(
            message, node=node, code=code.name, nothing_done=_nothing_done(code, detail)
        )
    if code == grpc.StatusCode.NOT_FOUND:
        return VmGone(message, node=node, code=code.name)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unsupported(message, node=node, code=code.name)
    return PermanentBackendError(message, node=node, code=code.name)


def _nothing_done(code: grpc.StatusCode, detail: str) -> bool:
    """Whether a retryable status proves the agent did nothing: it answered, or was never reached.

    RESOURCE_EXHAUSTED and ABORTED are the agent's own answers; UNAVAILABLE is only when
    the connection was never made. A deadline, or a connection lost mid-call, may hide a
    request the agent carried out.
    """
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED):
        return True
    return code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in detail.lower()


async def _close_aio(resources: dict[str, Any]) -> None:
    for key, value in list(resources.items()):
        if key.startswith("grpc:"):
            await value.close()


inflight.on_reset(_close_aio)


class AgentClient:
    """Calls to one node agent on this process's event loop (``grpc.aio``), each with a
    deadline and typed errors.

    Make it anywhere; call it from coroutines running on :mod:`workers.backends.inflight`'s
    loop (synchronous code: ``inflight.run(client.release(vmid))``). Its channel is the
    process's shared one to the address, made on the loop on first use; with
    ``shared=False`` it is one of its own, closed by :meth:`close` - a probe's. gRPC still
    shares the connection itself (the subchannel) among a process's channels to one
    address: a probe that connects readies it for the calls after it, and a probe in the
    moments after a node is back may find it in reconnect backoff (at most
    :data:`MAX_RECONNECT_BACKOFF_S`) and count a miss; the next pass hears it.
    """

    def __init__(  # noqa: PLR0913 - keyword-only options with defaults
        self,
        address: str,
        *,
        node: str | None = None,
        timeout_s: float = 10.0,
        create_timeout_s: float = 30.0,
        token: str | None = None,
        tls: TlsFiles | None = None,
        shared: bool = True,
    ) -> None:
        self.address = address
        self.node = node or address
        self.timeout_s = timeout_s
        self.create_timeout_s = create_timeout_s
        self._tls = tls
        self._shared = shared
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._token = token
        self._channel: Any = None
        self._stub_made: Any = None
        if token and tls is None:
            warn_plaintext(host_of(address), "the agent token")

    def _stub(self) -> Any:
        """The FcService stub, on the channel (made now, on the loop, if not yet)."""
        if self._stub_made is None:
            if self._shared:
                self._channel = inflight.resource(
                    f"grpc:{self.address}:{self._tls}", self._new_channel
                )
            else:
                self._channel = self._new_channel()
            self._stub_made = fcdaemon_grpc.FcServiceStub(self._channel)
        return self._stub_made

    def _new_channel(self) -> Any:
        return new_channel(self.address, self._tls)

    async def close(self) -> None:
        """Close the channel if this client owns it (``shared=False``)."""
        if not self._shared and self._channel is not None:
            await self._channel.close()

    async def _call(self, method: str, request: Any, timeout: float) -> Any:
        try:
            return await getattr(self._stub(), method)(
                request, timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            secrets = (
                self._token or "",
                getattr(request, "awsAccessKeyID", ""),
                getattr(request, "awsSecretAccessKey", ""),
            )
            raise _error(exc, self.node, method, secrets) from None

    async def create_replica(self, request: Any) -> CreatedVm:
        """Ask the agent for one VM; the agent picks the vmid (checked, as is its ip)."""
        if request.awsSecretAccessKey and self._tls is None:
            warn_plaintext(host_of(self.address), "AWS keys")
        reply = await self._call("CreateReplica", request, self.create_timeout_s)
        vmid = check_vmid(reply.vmid, self.node)
        ip = check_ip(reply.ip, self.node) if reply.ip else ""
        start = reply.start if reply.start in VM_STARTS else ""
        return CreatedVm(vmid=vmid, ip=ip, port=int(reply.port), start=start)

    async def release(self, vmid: str) -> bool:
        """Tear a VM down; False when the agent says it is already gone."""
        try:
            await self._call(
                "ReleaseVMSetup", fcdaemon_pb2.ReleaseRequest(vmid=vmid), self.timeout_s
            )
        except VmGone:
            return False
        return True

    async def create_cpu_hogs(self, n: int) -> None:
        """Start ``n`` busy-loop processes on the node."""
        await self._call("CreateCPUHogs", fcdaemon_pb2.CpuHogs(n=n), self.timeout_s)

    async def stop_cpu_hogs(self, n: int) -> None:
        """Stop up to ``n`` busy-loop processes on the node."""
        await self._call("StopCPUHogs", fcdaemon_pb2.CpuHogs(n=n), self.timeout_s)

    async def list_replicas(self) -> list[AgentVm]:
        """The VMs the agent runs (extension; raises :class:`Unsupported` if absent)."""
        reply = await self._call("ListReplicas", empty_pb2.Empty(), self.timeout_s)
        return [
            AgentVm(
                vmid=r.vmid,
                ip=r.ip,
                port=int(r.port),
                request_id=r.requestId,
                created_unix=float(r.createdUnix),
            )
            for r in reply.replicas
        ]

    async def health(self) -> bool:
        """True when the agent's grpc.health.v1 service says SERVING.

        An agent without the health service is probed with a ListReplicas call and
        counts as healthy if it answers at all (even UNIMPLEMENTED).
        """
        self._stub()
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise _error(exc, self.node, "health check") from None
            with contextlib.suppress(Unsupported):
                await self.list_replicas()
            return True
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def client(t: Target, settings: Settings, *, shared: bool = True) -> AgentClient:
    """The client for node ``t`` with the settings' deadlines, token and TLS."""
    tls = (
        TlsFiles(settings.agent_tls_ca, settings.agent_tls_cert, settings.agent_tls_key)
        if settings.agent_tls_ca
        else None
    )
    return AgentClient(
        t.address,
        node=t.name,
        timeout_s=settings.rpc_timeout_s,
        create_timeout_s=settings.create_timeout_s,
        token=reveal(settings.agent_token),
        tls=tls,
        shared=shared,
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
        awsAccessKeyID=fn.aws_access_key_id or reveal(settings.aws_access_key_id) or "",
        awsSecretAccessKey=fn.aws_secret_access_key or reveal(settings.aws_secret_access_key) or "",
        cpu=fn.cpu,
        mem=fn.mem_mb,
        numReplica=1,
        vmType=fn.vm_type,
        initrdPath=fn.initrd,
        requestId=request_id,
        guestPort=guest_port(fn),
    )


DEFAULT_AGENT_PORT = 50051


class FcdaemonBackend(NodeBackend):
    """Node agents speaking ``fcdaemon.FcService`` over gRPC."""

    kind = NodeKind.FCDAEMON
    keyed_creates = True  # the requestId extension
    runs_hogs = True
    on_node_network = True  # a VM is on a network of its node's, not at the node's address

    def normalize_address(self, address: str) -> str:
        """``HOST:PORT`` (port 50051 when none is given)."""
        try:
            return join_hostport(*parse_hostport(address, DEFAULT_AGENT_PORT, "agent address"))
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def image_of_rootfs(self, rootfs: str | None) -> str:
        """Nothing: an agent boots a kernel with an image, never a rootfs alone."""
        return ""

    def check_function(self, values: Mapping[str, Any]) -> None:
        """A replica boots the function's kernel: it needs one."""
        if not values["kernel"]:
            raise InputError("a fcdaemon function needs --kernel (or the KERNEL_IMAGE_PATH label)")

    def create_request(self, fn: Function, request_id: str, settings: Settings) -> Any:
        """A ``CreateRequest`` (:func:`create_request`)."""
        return create_request(fn, request_id, settings)

    async def create(self, call: CreateCall, settings: Settings) -> Created:
        """CreateReplica; the replica is at its reply's ip (else the node's host) and port."""
        created = await client(call.target, settings).create_replica(call.request)
        host = created.ip or host_of(call.target.address)
        return Created(created.vmid, host, created.port, created.start)

    async def release(self, t: Target, vmid: str, settings: Settings) -> bool:
        """ReleaseVMSetup; False on NOT_FOUND."""
        return await client(t, settings).release(vmid)

    async def list_vms(self, t: Target, settings: Settings) -> list[ListedVm]:
        """ListReplicas (extension)."""
        return [
            ListedVm(v.vmid, v.request_id, v.created_unix)
            for v in await client(t, settings).list_replicas()
        ]

    async def probe(self, t: Target, settings: Settings) -> bool:
        """The health service (or any answer at all), on a channel of its own."""
        probe = client(t, settings, shared=False)
        try:
            return await probe.health()
        finally:
            await probe.close()

    async def hogs(self, t: Target, action: str, n: int, settings: Settings) -> None:
        """CreateCPUHogs or StopCPUHogs."""
        agent = client(t, settings)
        await (agent.create_cpu_hogs(n) if action == "start" else agent.stop_cpu_hogs(n))
