"""What a command loads: ``corral --help`` and the listings start without Celery, gRPC or Alembic.

Each command runs in a fresh interpreter, as ``corral`` does; the test reads which
packages ended up in ``sys.modules``. Timings belong to benchmarks, not tests: this
checks what makes them (``python -m bench.startup`` measures, ``docs/benchmarks.md`` has
the figures). The parser built for one command line (only that command in full) must
parse it, and print help, as the whole parser does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from corral.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
RUN = """
import contextlib, io, json, sys
from corral.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    try:
        status = main(sys.argv[1:])
    except SystemExit as exc:
        status = exc.code
print(json.dumps({"status": status, "out": out.getvalue(),
                  "modules": sorted({name.split(".")[0] for name in sys.modules})}))
"""
# What a query of the store never needs: the Celery app and its transport, the agents'
# gRPC stubs and HTTP client, Redis, Alembic, the gateway and the exporter.
HEAVY = {
    "celery",
    "kombu",
    "grpc",
    "protos",
    "httpx",
    "redis",
    "alembic",
    "starlette",
    "uvicorn",
    "prometheus_client",
}


@pytest.fixture
def store(tmp_path: Path, sqlite_template: Path) -> dict[str, str]:
    """The environment of a migrated SQLite store with no broker and no stack around."""
    shutil.copyfile(sqlite_template, tmp_path / "corral.sqlite")  # migrated once a session
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    env.update(
        PYTHONPATH=str(ROOT),
        CORRAL_STATE_DIR=str(tmp_path / "state"),
        CORRAL_DATABASE_URL=f"sqlite:///{tmp_path / 'corral.sqlite'}",
        CORRAL_BROKER_URL="redis://127.0.0.1:1/0",
    )
    return env


def _corral(env: dict[str, str], *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", RUN, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(env["CORRAL_STATE_DIR"]).parent,
    )
    assert done.returncode == 0, done.stderr
    # the last line: a program the command ran (the worker) writes to the same stdout
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_help_loads_no_settings_nor_store(store: dict[str, str]) -> None:
    ran = _corral(store, "--help")
    assert ran["status"] == 0 and "nodes" in ran["out"]
    assert not ({"pydantic", "pydantic_settings", "sqlalchemy"} | HEAVY) & set(ran["modules"])
    usage = _corral(store, "nodes", "add")  # a usage error: the address is missing
    assert usage["status"] == 2
    assert not {"pydantic", "sqlalchemy"} & set(usage["modules"])


@pytest.mark.parametrize(
    "command",
    [["nodes", "list"], ["functions", "list"], ["replicas"], ["ops"], ["nodes", "list", "--json"]],
)
def test_listings_load_the_store_and_nothing_heavy(
    store: dict[str, str], command: list[str]
) -> None:
    ran = _corral(store, *command)
    assert ran["status"] == 0, ran
    assert {"sqlalchemy", "pydantic"} <= set(ran["modules"])
    assert not HEAVY & set(ran["modules"]), sorted(HEAVY & set(ran["modules"]))


def test_the_worker_supervisor_and_an_agent_load_no_settings(store: dict[str, str]) -> None:
    # each runs a program that loads its own: `corral worker --help` is Celery's worker's
    ran = _corral(store, "worker", "--help")
    assert ran["status"] == 0, ran
    assert not {"pydantic", "sqlalchemy", "celery"} & set(ran["modules"])
    agent = _corral(store, "agent", "fcdaemon", "--help")
    assert agent["status"] == 0 and "--listen" in agent["out"], agent
    assert not {"pydantic", "sqlalchemy", "celery"} & set(agent["modules"])


def test_what_uses_celery_or_alembic_loads_it(store: dict[str, str]) -> None:
    # the check above sees these packages when a command does load them
    assert "alembic" in _corral(store, "db", "upgrade")["modules"]
    spawn = _corral(store, "spawn", "nope")  # refused (no such function) after queueing began
    assert spawn["status"] == 1 and "celery" in spawn["modules"]


def test_an_eager_operation_registers_the_tasks_it_runs(store: dict[str, str]) -> None:
    # Nothing imports the task modules up front any more: queueing an operation in eager
    # mode loads them (the app's include), so its first task runs here.
    ran = _corral({**store, "CORRAL_EAGER": "1"}, "reconcile", "--wait", "--json")
    assert ran["status"] == 0, ran
    assert json.loads(ran["out"])["status"] == "succeeded"
    assert "celery" in ran["modules"]


@pytest.mark.parametrize(
    "argv",
    [
        ["nodes", "add", "127.0.0.1:1", "--name", "n", "--capacity", "3", "--json"],
        ["functions", "deploy", "hello", "--image", "examples.hello", "--min", "1", "--autoscale"],
        ["spawn", "hello", "-n", "3", "--wait"],
        ["replicas", "show", "0123456789abcdef0123456789abcdef"],
        ["hogs", "start", "2", "--node", "n"],
        ["agent", "fcdaemon", "--listen", "127.0.0.1:1"],
    ],
)
def test_a_parser_built_for_one_command_line_parses_it_as_the_whole_parser_does(
    argv: list[str],
) -> None:
    def parsed(parser: argparse.ArgumentParser) -> dict[str, Any]:
        found = vars(parser.parse_args(argv))
        return {**found, "handler": found["handler"].name}

    assert parsed(build_parser(argv)) == parsed(build_parser())


def test_help_is_the_same_from_a_partly_built_parser() -> None:
    assert build_parser(["--help"]).format_help() == build_parser().format_help()
    assert build_parser([]).format_usage() == build_parser().format_usage()
