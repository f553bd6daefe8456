"""The host's end of a guest's control port, and the timeline of one start.

The model
---------
Each VM has a virtio serial port named ``corral`` whose host end is a unix socket in the
VM's directory (:mod:`agents.qemu.machine`). The agent and the guest's runtime
(:mod:`agents.qemu.guest`) exchange JSON objects there, one per line. What comes from
the guest is untrusted: a line is at most :data:`MAX_CONTROL_LINE` bytes (a longer one
fails the start), anything that is not an object with an ``event`` string is passed
over, nothing is ever executed, and text shown from it is printable ASCII only.

A start that fails raises :class:`StartFailed` (the driver tears the VM down);
:class:`Phases` records when each step of a start ended, for the agent's log.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MAX_CONTROL_LINE", "Control", "Phases", "StartFailed", "printable"]

#: Bytes of one control line from a guest (it is untrusted: longer lines are refused).
MAX_CONTROL_LINE = 64 * 1024
_NOT_PRINTABLE = re.compile(r"[^\x20-\x7e\n\t]")


def printable(text: str, chars: int) -> str:
    """The last ``chars`` of untrusted ``text``, printable ASCII only, on one line."""
    return _NOT_PRINTABLE.sub("?", text)[-chars:].replace("\n", " | ").strip()


class StartFailed(Exception):
    """A start failed; the driver tears the VM down."""


class Phases:
    """When each phase of a start ended, for the log (``qemu 0.09s, loaded 0.21s...``)."""

    def __init__(self) -> None:
        """Start the clock now."""
        self.started = time.monotonic()
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        """Phase ``name`` ends now."""
        self.marks.append((name, time.monotonic() - self.started))

    def __str__(self) -> str:
        """``name seconds`` of each phase."""
        return ", ".join(f"{name} {at:.2f}s" for name, at in self.marks)


class Control:
    """The host end of a guest's control port: JSON lines, bounded, never executed."""

    def __init__(self, path: Path, deadline: float) -> None:
        """Connect to the port's socket (QEMU makes it as it starts) before ``deadline``."""
        self._buf = b""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        while True:
            try:
                self.sock.connect(str(path))
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.sock.close()
                    raise StartFailed("QEMU never opened the control socket") from None
                time.sleep(0.005)

    def event(
        self, want: str, deadline: float, alive: Callable[[], bool], *, or_none: bool = False
    ) -> dict[str, Any] | None:
        """The guest's next event ``want`` (a JSON object whose ``event`` is it; others are
        passed over); at the deadline, None with ``or_none``, else StartFailed. A
        ``failed`` event fails the start."""
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                with contextlib.suppress(ValueError):
                    message = json.loads(line)
                    if isinstance(message, dict) and isinstance(message.get("event"), str):
                        if message["event"] == "failed":
                            error = printable(str(message.get("error", "")), 2000)
                            raise StartFailed(f"the function failed: {error}")
                        if message["event"] == want:
                            return message
            if len(self._buf) > MAX_CONTROL_LINE:
                raise StartFailed("the guest sent an overlong control line")
            left = deadline - time.monotonic()
            if left <= 0:
                if or_none:
                    return None
                raise StartFailed("timed out")
            self.sock.settimeout(min(left, 0.25))
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                if not alive():
                    raise StartFailed("QEMU exited") from None
                continue
            except OSError as exc:
                raise StartFailed(f"control port: {exc}") from None
            if not chunk:
                raise StartFailed("QEMU exited" if not alive() else "control port closed")
            self._buf += chunk

    def send(self, message: dict[str, Any], deadline: float) -> None:
        """Send one JSON line."""
        self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError as exc:
            raise StartFailed(f"control port: {exc}") from None

    def close(self) -> None:
        """Close the socket."""
        with contextlib.suppress(OSError):
            self.sock.close()
