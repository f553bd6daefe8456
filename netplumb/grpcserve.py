"""gRPC serving shared by the agents and corral's registry: the bearer-token rule, health, ports.

Every corral gRPC server checks callers the same way: with a token configured, each call
must carry ``authorization: Bearer <token>`` metadata or is refused UNAUTHENTICATED,
except the standard ``grpc.health.v1`` service, which stays open so health checks need
no secret. :class:`TokenInterceptor` is that rule; the node agent, the GPU inventory
and the registry install it. The registry also accepts a guest's *report token*
(:func:`report_token`: ``vm.<vmid>.<MAC keyed by the registry token>``), which an agent
gives each guest it starts and which lets that guest report on its own VM only. The
other helpers are the steps every server takes: the health service, binding the listen
address (plain or TLS) and marking it serving (the agents' own server set-up is
:mod:`agents.grpcserve`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = [
    "REPORT_PREFIX",
    "TokenInterceptor",
    "add_health",
    "bearer_of",
    "bind_port",
    "mark_serving",
    "report_token",
    "report_vmid",
    "token_interceptors",
]


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
    vmid, _, _mac = bearer[len(REPORT_PREFIX) :].rpartition(".")
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
