"""Reference agents: the servers corral's workers talk to, runnable locally and in tests.

corral drives machines it does not own through two wire protocols (gRPC in ``protos/*.proto``,
HTTP in :mod:`agents.lambdo`): node agents speaking ``fcdaemon.FcService`` over gRPC and Lambdo
hosts speaking HTTP; it learns GPU inventory from ``gpuresc.GPUResc``. This package
holds a reference implementation of each, so the local stack and the tests run against
real servers on real sockets instead of mocks:

* :mod:`agents.fcdaemon` - node agent (``serve_fcdaemon``, ``corral agent fcdaemon``);
  registers with corral's registry and reports replicas READY;
* :mod:`agents.lambdo` - Lambdo-compatible host (``serve_lambdo``, ``corral agent lambdo``);
* :mod:`agents.gpus` - GPU inventory (``serve_gpus``, ``corral agent gpus``).

**Drivers.** An agent owns the protocol; a :class:`~agents.drivers.VMDriver` owns the
VMs. :class:`~agents.drivers.ProcessDriver` runs each replica as a real process (an
:mod:`examples` function serving HTTP on its host port) that dies with the agent, even
on SIGKILL; :class:`~agents.drivers.MemoryDriver` keeps VMs as records for fast tests
and benchmarks. A Firecracker or QEMU driver would slot in behind the same interface.

**Extensions.** Beyond the seed's contract the agents implement corral's
wire-compatible extensions: idempotent creation keyed by a request id, the function's
host port in the reply, ``ListReplicas`` / ``GET /vms`` for reconcile, the standard gRPC
health service, and bearer tokens. A client must still work with agents lacking them.

**Test hooks.** Every agent records the calls it received (``agent.calls``) and plays
scripted faults (``agent.inject(op, Fault.abort(...), Fault.delay(...), ...)``, see
:mod:`agents.faults`), so error paths are tested against the real transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from config import lazy

if TYPE_CHECKING:
    from agents.drivers import (
        VM,
        DriverError,
        ImageNotFound,
        MemoryDriver,
        ProcessDriver,
        VMDriver,
        VMSpec,
    )
    from agents.faults import Fault, FaultPlan
    from agents.fcdaemon import FcAgent, RunningAgent, serve_fcdaemon
    from agents.gpus import GpuAgent, RunningGpus, serve_gpus
    from agents.lambdo import LambdoAgent, RunningLambdo, serve_lambdo

# Imported lazily (PEP 562), so ``python -m agents.fcdaemon`` does not import the
# module it is about to run, and importing one agent does not import the others.
_EXPORTS = {
    **lazy.names_in(
        "agents.drivers",
        "VM",
        "DriverError",
        "ImageNotFound",
        "MemoryDriver",
        "ProcessDriver",
        "VMDriver",
        "VMSpec",
    ),
    **lazy.names_in("agents.faults", "Fault", "FaultPlan"),
    **lazy.names_in("agents.fcdaemon", "FcAgent", "RunningAgent", "serve_fcdaemon"),
    **lazy.names_in("agents.gpus", "GpuAgent", "RunningGpus", "serve_gpus"),
    **lazy.names_in("agents.lambdo", "LambdoAgent", "RunningLambdo", "serve_lambdo"),
}

__all__ = [
    "VM",
    "DriverError",
    "Fault",
    "FaultPlan",
    "FcAgent",
    "GpuAgent",
    "ImageNotFound",
    "LambdoAgent",
    "MemoryDriver",
    "ProcessDriver",
    "RunningAgent",
    "RunningGpus",
    "RunningLambdo",
    "VMDriver",
    "VMSpec",
    "serve_fcdaemon",
    "serve_gpus",
    "serve_lambdo",
]


if not TYPE_CHECKING:  # mypy sees the imports above: the names are typed, not Any
    __getattr__ = lazy.module_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    """Module attributes including the lazily imported public names."""
    return sorted({*globals(), *_EXPORTS})
