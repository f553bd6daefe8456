"""Reference GPU inventory server: ``gpuresc.GPUResc.GetGPUResource`` over gRPC.

Each GPU server's AvA manager tells corral which GPUs it has and how much memory
each holds (``ResourceReply.memory``: GPU UUID -> MB). This server answers from a
fixed map given on the command line (``--gpus UUID:MB,...``) or, without one, from
``nvidia-smi --query-gpu=uuid,memory.total --format=csv,noheader,nounits``.

For tests, :class:`GpuAgent` records calls, takes scripted faults (operation
``GetGPUResource``) and its ``gpus`` map may be changed while serving.

Command line: ``corral agent gpus`` / ``python -m agents.gpus``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
from typing import Any

import grpc

from agents import runtime
from agents.grpcserve import GrpcFaultHooks, agent_server
from netplumb.addresses import split_hostport
from netplumb.grpcserve import GuardedServer
from protos import gpuresc_grpc, gpuresc_pb2

__all__ = [
    "SERVICE_NAME",
    "GpuAgent",
    "RunningGpus",
    "main",
    "parse_gpus",
    "query_nvidia_smi",
    "serve_gpus",
]

log = logging.getLogger("agents.gpus")  # not __name__: also right under -m

SERVICE_NAME = "gpuresc.GPUResc"


def parse_gpus(text: str) -> dict[str, int]:
    """Parse ``UUID:MB,UUID:MB`` into a map; raise ValueError on malformed entries."""
    gpus: dict[str, int] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        uuid, sep, mb = item.rpartition(":")
        uuid, mb = uuid.strip(), mb.strip()
        if not sep or not uuid or not mb.isdigit():
            raise ValueError(f"expected UUID:MB, got {item!r}")
        if uuid in gpus:
            raise ValueError(f"GPU {uuid} listed twice")
        if int(mb) >= 1 << 32:
            raise ValueError(f"GPU {uuid}: {mb} MB does not fit in uint32")
        gpus[uuid] = int(mb)
    if not gpus:
        raise ValueError("no GPUs given")
    return gpus


def query_nvidia_smi(executable: str = "nvidia-smi") -> dict[str, int]:
    """Read GPU UUIDs and total memory (MB) from nvidia-smi; raise RuntimeError if unusable."""
    path = shutil.which(executable)
    if path is None:
        raise RuntimeError(f"{executable} not found; pass --gpus UUID:MB,...")
    try:
        out = subprocess.run(  # noqa: S603 - a fixed argv, nvidia-smi found on the operator's PATH
            [path, "--query-gpu=uuid,memory.total", "--format=csv,noheader,nounits"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{executable} failed: {exc}") from exc
    entries = [
        ":".join(part.strip() for part in line.split(",", 1))
        for line in out.splitlines()
        if line.strip()
    ]
    try:
        return parse_gpus(",".join(entries))
    except ValueError as exc:
        raise RuntimeError(f"cannot parse {executable} output: {exc}") from exc


class GpuAgent(GrpcFaultHooks, gpuresc_grpc.GPURescServicer):
    """The ``gpuresc.GPUResc`` servicer: answers the ``gpus`` map."""

    METHODS = ("GetGPUResource",)

    def __init__(self, gpus: dict[str, int]) -> None:
        """Serve ``gpus`` (UUID -> MB); the dict may be replaced or changed later."""
        super().__init__(self.METHODS)
        self.gpus = dict(gpus)

    def GetGPUResource(self, request: Any, context: grpc.ServicerContext) -> Any:
        """GPU UUID -> memory in MB."""
        canned, reply = self._begin("GetGPUResource", request, context)
        if canned:
            return reply
        return gpuresc_pb2.ResourceReply(memory=dict(self.gpus))


class RunningGpus(runtime.Running):
    """A GPU inventory server in background threads."""

    def __init__(
        self,
        server: GuardedServer,
        host: str,
        port: int,
        agent: GpuAgent,
    ) -> None:
        """Wrap the parts built by :func:`serve_gpus`."""
        super().__init__(host, port)
        self.server = server
        self.agent = agent

    def _shutdown(self, grace: float) -> None:
        """Stop serving (health says NOT_SERVING first)."""
        self.server.stop(grace)


def serve_gpus(
    listen: str = "127.0.0.1:0",
    gpus: dict[str, int] | None = None,
    require_token: str | None = None,
) -> RunningGpus:
    """Start a GPU inventory server answering ``gpus`` on ``listen`` (token: as fcdaemon's)."""
    host, _ = split_hostport(listen)
    agent = GpuAgent(gpus or {})
    server, port = agent_server("gpus", listen, max_workers=8, require_token=require_token)
    server.add(gpuresc_grpc.add_GPURescServicer_to_server, agent)
    server.start(SERVICE_NAME)
    shown = host or "0.0.0.0"  # noqa: S104 - a log line
    log.info("gpus listening on %s:%d serving %d GPU(s)", shown, port, len(agent.gpus))
    return RunningGpus(server, host, port, agent)


def build_parser() -> argparse.ArgumentParser:
    """The ``corral agent gpus`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="corral agent gpus",
        description="Reference GPU inventory server (gpuresc.GPUResc).",
    )
    runtime.add_common_arguments(
        parser,
        "127.0.0.1:50053",
        "--require-token",
        token_help="refuse calls without this bearer token",  # noqa: S106 - help text
    )
    parser.add_argument("--gpus", help="UUID:MB,... (default: ask nvidia-smi)")
    return parser


def serve_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Serve the GPU inventory its command line describes until SIGINT/SIGTERM; the exit code."""
    try:
        gpus = parse_gpus(args.gpus) if args.gpus is not None else query_nvidia_smi()
    except ValueError as exc:
        parser.error(str(exc))
    except RuntimeError as exc:
        log.error("%s", exc)
        return 2
    return runtime.serve_until_signalled(lambda: serve_gpus(args.listen, gpus, args.require_token))


main = runtime.agent_main(build_parser, "require_token", "CORRAL_AGENT_TOKEN", serve_from_args)

if __name__ == "__main__":
    raise SystemExit(main())
