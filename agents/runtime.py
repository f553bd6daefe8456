"""What the agents' servers and command lines share: arguments, signals, logging, addresses.

An agent command parses its arguments the same way (:func:`agent_main`: ``--listen``,
``--insecure``, ``--log-level``, the token option) and refuses to listen off loopback
without a token, printing the one-line refusal of corral's listening rule
(:mod:`netplumb.listening`, which the registry, the gateway and the metrics exporter
follow too); a server runs until SIGINT or SIGTERM (:func:`serve_until_signalled`) and
is stopped once (:class:`Running`).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, Self

from netplumb.addresses import host_of, is_wildcard, join_hostport, split_hostport
from netplumb.listening import refuse_to_listen
from netplumb.signals import until_signalled, wait_for

__all__ = [
    "AgentMain",
    "KeyedLock",
    "Running",
    "add_common_arguments",
    "agent_main",
    "configure_logging",
    "connect_host",
    "guess_node_ip",
    "http_answers",
    "parse_agent_args",
    "parse_port_range",
    "serve_until_signalled",
]


def connect_host(host: str) -> str:
    """The address a local client should dial for a server bound to ``host``."""
    return "127.0.0.1" if is_wildcard(host) else host_of(host)


def http_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """True if ``GET /`` on host:port gets any HTTP response (its body read, up to 64 KiB)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/")
        conn.getresponse().read(1 << 16)
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def guess_node_ip(listen_host: str) -> str:
    """The IP others should use to reach this node: the listen host, else the hostname's IP."""
    if not is_wildcard(listen_host):
        return host_of(listen_host)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def parse_port_range(text: str) -> tuple[int, int]:
    """Parse ``LOW-HIGH`` into a checked port range."""
    low, sep, high = text.partition("-")
    if not sep or not low.isdigit() or not high.isdigit():
        raise ValueError(f"expected LOW-HIGH, got {text!r}")
    lo, hi = int(low), int(high)
    if not 0 < lo <= hi < 65536:
        raise ValueError(f"bad port range {text!r}")
    return lo, hi


def configure_logging(level: str = "INFO") -> None:
    """Log to stderr with timestamps, once per process."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def add_common_arguments(
    parser: argparse.ArgumentParser,
    listen: str,
    token_flag: str,
    *,
    token_help: str | None = None,
) -> None:
    """Add ``--listen``, ``--insecure`` and ``--log-level`` to an agent's argparse parser.

    ``token_flag`` names the option that makes listening off loopback allowed; with
    ``token_help`` the parser also gets ``--require-token`` (default $CORRAL_AGENT_TOKEN).
    """
    parser.add_argument(
        "--listen",
        default=listen,
        help=f"HOST:PORT (default %(default)s; off loopback needs {token_flag})",
    )
    if token_help is not None:
        parser.add_argument(
            "--require-token",
            default=os.environ.get("CORRAL_AGENT_TOKEN") or None,
            help=f"{token_help} (default $CORRAL_AGENT_TOKEN)",
        )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="listen off loopback without a token (logs a warning at every start)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="stderr log level (default INFO)",
    )


def parse_agent_args(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    token: str,
    variable: str,
) -> argparse.Namespace | None:
    """Parse an agent's argv and set up logging; ``args.host`` is the listen host.

    ``args.port_range``, if the parser has it, becomes a checked (low, high) pair. None
    when the agent must not listen there without a token (option ``token``, set by
    ``variable``): the refusal is printed and the command exits 2.
    """
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        args.host, _ = split_hostport(args.listen)
        if hasattr(args, "port_range"):
            args.port_range = parse_port_range(args.port_range)
    except ValueError as exc:
        parser.error(str(exc))
    if refuse_to_listen(parser.prog, args.host, getattr(args, token), variable, args.insecure):
        return None
    return args


class AgentMain(Protocol):
    """An agent command's ``main``: run it with ``argv`` (default ``sys.argv``); the exit code."""

    def __call__(self, argv: list[str] | None = None) -> int:
        """Run the command; its exit code."""


def agent_main(
    build_parser: Callable[[], argparse.ArgumentParser],
    token: str,
    variable: str,
    serve: Callable[[argparse.ArgumentParser, argparse.Namespace], int],
) -> AgentMain:
    """An agent's ``main``: parse its argv (:func:`parse_agent_args`), then ``serve``.

    ``main`` returns 2 without serving when the agent must not listen there without a
    token (option ``token``, set by ``variable``), else what ``serve(parser, args)`` returns.
    """

    def main(argv: list[str] | None = None) -> int:
        parser = build_parser()
        args = parse_agent_args(parser, argv, token, variable)
        return 2 if args is None else serve(parser, args)

    return main


class Stoppable(Protocol):
    """A running server that can be stopped."""

    def stop(self) -> None:
        """Stop serving and release what it holds."""


class Running:
    """A server running in the background: stopped once by :meth:`stop`, or on leaving ``with``."""

    def __init__(self, host: str, port: int) -> None:
        """A server bound to ``host``:``port``; ``address`` is what a local client dials."""
        self.port = port
        self.address = join_hostport(connect_host(host), port)
        self._stopped = False
        self._lock = threading.Lock()

    def stop(self, grace: float = 0.5) -> None:
        """Stop serving and release what it holds (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._shutdown(grace)

    def _shutdown(self, grace: float) -> None:
        """Tear the server down; called once, by the first :meth:`stop`."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        """Use as a context manager that stops on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the server."""
        self.stop()


def serve_until_signalled(
    start: Callable[[], Stoppable], on_failure: Callable[[], None] | None = None
) -> int:
    """Start a server, run it until SIGINT/SIGTERM, stop it; the process exit code."""
    with until_signalled() as stop:
        try:
            running = start()
        except OSError as exc:
            logging.getLogger("agents").error("%s", exc)
            if on_failure is not None:
                on_failure()
            return 1
        try:
            wait_for(stop)
        finally:
            running.stop()
    return 0


class KeyedLock:
    """One holder per key at a time; holders of different keys never wait for each other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, threading.Event] = {}  # key -> set when its holder lets go

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        """Hold ``key`` (an empty key holds nothing)."""
        if not key:
            yield
            return
        while True:
            with self._lock:
                holder = self._held.get(key)
                if holder is None:
                    done = self._held[key] = threading.Event()
                    break
            holder.wait()
        try:
            yield
        finally:
            with self._lock:
                del self._held[key]
            done.set()
