"""Client for node agents speaking ``fcdaemon.FcService`` over gRPC.

One channel per agent address per process, created on first use and dropped after
a fork (:func:`reset_channels`), so prefork children never share a channel with
their parent. The batch paths (many creates or releases at once) use
:class:`AsyncAgentClient` on a ``grpc.aio`` channel that lives on the process's
event loop (:mod:`workers.backends.inflight`), made there on first use; both clients
check replies and redact errors the same way (:class:`_AgentCalls`).

Every call carries a deadline; gRPC status codes become :mod:`workers.errors`
types: UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED and ABORTED are
retryable, NOT_FOUND on release means the VM is already gone, UNIMPLEMENTED means
the agent lacks an extension, anything else is permanent.
AWS keys travel in the request and appear in no error message or log line.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from config.redact import redact
from protos import fcdaemon_grpc, fcdaemon_pb2
from workers.backends import inflight
from workers.errors import (
    BackendError,
    PermanentBackendError,
    TransientBackendError,
    Unsupported,
    VmGone,
)
from workers.untrusted import check_ip, check_vmid, warn_plaintext

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


@dataclass(frozen=True)
class AgentVm(CreatedVm):
    """One VM an agent reports through the ListReplicas extension."""

    request_id: str
    created_unix: float


_channels: dict[tuple[str, TlsFiles | None], grpc.Channel] = {}
_channels_pid = os.getpid()
_channels_lock = threading.Lock()


def new_channel(address: str, tls: TlsFiles | None = None, *, aio: bool = False) -> Any:
    """A new channel to ``address`` (callers normally want the shared :func:`channel`).

    ``aio=True``: a ``grpc.aio`` channel, to be made on the event loop that uses it.
    """
    options = [
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.enable_retries", 0),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    kind: Any = grpc.aio if aio else grpc
    if tls is None:
        return kind.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes(),
        private_key=tls.key.read_bytes() if tls.key else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert else None,
    )
    return kind.secure_channel(address, creds, options=options)


def channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """This process's channel to ``address``, created once and reused."""
    global _channels_pid
    with _channels_lock:
        if _channels_pid != os.getpid():
            _channels.clear()  # inherited across fork: never reuse
            _channels_pid = os.getpid()
        ch = _channels.get((address, tls))
        if ch is None:
            ch = _channels[(address, tls)] = new_channel(address, tls)
        return ch


def reset_channels() -> None:
    """Close and forget every channel of this process (after fork, at shutdown)."""
    global _channels_pid
    with _channels_lock:
        if _channels_pid == os.getpid():
            for ch in _channels.values():
                ch.close()
        _channels.clear()
        _channels_pid = os.getpid()


def _error(exc: grpc.RpcError, node: str, what: str, secrets: tuple[str, ...] = ()) -> BackendError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = redact((exc.details() if hasattr(exc, "details") else str(exc)) or "", secrets)
    message = f"{what} failed: {code.name}: {detail}"
    if code in RETRYABLE_CODES:
        return TransientBackendError(message, node=node, code=code.name,
                                     nothing_done=_nothing_done(code, detail))
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


class _AgentCalls:
    """What both clients share: settings, the bearer token, reply checks, redacted errors."""

    def __init__(
        self,
        address: str,
        *,
        node: str | None = None,
        timeout_s: float = 10.0,
        create_timeout_s: float = 30.0,
        token: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.address = address
        self._channel_plain = tls is None
        self.node = node or address
        self.timeout_s = timeout_s
        self.create_timeout_s = create_timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._token = token
        if token and tls is None:
            warn_plaintext(address.rsplit(":", 1)[0].strip("[]"), "the agent token")

    def _failed(self, exc: grpc.RpcError, method: str, request: Any) -> BackendError:
        secrets = (self._token or "", getattr(request, "awsAccessKeyID", ""),
                   getattr(request, "awsSecretAccessKey", ""))
        return _error(exc, self.node, method, secrets)

    def _creating(self, request: Any) -> None:
        if request.awsSecretAccessKey and self._channel_plain:
            warn_plaintext(self.address.rsplit(":", 1)[0].strip("[]"), "AWS keys")

    def _created(self, reply: Any) -> CreatedVm:
        """The VM a ``CreateReply`` describes: its vmid and ip checked."""
        vmid = check_vmid(reply.vmid, self.node)
        ip = check_ip(reply.ip, self.node) if reply.ip else ""
        return CreatedVm(vmid=vmid, ip=ip, port=int(reply.port))


class AsyncAgentClient(_AgentCalls):
    """CreateReplica and ReleaseVMSetup on this process's event loop (``grpc.aio``).

    Made and used only inside coroutines running on :mod:`workers.backends.inflight`'s loop.
    """

    def __init__(self, address: str, *, tls: TlsFiles | None = None, **calls: Any) -> None:
        super().__init__(address, tls=tls, **calls)
        ch = inflight.resource(f"grpc:{address}:{tls}",
                               lambda: new_channel(address, tls, aio=True))
        self._stub = fcdaemon_grpc.FcServiceStub(ch)

    async def _call(self, method: str, request: Any, timeout: float) -> Any:
        try:
            return await getattr(self._stub, method)(
                request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._failed(exc, method, request) from None

    async def create_replica(self, request: Any) -> CreatedVm:
        """Ask the agent for one VM; the agent picks the vmid (checked, as is its ip)."""
        self._creating(request)
        return self._created(await self._call("CreateReplica", request, self.create_timeout_s))

    async def release(self, vmid: str) -> bool:
        """Tear a VM down; False when the agent says it is already gone."""
        try:
            await self._call(
                "ReleaseVMSetup", fcdaemon_pb2.ReleaseRequest(vmid=vmid), self.timeout_s)
        except VmGone:
            return False
        return True


class AgentClient(_AgentCalls):
    """Calls to one node agent, each with a deadline and typed errors."""

    def __init__(
        self, address: str, *, tls: TlsFiles | None = None, shared: bool = True, **calls: Any
    ) -> None:
        super().__init__(address, tls=tls, **calls)
        self._owned = not shared
        # A probe uses its own channel: a shared one may sit in reconnect backoff
        # after failures and would report a node that is back as still down.
        self._channel = channel(address, tls) if shared else new_channel(address, tls)
        self._stub = fcdaemon_grpc.FcServiceStub(self._channel)

    def close(self) -> None:
        """Close the channel if this client owns it (``shared=False``)."""
        if self._owned:
            self._channel.close()

    def _call(self, method: str, request: Any, timeout: float) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._failed(exc, method, request) from None

    def create_replica(self, request: Any) -> CreatedVm:
        """Ask the agent for one VM; the agent picks the vmid (checked, as is its ip)."""
        self._creating(request)
        return self._created(self._call("CreateReplica", request, self.create_timeout_s))

    def release(self, vmid: str) -> bool:
        """Tear a VM down; False when the agent says it is already gone."""
        try:
            self._call("ReleaseVMSetup", fcdaemon_pb2.ReleaseRequest(vmid=vmid), self.timeout_s)
        except VmGone:
            return False
        return True

    def create_cpu_hogs(self, n: int) -> None:
        """Start ``n`` busy-loop processes on the node."""
        self._call("CreateCPUHogs", fcdaemon_pb2.CpuHogs(n=n), self.timeout_s)

    def stop_cpu_hogs(self, n: int) -> None:
        """Stop up to ``n`` busy-loop processes on the node."""
        self._call("StopCPUHogs", fcdaemon_pb2.CpuHogs(n=n), self.timeout_s)

    def list_replicas(self) -> list[AgentVm]:
        """The VMs the agent runs (extension; raises :class:`Unsupported` if absent)."""
        reply = self._call("ListReplicas", empty_pb2.Empty(), self.timeout_s)
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

    def health(self) -> bool:
        """True when the agent's grpc.health.v1 service says SERVING.

        An agent without the health service is probed with a ListReplicas call and
        counts as healthy if it answers at all (even UNIMPLEMENTED).
        """
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise _error(exc, self.node, "health check") from None
            with contextlib.suppress(Unsupported):
                self.list_replicas()
            return True
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
