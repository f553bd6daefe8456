"""Locks between processes sharing one cache directory: ``flock`` on a file.

Agents (and the test suite's workers) may share a cache: the kernel is unpacked once,
an image built once per key, the accelerator probed once, whoever comes first; the others
wait on the same lock file and then find the result in place.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

__all__ = ["lock_file"]


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
