"""Host-wide claims on host ports, shared by every agent process of one user.

A :class:`agents.drivers.PortAllocator` probes a candidate port with a bind, claims it,
and the replica binds it moments later. Inside one process a set of claimed ports closes
that window. Across processes it stays open: two agents on one host (the local stack,
a test run's workers) can both find a port free before either replica binds it; the
replica that loses exits with "address already in use", and until its agent sees it
exit, the readiness check and the gateway reach the *other* agent's replica there.

This module closes the window across processes with one record lock per port on one
shared file: a process claims port ``P`` by locking byte ``P`` of the file, and nobody
else may lock it until it lets go. The kernel drops every lock of a process when it
exits, so a killed agent leaves no claim behind, and a forked replica inherits none.

Record locks belong to a process, not to a file descriptor, and closing *any*
descriptor of the file drops them all: so the process opens the file once
(:func:`host_ports`) and never closes it. Within a process locks never conflict; the
allocator's own set still keeps two agents of one process apart.

The file lives in the temporary directory, named for the user, and is used only if the
user owns it: another user who made it first cannot take the ports away. Where it cannot
be used, claims fall back to the bind probe alone (and a warning says so once).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path

__all__ = ["HostPorts", "host_ports"]

log = logging.getLogger(__name__)


def default_path() -> Path:
    """The file of this user's claims: one per user, in the temporary directory."""
    return Path(tempfile.gettempdir()) / f"corral-host-ports-{os.getuid()}.lock"


class HostPorts:
    """Claims on host ports that other processes of this user see at once."""

    def __init__(self, path: Path) -> None:
        """Open (or make) the claims file; without a usable one, every claim succeeds."""
        self.path = path
        self._fd: int | None = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            log.warning("host ports: cannot open %s (%s); probing by bind alone", path, exc)
            return
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode):
            os.close(fd)
            log.warning("host ports: %s is not a file of this user; probing by bind alone", path)
            return
        self._fd = fd

    @property
    def shared(self) -> bool:
        """Whether claims are seen by other processes (False: the bind probe alone)."""
        return self._fd is not None

    def take(self, port: int) -> bool:
        """Claim ``port`` for this process; False if another process holds it."""
        if self._fd is None:
            return True
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            raise
        return True

    def give(self, port: int) -> None:
        """Let go of this process's claim on ``port`` (nothing if it held none)."""
        if self._fd is not None:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, port)


_HOST_PORTS: HostPorts | None = None
_HOST_PORTS_LOCK = threading.Lock()


def host_ports() -> HostPorts:
    """This process's one view of the user's claims file (opened once, never closed)."""
    global _HOST_PORTS  # one descriptor per process: closing any drops all its locks
    with _HOST_PORTS_LOCK:
        if _HOST_PORTS is None:
            _HOST_PORTS = HostPorts(default_path())
        return _HOST_PORTS
