"""Where one gateway's HAProxy keeps its files, and how a dead gateway's files are removed.

Each gateway on the warm path has a private directory (``0700``) for HAProxy's
configuration, its runtime socket and the activator's socket: ``haproxy-XXXXXXXX`` in
the state directory, or ``corral-haproxy-XXXXXXXX`` in the temporary directory when the
state directory's path is too long for a unix socket (``sun_path``: 108 bytes). A
gateway that stops removes its directory; one killed outright cannot.

So a gateway holds an exclusive ``flock`` on its directory for as long as it lives: the
kernel drops the lock when the process ends, however it ends (HAProxy does not inherit
it). A directory is made under a hidden name, locked and marked (an empty ``owner``
file), and only then given its public name, so a marked directory under a public name is
either locked by a live gateway or left by a dead one. Before making its own, a gateway
removes, among the directories of its user beside it (at most :data:`SWEEP_MAX` per
start), every marked one whose lock it can take. Unmarked directories (made before this
lock existed, or by something else) are left alone: nothing says whether their owner
lives.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SOCKET_PATH_MAX = 90  # a unix socket path (sun_path: 108 bytes; HAProxy takes 97 at most)
PREFIXES = ("haproxy-", "corral-haproxy-")  # in the state directory, in the temporary one
MARK = "owner"  # the file that says a directory is locked by the gateway that made it
SWEEP_MAX = 64  # dead gateways' directories one start removes at most


@dataclass
class Layout:
    """Where one gateway's HAProxy keeps its files: a private directory (``0700``), locked."""

    dir: Path
    lock_fd: int = field(default=-1, compare=False, repr=False)

    @classmethod
    def make(cls, state_dir: Path) -> Layout:
        """A new private directory in the state directory (under /tmp if its path is too long)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        parent, prefix = state_dir, PREFIXES[0]
        if len(str(cls(state_dir / f"{prefix}xxxxxxxx").activator)) > SOCKET_PATH_MAX:
            parent, prefix = Path(tempfile.gettempdir()), PREFIXES[1]
        sweep(parent)
        return cls._made(parent, prefix)

    @classmethod
    def _made(cls, parent: Path, prefix: str) -> Layout:
        """Make a hidden directory, lock and mark it, then give it its public name."""
        hidden = Path(tempfile.mkdtemp(prefix=f".{prefix}", dir=parent))
        fd = os.open(hidden, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new inode: nobody holds it
            (hidden / MARK).touch(mode=0o600)
            public = parent / hidden.name[1:]
            hidden.rename(public)  # mkdtemp's name is unique: nothing is there
        except BaseException:
            os.close(fd)
            shutil.rmtree(hidden, ignore_errors=True)
            raise
        return cls(public, fd)

    def remove(self) -> None:
        """Remove the directory and its files, then let go of its lock (idempotent)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.lock_fd >= 0:
            with contextlib.suppress(OSError):  # closed already
                os.close(self.lock_fd)
            self.lock_fd = -1

    @property
    def admin(self) -> Path:
        """HAProxy's runtime socket (``mode 600``)."""
        return self.dir / "admin.sock"

    @property
    def activator(self) -> Path:
        """The Python gateway's socket, which HAProxy hands what it does not carry."""
        return self.dir / "activator.sock"

    @property
    def relay(self) -> Path:
        """HAProxy's own socket between the functions' backends and the activator."""
        return self.dir / "relay.sock"

    @property
    def functions(self) -> Path:
        """The map from function name to backend (empty at start: filled at run time)."""
        return self.dir / "functions.map"

    @property
    def config(self) -> Path:
        """The configuration file."""
        return self.dir / "haproxy.cfg"

    @property
    def lua(self) -> Path:
        """The Lua action."""
        return self.dir / "corral.lua"

    def error(self, status: int) -> Path:
        """The answer HAProxy gives with ``status`` itself (``config.ERRORS``)."""
        return self.dir / f"{status}.http"

    @property
    def log(self) -> Path:
        """HAProxy's output."""
        return self.dir / "haproxy.log"


def sweep(parent: Path) -> list[Path]:
    """Remove the directories dead gateways of this user left in ``parent``; those removed."""
    removed: list[Path] = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIXES)]
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        if len(removed) >= SWEEP_MAX:
            break
        path = parent / name
        if _left_by_the_dead(path, uid):
            removed.append(path)
    return removed


def _left_by_the_dead(path: Path, uid: int) -> bool:
    """Remove ``path`` if it is this user's, marked, and its lock is free; True if removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, not a directory, a symlink, not ours to read
        return False
    try:
        info = os.fstat(fd)
        if info.st_uid != uid or not stat.S_ISDIR(info.st_mode):
            return False
        try:
            os.stat(MARK, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False  # unmarked: nothing says whether its owner lives
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its gateway lives
        shutil.rmtree(path, ignore_errors=True)  # under the lock: another sweeper skips it
        return True
    finally:
        os.close(fd)
