"""Command-line options the benchmarks share: their counts, and the store they run on.

Every benchmark sizes itself with integer options (``-n``, ``--concurrency``...), declared
here from a table of name, default and help, and takes ``--postgres [URL]``: without it a
run keeps its rows in a fresh SQLite file; with it, in a fresh database on ``URL``'s server
or, with no URL, on a throwaway PostgreSQL server started for the run.
"""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path
from typing import Any

import psycopg

from testkit.services import PostgresServer, make_shared_tempdir

Counts = dict[str, tuple[int, str]]  # option -> (default, help)


def add_counts(parser: argparse.ArgumentParser, counts: Counts) -> None:
    """Integer options, each with its default and help, in the order given."""
    for option, (default, text) in counts.items():
        parser.add_argument(option, type=int, default=default, help=f"{text} (default {default})")


def add_store_option(parser: argparse.ArgumentParser) -> None:
    """The ``--postgres [URL]`` option every benchmark takes."""
    parser.add_argument(
        "--postgres",
        nargs="?",
        const="",
        default=None,
        metavar="URL",
        help="store on PostgreSQL (a throwaway server unless URL is given)",
    )


def store_for(args: argparse.Namespace, tmp: Path) -> tuple[str, Any]:
    """This run's store URL (a fresh SQLite file, or ``--postgres``) and any server started."""
    if args.postgres is not None:
        return _postgres(args.postgres or None, tmp)
    return f"sqlite:///{tmp / 'corral.sqlite'}", None


def _postgres(url: str | None, tmp: Path) -> tuple[str, Any]:
    """A fresh PostgreSQL database: on ``url``'s server, or on a throwaway server."""
    server = None
    if url is None:
        server = PostgresServer(make_shared_tempdir("corral-bench-pg-"))
        server.start()
        url = server.url
    name = f"bench_{secrets.token_hex(4)}"
    plain = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + "/" + name, server
