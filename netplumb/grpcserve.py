"""gRPC serving shared by the agents and corral's registry: one server shape, behind one guard.

Every corral gRPC server (the node agent, the GPU inventory, the registry) is a
:class:`GuardedServer`: a :mod:`grpc.aio` server on an event loop of its own thread,
behind the :class:`~netplumb.grpcguard.Guard`. The loop takes every call's headers and
message, checks the bearer token on the headers alone, caps what each kind of caller has
in flight, and hands a call to the thread pool (``workers`` threads, where the
servicers' synchronous handlers run) only once its message is in: a caller without the
token, or one that never sends its message, holds no thread. The standard
``grpc.health.v1`` service is answered on the loop, never by the pool, and stays open:
health checks need no secret (a caller with the token is still counted as trusted).

The registry also accepts a guest's *report token* (:func:`report_token`:
``vm.<vmid>.<MAC keyed by the registry token>``), which an agent gives each guest it
starts and which lets that guest report on its own VM only.

The connection level is bounded by gRPC core's options (:data:`SERVER_OPTIONS`): streams
per connection, idle and aged connections closed, a handshake deadline, no port
sharing; each server sets its largest message.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import threading
from collections.abc import Callable, Coroutine
from concurrent import futures
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from netplumb.grpcguard import Guard, Limits, bearer_of

__all__ = [
    "REPORT_PREFIX",
    "SERVER_OPTIONS",
    "GuardedServer",
    "Limits",
    "bearer_of",
    "report_token",
    "report_vmid",
]

T = TypeVar("T")

REPORT_PREFIX = "vm."
_REPORT_MAC_HEX = 32

#: Every corral gRPC server: no other process may share its port; at most 1,024 calls at
#: once on one connection (far above what one peer may have in flight: the guard's
#: caps answer first); a connection with no call for 5 minutes is closed, and every
#: connection after 30 minutes (±10 %: gRPC's jitter), its calls given 60 s to finish
#: (more than the longest create corral waits for); a connection must finish its
#: HTTP/2 handshake within 10 s. BDP probing is off: it grows a stream's flow-control
#: window to megabytes, which gRPC core fills before it can refuse an oversized or
#: unauthenticated message (120 such calls held 17-86 MB; at the fixed 64 KiB, 6-8 MB).
#: corral's messages are small and its peers close, so the fixed window costs nothing.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_concurrent_streams", 1024),
    ("grpc.max_connection_idle_ms", 300_000),
    ("grpc.max_connection_age_ms", 1_800_000),
    ("grpc.max_connection_age_grace_ms", 60_000),
    ("grpc.server_handshake_timeout_ms", 10_000),
    ("grpc.http2.bdp_probe", 0),
]


def report_token(token: str, vmid: str) -> str:
    """The credential a guest of ``vmid`` reports with: ``vm.<vmid>.<MAC>``, good for that VM only.

    The MAC is keyed by the registry token, so whoever holds that token (an agent) can
    mint one per VM it starts, and the registry checks it without storing anything.
    """
    mac = hmac.new(token.encode(), b"corral-report\0" + vmid.encode(), hashlib.sha256)
    return f"{REPORT_PREFIX}{vmid}.{mac.hexdigest()[:_REPORT_MAC_HEX]}"


def report_vmid(token: str, bearer: str) -> str | None:
    """The vmid ``bearer`` is a report token for (keyed by ``token``), or None if it is not one."""
    if not token or not bearer.startswith(REPORT_PREFIX):
        return None
    vmid, _, _mac = bearer[len(REPORT_PREFIX) :].rpartition(".")
    if not vmid or not hmac.compare_digest(bearer.encode(), report_token(token, vmid).encode()):
        return None
    return vmid


class GuardedServer:
    """A gRPC server on its own event loop thread, behind the guard; handlers on a thread pool.

    Build it, :meth:`add` the servicers, :meth:`bind`, then :meth:`start`;
    :meth:`stop` once (later calls do nothing).
    """

    def __init__(  # noqa: PLR0913 - a server's options, by name
        self,
        name: str,
        *,
        workers: int,
        max_message: int,
        token: str | None = None,
        what: str = "agent",
        report: Callable[[str], str | None] | None = None,
        limits: Limits | None = None,
    ) -> None:
        """A server named ``name`` (its threads' names) with ``workers`` handler threads.

        With ``token``, a call must carry ``authorization: Bearer <token>`` or is refused
        UNAUTHENTICATED (a refusal names the ``what`` token); ``report`` lets guests'
        report tokens in (:class:`~netplumb.grpcguard.Guard`). A request message is at
        most ``max_message`` bytes; ``limits``: the guard's caps (default :class:`Limits`).
        """
        self.name = name
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.guard = Guard(token, self.pool, what=what, report=report, limits=limits or Limits())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{name}-grpc", daemon=True
        )
        self._thread.start()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_message)]
        self._server, self._health = self._run(self._build(options))

    async def _build(
        self, options: list[tuple[str, int]]
    ) -> tuple[grpc.aio.Server, health_async.HealthServicer]:
        server = grpc.aio.server(
            migration_thread_pool=self.pool, interceptors=[self.guard], options=options
        )
        health = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        return server, health

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def add(self, add_to_server: Callable[[Any, Any], None], servicer: object) -> None:
        """Add ``servicer`` with its generated ``add_XServicer_to_server`` function."""

        async def add() -> None:
            add_to_server(servicer, self._server)

        self._run(add())

    def bind(self, listen: str, tls: tuple[bytes, bytes] | None = None) -> int:
        """Bind ``listen`` (TLS with a (key, chain) PEM pair); the port, or OSError if it cannot.

        A server that cannot bind is stopped (its threads end) before the error is raised.
        """

        async def bind() -> int:
            if tls is not None:
                return int(self._server.add_secure_port(listen, grpc.ssl_server_credentials([tls])))
            return int(self._server.add_insecure_port(listen))

        try:
            port = self._run(bind())
        except RuntimeError as exc:
            self.stop(0)
            raise OSError(f"cannot listen on {listen}: {exc}") from exc
        if port == 0:
            self.stop(0)
            raise OSError(f"cannot listen on {listen}")
        return port

    def start(self, *services: str) -> None:
        """Start serving; health says SERVING for the server and each of ``services``."""

        async def start() -> None:
            for service in ("", *services):
                await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
            await self._server.start()

        self._run(start())

    def stop(self, grace: float = 0.5) -> threading.Event:
        """Say NOT_SERVING, stop (calls in flight get ``grace`` seconds), end the threads.

        Returns an event, already set: the server has stopped.
        """
        with self._lock:
            if self._stopping:
                self._stopped.wait()
                return self._stopped
            self._stopping = True

        async def stop() -> None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace)
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        try:
            self._run(stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            with contextlib.suppress(RuntimeError):
                self._loop.close()
            self.pool.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped (or ``timeout``); True if it has."""
        return self._stopped.wait(timeout)
