"""A guest's environment is the function's, checked, and never the agent's own.

Each vector below ran code on the node before ``netplumb.guest_env``: a variable that some
interpreter or loader reads as code, sent as a ``--env=K=V`` kernel argument to the
fcdaemon agent or in the ``env`` object of a Lambdo ``/spawn``. Real agents with the
process driver, real guest processes; a vector counts as refused when the agent
answers INVALID_ARGUMENT / 400 and its marker file never appears.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from agents.drivers import ProcessDriver
from agents.fcdaemon import RunningAgent, serve_fcdaemon
from agents.lambdo import RunningLambdo, serve_lambdo
from corral.cli import main
from protos import fcdaemon_grpc, fcdaemon_pb2
from testkit import httpcalls
from tests.fixtures import Env
from tests.requirements import CC, unmet
from workers.store.models import Function

Vector = Callable[[Path, Path], dict[str, str]]


def _antigravity(tmp: Path, marker: Path) -> dict[str, str]:
    # the reproduction: a warnings filter imports antigravity, which opens a
    # "browser" (bash), which sources BASH_ENV, whose command substitution runs
    return {
        "PYTHONWARNINGS": "all:0:antigravity.x:0:0",
        "BROWSER": "/bin/bash",
        "BASH_ENV": f"$(id>{marker})",
    }


def _pythonpath(tmp: Path, marker: Path) -> dict[str, str]:
    # any file the node's user can write becomes code: sitecustomize runs at start-up
    (tmp / "planted").mkdir()
    (tmp / "planted" / "sitecustomize.py").write_text(
        f"open({str(marker)!r}, 'w').write('pwned')\n"
    )
    return {"PYTHONPATH": str(tmp / "planted")}


def _ld_preload(tmp: Path, marker: Path) -> dict[str, str]:
    if shutil.which("cc") is None:
        unmet(CC, "no C compiler (cc) to build the preload library")
    src = tmp / "evil.c"
    src.write_text(
        "#include <stdio.h>\n__attribute__((constructor)) static void f(void) {\n"
        f'  FILE *o = fopen("{marker}", "w"); if (o) {{ fputs("pwned", o); '
        "fclose(o); }\n}\n"
    )
    lib = tmp / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    return {"LD_PRELOAD": str(lib)}


VECTORS = {
    "antigravity-browser-bash_env": _antigravity,
    "pythonpath": _pythonpath,
    "ld_preload": _ld_preload,
}


@pytest.fixture
def fcdaemon() -> Iterator[RunningAgent]:
    agent = serve_fcdaemon("127.0.0.1:0", driver=ProcessDriver((31000, 31999), ready_timeout=10))
    yield agent
    agent.stop(grace=0)


@pytest.fixture
def lambdo() -> Iterator[RunningLambdo]:
    running = serve_lambdo("127.0.0.1:0", driver=ProcessDriver((32000, 32999), ready_timeout=10))
    yield running
    running.stop()


def _never_appears(marker: Path, start_guest: Callable[[], object]) -> None:
    """No guest wrote ``marker``: checked once a guest started after the refused one is up
    (a refused guest started all the same would have run its start-up by then)."""
    start_guest()
    assert not marker.exists(), marker.read_text()


@pytest.mark.parametrize("vector", VECTORS.values(), ids=VECTORS.keys())
def test_fcdaemon_refuses_code_in_env_kernel_args(
    fcdaemon: RunningAgent, tmp_path: Path, vector: Vector
) -> None:
    marker = tmp_path / "F"
    env = vector(tmp_path, marker)
    kernel_args = " ".join(shlex.quote(f"--env={k}={v}") for k, v in env.items())
    stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(fcdaemon.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateReplica(
            fcdaemon_pb2.CreateRequest(
                imageName="examples.hello", kernelArgs=f"console=ttyS0 {kernel_args}"
            ),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is refused" in (err.value.details() or "")
    assert fcdaemon.driver.list() == []
    hello = fcdaemon_pb2.CreateRequest(imageName="examples.hello")
    _never_appears(marker, lambda: stub.CreateReplica(hello, timeout=30).vmid)


@pytest.mark.parametrize("vector", VECTORS.values(), ids=VECTORS.keys())
def test_lambdo_refuses_code_in_the_spawn_env(
    lambdo: RunningLambdo, tmp_path: Path, vector: Vector
) -> None:
    marker = tmp_path / "F"
    body = {
        "rootfs": {"id": "f_1", "location": "examples.hello"},
        "requestedPorts": [8080],
        "env": vector(tmp_path, marker),
    }
    resp = httpcalls.post(f"{lambdo.url}/spawn", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert "is refused" in resp.text
    assert lambdo.driver.list() == []

    def hello() -> None:
        plain = {"rootfs": {"id": "f_2", "location": "examples.hello"}, "requestedPorts": [8080]}
        assert httpcalls.post(f"{lambdo.url}/spawn", json=plain, timeout=30).status_code == 200

    _never_appears(marker, hello)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_guests_never_inherit_the_agents_environment(
    fcdaemon: RunningAgent, lambdo: RunningLambdo, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what `corral up` hands its agents: the operator's keys, Flower's password, tokens
    secrets = {
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-operator-key",
        "FLOWER_BASIC_AUTH": "admin:flower-pw",
        "CORRAL_REGISTRY_TOKEN": "reg-t0ken",
    }
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(fcdaemon.address))
    stub.CreateReplica(
        fcdaemon_pb2.CreateRequest(
            imageName="examples.hello", kernelArgs="--env=GREETING='hi there'"
        ),
        timeout=30,
    )
    resp = httpcalls.post(
        f"{lambdo.url}/spawn",
        timeout=30,
        json={
            "rootfs": {"id": "f_1", "location": "examples.hello"},
            "env": {"GREETING": "hi there"},
        },
    )
    assert resp.status_code == 200, resp.text
    for vm in (*fcdaemon.driver.list(), *lambdo.driver.list()):
        assert vm.pid is not None
        environ = _environ(vm.pid)
        assert environ["GREETING"] == "hi there" and environ["VMID"] == vm.vmid
        assert environ["PORT"] == str(vm.port)
        for key, value in secrets.items():
            assert key not in environ and value not in "".join(environ.values()), key
        # only the function's variables and the agent's own few
        assert set(environ) == {"GREETING", "PORT", "HOST", "VMID", "PATH", "PYTHONPATH"}


@pytest.mark.parametrize(
    "argv",
    [
        ["--env", "PYTHONSTARTUP=/tmp/x.py"],
        ["--env", "ld_preload=/tmp/x.so"],
        ["--env", "BROWSER=/bin/bash"],
        ["--kernel-args=console=ttyS0 --env=BASH_ENV=$(id)"],
        ["--label", "KERNEL_ARGS=--env=NODE_OPTIONS=--require=/tmp/x.js"],
    ],
    ids=["env", "lowercase", "browser", "kernel-args", "label"],
)
def test_deploy_refuses_code_in_the_environment(
    corral_env: Env, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    base = ["functions", "deploy", "f", "--image", "examples.hello", "--kernel", "/k"]
    assert main([*base, "--env", "GREETING=hi"]) == 0
    capsys.readouterr()
    with corral_env.db.read() as s:
        before = s.query(Function).one().build_version
    assert main([*base, *argv]) == 1
    err = capsys.readouterr().err
    name = next(
        v
        for v in ("PYTHONSTARTUP", "ld_preload", "BROWSER", "BASH_ENV", "NODE_OPTIONS")
        if v in " ".join(argv)
    )
    assert f"{name} is refused" in err, err
    with corral_env.db.read() as s:  # nothing changed
        fn = s.query(Function).one()
        assert (fn.env, fn.kernel_args, fn.build_version) == ({"GREETING": "hi"}, "", before)
