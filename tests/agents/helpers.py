"""Helpers for the agent tests: a recording registry server, HTTP and process checks."""

from __future__ import annotations

import http.client
import threading
import zlib
from concurrent import futures
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf import empty_pb2

from agents import MemoryDriver
from agents.drivers import VM, VMSpec
from agents.procs import is_alive
from protos import resmngr_grpc, resmngr_pb2

__all__ = [
    "RecordingRegistry",
    "children_of",
    "descendants_of",
    "http_get",
    "is_alive",
    "listening_on",
    "start_registry",
]

T = TypeVar("T")


def http_get(
    host: str, port: int, path: str = "/", timeout: float = 2.0
) -> tuple[int, bytes] | None:
    """GET ``path``; (status, body), or None if nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def listening_on(pids: list[int], port: int) -> set[str]:
    """The IPv4 addresses on which these processes hold a listening TCP socket at ``port``.

    Read from ``/proc``, not by connecting: another test's server may hold the same port
    number on another loopback address, and would answer a connection.
    """
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = fd.readlink().name
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found: set[str] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port and inode in inodes:
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is ``pid``, from ``/proc``."""
    kids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] not in (b"Z", b"X"):
            kids.append(int(entry.name))
    return kids


def descendants_of(pid: int) -> list[int]:
    """``pid`` and every live process below it (children, theirs, ...)."""
    tree = [pid]
    for parent in tree:  # the list grows as it is walked
        tree.extend(children_of(parent))
    return tree


Action: TypeAlias = resmngr_pb2.StatusUpdateReply.Action.ValueType


class RecordingRegistry(resmngr_grpc.ResMngrServiceServicer):
    """A tiny ``resmngr.ResMngrService`` that records calls and answers a set action."""

    def __init__(self, action: Action = resmngr_pb2.StatusUpdateReply.OK) -> None:
        """Answer every UpdateStatus with ``action``."""
        self.action = action
        #: Status codes UpdateStatus fails with, one per call, before answering normally.
        self.failures: list[grpc.StatusCode] = []
        self.calls: list[tuple[str, Any, dict[str, str | bytes]]] = []
        self._lock = threading.Lock()

    def _record(self, name: str, request: Any, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.calls.append((name, request, dict(context.invocation_metadata())))

    def of(self, name: str) -> list[tuple[Any, dict[str, str | bytes]]]:
        """(request, metadata) of each recorded call of ``name``."""
        with self._lock:
            return [(req, md) for n, req, md in self.calls if n == name]

    def RegisterNode(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Record the node."""
        self._record("RegisterNode", request, context)
        return empty_pb2.Empty()

    def UpdateStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Record the status and answer the configured action."""
        self._record("UpdateStatus", request, context)
        with self._lock:
            failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            context.abort(failure, "scripted failure")
        return resmngr_pb2.StatusUpdateReply(action=self.action)


def start_registry(
    listen: str = "127.0.0.1:0", servicer: RecordingRegistry | None = None
) -> tuple[grpc.Server, str, RecordingRegistry]:
    """Serve a recording registry; return (server, address, servicer)."""
    servicer = servicer or RecordingRegistry()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    resmngr_grpc.add_ResMngrServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(listen)
    server.start()
    return server, f"127.0.0.1:{port}", servicer


class MeetingDriver(MemoryDriver):
    """Each start waits until ``parties`` starts are under way at once (or times out)."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.meeting = threading.Barrier(parties, timeout=5)

    def start(self, spec: VMSpec) -> VM:
        """Start once ``parties`` starts meet; BrokenBarrierError if creates ran one by one."""
        self.meeting.wait()
        return super().start(spec)


def same_bucket_ids(n: int) -> list[str]:
    """``n`` request ids whose crc32 share one of 64 buckets (the agents' old lock stripes)."""
    ids = [f"req-{i}" for i in range(5000)]
    bucket = zlib.crc32(ids[0].encode()) % 64
    return [i for i in ids if zlib.crc32(i.encode()) % 64 == bucket][:n]
