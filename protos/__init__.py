"""Wire protocols corral speaks, compiled from the ``.proto`` files beside this module.

The ``.proto`` files are the source of truth; their Python message classes and
gRPC stubs are produced from them by ``grpc_tools`` when this package is first
imported (``grpc.protos_and_services``), so no generated code is kept in the
tree or edited by hand.

* ``fcdaemon`` - the node agent (``FcService``), spoken by corral's workers.
* ``resmngr`` / ``mngrinfo`` - the registry, served by ``corral registry``.
* ``gpuresc`` - the GPU inventory served by each GPU server's AvA manager.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import grpc

__all__ = [
    "fcdaemon_grpc",
    "fcdaemon_pb2",
    "gpuresc_grpc",
    "gpuresc_pb2",
    "mngrinfo_grpc",
    "mngrinfo_pb2",
    "resmngr_grpc",
    "resmngr_pb2",
]

fcdaemon_pb2: Any
fcdaemon_grpc: Any
resmngr_pb2: Any
resmngr_grpc: Any
mngrinfo_pb2: Any
mngrinfo_grpc: Any
gpuresc_pb2: Any
gpuresc_grpc: Any

# grpc resolves proto paths against sys.path; make sure this package's parent is
# on it whatever the install mode, so module names come out as ``protos.*_pb2``.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

fcdaemon_pb2, fcdaemon_grpc = grpc.protos_and_services("protos/fcdaemon.proto")
resmngr_pb2, resmngr_grpc = grpc.protos_and_services("protos/resmngr.proto")
mngrinfo_pb2, mngrinfo_grpc = grpc.protos_and_services("protos/mngrinfo.proto")
gpuresc_pb2, gpuresc_grpc = grpc.protos_and_services("protos/gpuresc.proto")
