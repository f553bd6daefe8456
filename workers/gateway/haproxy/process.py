"""The gateway's HAProxy process: found, started on the gateway's socket, watched, stopped.

HAProxy runs in the foreground (``-db``) as a child of the gateway, on the listening
socket the gateway bound (passed to it as its stdin: ``bind fd@0``), so the port is the gateway's
whatever HAProxy does: if it dies, the gateway starts it again on the same socket
(callers wait in the kernel's backlog meanwhile) and programs it again from what it
holds (:mod:`.router`). Where ``setpriv`` is installed HAProxy is started under
``--pdeathsig TERM``, so a gateway killed outright takes its HAProxy with it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

from workers.gateway.haproxy.layout import Layout

log = logging.getLogger(__name__)

LEAST = (2, 6)  # add server at run time without experimental mode, be_conn_free, wait-for-body
START_S = 10.0  # from start to the runtime socket answering
STOP_S = 5.0  # a soft stop's grace before it is killed


class Unavailable(Exception):
    """No usable HAProxy: not installed, too old, or it would not start."""


@dataclass(frozen=True)
class Binary:
    """An HAProxy executable and its version."""

    path: str
    version: str  # as it says: 2.6.12-1+deb12u3

    def __str__(self) -> str:
        return f"HAProxy {self.version}"


def find(name: str) -> Binary:
    """The HAProxy ``name`` names (on ``PATH``, or a path); :class:`Unavailable` if unusable."""
    path = shutil.which(name)
    if path is None:
        raise Unavailable(f"{name!r} is not installed (no such file on PATH)")
    try:
        out = subprocess.run(  # noqa: S603 - the operator's own HAProxy, no shell
            [path, "-v"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"{path} -v failed: {exc}") from None
    found = re.search(r"version (\d+)\.(\d+)(\S*)", out)
    if found is None:
        raise Unavailable(f"{path} -v did not say its version: {out[:200]!r}")
    major, minor = int(found[1]), int(found[2])
    if (major, minor) < LEAST:
        least = ".".join(map(str, LEAST))
        raise Unavailable(f"{path} is HAProxy {major}.{minor}; {least} or later is needed")
    return Binary(path, f"{major}.{minor}{found[3]}")


class Process:
    """One HAProxy, started on ``listen`` with the configuration in ``layout``."""

    def __init__(self, binary: Binary, layout: Layout, listen: socket.socket) -> None:
        self.binary = binary
        self.layout = layout
        self.listen = listen
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start HAProxy and wait until its runtime socket answers; :class:`Unavailable` if not."""
        argv = [self.binary.path, "-f", str(self.layout.config), "-db"]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # dies with the gateway, however the gateway ends
            argv = [setpriv, "--pdeathsig", "TERM", "--", *argv]
        with contextlib.suppress(FileNotFoundError):
            self.layout.admin.unlink()  # a dead one's socket
        with self.layout.log.open("ab") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - the operator's own HAProxy, no shell
                argv,
                stdin=self.listen.fileno(),  # config.LISTEN_FD, whatever its number here
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C is the gateway's, which stops HAProxy
            )
        self.starts += 1
        deadline = time.monotonic() + START_S
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise Unavailable(f"HAProxy did not start: {self.tail()}")
            time.sleep(0.01)

    def _answers(self) -> bool:
        """True once the runtime socket takes a connection."""
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(str(self.layout.admin))
            except OSError:
                return False
            probe.sendall(b"show version\n")
            return bool(probe.recv(64))

    @property
    def pid(self) -> int | None:
        """HAProxy's process id while it runs."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def alive(self) -> bool:
        """True while HAProxy runs."""
        return self.proc is not None and self.proc.poll() is None

    def tail(self, size: int = 2000) -> str:
        """The end of HAProxy's output."""
        try:
            data = self.layout.log.read_bytes()[-size:]
        except OSError:
            return ""
        return data.decode("utf-8", "replace").strip()

    def stop(self) -> None:
        """Stop HAProxy: a soft stop (requests under way finish), killed after ``STOP_S``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGUSR1)  # soft stop: stop listening, finish what runs
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Kill HAProxy at once."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(STOP_S)
