"""The agents' gRPC servers: how one is built, and the faults it can be told to play.

:func:`agent_server` makes the server the node agent and the GPU inventory run: its
options (:data:`AGENT_OPTIONS`), a bound on calls in flight, the token rule and the
health service (:mod:`netplumb.grpcserve`, shared with corral's registry), bound to the
listen address. :class:`GrpcFaultHooks` plays the faults a test scripts
(:mod:`agents.faults`) on a gRPC call.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health

from agents.faults import FaultHooks, record_call
from netplumb.grpcserve import add_health, bind_port, token_interceptors

__all__ = ["AGENT_OPTIONS", "GrpcFaultHooks", "agent_server"]

log = logging.getLogger("agents.faults")


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

    Add the agent's servicer, then ``server.start()`` and
    :func:`~netplumb.grpcserve.mark_serving`.
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
            fault.wait()
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
