"""``corral up`` end to end: driven by the CLI as a user would, and attacked as a stranger would.

One stack serves every check (it is slow to start): the README's quickstart, run
verbatim; every listener refusing a caller without the stack's credentials (the
registry, the agent, the Lambdo host, the exporter, Flower, Redis); and the
credentials never printed, logged, on a command line or in a guest's environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
from google.protobuf import empty_pb2

from config.celery import HOUSEKEEPING
from netplumb.addresses import parse_url
from protos import fcdaemon_grpc, fcdaemon_pb2, resmngr_grpc, resmngr_pb2
from testkit import httpcalls
from testkit.eventually import eventually
from testkit.processes import alive
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
        [sys.executable, "-m", "corral.cli", *args],
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


def _credentials(tmp_path: Path) -> dict[str, str]:
    """The stack's credentials, as its operator reads them."""
    data = json.loads((tmp_path / ".corral" / "credentials.json").read_text())
    assert isinstance(data, dict)
    return {str(k): str(v) for k, v in data.items()}


def _secrets(tmp_path: Path) -> list[str]:
    """Every secret of the stack (the Flower user is a name, not a secret)."""
    return [v for k, v in _credentials(tmp_path).items() if k != "flower_user"]


def _flower_auth(tmp_path: Path) -> tuple[str, str]:
    creds = _credentials(tmp_path)
    return creds["flower_user"], creds["flower_password"]


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
        "600",
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
        "600",
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
    answer = httpcalls.get(claimed["address"], timeout=10)
    assert answer.status_code == 200 and "hello from corral" in answer.text
    assert "hello from corral" in httpcalls.get(by_fn["hello"][0]["address"], timeout=10).text
    _corral(tmp_path, "release", claimed["claim_id"])
    assert f"gateway          {gateway}" in (tmp_path / "up.out").read_text()
    called = httpcalls.get(f"{gateway}/function/hello", timeout=60)
    assert called.status_code == 200 and called.text == "hello from corral\n"
    assert httpcalls.get(f"{gateway}/function/nope", timeout=10).status_code == 404
    # an asynchronous call: 202 at once, run by the invoker worker, its answer kept
    accepted = httpcalls.post(f"{gateway}/async-function/hello", content=b"work", timeout=30)
    assert accepted.status_code == 202, accepted.text
    call = f"{gateway}/calls/{accepted.headers['x-call-id']}"

    def answered() -> httpx.Response | None:
        read = httpcalls.get(call, timeout=10)
        return read if read.status_code == 200 else None

    done = eventually(answered, 60, "the call's answer")
    assert done is not None
    assert done.text == "hello from corral\n" and done.headers["x-call-status"] == "succeeded"
    # The gateway (and the invoker's) keeps the environment it used for its keep window
    # (CORRAL_GATEWAY_KEEP_S), then gives it back: only then is the replica idle for the reaper.
    deadline = time.monotonic() + 30
    while any(r["envs_in_use"] for r in json.loads(_corral(tmp_path, "replicas", "--json").stdout)):
        assert time.monotonic() < deadline, "the gateway kept its claim past its keep window"
        time.sleep(0.2)


def _check_flower(tmp_path: Path, flower: str) -> None:
    """Flower shows the operations' tasks (no housekeeping) and the broker's queues, no secret."""

    auth = _flower_auth(tmp_path)

    def listed() -> set[str]:
        tasks = httpcalls.get(f"{flower}/api/tasks", timeout=10, auth=auth).json()
        names = {t.get("name") for t in tasks.values()}
        return names if {"corral.scale", "corral.reap", "corral.invoke"} <= names else set()

    # the operator's reap is listed, and the asynchronous call's attempt
    names = eventually(listed, 30, "the scale, the operator's reap and the call listed in Flower")
    # beat's passes (health every 5 s, autoscale every 2 s, ...) ran all along, unlisted
    assert not names & set(HOUSEKEEPING), names
    flower_text = httpcalls.get(f"{flower}/api/tasks", timeout=10, auth=auth).text
    broker_page = httpcalls.get(f"{flower}/broker", timeout=10, auth=auth)  # queues, from Redis
    assert broker_page.status_code == 200 and "corral.spawn" in broker_page.text
    assert AWS_ID not in flower_text and AWS_SECRET not in flower_text
    assert not any(secret in broker_page.text + flower_text for secret in _secrets(tmp_path))
    ops = _corral(tmp_path, "ops", "--json").stdout
    assert AWS_ID not in ops and AWS_SECRET not in ops


def _check_metrics(tmp_path: Path) -> None:
    """The exporter ``corral up`` started: its URL printed, the work above in its numbers."""
    services = json.loads((tmp_path / ".corral" / "stack.json").read_text())["services"]
    assert f"metrics          {services['metrics']}" in (tmp_path / "up.out").read_text()

    # Every replica spawned (the 5 above: their idle timeout, 600 s, keeps them for the
    # checks on a busy machine too) was reaped as idle by the operator's pass; a pass adds
    # to the total just after it retires its rows: wait for it.
    token = {"Authorization": f"Bearer {_credentials(tmp_path)['metrics_token']}"}

    def counted() -> tuple[str, dict[str, float]] | None:
        metrics = httpcalls.get(services["metrics"], timeout=10, headers=token).text
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


def _check_guests_environment(up_pid: int, secrets: list[str]) -> None:
    """Every replica (a process with a VMID) has none of the operator's environment, nor
    any of the stack's credentials."""
    guests = 0
    for pid in _descendants(up_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b"\0VMID=" in b"\0" + environ:
            guests += 1
            assert OPERATOR_SECRET.encode() not in environ and b"AWS_SECRET" not in environ
            assert not [s for s in secrets if s.encode() in environ], pid
    assert guests >= 5  # hello's three and web's two


def _refused_grpc(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    code = err.value.code()
    assert isinstance(code, grpc.StatusCode)
    return code


def _check_grpc_refusals(services: dict[str, str], by_fn: dict[str, list[dict[str, Any]]]) -> None:
    """The registry and the agent refuse a caller without the stack's tokens."""
    registry = resmngr_grpc.ResMngrServiceStub(grpc.insecure_channel(services["registry"]))
    fake = resmngr_pb2.RegisterNodeRequest(ip="127.0.0.1", port=1, node_id="fake-node")
    assert _refused_grpc(lambda: registry.RegisterNode(fake, timeout=10)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    vmid = by_fn["hello"][0]["vmid"]
    ready = resmngr_pb2.StatusUpdateRequest(vmid=vmid, status=resmngr_pb2.StatusUpdateRequest.READY)
    assert _refused_grpc(lambda: registry.UpdateStatus(ready, timeout=10)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    agent = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(services["fcdaemon"]))
    for call in (
        lambda: agent.ListReplicas(empty_pb2.Empty(), timeout=10),
        lambda: agent.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=vmid), timeout=10),
        lambda: agent.CreateCPUHogs(fcdaemon_pb2.CpuHogs(n=1), timeout=10),
    ):
        assert _refused_grpc(call) == grpc.StatusCode.UNAUTHENTICATED


def _check_http_refusals(tmp_path: Path, services: dict[str, str], web_vmid: str) -> None:
    """The Lambdo host and the exporter refuse a caller without their tokens."""
    lambdo = services["lambdo"]
    spawn = {"rootfs": {"id": "x", "location": "examples.hello"}, "requestedPorts": [8080]}
    assert httpcalls.post(f"{lambdo}/spawn", json=spawn, timeout=10).status_code == 401
    assert httpcalls.delete(f"{lambdo}/destroy/{web_vmid}", timeout=10).status_code == 401
    assert httpcalls.get(f"{lambdo}/vms", timeout=10).status_code == 401
    assert httpcalls.get(services["metrics"], timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer " + _credentials(tmp_path)["agent_token"]}  # another's
    assert httpcalls.get(services["metrics"], timeout=10, headers=wrong).status_code == 401


def _check_flower_refusals(tmp_path: Path, flower: str) -> None:
    """Flower: no API without the stack's user and password, no cross-site POST even with
    them (a browser that has logged in sends them along), no other Host, no CORS."""
    auth = _flower_auth(tmp_path)
    workers = httpcalls.get(f"{flower}/api/workers?refresh=1", timeout=30, auth=auth)
    assert workers.status_code == 200, workers.text
    worker = next(iter(workers.json()))  # corral@host
    shutdown = f"{flower}/api/worker/shutdown/{worker}"
    rate_limit = f"{flower}/api/task/rate-limit/{worker}"
    limit = {"taskname": "corral.spawn", "ratelimit": "1/h"}
    answers = [
        httpcalls.get(f"{flower}/api/workers", timeout=10),
        httpcalls.post(shutdown, timeout=10),
        httpcalls.post(rate_limit, data=limit, timeout=10),
    ]
    assert [a.status_code for a in answers] == [401, 401, 401]
    for headers in (
        {"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"},
        {"Origin": "http://evil.example"},  # a browser without fetch metadata
    ):
        for url, data in ((shutdown, None), (rate_limit, limit)):
            refused = httpcalls.post(url, data=data, auth=auth, headers=headers, timeout=10)
            assert refused.status_code == 403, refused.text
            answers.append(refused)
    rebound = httpcalls.get(
        f"{flower}/api/workers", auth=auth, headers={"Host": "evil.example"}, timeout=10
    )
    assert rebound.status_code == 403
    answers.append(rebound)
    assert not [a for a in answers if "access-control-allow-origin" in a.headers]
    # the worker is still there (a shutdown that went through would have stopped it)
    assert worker in httpcalls.get(f"{flower}/api/workers?refresh=1", timeout=30, auth=auth).json()


def _check_redis_refusals(tmp_path: Path, broker_url: str) -> None:
    """Redis: nothing without the password; with it, no CONFIG (nor MODULE, DEBUG)."""
    port = parse_url(broker_url, {"redis": 6379}).port
    assert ":***@" not in broker_url and "@127.0.0.1:" in broker_url  # a password in it
    stranger = redis.Redis(port=port, socket_timeout=10)
    with pytest.raises(redis.exceptions.RedisError, match=r"(?i)auth"):
        stranger.config_set("dir", str(tmp_path))
    stranger.close()
    operator = redis.Redis.from_url(broker_url, socket_timeout=10)
    assert operator.ping()
    for command in (
        lambda: operator.config_set("dir", str(tmp_path)),
        operator.module_list,
        lambda: operator.debug_object("corral.spawn"),
    ):
        with pytest.raises(redis.exceptions.ResponseError, match="unknown command"):
            command()
    operator.close()


def _check_secrets_never_shown(tmp_path: Path, up_pid: int) -> None:
    """No credential in ``corral up``'s output nor on any of its processes' command lines."""
    secrets = _secrets(tmp_path)
    assert len(secrets) == 6
    out = (tmp_path / "up.out").read_text()
    assert str(tmp_path / ".corral" / "credentials.json") in out  # the banner names the file
    assert not [s for s in secrets if s in out]
    for pid in _descendants(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert not [s for s in secrets if s.encode() in argv], argv


def _readme_quickstart(gateway: str) -> str:
    """The README's "Try it" commands, verbatim (the gateway's port, if 8080 was taken)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Try it", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```sh\n")[1:]
    script = "".join(block.split("```", 1)[0] for block in blocks)
    assert "corral scale hello 3 --wait" in script and "corral scale web 2 --wait" in script
    return script.replace("http://127.0.0.1:8080", gateway)


def _check_quickstart(tmp_path: Path, gateway: str) -> None:
    """The README's quickstart works as written, in the stack's directory."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    # each command traced with the time it began: a failure or a timeout shows where it stood
    script = "PS4='+ $EPOCHREALTIME '; set -x\n" + _readme_quickstart(gateway)
    try:
        done = subprocess.run(
            ["bash", "-e", "-c", script],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=420,  # a bound on a hang: 11-15 s quiet, 85-145 s beside a second suite
        )
    except subprocess.TimeoutExpired as late:
        output = [part.decode(errors="replace") for part in (late.stdout, late.stderr) if part]
        pytest.fail(f"the quickstart ran past {late.timeout} s:\n" + "\n".join(output))
    (tmp_path / "quickstart.trace").write_text(done.stderr)  # kept with the test's files
    assert done.returncode == 0, done.stdout + done.stderr
    # 2 through the gateway, 1 from the claimed address, and the asynchronous call's
    # stored answer if it was done when it was asked for
    assert done.stdout.count("hello from corral") in (3, 4), done.stdout
    assert done.stdout.count("succeeded") >= 2, done.stdout  # both scales waited for


def _check_private(state: Path) -> None:
    """The state directory (store with AWS keys, Redis's AOF, logs) is this user's alone."""
    assert state.stat().st_mode & 0o777 == 0o700
    for path in state.rglob("*"):
        assert path.stat().st_mode & 0o077 == 0, f"{path} is {oct(path.stat().st_mode)}"


@pytest.mark.long(110)
# a bound on a hang, not on speed: 109 s on a quiet CI run, 309-408 s beside a second copy
# of the suite (this test starts with the other long ones, when both copies are busiest)
@pytest.mark.timeout(900)
def test_corral_up_end_to_end(tmp_path: Path) -> None:
    up_log = (tmp_path / "up.out").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "corral.cli", "up"],
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
        _check_guests_environment(up.pid, _secrets(tmp_path))
        _check_private(tmp_path / ".corral")
        _check_secrets_never_shown(tmp_path, up.pid)
        # a stranger gets nothing from any listener; the stack's replicas live on (_call)
        _check_grpc_refusals(services, by_fn)
        _check_http_refusals(tmp_path, services, by_fn["web"][0]["vmid"])
        _check_flower_refusals(tmp_path, f"http://127.0.0.1:{stack['flower_port']}")
        _check_redis_refusals(tmp_path, stack["broker_url"])
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
        _check_quickstart(tmp_path, services["gateway"])
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        finally:
            up_log.close()
    text = (tmp_path / "up.out").read_text()
    assert up.returncode == 0, text
    secrets = _secrets(tmp_path)
    assert "stopped; nothing left running" in text
    eventually(lambda: not [p for p in started if alive(p)], 10, "every process it started gone")
    for log in (tmp_path / ".corral" / "logs").iterdir():
        content = log.read_text(errors="replace")
        assert AWS_ID not in content and AWS_SECRET not in content, log.name
        assert not [secret for secret in secrets if secret in content], log.name
