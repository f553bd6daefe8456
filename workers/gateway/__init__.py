"""The invocation gateway: HTTP requests to functions, through claims, to replicas.

``corral gateway`` serves ``ANY /function/NAME[/PATH]``: it takes an execution
environment of one of the function's replicas (one it holds from an earlier request,
else a claim from the store, a cold start when none is Idle, shared with every other
waiter through the store), forwards the request there, streams the answer back and
returns the environment on every way out; environments unused for a moment are
given back to the store. Several gateways may serve one control plane: everything
they share lives in the store (claims, cold-start waiters) and in Redis (the demand
signal the autoscaler reads).

* :mod:`workers.gateway.proxy` - the request flow: one request, step by step, and its
  error answers (:mod:`workers.gateway.asgi`: the ASGI types and the gateway's answers);
* :mod:`workers.gateway.catalog` - each function's limit (cached) and admission gate;
* :mod:`workers.gateway.admission` - per-function concurrency limit and bounded queue;
* :mod:`workers.gateway.ledger` - the claims the gateway holds: taking one (cold start
  included), giving it back, retiring a failed replica, renewal and the keep window;
* :mod:`workers.gateway.pool` - one function's idle claims and the requests waiting;
* :mod:`workers.gateway.upstream` - the replicas' side: clients, header rules, relay;
* :mod:`workers.gateway.background` - store calls in threads, tracked background tasks;
* :mod:`workers.gateway.metrics` - the Prometheus metrics served at ``/metrics``;
* :mod:`workers.gateway.traces` - requests' spans (tracing on) and cold starts' stages;
* :mod:`workers.gateway.app` - the ASGI app, demand reports, listening rules, uvicorn;
* :mod:`workers.gateway.haproxy` - the warm data plane: a private HAProxy in front of
  the gateway carries the calls of functions whose environments the gateway holds,
  straight to their replicas; the gateway, behind it, is the activator for the rest.
"""

from workers.gateway.app import (
    GatewayApp,
    ListenRefused,
    RunningGateway,
    build_app,
    check_listen,
    run_gateway,
    serve_gateway,
)
from workers.gateway.proxy import Gateway

__all__ = [
    "Gateway",
    "GatewayApp",
    "ListenRefused",
    "RunningGateway",
    "build_app",
    "check_listen",
    "run_gateway",
    "serve_gateway",
]
