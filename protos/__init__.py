"""Wire protocols corral speaks, generated from the ``.proto`` files beside this module.

The ``.proto`` files are the source of truth. Their message classes, gRPC stubs and
type stubs (``*_pb2.py``, ``*_pb2_grpc.py`` and ``.pyi`` files from mypy-protobuf)
are produced by ``python -m protos.generate`` and committed; a test runs
``python -m protos.generate --check`` so they cannot drift from the ``.proto``
files, and the runtime needs no compiler.

* ``fcdaemon`` - the node agent (``FcService``), spoken by corral's workers.
* ``resmngr`` / ``mngrinfo`` - the registry, served by ``corral registry``.
* ``gpuresc`` - the GPU inventory served by each GPU server's AvA manager.

``X_grpc`` is the short name of the generated ``X_pb2_grpc`` module.
"""

from __future__ import annotations

from protos import fcdaemon_pb2, gpuresc_pb2, mngrinfo_pb2, resmngr_pb2
from protos import fcdaemon_pb2_grpc as fcdaemon_grpc
from protos import gpuresc_pb2_grpc as gpuresc_grpc
from protos import mngrinfo_pb2_grpc as mngrinfo_grpc
from protos import resmngr_pb2_grpc as resmngr_grpc

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
