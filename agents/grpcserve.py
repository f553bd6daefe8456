"""The agents' gRPC servers: how one is built, and the faults it can be told to play.

:func:`agent_server` makes the server the node agent and the GPU inventory run: a
:class:`~netplumb.grpcserve.GuardedServer` (shared with corral's registry: the token
checked on a call's headers, calls in flight capped per caller, a deadline for the
request message, health answered off the thread pool) with the agents' message size,
bound to the listen address. :class:`GrpcFaultHooks` plays the faults a test scripts
(:mod:`agents.faults`) on a gRPC call.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from agents.faults import FaultHooks, record_call
from netplumb.grpcserve import GuardedServer, Limits

__all__ = ["MAX_MESSAGE", "GrpcFaultHooks", "agent_server"]

log = logging.getLogger("agents.faults")


#: An agent's largest request message: 1 MiB (a CreateRequest with a function's whole
#: environment is far less).
MAX_MESSAGE = 1 << 20


def agent_server(
    name: str,
    listen: str,
    *,
    max_workers: int,
    require_token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
) -> tuple[GuardedServer, int]:
    """An agent's gRPC server bound to ``listen``: (server, port).

    Add the agent's servicer (:meth:`~netplumb.grpcserve.GuardedServer.add`), then
    ``server.start(SERVICE_NAME)``. Callers with the token may have 4 calls per
    handler thread in flight each (running or waiting for a thread).
    """
    server = GuardedServer(
        name,
        workers=max_workers,
        max_message=MAX_MESSAGE,
        token=require_token,
        limits=Limits(calls_per_peer=4 * max_workers),
    )
    return server, server.bind(listen, tls)


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
