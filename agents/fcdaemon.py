"""Reference node agent: serves ``fcdaemon.FcService`` over gRPC, backed by a VM driver.

The node agent is what corral's workers call to run replicas on a node. This one
speaks the seed's wire contract (CreateReplica, ReleaseVMSetup, CreateCPUHogs,
StopCPUHogs) plus corral's wire-compatible extensions:

* ``CreateRequest.requestId`` - idempotency: a repeated request whose id belongs to a
  live VM is answered with that VM, so a redelivered spawn never makes a second one;
* ``CreateRequest.guestPort`` / ``CreateReply.port`` - which port the function serves on;
* ``ListReplicas`` - the VMs running here, for corral's reconcile;
* the standard ``grpc.health.v1`` service.

VMs come from a :class:`agents.drivers.VMDriver` (processes or records); CPU hogs are
real busy-loop processes. With a registry address the agent announces itself
(``RegisterNode``, retried with backoff until the registry answers) and reports each
replica READY (``UpdateStatus``) once its HTTP port answers; a DESTROY reply releases it.
It registers an IP, never a name (the registry refuses names): ``--advertise-ip``
must be one, and without it the listen host is used, a name resolved here once
(:func:`node_ip`).

For tests, :class:`FcAgent` records every call in ``calls`` and accepts scripted faults
(:meth:`FcAgent.inject`, see :mod:`agents.faults`). AWS credentials in requests are
never logged.

Command line: ``corral agent fcdaemon`` / ``python -m agents.fcdaemon``.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import empty_pb2

from agents.drivers import (
    VM,
    BadSpec,
    DriverError,
    MemoryDriver,
    VMDriver,
    VMSpec,
    add_driver_arguments,
    driver_from_args,
)
from agents.grpcserve import GrpcFaultHooks, agent_server
from agents.procs import kill_group, spawn
from agents.runtime import (
    KeyedLock,
    Running,
    add_common_arguments,
    agent_main,
    connect_host,
    guess_node_ip,
    http_answers,
    serve_until_signalled,
)
from config.processes import exited
from netplumb.addresses import is_loopback, join_hostport, split_hostport
from netplumb.grpcserve import GuardedServer, report_token
from protos import fcdaemon_grpc, fcdaemon_pb2, resmngr_grpc, resmngr_pb2

__all__ = [
    "DEFAULT_PORT_RANGE",
    "SERVICE_NAME",
    "FcAgent",
    "HogPool",
    "RegistryReporter",
    "RunningAgent",
    "main",
    "serve_fcdaemon",
    "spec_from_request",
]

log = logging.getLogger("agents.fcdaemon")  # not __name__: also right under -m

SERVICE_NAME = "fcdaemon.FcService"
DEFAULT_PORT_RANGE = (20000, 29999)
HOG_ARGV = (sys.executable, "-c", "while True: pass")


def spec_from_request(request: Any) -> VMSpec:
    """Translate a ``CreateRequest`` into a :class:`VMSpec` (guestPort 0 means 8080)."""
    return VMSpec(
        image=request.imageName,
        kernel=request.kernelImagePath,
        initrd=request.initrdPath,
        kernel_args=request.kernelArgs,
        vm_type=request.vmType or "osv",
        cpu=int(request.cpu),
        mem_mb=int(request.mem),
        guest_port=int(request.guestPort) or 8080,
        request_id=request.requestId,
        vmid=uuid.uuid4().hex,
    )


def created_reply(vm: VM) -> Any:
    """The ``CreateReply`` for a VM (``start``: how it started, where the driver says)."""
    return fcdaemon_pb2.CreateReply(ip=vm.ip, vmid=vm.vmid, port=vm.port, start=vm.start)


class HogPool:
    """CPU-hog processes: busy loops in their own process groups, dying with the agent."""

    def __init__(self, limit: int = 64) -> None:
        """At most ``limit`` hogs run at once."""
        self.limit = limit
        self._procs: list[Any] = []
        self._lock = threading.Lock()

    def _prune(self) -> None:
        dead = [p for p in self._procs if exited(p)]  # unreaped until kill_group
        for proc in dead:
            self._procs.remove(proc)
            kill_group(proc, grace=0.0)

    @property
    def count(self) -> int:
        """Hogs running now."""
        with self._lock:
            self._prune()
            return len(self._procs)

    @property
    def pids(self) -> list[int]:
        """Process ids of the running hogs."""
        with self._lock:
            self._prune()
            return [p.pid for p in self._procs]

    def start(self, n: int) -> int:
        """Start ``n`` more hogs; raise ValueError beyond the limit; return the new count."""
        if n < 0:
            raise ValueError("n must not be negative")
        with self._lock:
            self._prune()
            if len(self._procs) + n > self.limit:
                raise ValueError(
                    f"{len(self._procs)} hogs running; {n} more exceeds the limit of {self.limit}"
                )
            for _ in range(n):
                self._procs.append(spawn(HOG_ARGV, {"PATH": "/usr/bin:/bin"}))
            return len(self._procs)

    def stop(self, n: int) -> int:
        """Stop up to ``n`` hogs (newest first); return how many were stopped."""
        if n < 0:
            raise ValueError("n must not be negative")
        with self._lock:
            self._prune()
            victims = self._procs[len(self._procs) - min(n, len(self._procs)) :]
            del self._procs[len(self._procs) - len(victims) :]
        for proc in victims:
            kill_group(proc, grace=1.0)
        return len(victims)

    def close(self) -> None:
        """Stop every hog."""
        self.stop(sys.maxsize)


#: Registry answers that retrying cannot change.
_FINAL_CODES = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class RegistryReporter:
    """Talks to corral's registry: RegisterNode with backoff, then READY per replica."""

    def __init__(  # noqa: PLR0913 - keyword-only options with defaults
        self,
        target: str,
        *,
        node_ip: str,
        node_port: int,
        node_id: str,
        token: str | None = None,
        on_destroy: Callable[[str], object] | None = None,
        is_live: Callable[[str], bool] | None = None,
        heartbeat: float | None = None,
        ready_timeout: float = 60.0,
        max_backoff: float = 5.0,
        seed_only: bool = False,
    ) -> None:
        """``on_destroy(vmid)`` runs when the registry answers DESTROY to a READY report.

        ``seed_only``: register as the seed protocol does, without corral's credential
        field (the registry then pins the node to its host).
        """
        self.target = target
        self.seed_only = seed_only
        self.node_ip, self.node_port, self.node_id = node_ip, node_port, node_id
        self.heartbeat = heartbeat
        self.ready_timeout = ready_timeout
        self.max_backoff = max_backoff
        self.on_destroy = on_destroy
        self.is_live = is_live or (lambda vmid: True)
        self.registered = threading.Event()
        #: The credential the registry issued this node ("" until it has).
        self.credential = ""
        #: Registrations the registry accepted (the first, then each heartbeat).
        self.registrations = 0
        self._token = token
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if token and not is_loopback(split_hostport(target)[0]):
            log.warning(
                "the registry token travels in plain text to %s: use a private network", target
            )
        # gRPC's own reconnect backoff grows to 120 s; keep it near ours so a registry
        # that comes back is noticed within seconds.
        self._channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", int(max_backoff * 1000)),
            ],
        )
        self._stub = resmngr_grpc.ResMngrServiceStub(self._channel)
        self._stop = threading.Event()
        self._pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="corral-ready")
        self._thread = threading.Thread(
            target=self._register_loop, name="corral-register", daemon=True
        )

    def start(self) -> None:
        """Start announcing the node in the background."""
        self._thread.start()

    def _register_loop(self) -> None:
        backoff, failures = 0.1, 0
        while not self._stop.is_set():
            # corral's extension: ask for a credential, then present the one issued
            request = resmngr_pb2.RegisterNodeRequest(
                ip=self.node_ip, port=self.node_port, node_id=self.node_id
            )
            if not self.seed_only:
                request.credential = self.credential
            try:
                reply = self._stub.RegisterNode(request, timeout=5.0, metadata=self._metadata)
            except grpc.RpcError as exc:
                failures += 1
                code = exc.code()
                if failures in (1, 10) or failures % 100 == 0:
                    level = logging.ERROR if code in _FINAL_CODES else logging.WARNING
                    log.log(
                        level,
                        "RegisterNode to %s failed (%s, attempt %d); retrying",
                        self.target,
                        code,
                        failures,
                    )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                continue
            if reply.credential:
                self.credential = reply.credential
            if not self.registered.is_set():
                log.info(
                    "registered node %s (%s:%d) with %s",
                    self.node_id,
                    self.node_ip,
                    self.node_port,
                    self.target,
                )
            self.registered.set()
            self.registrations += 1
            backoff, failures = 0.1, 0
            if not self.heartbeat:
                return
            self._stop.wait(self.heartbeat)

    def guest_vars(self, vmid: str) -> dict[str, str]:
        """What a guest of this node needs to report on its VM: the registry, its report token.

        The token is good for this vmid only (:func:`netplumb.grpcserve.report_token`):
        a guest never holds the node's registry token.
        """
        found = {"REGISTRY": self.target}
        if self._token:
            found["REPORT_TOKEN"] = report_token(self._token, vmid)
        return found

    def report_ready(self, vm: VM, probe: bool) -> None:
        """Report ``vm`` READY in the background, after its HTTP port answers if ``probe``."""
        with contextlib.suppress(RuntimeError):  # pool shut down: the agent is stopping
            self._pool.submit(self._report_ready, vm, probe)

    def _report_ready(self, vm: VM, probe: bool) -> None:
        deadline = time.monotonic() + self.ready_timeout
        if probe:
            host = connect_host(vm.ip)
            while not http_answers(host, vm.port):
                if self._stop.is_set() or not self.is_live(vm.vmid):
                    return
                if time.monotonic() > deadline:
                    log.warning(
                        "replica %s never answered on port %d; not reporting READY",
                        vm.vmid,
                        vm.port,
                    )
                    return
                self._stop.wait(0.05)
        request = resmngr_pb2.StatusUpdateRequest(
            vmid=vm.vmid, status=resmngr_pb2.StatusUpdateRequest.READY
        )
        backoff = 0.1
        while not self._stop.is_set():
            try:
                reply = self._stub.UpdateStatus(request, timeout=5.0, metadata=self._metadata)
                break
            except grpc.RpcError as exc:
                # Retried for as long as the VM lives, not until a deadline: a READY is how
                # corral finds a VM whose create's answer it lost, and a registry cut off
                # for a minute must not leave such a VM unknown for ever.
                code = exc.code()
                if code in _FINAL_CODES or not self.is_live(vm.vmid):
                    log.warning("READY of %s not delivered: %s %s", vm.vmid, code, exc.details())
                    return
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff)
        else:
            return
        action = resmngr_pb2.StatusUpdateReply.Action.Name(reply.action)
        log.info("replica %s READY; registry says %s", vm.vmid, action)
        if reply.action == resmngr_pb2.StatusUpdateReply.DESTROY and self.on_destroy:
            self.on_destroy(vm.vmid)

    def close(self) -> None:
        """Stop background work and close the channel."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._channel.close()


class FcAgent(GrpcFaultHooks, fcdaemon_grpc.FcServiceServicer):
    """The ``fcdaemon.FcService`` servicer: VMs from a driver, hogs, calls log, faults."""

    METHODS = ("CreateReplica", "ReleaseVMSetup", "CreateCPUHogs", "StopCPUHogs", "ListReplicas")

    def __init__(
        self,
        driver: VMDriver,
        *,
        hogs: HogPool | None = None,
        on_created: Callable[[VM], object] | None = None,
        seed_only: bool = False,
        create_delay: float = 0.0,
    ) -> None:
        """``on_created(vm)`` runs after each new replica (used to report READY).

        ``create_delay`` seconds pass before each create starts its VM (a slow host: fault
        runs hold creates in flight with it).

        ``seed_only`` makes the agent speak only the seed protocol, as faas-backend's
        agent does: ``requestId`` is ignored (a create sent twice makes two VMs) and
        ``ListReplicas`` answers UNIMPLEMENTED.
        """
        self.driver = driver
        self.seed_only = seed_only
        self.create_delay = create_delay
        self.hogs = hogs or HogPool()
        self.on_created = on_created
        #: The variables the agent adds to a guest's environment, by vmid (its registry's).
        self.guest_vars: Callable[[str], dict[str, str]] | None = None
        super().__init__(self.METHODS)
        self._vm_by_request: dict[str, str] = {}
        self._request_by_vm: dict[str, str] = {}
        self._map_lock = threading.Lock()
        # a second create of the same requestId waits for the first; other ids run side by side
        self._creating = KeyedLock()
        self._adopt_requests()

    def _adopt_requests(self) -> None:
        """Know the request ids of the VMs a driver adopted as it started (the qemu
        driver's, after a restart), so a repeated create is answered with its VM."""
        adopted = getattr(self.driver, "adopted", None)
        if self.seed_only or not callable(adopted):
            return
        for vm in adopted():
            if vm.request_id:
                self._vm_by_request[vm.request_id] = vm.vmid
                self._request_by_vm[vm.vmid] = vm.request_id

    # -- VM bookkeeping -----------------------------------------------------------------

    def _lookup(self, vmid: str) -> VM | None:
        getter = getattr(self.driver, "get", None)
        if callable(getter):
            return getter(vmid)  # type: ignore[no-any-return]
        return next((vm for vm in self.driver.list() if vm.vmid == vmid), None)

    def is_live(self, vmid: str) -> bool:
        """True if the driver still runs ``vmid``."""
        return self._lookup(vmid) is not None

    def release(self, vmid: str) -> bool:
        """Stop a VM and forget its request id; False if it was unknown."""
        stopped = self.driver.stop(vmid)
        with self._map_lock:
            rid = self._request_by_vm.pop(vmid, None)
            if rid is not None and self._vm_by_request.get(rid) == vmid:
                del self._vm_by_request[rid]
        return stopped

    def _existing(self, request_id: str) -> VM | None:
        with self._map_lock:
            vmid = self._vm_by_request.get(request_id)
        vm = None if vmid is None else self._lookup(vmid)
        if vmid is not None and vm is None:  # died since: a retry may create a fresh one
            with self._map_lock:
                self._vm_by_request.pop(request_id, None)
                self._request_by_vm.pop(vmid, None)
        return vm

    # -- RPCs ---------------------------------------------------------------------------

    def CreateReplica(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Start one replica (or answer the live one that has this requestId)."""
        canned, reply = self._begin("CreateReplica", request, context)
        if canned:
            return reply
        # Log what identifies the request - never the message itself (it carries AWS keys).
        log.debug(
            "CreateReplica image=%s vmType=%s cpu=%d mem=%d guestPort=%d requestId=%s",
            request.imageName,
            request.vmType,
            request.cpu,
            request.mem,
            request.guestPort,
            request.requestId or "-",
        )
        if not request.imageName:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "imageName is required")
        if request.cpu < 0 or request.mem < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cpu and mem must not be negative")
        if request.guestPort > 65535:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "guestPort must be below 65536")
        time.sleep(self.create_delay)  # 0 but on a host made slow
        rid = "" if self.seed_only else request.requestId
        with self._creating.hold(rid):
            existing = self._existing(rid) if rid else None
            if existing is not None:
                log.info("CreateReplica requestId=%s: already running as %s", rid, existing.vmid)
                return created_reply(existing)
            spec = spec_from_request(request)
            if self.guest_vars is not None:
                spec.agent_env.update(self.guest_vars(spec.vmid))
            try:
                vm: VM = self.driver.start(spec)
            except BadSpec as exc:  # an image or environment the agent refuses
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except DriverError as exc:
                log.error("CreateReplica image=%s failed: %s", request.imageName, exc)
                context.abort(grpc.StatusCode.INTERNAL, str(exc))
            except Exception as exc:
                log.exception("CreateReplica image=%s crashed", request.imageName)
                context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            if rid:
                with self._map_lock:
                    self._vm_by_request[rid] = vm.vmid
                    self._request_by_vm[vm.vmid] = rid
        # a seed agent ignores the id, but says which it was sent (who sends twice shows)
        log.info(
            "CreateReplica image=%s requestId=%s%s: %s at %s:%d",
            request.imageName,
            request.requestId[:128] or "-",
            " (ignored: seed protocol)" if self.seed_only and request.requestId else "",
            vm.vmid,
            vm.ip,
            vm.port,
        )
        if self.on_created is not None:
            try:
                self.on_created(vm)
            except Exception:
                log.exception("post-create hook failed for %s", vm.vmid)
        return created_reply(vm)

    def ReleaseVMSetup(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Tear a replica down; NOT_FOUND if the vmid is unknown."""
        canned, reply = self._begin("ReleaseVMSetup", request, context)
        if canned:
            return reply
        if not request.vmid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "vmid is required")
        try:
            stopped = self.release(request.vmid)
        except Exception as exc:
            log.exception("ReleaseVMSetup %s failed", request.vmid)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        if not stopped:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown vmid {request.vmid}")
        log.info("ReleaseVMSetup: %s released", request.vmid)
        return empty_pb2.Empty()

    def _begin_hogs(
        self, method: str, request: Any, context: grpc.ServicerContext
    ) -> tuple[bool, Any]:
        """:meth:`_begin` for a hog call, then refuse a negative ``n``."""
        canned, reply = self._begin(method, request, context)
        if not canned and request.n < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "n must not be negative")
        return canned, reply

    def CreateCPUHogs(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Start ``n`` busy-loop processes."""
        canned, reply = self._begin_hogs("CreateCPUHogs", request, context)
        if canned:
            return reply
        try:
            count = self.hogs.start(request.n)
        except ValueError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except OSError as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"cannot start hogs: {exc}")
        log.info("CreateCPUHogs n=%d: %d running", request.n, count)
        return empty_pb2.Empty()

    def StopCPUHogs(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Stop up to ``n`` busy-loop processes."""
        canned, reply = self._begin_hogs("StopCPUHogs", request, context)
        if canned:
            return reply
        stopped = self.hogs.stop(request.n)
        log.info("StopCPUHogs n=%d: stopped %d, %d running", request.n, stopped, self.hogs.count)
        return empty_pb2.Empty()

    def ListReplicas(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The replicas the driver runs now (extension)."""
        canned, reply = self._begin("ListReplicas", request, context)
        if canned:
            return reply
        if self.seed_only:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "ListReplicas: seed protocol only")
        return fcdaemon_pb2.ReplicaList(
            replicas=[
                fcdaemon_pb2.ReplicaInfo(
                    vmid=vm.vmid,
                    ip=vm.ip,
                    port=vm.port,
                    requestId=vm.request_id or None,  # unset, not "", when none was given
                    createdUnix=vm.created_unix,
                )
                for vm in self.driver.list()
            ]
        )


class RunningAgent(Running):
    """A node agent serving in background threads; ``stop()`` tears everything down."""

    def __init__(  # noqa: PLR0913 - the parts serve_fcdaemon built, by name
        self,
        *,
        server: GuardedServer,
        port: int,
        host: str,
        agent: FcAgent,
        driver: VMDriver,
        reporter: RegistryReporter | None,
    ) -> None:
        """Wrap the parts built by :func:`serve_fcdaemon`."""
        super().__init__(host, port)  # address: where a local client dials, 127.0.0.1:50051
        self.server = server
        self.agent = agent
        self.driver = driver
        self.reporter = reporter

    def _shutdown(self, grace: float) -> None:
        """Stop serving (health says NOT_SERVING first), then stop every replica and hog."""
        if self.reporter is not None:
            self.reporter.close()
        self.server.stop(grace)
        self.driver.close()
        self.agent.hogs.close()
        log.info("fcdaemon on port %d stopped", self.port)


def ip_argument(text: str) -> str:
    """``--advertise-ip`` or ``--replica-ip``: an IP address (never a host name)."""
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an IP address (corral knows a node by IP, never by name)"
        ) from None


def node_ip(advertise: str) -> str:
    """The IP to register: ``advertise`` if it is one, else what that name resolves to now."""
    try:
        return str(ipaddress.ip_address(advertise.strip("[]")))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(advertise, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise OSError(f"cannot resolve {advertise!r} to an IP to register: {exc}") from None
    return str(infos[0][4][0]).split("%", 1)[0]


def serve_fcdaemon(  # noqa: PLR0913 - a server's options, by name with defaults
    listen: str = "127.0.0.1:0",
    driver: VMDriver | None = None,
    registry: str | None = None,
    node_id: str | None = None,
    readiness_probe: bool = True,
    token: str | None = None,
    *,
    advertise_ip: str | None = None,
    heartbeat: float | None = None,
    max_hogs: int = 64,
    max_workers: int = 32,
    tls: tuple[bytes, bytes] | None = None,
    require_token: str | None = None,
    seed_only: bool = False,
    create_delay: float = 0.0,
) -> RunningAgent:
    """Start a node agent on ``listen`` (default driver: :class:`MemoryDriver`).

    ``tls`` is a (private key, certificate chain) PEM pair to serve TLS instead of
    plaintext; with ``require_token`` every FcService call must carry
    ``authorization: Bearer <token>`` or is refused UNAUTHENTICATED; ``seed_only``
    drops corral's extensions (see :class:`FcAgent`).
    """
    host, _ = split_hostport(listen)
    driver = driver if driver is not None else MemoryDriver()
    server, port = agent_server(
        "fcdaemon", listen, max_workers=max_workers, require_token=require_token, tls=tls
    )
    agent = FcAgent(driver, hogs=HogPool(max_hogs), seed_only=seed_only, create_delay=create_delay)
    server.add(fcdaemon_grpc.add_FcServiceServicer_to_server, agent)
    reporter: RegistryReporter | None = None
    if registry:
        ip = node_ip(advertise_ip or guess_node_ip(host))
        reporter = RegistryReporter(
            registry,
            node_ip=ip,
            node_port=port,
            node_id=node_id or join_hostport(ip, port),
            token=token,
            on_destroy=agent.release,
            is_live=agent.is_live,
            heartbeat=heartbeat,
            seed_only=seed_only,
        )
        agent.guest_vars = reporter.guest_vars
        if readiness_probe:
            rep = reporter
            agent.on_created = lambda vm: rep.report_ready(vm, probe=vm.pid is not None)
    server.start(SERVICE_NAME)
    if reporter is not None:
        reporter.start()
    log.info("fcdaemon listening on %s:%d", host or "0.0.0.0", port)  # noqa: S104 - a log line
    return RunningAgent(
        server=server,
        port=port,
        host=host,
        agent=agent,
        driver=driver,
        reporter=reporter,
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``corral agent fcdaemon`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="corral agent fcdaemon",
        description="Reference node agent serving fcdaemon.FcService (gRPC).",
    )
    add_common_arguments(
        parser,
        "127.0.0.1:50051",
        "--require-token",
        token_help="refuse FcService calls without this bearer token",  # noqa: S106 - help text
    )
    parser.add_argument("--registry", help="corral registry HOST:PORT to register with")
    parser.add_argument("--node-id", help="node id to register (default IP:PORT)")
    parser.add_argument(
        "--advertise-ip",
        type=ip_argument,
        help="IP the registry and clients should use: the one this agent calls the registry "
        "from (default: the listen host's)",
    )
    parser.add_argument(
        "--replica-ip",
        type=ip_argument,
        help="IP its replicas get and (process driver) listen on: an address of this host on "
        "its replica network (default the advertised IP)",
    )
    add_driver_arguments(
        parser,
        DEFAULT_PORT_RANGE,
        vms="replicas",
        port_help="host ports for process replicas",
        image_source="images",
        qemu=True,
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("CORRAL_REGISTRY_TOKEN") or None,
        help="bearer token for registry calls (default $CORRAL_REGISTRY_TOKEN; "
        "prefer the variable: argv is visible in ps)",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=0.0,
        help="re-send RegisterNode every N seconds (default 0: only at start)",
    )
    parser.add_argument("--max-hogs", type=int, default=64, help="CPU hog limit (default 64)")
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key for --tls-cert")
    parser.add_argument(
        "--seed-only",
        action="store_true",
        help="speak only the seed protocol: ignore requestId, no ListReplicas (as "
        "faas-backend's agent)",
    )
    parser.add_argument(
        "--create-delay",
        type=float,
        default=0.0,
        help="seconds each create waits before starting its VM (a slow host, for fault runs)",
    )
    return parser


def serve_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the node agent its command line describes until SIGINT/SIGTERM; the exit code."""
    advertise = args.advertise_ip or node_ip(guess_node_ip(args.host))
    tls = None
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert:
        with open(args.tls_key, "rb") as key, open(args.tls_cert, "rb") as cert:
            tls = (key.read(), cert.read())
    replica_ip = args.replica_ip or advertise
    driver = driver_from_args(
        parser, args, lambda: MemoryDriver(args.port_range, ip=replica_ip), advertise_ip=replica_ip
    )
    return serve_until_signalled(
        lambda: serve_fcdaemon(
            args.listen,
            driver=driver,
            registry=args.registry,
            node_id=args.node_id,
            token=args.token,
            advertise_ip=advertise,
            heartbeat=args.heartbeat or None,
            max_hogs=args.max_hogs,
            tls=tls,
            require_token=args.require_token,
            seed_only=args.seed_only,
            create_delay=args.create_delay,
        ),
        on_failure=driver.close,
    )


main = agent_main(build_parser, "require_token", "CORRAL_AGENT_TOKEN", serve_from_args)

if __name__ == "__main__":
    raise SystemExit(main())
