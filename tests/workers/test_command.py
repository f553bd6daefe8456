"""``python -m workers.command``: Celery's worker and beat commands, without the rest of its CLI.

Each case runs a fresh interpreter, as ``corral worker`` starts its worker. The commands
behave as under ``celery -A workers`` (options, usage errors, ``CELERY_WORKER_*``
variables); what they load is read from ``sys.modules``. The worker itself runs in every
test that starts a ``corral worker`` (``testkit/processes.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from tests.fixtures import Env
from workers.celery import app

ROOT = Path(__file__).resolve().parents[2]
# Loaded by Celery's umbrella command line for its other commands and its plugins (Flower's
# registers one), never by the worker or beat.
TASKS = "tests.faults.limit_tasks"
UNUSED = ("celery.bin.celery", "flower", "tornado", "prompt_toolkit", "click_repl")
LOADED = """
import json, sys
from workers import command
try:
    command.main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("name", ["worker", "beat"])
def test_the_command_is_celerys_own_on_corrals_app_and_loads_none_of_the_others(
    name: str,
) -> None:
    run = _run(sys.executable, "-c", LOADED, name, "--help")
    assert run.returncode == 0, run.stderr
    usage, _, modules = run.stdout.rpartition("\n[")
    assert f"Usage: celery -A workers {name} [OPTIONS]" in usage
    loaded = set(json.loads("[" + modules))
    assert "workers.celery" in loaded  # the app, found as -A workers finds it
    assert not loaded & set(UNUSED), sorted(loaded & set(UNUSED))
    # where Celery's umbrella command is loaded, so are they (what this test guards)
    umbrella = _run(sys.executable, "-c", "import celery.bin.celery, sys; print(list(sys.modules))")
    assert "'flower'" in umbrella.stdout and "'prompt_toolkit'" in umbrella.stdout


@pytest.mark.parametrize(
    "argv", [[], ["flower"], ["worker", "--no-such-option"]], ids=["none", "other", "bad-option"]
)
def test_anything_but_worker_or_beat_and_a_bad_option_are_usage_errors(argv: list[str]) -> None:
    run = _run(sys.executable, "-m", "workers.command", *argv)
    assert run.returncode == 2, run.stderr
    assert ("usage" in run.stderr.lower()) and "Traceback" not in run.stderr


def test_celery_worker_variables_reach_the_worker_as_under_celerys_command() -> None:
    # An invalid value in CELERY_WORKER_LOGLEVEL is refused before the worker starts, by
    # Celery's own option check: the variable is read, under the same name as
    # `celery -A workers worker` reads it.
    env = {"CELERY_WORKER_LOGLEVEL": "NOT-A-LEVEL"}
    ours = _run(sys.executable, "-m", "workers.command", "worker", env=env)
    celerys = _run(sys.executable, "-m", "celery", "-A", "workers", "worker", env=env)
    assert ours.returncode == celerys.returncode == 2, (ours.stderr, celerys.stderr)
    assert "NOT-A-LEVEL" in ours.stderr and "NOT-A-LEVEL" in celerys.stderr


def test_a_bad_setting_is_one_line_naming_it_through_corral_worker_too() -> None:
    # `corral worker` loads no settings itself (its supervisor needs none): the worker says
    env = {"CORRAL_TASK_TIME_LIMIT_S": "abc"}
    for argv in (["-m", "workers.command", "worker"], ["-m", "corral.cli", "worker"]):
        run = _run(sys.executable, *argv, env=env)
        assert run.returncode == 1, run.stderr
        lines = [line for line in run.stderr.splitlines() if "CORRAL_TASK_TIME_LIMIT_S" in line]
        assert lines and lines[0].startswith("corral worker: error: bad setting"), run.stderr
        assert "Traceback" not in run.stderr


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # no store work: one run
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_running_worker_collects_garbage_with_what_it_loaded_at_start_frozen(
    broker_env: Env, worker_processes: list[WorkerProcess], pool: str
) -> None:
    # Collection is paused while the worker imports what it runs, and must be on again
    # once it runs tasks (in a prefork child too), with the start's objects frozen.
    worker = WorkerProcess(broker_env.tmp, concurrency=1, pool=pool, include=TASKS)
    worker_processes.append(worker.start())
    app.send_task("corral.test.where", args=(pool,))
    pattern = re.compile(rf"where {pool}: \S+, collecting (\w+), (\d+) frozen")
    found = eventually(
        lambda: pattern.search(worker.log_path.read_text()), 30, "the task", detail=worker.tail
    )
    assert found is not None
    assert found.group(1) == "True", found.group(0)
    assert int(found.group(2)) > 100_000, found.group(0)  # the app, the tasks, Celery


BEAT_STARTED = """
import gc, os, sys
from workers import command

def started(**kw):  # what beat_init calls, then a line and the end of the process
    freeze(**kw)
    line = f"collecting {gc.isenabled()}, {gc.get_freeze_count()} frozen\\n"
    os.write(1, line.encode())  # (beat's sys.stdout is a logger by then)
    os._exit(0)

freeze, command._freeze = command._freeze, started
command.main(["beat", "-l", "WARNING", "-s", sys.argv[1]])
"""


def test_beat_collects_garbage_once_started_with_what_it_loaded_frozen(tmp_path: Path) -> None:
    # a broker that refuses (loopback, port 1): beat starts before it sends anything
    env = {
        "CORRAL_BROKER_URL": "redis://127.0.0.1:1/0",
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'beat.sqlite'}",
    }
    run = _run(sys.executable, "-c", BEAT_STARTED, str(tmp_path / "schedule"), env=env)
    assert run.returncode == 0, run.stderr
    found = re.search(r"collecting (\w+), (\d+) frozen", run.stdout)
    assert found is not None, (run.stdout, run.stderr)
    assert found.group(1) == "True" and int(found.group(2)) > 100_000, found.group(0)
