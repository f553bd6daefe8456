"""The credentials of a ``corral up`` stack: made once, kept in its state directory.

Loopback is not a trust boundary (other users and the process driver's guests share
it), so every listener ``corral up`` starts asks for a credential: the registry and
the agents a bearer token each, the Lambdo host and the metrics exporter theirs, Flower
a user and password, the embedded Redis a password. They are random
(:func:`secrets.token_urlsafe`, 256 bits), made the first time a stack starts in a state
directory and kept there in ``credentials.json`` (0600, in the 0700 directory), so
they stay the same across restarts (a browser's Flower login, a Prometheus
scrape configuration). One the operator set in the environment (``CORRAL_AGENT_TOKEN``,
``CORRAL_FLOWER_PASSWORD``...) is used instead of the file's.

They reach the stack's processes through the environment, never argv (``ps`` shows
argv to every user), and the CLI run in the stack's directory through ``stack.json``
(0600), as it finds the broker and the store. Nothing prints them: ``corral up``'s
banner names the file.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import asdict, dataclass, fields
from pathlib import Path

__all__ = ["FILE", "FLOWER_USER", "Credentials", "load_or_make"]

FILE = "credentials.json"
FLOWER_USER = "corral"


@dataclass(frozen=True)
class Credentials:
    """One stack's secrets, by the setting each one fills (``redis_password``: Redis's own)."""

    registry_token: str
    agent_token: str
    lambdo_token: str
    metrics_token: str
    flower_user: str
    flower_password: str
    redis_password: str

    def settings(self) -> dict[str, str]:
        """The ``CORRAL_*`` settings they fill (by field name), Redis's password aside."""
        values = asdict(self)
        del values["redis_password"]
        return values


def _made() -> Credentials:
    values = {f.name: secrets.token_urlsafe(32) for f in fields(Credentials)}
    values["flower_user"] = FLOWER_USER
    return Credentials(**values)


def _read(path: Path) -> Credentials | None:
    """The credentials kept at ``path``; None if there are none yet; RuntimeError if unsafe."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RuntimeError(
            f"{path} must be owned by uid {os.getuid()} and private (mode 0600); it is "
            f"owned by {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}: fix or delete it"
        )
    try:
        data = json.loads(path.read_text())
        return Credentials(**{f.name: str(data[f.name]) for f in fields(Credentials)})
    except (ValueError, KeyError, TypeError) as exc:
        kind = type(exc).__name__
        raise RuntimeError(f"{path} is not a credentials file ({kind}): delete it") from None


def load_or_make(state_dir: Path, environ: dict[str, str]) -> Credentials:
    """The stack's credentials: kept in ``state_dir``, made there the first time.

    A ``CORRAL_*`` variable set in ``environ`` wins over the file for its setting.
    """
    path = state_dir / FILE
    kept = _read(path)
    if kept is None:
        kept = _made()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(kept), fh, indent=2)
    chosen = asdict(kept)
    for name in kept.settings():
        given = environ.get("CORRAL_" + name.upper())
        if given:
            chosen[name] = given
    return Credentials(**chosen)
