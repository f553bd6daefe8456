"""Snapshots for warm starts: one per function build, restored only by VMs of that build.

The model
---------
Once the first replica of a build serves (and before it has any identity:
:mod:`agents.qemu.guest`), the driver pauses it and writes its whole state - RAM,
devices - to a file with QMP ``migrate``; once that replica has answered as itself, the
snapshot is published. Later creates of the same image start QEMU with ``-incoming`` on
that file and ``cont`` it: the function is already serving, only the identity is new.

A snapshot lives in ``CACHE/snapshots/<slot>/<key>/`` (``state`` and ``meta.json``; the
slot is the image and the VM's shape, ``examples.hello@512m1c``),
where the key hashes everything the saved state depends on (:class:`SnapshotKey`): the
function's build (every byte of its image) and environment (a keyed hash: the snapshot's
function has read it), the kernel, the QEMU binary and the machine (accelerator, CPU
model, memory, CPUs, kernel arguments). A create looks only in
its slot: a snapshot there under another key - an older build, another
kernel, another QEMU - is **refused**: never restored, counted (by the fields that
differ) and deleted; the VM boots cold and becomes the new build's snapshot.

Bounds: one snapshot per slot, at most ``max_snapshots`` slots and ``max_bytes`` in
all (the least recently restored go first). One snapshot per key is taken at a time,
across processes sharing the cache (a lock file held while it is written).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["SnapshotKey", "Snapshots"]

log = logging.getLogger(__name__)

_REASONS = {
    "build": "another build of the function",
    "env": "another environment",
    "kernel": "another kernel",
    "qemu": "another QEMU",
}


@dataclass(frozen=True)
class SnapshotKey:
    """What a snapshot's state depends on; a restore needs every field equal."""

    build: str  # the image's key
    env: str  # a keyed hash of the function's environment (it is set before the snapshot)
    kernel: str
    qemu: str
    accel: str
    cpu_model: str
    mem_mb: int
    cpus: int
    append: str
    devices: str = ""

    def digest(self) -> str:
        """A short hash of every field (the snapshot's directory name)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:24]


def _reason(old: dict[str, object], new: SnapshotKey) -> str:
    """Why a snapshot made under ``old`` does not fit ``new``: the first field that differs."""
    for name, value in asdict(new).items():
        if old.get(name) != value:
            return _REASONS.get(name, f"another machine ({name})")
    return "an unreadable snapshot"


class Snapshots:
    """The snapshot store of one cache directory."""

    def __init__(
        self,
        cache: Path,
        *,
        max_snapshots: int = 8,
        max_bytes: int = 4 << 30,
        directory: Path | None = None,
    ) -> None:
        """Keep at most ``max_snapshots`` snapshots and ``max_bytes`` of them, in
        ``directory`` (default: the cache's ``snapshots``)."""
        self.directory = directory or cache / "snapshots"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_snapshots = max(1, max_snapshots)
        self.max_bytes = max_bytes
        #: Snapshots refused, by reason ("another build of the function"...).
        self.refused: collections.Counter[str] = collections.Counter()
        self.taken = 0
        self._lock = threading.Lock()

    def _slot(self, slot: str) -> Path:
        return self.directory / slot

    def find(self, name: str, key: SnapshotKey) -> Path | None:
        """The state file to restore a VM of slot ``name`` from, or None (refusing a stale one)."""
        slot = self._slot(name)
        if not slot.is_dir():
            return None
        found = None
        for entry in list(slot.iterdir()):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            state, meta = entry / "state", entry / "meta.json"
            if entry.name == key.digest() and state.is_file() and meta.is_file():
                found = state
                with contextlib.suppress(OSError):
                    os.utime(meta)
                continue
            try:
                old = json.loads(meta.read_text()).get("key", {})
            except (OSError, ValueError, AttributeError):
                old = {}
            reason = _reason(old if isinstance(old, dict) else {}, key)
            with self._lock:
                self.refused[reason] += 1
            log.warning("snapshot of %s refused (%s): booting cold; it is deleted", name, reason)
            shutil.rmtree(entry, ignore_errors=True)
        return found

    @contextlib.contextmanager
    def taking(self, name: str, key: SnapshotKey) -> Iterator[Path | None]:
        """A staging file to write ``key``'s snapshot to, or None when one is being taken
        (here or by another process) or exists already."""
        slot = self._slot(name)
        slot.mkdir(parents=True, exist_ok=True)
        target = slot / key.digest()
        with open(slot / f".{key.digest()}.lock", "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
                return
            try:
                if target.is_dir():
                    yield None
                    return
                # One staging file per key, under its lock: what a killed taker left is
                # overwritten here, not kept beside a new one.
                staging = slot / f".{key.digest()}.staging"
                fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.close(fd)
                try:
                    yield staging
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(staging)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def publish(self, name: str, key: SnapshotKey, staging: Path) -> Path:
        """Make a written staging file the snapshot of ``key``; prune to the bounds."""
        slot = self._slot(name)
        build = Path(tempfile.mkdtemp(prefix=".new-", dir=slot))
        try:
            os.replace(staging, build / "state")
            meta = {"slot": name, "key": asdict(key), "bytes": (build / "state").stat().st_size}
            (build / "meta.json").write_text(json.dumps(meta, indent=1))
            os.replace(build, slot / key.digest())
        except OSError:
            shutil.rmtree(build, ignore_errors=True)
            raise
        with self._lock:
            self.taken += 1
        self._prune()
        return slot / key.digest() / "state"

    def discard(self, name: str, key: SnapshotKey) -> None:
        """Delete the snapshot of ``key`` (one that failed to restore)."""
        shutil.rmtree(self._slot(name) / key.digest(), ignore_errors=True)

    def _prune(self) -> None:
        """Remove the least recently used snapshots beyond the bounds, and what a taker
        killed mid-way left (a staging file or a half-made directory, an hour old)."""
        stale = time.time() - 3600
        for leftover in [*self.directory.glob("*/.*.staging"), *self.directory.glob("*/.new-*")]:
            with contextlib.suppress(OSError):
                if leftover.stat().st_mtime < stale:
                    if leftover.is_dir():
                        shutil.rmtree(leftover, ignore_errors=True)
                    else:
                        leftover.unlink()
        entries = []
        for meta in self.directory.glob("*/*/meta.json"):
            with contextlib.suppress(OSError):
                state = meta.with_name("state")
                entries.append((meta.stat().st_mtime, meta.parent, state.stat().st_size))
        entries.sort(reverse=True)
        total = 0
        for i, (_, entry, size) in enumerate(entries):
            total += size
            if i >= self.max_snapshots or total > self.max_bytes:
                log.info("snapshot %s removed (store bounds)", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def stats(self) -> dict[str, object]:
        """Snapshots taken and refused (by reason), since this store was made."""
        with self._lock:
            return {"taken": self.taken, "refused": dict(self.refused)}
