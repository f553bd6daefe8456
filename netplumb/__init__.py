"""Network plumbing that corral's control plane (``workers``) and its reference agents share.

The model
---------
corral's servers (the registry, the gateway, the metrics exporter) and the reference
agents (the fcdaemon agent, the Lambdo host, the GPU inventory) stand on the same
network and follow the same rules: they parse addresses alike, none listens off
loopback without a token, a gRPC server checks a bearer token (and guests' report
tokens) the same way and keeps its health service open, an HTTP server bounds what a
caller can make it do before it has shown the token, and a function's environment -
which crosses the network into a guest - passes one rule on both ends.

That plumbing lives here, in a package of its own below both ``workers`` and
``agents``, because neither may import the other: the agents are a reference
implementation anyone may replace, so the control plane must not depend on them
(``lint-imports`` forbids it), and an agent process must not load the control
plane's dependencies (SQLAlchemy, pydantic, Celery). ``netplumb`` imports neither of
them, nor :mod:`config`: the standard library, gRPC and the HTTP server stack
(uvicorn, httptools) only.

* :mod:`netplumb.addresses` - host and port strings: the one parser;
* :mod:`netplumb.listening` - the listening rule;
* :mod:`netplumb.grpcserve` - the one gRPC server shape (an event loop thread in front
  of the handlers' pool), guests' report tokens;
* :mod:`netplumb.grpcguard` - what a gRPC caller may hold: the token checked on a
  call's headers, calls in flight capped per kind of caller, the request message's
  deadline;
* :mod:`netplumb.asgiserve` - bounded HTTP serving, the one server stack of the
  gateway, the Lambdo host and the exporter (connections in all and per peer, a request
  head's bytes and deadline, trailers, idle connections, a lingering close after an
  early answer);
* :mod:`netplumb.descriptors` - the descriptor limit, raised at start, that the
  servers' caps stay below;
* :mod:`netplumb.guest_env` - what a function's environment may hold.
"""
