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

import importlib
from typing import TYPE_CHECKING, Any

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
    "VM": "agents.drivers",
    "DriverError": "agents.drivers",
    "ImageNotFound": "agents.drivers",
    "MemoryDriver": "agents.drivers",
    "ProcessDriver": "agents.drivers",
    "VMDriver": "agents.drivers",
    "VMSpec": "agents.drivers",
    "Fault": "agents.faults",
    "FaultPlan": "agents.faults",
    "FcAgent": "agents.fcdaemon",
    "RunningAgent": "agents.fcdaemon",
    "serve_fcdaemon": "agents.fcdaemon",
    "GpuAgent": "agents.gpus",
    "RunningGpus": "agents.gpus",
    "serve_gpus": "agents.gpus",
    "LambdoAgent": "agents.lambdo",
    "RunningLambdo": "agents.lambdo",
    "serve_lambdo": "agents.lambdo",
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


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use.

    importlib, not kombu's ``symbol_by_name`` as the workers' lazy imports: importing
    ``kombu.utils`` loads about 0.1 s of kombu, which an agent process never needs."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agents' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Module attributes including the lazily imported public names."""
    return sorted({*globals(), *_EXPORTS})
