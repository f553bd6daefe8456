"""``corral up`` end to end: driven by the CLI as a user would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from config.celery import HOUSEKEEPING
from tests.eventually import eventually
from workers.gateway.haproxy.process import Unavailable, find

ROOT = Path(__file__).resolve().parents[2]
AWS_ID = "AKIAEXAMPLESECRET01"
AWS_SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
OPERATOR_SECRET = "operator-own-aws-secret-key-0000"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    env["PYTHONPATH"] = str(ROOT)
    # the operator's own keys, in the shell that runs `corral up`: never a guest's
    env["AWS_SECRET_ACCESS_KEY"] = OPERATOR_SECRET
    return env


def _corral(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert proc.returncode == 0, f"corral {' '.join(args)}: {proc.stderr}"
    return proc


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_up(tmp_path: Path, up: subprocess.Popen[bytes]) -> tuple[dict[str, Any], dict[str, str]]:
    """Wait for ``corral is up``; the published settings and service URLs."""
    deadline = time.monotonic() + 120
    while "corral is up" not in (tmp_path / "up.out").read_text():
        assert up.poll() is None, (tmp_path / "up.out").read_text()
        assert time.monotonic() < deadline, (tmp_path / "up.out").read_text()
        time.sleep(0.2)
    published = json.loads((tmp_path / ".corral" / "stack.json").read_text())
    # it says which data plane the gateway runs: HAProxy in front of it where installed
    plane = "python" if _no_haproxy() else "haproxy"
    assert f"  data plane       {plane} (" in (tmp_path / "up.out").read_text()
    return published["settings"], published["services"]


def _no_haproxy() -> bool:
    try:
        find("haproxy")
    except Unavailable:
        return True
    return False


def _deploy_and_scale(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    """Deploy ``hello`` (fcdaemon) and ``web`` (Lambdo), scale them to 3 and 2; their replicas."""
    out = _corral(
        tmp_path,
        "functions",
        "deploy",
        "hello",
        "--image",
        "examples.hello",
        "--kernel",
        "/boot/vmlinux",
        "--idle-timeout",
        "1",
        "--aws-access-key-id",
        AWS_ID,
        "--aws-secret-access-key",
        AWS_SECRET,
    )
    assert AWS_ID not in out.stdout and AWS_SECRET not in out.stdout
    _corral(
        tmp_path,
        "functions",
        "deploy",
        "web",
        "--backend",
        "lambdo",
        "--image",
        "examples.hello",
        "--rootfs",
        "examples.hello",
        "--idle-timeout",
        "1",
    )
    _corral(tmp_path, "scale", "hello", "3", "--wait")
    _corral(tmp_path, "scale", "web", "2", "--wait")
    replicas = json.loads(_corral(tmp_path, "replicas", "--json").stdout)
    by_fn = {fn: [r for r in replicas if r["function"] == fn] for fn in ("hello", "web")}
    assert len(by_fn["hello"]) == 3 and len(by_fn["web"]) == 2
    assert all(r["status"] == "idle" for r in replicas)
    return by_fn


def _call(tmp_path: Path, by_fn: dict[str, list[dict[str, Any]]], gateway: str) -> None:
    """A claimed replica answers; the gateway calls a function and 404s an unknown one."""
    claimed = json.loads(_corral(tmp_path, "claim", "web", "--json").stdout)
    answer = httpx.get(claimed["address"], timeout=10)
    assert answer.status_code == 200 and "hello from corral" in answer.text
    assert "hello from corral" in httpx.get(by_fn["hello"][0]["address"], timeout=10).text
    _corral(tmp_path, "release", claimed["claim_id"])
    assert f"gateway          {gateway}" in (tmp_path / "up.out").read_text()
    called = httpx.get(f"{gateway}/function/hello", timeout=60)
    assert called.status_code == 200 and called.text == "hello from corral\n"
    assert httpx.get(f"{gateway}/function/nope", timeout=10).status_code == 404
    # The gateway keeps the environment it used for its keep window (CORRAL_GATEWAY_KEEP_S),
    # then gives it back: only then is the replica idle for the reaper.
    deadline = time.monotonic() + 30
    while any(r["envs_in_use"] for r in json.loads(_corral(tmp_path, "replicas", "--json").stdout)):
        assert time.monotonic() < deadline, "the gateway kept its claim past its keep window"
        time.sleep(0.2)


def _check_flower(tmp_path: Path, flower: str) -> None:
    """Flower shows the operations' tasks (no housekeeping) and the broker's queues, no secret."""

    def listed() -> set[str]:
        tasks = httpx.get(f"{flower}/api/tasks", timeout=10).json()
        names = {t.get("name") for t in tasks.values()}
        return names if {"corral.scale", "corral.reap"} <= names else set()

    # the operator's reap is listed
    names = eventually(listed, 30, "the scale and the operator's reap listed in Flower")
    # beat's passes (health every 5 s, autoscale every 2 s, ...) ran all along, unlisted
    assert not names & set(HOUSEKEEPING), names
    flower_text = httpx.get(f"{flower}/api/tasks", timeout=10).text
    broker_page = httpx.get(f"{flower}/broker", timeout=10)  # queue lengths, read from Redis
    assert broker_page.status_code == 200 and "corral.spawn" in broker_page.text
    assert AWS_ID not in flower_text and AWS_SECRET not in flower_text
    ops = _corral(tmp_path, "ops", "--json").stdout
    assert AWS_ID not in ops and AWS_SECRET not in ops


def _check_metrics(tmp_path: Path) -> None:
    """The exporter ``corral up`` started: its URL printed, the work above in its numbers."""
    services = json.loads((tmp_path / ".corral" / "stack.json").read_text())["services"]
    assert f"metrics          {services['metrics']}" in (tmp_path / "up.out").read_text()

    # Every replica spawned (the 5 above, and one the gateway's call cold-starts when beat's
    # pass already reaped hello's, idle timeout 1 s) was reaped as idle, by beat or by the
    # operator's pass; a pass adds to the total just after it retires its rows: wait for it.
    def counted() -> tuple[str, dict[str, float]] | None:
        metrics = httpx.get(services["metrics"], timeout=10).text
        values = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in metrics.splitlines()
            if line.startswith(("corral_reaped_total", "corral_spawn_seconds_count"))
        }
        spawned = values["corral_spawn_seconds_count"]
        reaped = values['corral_reaped_total{reason="idle"}']
        return (metrics, values) if reaped == spawned else None

    found = eventually(counted, 30, "every replica spawned counted as reaped")
    assert found is not None
    metrics, values = found
    assert values["corral_spawn_seconds_count"] >= 5, values
    assert 'corral_operations_total{kind="scale",status="succeeded"} 2.0' in metrics
    assert 'corral_replicas{function="hello",state="idle"} 0.0' in metrics
    assert 'corral_node_healthy{node="local-fcdaemon"} 1.0' in metrics
    assert AWS_ID not in metrics and AWS_SECRET not in metrics


def _check_guests_environment(up_pid: int) -> None:
    """Every replica (a process with a VMID) has none of the operator's environment."""
    guests = 0
    for pid in _descendants(up_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b"\0VMID=" in b"\0" + environ:
            guests += 1
            assert OPERATOR_SECRET.encode() not in environ and b"AWS_SECRET" not in environ
    assert guests >= 5  # hello's three and web's two


def _check_private(state: Path) -> None:
    """The state directory (store with AWS keys, Redis's AOF, logs) is this user's alone."""
    assert state.stat().st_mode & 0o777 == 0o700
    for path in state.rglob("*"):
        assert path.stat().st_mode & 0o077 == 0, f"{path} is {oct(path.stat().st_mode)}"


@pytest.mark.timeout(240)
def test_corral_up_end_to_end(tmp_path: Path) -> None:
    up_log = (tmp_path / "up.out").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "tasks.cli", "up"],
        cwd=tmp_path,
        env=_env(),
        stdout=up_log,
        stderr=subprocess.STDOUT,
    )
    started: set[int] = set()
    try:
        stack, services = _wait_up(tmp_path, up)
        # a second `corral up` in the same directory refuses
        second = _corral(tmp_path, "up", check=False)
        assert second.returncode == 1 and "already running" in second.stderr
        nodes = json.loads(_corral(tmp_path, "nodes", "list", "--json").stdout)
        assert {n["name"] for n in nodes} == {"local-fcdaemon", "local-lambdo"}

        by_fn = _deploy_and_scale(tmp_path)
        _check_guests_environment(up.pid)
        _check_private(tmp_path / ".corral")
        _call(tmp_path, by_fn, services["gateway"])  # the data path: a function over HTTP

        started = _descendants(up.pid)
        assert len(started) >= 9  # redis, registry, worker(+pool), beat, flower, metrics, agents...
        reap = json.loads(
            _corral(tmp_path, "reap", "--idle-timeout", "0", "--wait", "--json").stdout
        )
        assert reap["status"] == "succeeded", reap
        assert json.loads(_corral(tmp_path, "replicas", "--json").stdout) == []

        _check_flower(tmp_path, f"http://127.0.0.1:{stack['flower_port']}")
        _check_metrics(tmp_path)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        finally:
            up_log.close()
    text = (tmp_path / "up.out").read_text()
    assert up.returncode == 0, text
    assert "stopped; nothing left running" in text
    eventually(lambda: not [p for p in started if _alive(p)], 10, "every process it started gone")
    for log in (tmp_path / ".corral" / "logs").iterdir():
        content = log.read_text(errors="replace")
        assert AWS_ID not in content and AWS_SECRET not in content, log.name
