"""The qemu driver with real guests: QEMU microVMs booting Debian's cloud kernel (TCG).

Every test here runs real VMs (``make_qemu_driver`` in ``tests/agents/conftest.py``). They
share the driver's cache: a build's image is built once, and its snapshot, once taken,
is what later creates restore (in this run and the next), so most VMs here are restores
and few tests pay for a cold boot. A test that needs a boot or a snapshot of its own
makes it with an image of its own.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import empty_pb2

from agents import RunningAgent, serve_fcdaemon
from agents.drivers import DriverError, VMSpec
from agents.procs import is_alive
from agents.qemu.driver import QemuDriver
from corral import api
from netplumb.grpcserve import report_token
from protos import fcdaemon_grpc, fcdaemon_pb2
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from testkit import httpcalls
from testkit.eventually import eventually
from testkit.services import free_port
from tests.agents.conftest import QEMU_BOOT_S, MakeQemuDriver, kill_processes_naming, stub_for
from tests.agents.helpers import RecordingRegistry, descendants_of, http_get, listening_on
from tests.fixtures import Env
from tests.helpers import deploy_fn, replicas
from workers.fleet.nodes import upsert_node
from workers.gateway import serve_gateway

pytestmark = pytest.mark.slow

IMAGE = "examples.whoami"
CALL_S = QEMU_BOOT_S + 30  # a create's gRPC deadline: the driver's own, and a margin


def whoami(port: int) -> dict[str, Any]:
    """What the replica on ``port`` says it is (``examples.whoami``)."""
    got = http_get("127.0.0.1", port, timeout=10)
    assert got is not None and got[0] == 200, got
    answer: dict[str, Any] = json.loads(got[1])
    return answer


def qemus_naming(state: Path) -> list[int]:
    """Live QEMU processes whose command line names ``state``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        named = b"qemu-system" in cmdline and str(state).encode() in cmdline
        if named and is_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def create(
    stub: fcdaemon_grpc.FcServiceStub, request_id: str = "", mem: int = 256, image: str = IMAGE
) -> Any:
    """CreateReplica of ``image``; its reply."""
    request = fcdaemon_pb2.CreateRequest(imageName=image, cpu=1, mem=mem, requestId=request_id)
    return stub.CreateReplica(request, timeout=CALL_S)


def listed(stub: fcdaemon_grpc.FcServiceStub) -> list[Any]:
    """What ListReplicas says the agent runs."""
    return list(stub.ListReplicas(empty_pb2.Empty(), timeout=10).replicas)


REGISTRY_TOKEN = "registry-token-never-on-a-command-line"


@pytest.fixture
def qemu_agent(
    make_qemu_driver: MakeQemuDriver, registry: tuple[str, RecordingRegistry]
) -> Iterator[tuple[RunningAgent, QemuDriver]]:
    """An agent on a qemu driver, reporting READY to a recording registry (with a token)."""
    driver = make_qemu_driver()
    running = serve_fcdaemon(
        driver=driver, registry=registry[0], advertise_ip="127.0.0.1", token=REGISTRY_TOKEN
    )
    yield running, driver
    running.stop()


def test_a_guest_starts_reports_ready_serves_and_is_released(
    qemu_agent: tuple[RunningAgent, QemuDriver],
    registry: tuple[str, RecordingRegistry],
    qemu_state: Path,
) -> None:
    running, driver = qemu_agent
    stub = stub_for(running)
    reply = create(stub, request_id="req-1")
    assert reply.start in ("boot", "restore")
    # the guest answers on the host port the reply names, as the replica it was told it is
    assert whoami(reply.port)["vmid"] == reply.vmid
    vm = driver.get(reply.vmid)
    assert vm is not None and vm.pid is not None
    cmdline = Path(f"/proc/{vm.pid}/cmdline").read_bytes()
    assert b"qemu-system-x86_64" in cmdline and b"-sandbox" in cmdline
    # its identity went over its control port, never on QEMU's command line (ps shows it)
    assert reply.vmid.encode() not in cmdline
    assert report_token(REGISTRY_TOKEN, reply.vmid).encode() not in cmdline
    if os.geteuid() == 0:  # an agent running as root runs QEMU as nobody
        assert Path(f"/proc/{vm.pid}").stat().st_uid == pwd.getpwnam("nobody").pw_uid
    ready = eventually(
        lambda: [r for r, _ in registry[1].of("UpdateStatus") if r.vmid == reply.vmid],
        timeout=30,
        what="the replica's READY",
    )
    assert len(ready) == 1
    assert [(r.vmid, r.requestId) for r in listed(stub)] == [(reply.vmid, "req-1")]
    # the same request id again: the same VM, not a second one
    assert create(stub, request_id="req-1").vmid == reply.vmid

    assert listening_on(descendants_of(os.getpid()), reply.port) == {"127.0.0.1"}
    stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=reply.vmid), timeout=30)
    assert not is_alive(vm.pid)
    assert listed(stub) == []
    # nothing of ours listens there (asking the port could reach another test's server)
    assert listening_on(descendants_of(os.getpid()), reply.port) == set()
    assert list(qemu_state.iterdir()) == []  # its sockets and record went with it
    with pytest.raises(grpc.RpcError) as gone:
        stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=reply.vmid), timeout=10)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_guest_that_never_serves_is_killed_at_the_create_deadline(
    make_qemu_driver: MakeQemuDriver,
    qemu_state: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A function whose import never ends: its guest boots, but never loads nor serves.
    (tmp_path / "corral_never_serves.py").write_text("import time\n\ntime.sleep(10**6)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    driver = make_qemu_driver(
        boot_timeout=8.0, allow_images=["corral_never_serves"], snapshots=False
    )
    with serve_fcdaemon(driver=driver) as running:
        stub = stub_for(running)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            create(stub, image="corral_never_serves")
        took = time.monotonic() - started
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert "not serving" in (failed.value.details() or "")
        assert took >= 8.0  # it was given its whole deadline
        assert listed(stub) == []
        assert qemus_naming(qemu_state) == []  # killed, not left running
        assert list(qemu_state.iterdir()) == []


def test_a_qemu_killed_under_a_live_replica_is_a_vm_gone(
    qemu_agent: tuple[RunningAgent, QemuDriver], qemu_state: Path
) -> None:
    running, driver = qemu_agent
    stub = stub_for(running)
    reply = create(stub, request_id="req-killed")
    vm = driver.get(reply.vmid)
    assert vm is not None and vm.pid is not None
    os.kill(vm.pid, signal.SIGKILL)
    eventually(lambda: listed(stub) == [], timeout=10, what="the dead VM to leave ListReplicas")
    assert driver.get(reply.vmid) is None
    with pytest.raises(grpc.RpcError) as gone:
        stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=reply.vmid), timeout=10)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    # the call that found the VM dead removes its directory after taking it off the list
    # (a loaded CI run looked in between)
    eventually(lambda: list(qemu_state.iterdir()) == [], 10, "the dead VM's directory removed")
    # the request id is free again: a retried create makes a new VM
    again = create(stub, request_id="req-killed")
    assert again.vmid != reply.vmid and whoami(again.port)["vmid"] == again.vmid


def _agent_process(cache: Path, state: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``corral agent fcdaemon --driver qemu`` on ``port``, its log in ``log``."""
    argv = [
        sys.executable,
        "-m",
        "agents.fcdaemon",
        "--listen",
        f"127.0.0.1:{port}",
        "--driver",
        "qemu",
        "--qemu-cache",
        str(cache),
        "--qemu-state",
        str(state),
        "--qemu-accel",
        "tcg",
        "--qemu-boot-timeout",
        str(QEMU_BOOT_S),
    ]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def _serving(stub: fcdaemon_grpc.FcServiceStub) -> bool:
    try:
        listed(stub)
    except grpc.RpcError:
        return False
    return True


def test_an_agent_restarted_adopts_its_serving_vms_and_kills_the_rest(
    qemu_cache: Path, qemu_state: Path, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    port = free_port()
    first = _agent_process(qemu_cache, qemu_state, port, log)
    second: subprocess.Popen[bytes] | None = None
    stranger: subprocess.Popen[bytes] | None = None
    try:
        stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        eventually(lambda: _serving(stub), timeout=60, what="the agent", detail=log.read_text)
        reply = create(stub, request_id="req-adopt")
        (qemu_pid,) = qemus_naming(qemu_state)
        first.kill()  # SIGKILL: no clean-up of any kind
        first.wait()
        assert is_alive(qemu_pid)  # a VM outlives its agent...
        # ...and so may a VM whose create never finished: its record says it never served
        leftover = qemu_state / "notserving000000"
        leftover.mkdir()
        stranger = subprocess.Popen(  # a process standing in for its QEMU
            [sys.executable, "-c", "import time; time.sleep(600)", str(leftover / "qmp.sock")]
        )
        record = {"vmid": "notserving", "pid": stranger.pid, "ready": False, "port_mapping": []}
        (leftover / "vm.json").write_text(json.dumps(record))

        second = _agent_process(qemu_cache, qemu_state, port, log)
        eventually(lambda: _serving(stub), timeout=60, what="the restarted agent")
        assert [(r.vmid, r.requestId) for r in listed(stub)] == [(reply.vmid, "req-adopt")]
        assert whoami(reply.port)["vmid"] == reply.vmid  # the same guest, still serving
        # the adopted VM keeps its request id: a repeated create is answered with it
        assert create(stub, request_id="req-adopt").vmid == reply.vmid
        stranger.wait(timeout=10)  # the agent killed what never served...
        assert not leftover.exists()  # ...and removed its record
        assert qemus_naming(qemu_state) == [qemu_pid]

        second.send_signal(signal.SIGTERM)  # a clean stop stops its VMs
        assert second.wait(timeout=60) == 0
        assert not is_alive(qemu_pid)
        assert qemus_naming(qemu_state) == []
    finally:
        for proc in (first, second, stranger):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        kill_processes_naming(qemu_state)


def test_replicas_restored_from_one_snapshot_each_get_their_own_identity(
    make_qemu_driver: MakeQemuDriver,
) -> None:
    driver = make_qemu_driver()
    spec = VMSpec(image=IMAGE, mem_mb=256)
    first = driver.start(spec)
    # The build's snapshot exists once a replica of it has answered (taken by this one,
    # or by another test or run of the same build).
    eventually(lambda: driver.has_snapshot(spec), timeout=QEMU_BOOT_S, what="the snapshot")
    clones = [driver.start(VMSpec(image=IMAGE, mem_mb=256)) for _ in range(2)]
    assert [vm.start for vm in clones] == ["restore", "restore"]
    answers = [whoami(vm.port) for vm in [first, *clones]]
    assert [a["vmid"] for a in answers] == [vm.vmid for vm in [first, *clones]]
    for key in ("random", "urandom", "uuid"):  # reseeded: no two share what they draw
        assert len({a[key] for a in answers}) == 3, (key, answers)
    for answer in answers:  # the clock is the host's, not the snapshot's
        assert abs(answer["time"] - time.time()) < 60
    assert driver.stats()["restore"] >= 2


def test_a_snapshot_of_another_build_is_refused_and_the_guest_boots_cold(
    make_qemu_driver: MakeQemuDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A function of this test's own, whose source changes between two creates.
    source = tmp_path / "corral_build_probe.py"
    program = (
        "from http.server import BaseHTTPRequestHandler, HTTPServer\nimport os\n"
        "BUILD = {build!r}\n\n"
        "class H(BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200)\n        self.end_headers()\n"
        "        self.wfile.write(BUILD.encode())\n\n"
        "if __name__ == '__main__':\n"
        "    HTTPServer(('0.0.0.0', int(os.environ['PORT'])), H).serve_forever()\n"
    )
    source.write_text(program.format(build="one"))
    monkeypatch.syspath_prepend(str(tmp_path))
    driver = make_qemu_driver(allow_images=["corral_build_probe"])
    spec = VMSpec(image="corral_build_probe", mem_mb=256)
    one = driver.start(spec)
    assert http_get("127.0.0.1", one.port) == (200, b"one")
    eventually(lambda: driver.has_snapshot(spec), timeout=QEMU_BOOT_S, what="build one's snapshot")
    driver.stop(one.vmid)

    source.write_text(program.format(build="two"))  # a new build of the function
    refused_before = driver.stats()["snapshots"]["refused"].get("another build of the function", 0)
    two = driver.start(VMSpec(image="corral_build_probe", mem_mb=256))
    assert two.start == "boot"  # build one's snapshot was not restored...
    assert http_get("127.0.0.1", two.port) == (200, b"two")
    refused = driver.stats()["snapshots"]["refused"]
    assert refused.get("another build of the function", 0) == refused_before + 1  # ...but counted
    assert driver.has_snapshot(VMSpec(image="corral_build_probe", mem_mb=256))  # build two's now
    slot = driver.snapshots.directory / "corral_build_probe@256m1c"
    assert len([p for p in slot.iterdir() if p.is_dir() and not p.name.startswith(".")]) == 1


def test_a_snapshot_that_fails_to_restore_is_deleted_and_the_guest_boots_cold(
    make_qemu_driver: MakeQemuDriver,
) -> None:
    driver = make_qemu_driver()
    spec = VMSpec(image=IMAGE, mem_mb=320)  # a VM shape, and so a snapshot, of its own
    first = driver.start(spec)
    eventually(lambda: driver.has_snapshot(spec), timeout=QEMU_BOOT_S, what="the snapshot")
    driver.stop(first.vmid)
    (state,) = (driver.snapshots.directory / f"{IMAGE}@320m1c").glob("*/state")
    state.write_bytes(b"not a migration stream")  # a snapshot QEMU cannot load
    vm = driver.start(VMSpec(image=IMAGE, mem_mb=320))
    assert vm.start == "boot"  # the create did not fail: it booted cold...
    assert whoami(vm.port)["vmid"] == vm.vmid
    assert driver.stats()["restore_failed"] == 1
    assert not state.exists() or state.read_bytes() != b"not a migration stream"  # ...deleted
    assert qemus_naming(driver.state) == [vm.pid]  # the failed restore's QEMU is gone


def test_bad_input_is_refused_before_any_vm_starts(
    make_qemu_driver: MakeQemuDriver, qemu_state: Path
) -> None:
    driver = make_qemu_driver()
    for spec in (
        VMSpec(image="os.system"),  # not an examples module, not allowed
        VMSpec(image="examples.hello; rm -rf /"),
        VMSpec(image=IMAGE, env={"LD_PRELOAD": "/tmp/x.so"}),
        VMSpec(image=IMAGE, guest_port=70000),
    ):
        with pytest.raises(DriverError):
            driver.start(spec)
    assert driver.list() == [] and list(qemu_state.iterdir()) == []


def test_a_call_through_the_gateway_is_answered_by_a_real_guest(
    thread_worker: Env, make_qemu_driver: MakeQemuDriver
) -> None:
    broker_env = thread_worker  # the gateway carries out the cold start; a worker, the delete
    settings = broker_env.set(
        create_timeout_s=QEMU_BOOT_S + 10,
        task_soft_time_limit_s=QEMU_BOOT_S + 30,
        task_time_limit_s=QEMU_BOOT_S + 40,
        visibility_timeout_s=QEMU_BOOT_S + 100,
        gateway_cold_start_timeout_s=QEMU_BOOT_S + 20,
    )
    driver = make_qemu_driver()
    with serve_fcdaemon("127.0.0.1:0", driver=driver) as agent:
        with broker_env.db.transaction() as s:
            upsert_node(s, agent.address, name="vm-node", capacity=4)
        deploy_fn(broker_env, "who", image=IMAGE, mem=256)
        gateway = serve_gateway(settings, "127.0.0.1:0", queue=HereFirst(QUEUE))
        try:
            answer = httpcalls.get(f"{gateway.url}/function/who", timeout=QEMU_BOOT_S + 30)
        finally:
            gateway.stop()
        assert answer.status_code == 200, answer.text
        (replica,) = replicas(broker_env, "who")
        assert answer.json()["vmid"] == replica.vmid  # the guest that answered is the replica's
        assert replica.vmid is not None
        vm = driver.get(replica.vmid)
        assert vm is not None and vm.pid is not None
        assert b"qemu-system-x86_64" in Path(f"/proc/{vm.pid}/cmdline").read_bytes()
        (op,) = [o for o in api.operations(settings=settings) if o["kind"] == "spawn"]
        assert op["result"] is not None
        assert op["result"]["starts"] == {replica.id: vm.start}  # booted or restored: said
        assert vm.start in ("boot", "restore")

        done = api.wait(api.delete(replica.id, settings=settings), timeout=60, settings=settings)
        assert done["status"] == "succeeded", done
        assert driver.list() == [] and not is_alive(vm.pid)


def test_the_agent_log_says_which_accelerator_it_runs(
    qemu_cache: Path, qemu_state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="agents.qemu.driver")
    driver = QemuDriver(cache=qemu_cache, state=qemu_state, accel="tcg")
    try:
        assert driver.accel == "tcg"
        assert any("qemu driver: TCG" in r.getMessage() for r in caplog.records)
    finally:
        driver.close()
