"""QMP, the QEMU Machine Protocol, from the driver's threads: one event loop for every VM.

The model
---------
QEMU's own client library (``qemu.qmp``, maintained by the QEMU project) is asyncio. The
driver's callers are threads (gRPC's pool, the Lambdo host's), so the driver keeps one
event loop in a daemon thread (:class:`QmpLoop`) where every VM's client lives, and a
:class:`Monitor` per VM turns each command into a call that waits on that loop with a
deadline. A command that outlives its deadline raises :class:`QmpError`; so does a VM
whose QEMU went away (its socket closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from qemu.qmp import QMPClient, QMPError

__all__ = ["Monitor", "QmpError", "QmpLoop"]

T = TypeVar("T")
# qemu.qmp logs each connection and command, and each failure at ERROR (a VM that is
# stopping, a socket not made yet): the driver reports what failed itself.
logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)


class QmpError(RuntimeError):
    """A QMP command failed, timed out, or its QEMU is gone."""


class QmpLoop:
    """An asyncio event loop in a daemon thread, shared by every VM's QMP client."""

    def __init__(self) -> None:
        """Start the loop's thread."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="corral-qmp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it, at most ``timeout`` seconds."""
        if self.loop.is_closed():
            coro.close()
            raise QmpError("the QMP loop is closed")
        future = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(coro, max(0.001, timeout)), self.loop
        )
        try:
            return future.result(timeout + 1.0)
        except TimeoutError:
            future.cancel()
            raise QmpError(f"no answer within {timeout:.1f}s") from None

    def close(self) -> None:
        """Stop the loop and its thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()


class Monitor:
    """One VM's QMP connection, used from any thread."""

    def __init__(self, loop: QmpLoop, path: Path, name: str) -> None:
        """A monitor for the QMP socket at ``path`` (connect with :meth:`connect`)."""
        self._loop = loop
        self.path = path
        self.name = name
        self._client: QMPClient | None = None

    def connect(self, timeout: float) -> None:
        """Connect, retrying while QEMU has not made its socket yet, for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout

        async def attempt() -> QMPClient:
            while not self.path.exists():
                if time.monotonic() > deadline:
                    raise QmpError(f"no QMP socket at {self.path}")
                await asyncio.sleep(0.005)
            while True:
                client = QMPClient(self.name)
                try:
                    await client.connect(str(self.path))
                    return client
                except (QMPError, OSError):
                    with contextlib.suppress(QMPError, OSError):
                        await client.disconnect()
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.01)

        try:
            self._client = self._loop.run(attempt(), timeout)
        except QmpError:
            raise
        except (QMPError, OSError, EOFError) as exc:
            raise QmpError(f"QMP connect to {self.path} failed: {exc}") from None

    def execute(
        self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> Any:
        """Run one QMP command; its return value."""
        client = self._client
        if client is None:
            raise QmpError("not connected")
        try:
            return self._loop.run(client.execute(command, arguments), timeout)
        except (QMPError, OSError, EOFError) as exc:
            raise QmpError(f"{command}: {type(exc).__name__}: {exc}") from None

    def send_fd(self, fd: int, name: str, timeout: float = 10.0) -> None:
        """Hand QEMU a file descriptor (SCM_RIGHTS), known to it as ``name`` (``getfd``)."""
        client = self._client
        if client is None:
            raise QmpError("not connected")

        async def send() -> None:
            client.send_fd_scm(fd)
            await client.execute("getfd", {"fdname": name})

        try:
            self._loop.run(send(), timeout)
        except (QMPError, OSError, EOFError) as exc:
            raise QmpError(f"getfd: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        """Disconnect (quietly: QEMU may be gone already)."""
        client, self._client = self._client, None
        if client is not None:
            # whatever the library raises from a connection QEMU has closed: it is closed
            with contextlib.suppress(Exception):
                self._loop.run(client.disconnect(), 2.0)
