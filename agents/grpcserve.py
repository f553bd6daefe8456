"""gRPC serving shared by the agents and corral's registry: the bearer-token rule, health, ports.

Every corral gRPC server checks callers the same way: with a token configured, each call
must carry ``authorization: Bearer <token>`` metadata or is refused UNAUTHENTICATED,
except the standard ``grpc.health.v1`` service, which stays open so health checks need
no secret. :class:`TokenInterceptor` is that rule; the node agent, the GPU inventory
and the registry install it. The registry also accepts a guest's *report token*
(:func:`report_token`: ``vm.<vmid>.<MAC keyed by the registry token>``), which an agent
gives each guest it starts and which lets that guest report on its own VM only. The
other helpers are the steps the agents' servers share: the health service, binding the
listen address (plain or TLS) and marking it serving.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agents.faults import FaultHooks, record_call

__all__ = [
    "AGENT_OPTIONS", "REPORT_PREFIX", "GrpcFaultHooks", "TokenInterceptor", "add_health",
    "agent_server", "bearer_of", "bind_port", "mark_serving", "report_token", "report_vmid",
    "token_interceptors",
]

log = logging.getLogger("agents.faults")


REPORT_PREFIX = "vm."
_REPORT_MAC_HEX = 32


def report_token(token: str, vmid: str) -> str:
    """The credential a guest of ``vmid`` reports with: ``vm.<vmid>.<MAC>``, good for that VM only.

    The MAC is keyed by the registry token, so whoever holds that token (an agent) can
    mint one per VM it starts, and the registry checks it without storing anything.
    """
    mac = hmac.new(token.encode(), b"corral-report\0" + vmid.encode(), hashlib.sha256)
    return f"{REPORT_PREFIX}{vmid}.{mac.hexdigest()[:_REPORT_MAC_HEX]}"


def report_vmid(token: str, bearer: str) -> str | None:
    """The vmid ``bearer`` is a report token for (keyed by ``token``), or None if it is not one."""
    if not bearer.startswith(REPORT_PREFIX):
        return None
    vmid, _, _mac = bearer[len(REPORT_PREFIX):].rpartition(".")
    if not vmid or not hmac.compare_digest(bearer.encode(), report_token(token, vmid).encode()):
        return None
    return vmid


def bearer_of(metadata: Any) -> str:
    """The bearer value of a call's ``authorization`` metadata ("" if none)."""
    sent = str(dict(metadata or ()).get("authorization", ""))
    scheme, _, value = sent.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the shared bearer token (the health service stays open)."""

    def __init__(
        self, token: str, what: str = "agent", *, also: Callable[[str], bool] | None = None
    ) -> None:
        """Expect ``authorization: Bearer <token>``; a refusal names the ``what`` token.

        ``also(bearer)`` may accept other bearer values (the registry: guests' report
        tokens); the servicer then limits what such a caller may do.
        """
        self._expected = f"Bearer {token}".encode()
        self._also = also
        message = f"missing or invalid {what} token"

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        self._deny: Any = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        """Let the call through only with the right token."""
        if details.method.startswith("/grpc.health."):
            return continuation(details)
        sent = str(dict(details.invocation_metadata).get("authorization", ""))
        if hmac.compare_digest(sent.encode(), self._expected):
            return continuation(details)
        if self._also is not None and self._also(bearer_of(details.invocation_metadata)):
            return continuation(details)
        return self._deny


def token_interceptors(
    token: str | None, what: str = "agent", *, also: Callable[[str], bool] | None = None
) -> list[grpc.ServerInterceptor]:
    """The interceptors a server needs: the token check when ``token`` is set, else none."""
    return [TokenInterceptor(token, what, also=also)] if token else []


#: An agent's server: no other process may share its port; a message is at most 1 MiB (a
#: CreateRequest with a function's whole environment is far less). Calls per connection are
#: not capped: a client that opens many before the server's SETTINGS arrive has them refused
#: (REFUSED_STREAM), which a reap of hundreds showed; the cap on calls in all holds instead.
AGENT_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 1 << 20),
]


def agent_server(
    name: str,
    listen: str,
    *,
    max_workers: int,
    require_token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """An agent's gRPC server bound to ``listen``: (server, its health service, port).

    Add the agent's servicer, then ``server.start()`` and :func:`mark_serving`.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
        options=AGENT_OPTIONS,
        # calls beyond this (running or queued for the threads, each holding its message)
        # are answered RESOURCE_EXHAUSTED at once instead of piling up in memory
        maximum_concurrent_rpcs=4 * max_workers,
        interceptors=token_interceptors(require_token),
    )
    health_servicer = add_health(server)
    return server, health_servicer, bind_port(server, listen, tls)


def add_health(server: grpc.Server, *, non_blocking: bool = True) -> health.HealthServicer:
    """Add the standard health service to ``server`` (NOT_SERVING until marked)."""
    servicer = health.HealthServicer(experimental_non_blocking=non_blocking)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


def mark_serving(servicer: health.HealthServicer, *services: str) -> None:
    """Report the server (``""``) and each named service SERVING."""
    for service in ("", *services):
        servicer.set(service, health_pb2.HealthCheckResponse.SERVING)


def bind_port(server: grpc.Server, listen: str, tls: tuple[bytes, bytes] | None = None) -> int:
    """Bind ``listen`` (TLS with a (key, chain) PEM pair); the port, or OSError if it cannot."""
    try:
        if tls is not None:
            port = server.add_secure_port(listen, grpc.ssl_server_credentials([tls]))
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {listen}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    return int(port)


class GrpcFaultHooks(FaultHooks):
    """:class:`~agents.faults.FaultHooks` for a gRPC servicer: plays a fault on the call."""

    def _begin(self, method: str, request: Any, context: grpc.ServicerContext) -> tuple[bool, Any]:
        """Record the call and apply the next fault; (True, reply) means answer that."""
        record_call(self.calls, method, request)
        fault = self.faults.take(method)
        if fault is None:
            return False, None
        log.info("%s: injected fault %s", method, fault.kind)
        if fault.kind == "delay":
            time.sleep(fault.seconds)
            return False, None
        if fault.kind == "reply":
            return True, fault.value
        if fault.kind == "abort":
            code = fault.code
            if not isinstance(code, grpc.StatusCode):
                code = grpc.StatusCode.UNKNOWN
            context.abort(code, fault.message or f"injected {code.name}")
        context.abort(grpc.StatusCode.UNAVAILABLE, "injected hangup")
        raise AssertionError("unreachable")  # context.abort raises
