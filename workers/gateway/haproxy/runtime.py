"""HAProxy's runtime API, spoken over its unix socket: commands, and what ``show stat`` says.

One connection, kept, in HAProxy's interactive mode (:class:`Runtime`). A command
that HAProxy refuses answers a line that is not one of its success messages
(:data:`DONE`): :meth:`Runtime.run` reports it (:class:`Refused`) with the command.

:func:`parse_stat` reads ``show stat``'s CSV into :class:`Row` records: per server (and
per backend) the counters the gateway follows - sessions now and in all, queued
requests, refused answers, interim answers, its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0  # one batch of commands, its first byte sent to its last answer
IDLE_S = 30.0  # a connection unused this long is replaced (HAProxy's stats timeout: 1 m)
PROMPT = b"\n> "  # what ends each answer in the interactive mode
RETRY_S = 0.05  # a batch of commands the socket failed is sent again this much later
READ_MAX = 64 * 1024 * 1024  # the longest answer read (show sess of many streams)
# Answers HAProxy gives a command that did what it was asked (others are refusals).
DONE = ("", "New server registered.", "Server deleted.")


class RuntimeError_(Exception):
    """HAProxy's runtime socket cannot be reached, or answered what cannot be read."""


class Refused(RuntimeError_):
    """HAProxy refused a command (its answer says why)."""

    def __init__(self, command: str, answer: str) -> None:
        super().__init__(f"haproxy refused {command!r}: {answer.strip()}")
        self.command = command
        self.answer = answer


@dataclass(frozen=True, slots=True)
class Row:
    """One line of ``show stat``: a server (or ``BACKEND``) of a backend."""

    backend: str
    server: str
    queued: int  # qcur: requests waiting for a place
    sessions: int  # scur: requests being served now
    peak: int  # smax: the most served at once since the counters were cleared
    total: int  # stot: requests sent to it so far
    errors: int  # eresp: answers refused or broken (HAProxy's 502 / 504)
    failed: int  # econ: connections that could not be made
    interim: int  # hrsp_1xx: interim answers relayed
    status: str  # UP, DOWN, MAINT, DRAIN, no check...

    @property
    def usable(self) -> bool:
        """True unless HAProxy marked it down or took it out."""
        return not self.status.startswith(("DOWN", "MAINT", "NOLB"))


def _int(value: str) -> int:
    return int(value) if value.isdigit() else 0


def parse_stat(text: str) -> list[Row]:
    """``show stat``'s CSV (header line ``# pxname,svname,...``) as rows."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        raise RuntimeError_(f"not show stat's output: {text[:200]!r}")
    reader = csv.DictReader(io.StringIO("\n".join([lines[0][2:], *lines[1:]])))
    rows = []
    for item in reader:
        if not item.get("pxname") or item.get("svname") == "FRONTEND":
            continue
        rows.append(
            Row(
                backend=item["pxname"],
                server=item["svname"],
                queued=_int(item.get("qcur", "")),
                sessions=_int(item.get("scur", "")),
                peak=_int(item.get("smax", "")),
                total=_int(item.get("stot", "")),
                errors=_int(item.get("eresp", "")),
                failed=_int(item.get("econ", "")),
                interim=_int(item.get("hrsp_1xx", "")),
                status=item.get("status", ""),
            )
        )
    return rows


@dataclass(frozen=True, slots=True)
class Stream:
    """One line of ``show sess``: a stream, its backend, server and age."""

    id: str
    backend: str
    server: str
    age_s: float


_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def _age(text: str) -> float:
    """``1h2m3s`` -> 3723.0 (HAProxy's human durations)."""
    total, number = 0.0, ""
    for char in text:
        if char.isdigit():
            number += char
        elif char in _UNITS and number:
            total += int(number) * _UNITS[char]
            number = ""
    return total


def parse_sessions(text: str) -> list[Stream]:
    """``show sess``'s lines as streams (those without a backend are left out)."""
    streams = []
    for line in text.splitlines():
        ident, _, rest = line.partition(":")
        fields = dict(part.split("=", 1) for part in rest.split() if "=" in part)
        if not ident.startswith("0x") or fields.get("be", "<NONE>") == "<NONE>":
            continue
        streams.append(
            Stream(ident, fields["be"], fields.get("srv", ""), _age(fields.get("age", "")))
        )
    return streams


class Runtime:
    """The runtime API of one HAProxy, over its unix socket, in its interactive mode.

    One connection, kept: ``prompt`` first, then each command on a line of its own;
    HAProxy answers each in turn and ends the answer with its prompt (``> `` at the
    start of a line), which is how answers are told apart (its messages do not all end
    with the blank line that ends them outside this mode: ``del server``'s does not).
    Commands are written at once and their answers read in order. A connection that
    fails is closed, and the next call opens another.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._used = 0.0  # time.monotonic() of the connection's last answer

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._conn is not None and time.monotonic() - self._used > IDLE_S:
            self.close()  # HAProxy may be closing it (stats timeout): a new one
        if self._conn is None:
            reader, writer = await asyncio.open_unix_connection(str(self.path), limit=READ_MAX)
            writer.write(b"prompt\n")
            await reader.readuntil(PROMPT)
            self._conn = reader, writer
        return self._conn

    def close(self) -> None:
        """Close the connection (the next call opens another)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn[1].close()

    async def ask(self, *commands: str) -> list[str]:
        """Send the commands; each one's answer, in order."""
        for command in commands:
            if "\n" in command or ";" in command:
                raise ValueError(f"not one command: {command!r}")
        if not commands:
            return []
        async with self._lock:
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    reader, writer = await self._connect()
                    writer.write("".join(f"{c}\n" for c in commands).encode())
                    await writer.drain()
                    answers = []
                    for _ in commands:
                        data = await reader.readuntil(PROMPT)
                        answers.append(data[: -len(PROMPT)].decode("utf-8", "replace").strip("\n"))
                    self._used = time.monotonic()
                    return answers
            except (OSError, TimeoutError, EOFError, ValueError) as exc:
                # (asyncio's IncompleteReadError is an EOFError, LimitOverrunError a ValueError)
                self.close()
                what = str(exc) or type(exc).__name__
                raise RuntimeError_(f"haproxy's runtime socket: {what}") from None

    async def run(self, *commands: str) -> None:
        """Send the commands; :class:`Refused` names the first HAProxy did not do."""
        for command, answer in zip(commands, await self.ask(*commands), strict=False):
            if answer.strip() not in DONE:
                raise Refused(command, answer)

    async def stat(self, backends: list[str] | None = None) -> list[Row]:
        """``show stat`` of these backends (and their servers), or of all."""
        if backends is None:
            return parse_stat((await self.ask("show stat"))[0])
        if not backends:
            return []
        answers = await self.ask(*(f"show stat {b} 6 -1" for b in backends))
        return [row for answer in answers for row in parse_stat(answer)]

    async def sessions(self) -> list[Stream]:
        """``show sess``: every stream now."""
        return parse_sessions("\n".join(await self.ask("show sess")))


class Commands:
    """HAProxy's runtime API from a thread of its own: a blocking socket, interactive mode.

    The same conversation as :class:`Runtime`'s, for a caller that must not wait for an
    event loop busy with other work (the router's writer).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._pending = b""
        self._used = 0.0

    def _read_answer(self, sock: socket.socket) -> bytes:
        while PROMPT not in self._pending:
            data = sock.recv(65536)
            if not data:
                raise EOFError("haproxy closed its runtime socket")
            self._pending += data
            if len(self._pending) > READ_MAX:
                raise ValueError("an answer past READ_MAX")
        answer, _, self._pending = self._pending.partition(PROMPT)
        return answer

    def _connect(self) -> socket.socket:
        if self._sock is not None and time.monotonic() - self._used > IDLE_S:
            self.close()
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(TIMEOUT_S)
            try:
                sock.connect(str(self.path))
                sock.sendall(b"prompt\n")
                self._pending = b""
                self._read_answer(sock)
            except BaseException:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def close(self) -> None:
        """Close the connection (the next call opens another)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def ask(self, *commands: str) -> list[str]:
        """Send the commands; each one's answer, in order."""
        for command in commands:
            if "\n" in command or ";" in command:
                raise ValueError(f"not one command: {command!r}")
        try:
            sock = self._connect()
            sock.sendall("".join(f"{c}\n" for c in commands).encode())
            answers = [
                self._read_answer(sock).decode("utf-8", "replace").strip("\n") for _ in commands
            ]
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise RuntimeError_(f"haproxy's runtime socket: {exc or type(exc).__name__}") from None
        self._used = time.monotonic()
        return answers


Then = Callable[["Refused | None", float], None]  # told HAProxy's answer, and when it came


class Writer(threading.Thread):
    """The router's commands, sent from a thread of its own, in order, as they are made.

    A routing change reaches HAProxy as fast as HAProxy answers, however busy the
    gateway's event loop is with the calls it serves; what to do with each answer is
    handed back to the loop (``call_soon_threadsafe``), with the time it came. Commands
    made for an HAProxy that has died since (an older *generation*) are dropped: the
    router gives the new one every route again.
    """

    def __init__(self, commands: Commands, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name="haproxy-commands", daemon=True)
        self.commands = commands
        self.loop = loop
        self.generation = 0
        self.queue: queue.SimpleQueue[tuple[int, str, Then | None] | None] = queue.SimpleQueue()

    def send(self, command: str, then: Then | None = None) -> None:
        """Queue one command (any thread)."""
        self.queue.put((self.generation, command, then))

    def stop(self) -> None:
        """End the thread once the commands queued are sent."""
        self.queue.put(None)
        self.join(10)
        self.commands.close()

    def run(self) -> None:
        """Send what comes, a batch at a time, until :meth:`stop`."""
        while True:
            first = self.queue.get()
            if first is None:
                return
            batch = [first]
            with contextlib.suppress(queue.Empty):
                while (more := self.queue.get_nowait()) is not None:
                    batch.append(more)
                else:
                    self.queue.put(None)  # (stop, once this batch is sent)
            while batch := [op for op in batch if op[0] == self.generation]:
                try:
                    answers = self.commands.ask(*(command for _, command, _ in batch))
                except RuntimeError_ as exc:
                    log.warning("gateway: %s (sent again in a moment)", exc)
                    time.sleep(RETRY_S)
                    continue
                at = time.perf_counter()
                for (_, command, then), answer in zip(batch, answers, strict=True):
                    refused = None if answer.strip() in DONE else Refused(command, answer)
                    if then is not None:
                        self.loop.call_soon_threadsafe(then, refused, at)
                    elif refused is not None:
                        log.warning("gateway: %s", refused)
                break
