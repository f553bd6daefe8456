"""Example functions: tiny HTTP servers that stand in for a function running in a microVM.

A replica started by :class:`agents.drivers.ProcessDriver` whose image is ``hello`` or
``examples.hello`` runs ``python -m examples.hello``. The contract every example keeps
(and any command used as an image must keep too):

* listen for HTTP on ``$HOST:$PORT`` (``HOST`` defaults to ``127.0.0.1``, ``PORT`` to 8080);
* answer as soon as the port is open - the agent's readiness probe sends ``GET /``;
* exit promptly on SIGTERM.

Examples use only the standard library, so they start in a fraction of a second.

* :mod:`examples.hello` - answers ``hello from corral`` to GET and POST.
* :mod:`examples.echo` - echoes the request body back, after an optional delay.
* :mod:`examples.whoami` - says which replica answered: its VMID, fresh random numbers, its clock.
"""
