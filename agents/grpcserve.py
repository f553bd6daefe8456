"""gRPC serving shared by the agents and corral's registry: the bearer-token rule, health, ports.

Every corral gRPC server checks callers the same way: with a token configured, each call
must carry ``authorization: Bearer <token>`` metadata or is refused UNAUTHENTICATED,
except the standard ``grpc.health.v1`` service, which stays open so health checks need
no secret. :class:`TokenInterceptor` is that rule; the node agent, the GPU inventory
and the registry install it. The other helpers are the steps the agents' servers share:
the health service, binding the listen address (plain or TLS) and marking it serving.
"""

from __future__ import annotations

import hmac
import logging
import time
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agents.faults import FaultHooks, record_call

__all__ = [
    "GrpcFaultHooks", "TokenInterceptor", "add_health", "agent_server", "bind_port",
    "mark_serving", "token_interceptors",
]

log = logging.getLogger("agents.faults")


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the shared bearer token (the health service stays open)."""

    def __init__(self, token: str, what: str = "agent") -> None:
        """Expect ``authorization: Bearer <token>``; a refusal names the ``what`` token."""
        self._expected = f"Bearer {token}".encode()
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
        return self._deny


def token_interceptors(token: str | None, what: str = "agent") -> list[grpc.ServerInterceptor]:
    """The interceptors a server needs: the token check when ``token`` is set, else none."""
    return [TokenInterceptor(token, what)] if token else []


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
        options=[("grpc.so_reuseport", 0)],
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
