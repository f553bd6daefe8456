"""The qemu driver's cache directory: where it is, and locks between processes sharing it.

The cache holds the guest kernel, the images and the snapshots (``$CORRAL_QEMU_CACHE``,
else ``~/.cache/corral/qemu``). Agents (and the test suite's workers) may share one: the
kernel is unpacked once, an image built once per key, the accelerator probed once,
whoever comes first; the others wait on the same lock file (``flock``) and then find the
result in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["cache_secret", "default_cache", "lock_file"]


def default_cache() -> Path:
    """``$CORRAL_QEMU_CACHE``, else ``$XDG_CACHE_HOME/corral/qemu`` (``~/.cache/...``)."""
    env = os.environ.get("CORRAL_QEMU_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "corral" / "qemu"


@contextlib.contextmanager
def lock_file(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cache_secret(cache: Path) -> bytes:
    """A random key of this cache (made once, readable by its owner only): what keys the
    hashes of secrets the cache records (a function's environment in a snapshot's key)."""
    path = cache / ".secret"
    with lock_file(cache / ".secret.lock"):
        with contextlib.suppress(FileNotFoundError):
            data = path.read_bytes()
            if len(data) == 32:
                return data
        data = os.urandom(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return data
