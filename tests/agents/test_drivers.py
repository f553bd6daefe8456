"""VM drivers on their own: specs, port allocation, process replicas, examples."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

from agents.drivers import (
    DriverError,
    ImageNotFound,
    MemoryDriver,
    PortAllocator,
    ProcessDriver,
    VMDriver,
    VMSpec,
    parse_env_args,
    resolve_command,
)
from testkit import httpcalls
from testkit.eventually import eventually
from testkit.services import free_port
from tests.agents.helpers import http_get, is_alive

pytestmark = pytest.mark.timeout(30)


def test_env_comes_from_kernel_args_and_explicit_env_wins() -> None:
    assert parse_env_args('console=ttyS0 --env=A=1 --env=B="x y" --env=C=a=b --env=bad') == {
        "A": "1",
        "B": "x y",
        "C": "a=b",
    }
    spec = VMSpec(image="hello", kernel_args="--env=A=1 --env=B=2", env={"B": "3"})
    assert spec.env == {"A": "1", "B": "3"}
    assert spec.guest_port == 8080 and spec.guest_ports == [8080]


def test_resolve_command_runs_only_allowed_modules() -> None:
    # the second item: where the guest imports the module from (its PYTHONPATH)
    root = str(Path(__file__).resolve().parents[2])
    assert resolve_command("hello") == ([sys.executable, "-m", "examples.hello"], root)
    assert resolve_command("examples.echo:latest")[0][-1] == "examples.echo"
    assert resolve_command("json.tool", ["json.tool"]) == (
        [sys.executable, "-m", "json.tool"],
        str(Path(json.__file__).resolve().parents[1]),
    )
    for bad in (
        "",
        "sleep 5",
        "sh -c 'touch /tmp/x'",
        "no-such-binary-xyz",
        "'unterminated",
        "json.tool",
        "examples.nope",
        "/bin/sh",
        "hello; true",
    ):
        with pytest.raises(ImageNotFound):
            resolve_command(bad)


def test_memory_driver_records_vms() -> None:
    driver = MemoryDriver()
    assert isinstance(driver, VMDriver)
    a = driver.start(VMSpec(image="x", request_id="r1", guest_port=9000))
    b = driver.start(VMSpec(image="x"))
    assert (a.ip, a.pid, a.request_id, a.port_mapping[0][1]) == ("127.0.0.1", None, "r1", 9000)
    # fake host ports, one per VM, never a guest port such as 8080 (corral's gateway's)
    assert 20000 <= a.port <= 29999 and 20000 <= b.port <= 29999 and a.port != b.port
    assert MemoryDriver(port_range=None).start(VMSpec(image="x", guest_port=9000)).port == 9000
    assert [vm.vmid for vm in driver.list()] == [a.vmid, b.vmid]
    assert driver.stop(a.vmid) and not driver.stop(a.vmid)
    driver.close()
    assert driver.list() == []
    with pytest.raises(ImageNotFound):
        driver.start(VMSpec(image=""))


def test_memory_driver_with_a_port_range_hands_out_unique_ports() -> None:
    driver = MemoryDriver(port_range=(10000, 10002))
    vms = [driver.start(VMSpec(image="x")) for _ in range(3)]
    assert sorted(vm.port for vm in vms) == [10000, 10001, 10002]
    with pytest.raises(DriverError):
        driver.start(VMSpec(image="x"))
    driver.stop(vms[0].vmid)
    assert driver.start(VMSpec(image="x")).port == vms[0].port


def _busy_port_with_a_free_neighbour(busy: socket.socket) -> int:
    """Bind ``busy`` to a port whose next port is free (other processes take ports too)."""
    for _ in range(50):
        port = free_port()
        if port >= 65535:
            continue
        try:
            with socket.socket() as neighbour:
                neighbour.bind(("127.0.0.1", port + 1))
            busy.bind(("127.0.0.1", port))
        except OSError:
            continue
        return int(port)
    pytest.skip("found no busy port with a free neighbour")


def test_port_allocator_skips_ports_in_use() -> None:
    with socket.socket() as busy:
        port = _busy_port_with_a_free_neighbour(busy)
        busy.listen()
        alloc = PortAllocator(port, port + 1)
        got = alloc.allocate()
        assert got == port + 1
        with pytest.raises(DriverError):
            alloc.allocate()
        with pytest.raises(DriverError):
            alloc.allocate(port)
        alloc.release([got])
        assert alloc.allocate() == got
        alloc.release([got])


def _allowed_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, code: str
) -> dict[str, str]:
    """Write module ``name`` under tmp_path, importable here and in children (their env)."""
    (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    return {"PYTHONPATH": str(tmp_path)}


def test_process_driver_passes_port_and_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "env.txt"
    code = (
        "import os, pathlib, time\n"
        f"pathlib.Path({str(out)!r}).write_text("
        "os.environ['PORT'] + ' ' + os.environ['MSG'] + ' ' + os.environ['VMID'])\n"
        "time.sleep(60)\n"
    )
    env = _allowed_module(tmp_path, monkeypatch, "envdump", code)
    driver = ProcessDriver((20000, 29999), env=env, allow_images=["envdump"])
    try:
        vm = driver.start(VMSpec(image="envdump", kernel_args="--env=MSG=hi"))
        text = eventually(lambda: out.exists() and out.read_text(), what="child env")
        assert text == f"{vm.port} hi {vm.vmid}"
        assert vm.pid is not None and is_alive(vm.pid)
    finally:
        driver.close()
    assert not is_alive(vm.pid)
    assert driver.list() == []
    with pytest.raises(DriverError):
        driver.start(VMSpec(image="hello"))


def test_process_driver_ready_timeout_waits_for_the_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _allowed_module(tmp_path, monkeypatch, "quits", "raise SystemExit(1)\n")
    driver = ProcessDriver((20000, 29999), ready_timeout=10, env=env, allow_images=["quits"])
    try:
        vm = driver.start(VMSpec(image="hello"))
        assert http_get("127.0.0.1", vm.port) == (200, b"hello from corral\n")
        with pytest.raises(DriverError):  # exits at once, never listens
            driver.start(VMSpec(image="quits"))
        assert [v.vmid for v in driver.list()] == [vm.vmid]
    finally:
        driver.close()


def test_a_replica_that_exits_on_its_own_is_dropped_and_what_it_left_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    left = tmp_path / "left"
    code = (  # a child in its process group that ignores SIGTERM, then the replica exits
        "import pathlib, signal, subprocess\n"
        "child = subprocess.Popen(['sh', '-c', 'trap \"\" TERM; exec sleep 600'])\n"
        f"pathlib.Path({str(left)!r}).write_text(str(child.pid))\n"
    )
    env = _allowed_module(tmp_path, monkeypatch, "leaves", code)
    driver = ProcessDriver((20000, 29999), env=env, allow_images=["leaves"])
    try:
        vm = driver.start(VMSpec(image="leaves"))
        straggler = int(eventually(lambda: left.exists() and left.read_text(), what="its child"))
        assert vm.pid is not None
        eventually(lambda: driver.list() == [], 30, "the replica dropped")
        # seen ended unreaped, so its group was still surely its own when it was killed
        eventually(lambda: not is_alive(straggler), 30, "what it left killed")
        assert not is_alive(vm.pid)
    finally:
        driver.close()


def test_echo_example_echoes_and_delays() -> None:
    driver = ProcessDriver((20000, 29999), ready_timeout=10)
    try:
        vm = driver.start(VMSpec(image="echo", env={"ECHO_DELAY": "1"}))
        with httpcalls.client(base_url=f"http://127.0.0.1:{vm.port}", timeout=5) as c:
            t0 = time.monotonic()
            assert c.get("/").status_code == 200
            assert time.monotonic() - t0 < 1  # GET ignores ECHO_DELAY (readiness probes)
            t0 = time.monotonic()
            resp = c.post("/", content=b"ping", headers={"content-type": "text/plain"})
            assert time.monotonic() - t0 >= 1
            assert (resp.status_code, resp.content) == (200, b"ping")
            assert resp.headers["content-type"] == "text/plain"
            assert c.post("/?delay=0", content=b"fast").content == b"fast"
            assert c.post("/?delay=abc", content=b"x").status_code == 400
    finally:
        driver.close()
