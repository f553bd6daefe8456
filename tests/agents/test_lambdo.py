"""The reference Lambdo host over real HTTP: spawn, destroy, start, /vms, auth, faults."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from agents import Fault, ProcessDriver, RunningLambdo, serve_lambdo
from agents.lambdo import main
from testkit import httpcalls
from testkit.eventually import eventually
from tests.agents.helpers import (
    MeetingDriver,
    descendants_of,
    http_get,
    is_alive,
    listening_on,
    same_bucket_ids,
)

pytestmark = pytest.mark.timeout(30)

FUNCTION = "3f1c2a9e-0000-4000-8000-000000000001"
ROOTFS_URL = f"http://objects.local/functions/{FUNCTION}/rootfs.ext4"


def spawn_body(ports: list[int] | None = None, **rootfs: str) -> dict[str, object]:
    """A /spawn body in the shape grobuzin sends."""
    fs = {"id": f"{FUNCTION}_1700000000", "location": ROOTFS_URL, **rootfs}
    return {"rootfs": fs, "requestedPorts": [8080] if ports is None else ports}


@pytest.fixture
def lambdo() -> Iterator[RunningLambdo]:
    """A Lambdo host whose VMs are records."""
    running = serve_lambdo()
    yield running
    running.stop()


@pytest.fixture
def client(lambdo: RunningLambdo) -> Iterator[httpx.Client]:
    """An HTTP client for :func:`lambdo`."""
    with httpcalls.client(base_url=lambdo.url, timeout=10) as c:
        yield c


@pytest.fixture
def process_lambdo() -> Iterator[RunningLambdo]:
    """A Lambdo host whose VMs are real processes, answered once they listen."""
    running = serve_lambdo(
        driver=ProcessDriver((10000, 19999), ready_timeout=10), port_order="reverse"
    )
    yield running
    running.stop()


def test_spawn_maps_every_requested_port(client: httpx.Client, lambdo: RunningLambdo) -> None:
    resp = client.post("/spawn", json=spawn_body([8080, 9090, 7000]))
    assert resp.status_code == 200
    data = resp.json()
    uuid.UUID(data["id"])
    mapping = {guest: host for host, guest in data["port_mapping"]}
    assert set(mapping) == {8080, 9090, 7000}
    assert len(set(mapping.values())) == 3
    assert all(10000 <= host <= 19999 for host in mapping.values())
    assert [vm.vmid for vm in lambdo.driver.list()] == [data["id"]]


def test_spawn_process_listens_on_the_host_port_of_the_first_requested_port(
    process_lambdo: RunningLambdo,
) -> None:
    with httpcalls.client(base_url=process_lambdo.url, timeout=15) as c:
        resp = c.post("/spawn", json=spawn_body([9000, 8080], location="examples.hello"))
        assert resp.status_code == 200, resp.text
        data = resp.json()
        pairs = data["port_mapping"]
        # port_order="reverse": the function's port is not the first pair, so a client
        # must look the guest port up rather than take pairs[0].
        assert [g for _, g in pairs] == [8080, 9000]
        host = {g: h for h, g in pairs}[9000]
        assert http_get("127.0.0.1", host) == (200, b"hello from corral\n")
        (vm,) = process_lambdo.driver.list()
        assert vm.pid is not None and is_alive(vm.pid)
        assert listening_on(descendants_of(os.getpid()), host) == {"127.0.0.1"}

        assert c.delete(f"/destroy/{data['id']}").status_code == 204
        assert not is_alive(vm.pid)
        # nothing of ours listens there (asking the port could reach another test's server)
        assert listening_on(descendants_of(os.getpid()), host) == set()
        again = c.delete(f"/destroy/{data['id']}")
        assert again.status_code == 404
        assert again.headers["content-type"].startswith("text/plain")


def test_spawn_of_an_object_store_url_runs_the_default_image(
    process_lambdo: RunningLambdo,
) -> None:
    with httpcalls.client(base_url=process_lambdo.url, timeout=15) as c:
        data = c.post("/spawn", json=spawn_body([8080])).json()
    ((host, guest),) = data["port_mapping"]
    assert guest == 8080
    assert http_get("127.0.0.1", host) == (200, b"hello from corral\n")


def test_spawn_of_an_unrunnable_image_is_a_plain_text_400(
    process_lambdo: RunningLambdo,
) -> None:
    with httpcalls.client(base_url=process_lambdo.url, timeout=15) as c:
        resp = c.post("/spawn", json=spawn_body(image="no-such-binary-xyz"))
    assert resp.status_code == 400
    assert resp.headers["content-type"].startswith("text/plain")
    assert "no-such-binary-xyz" in resp.text
    assert process_lambdo.driver.list() == []


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"requestedPorts": [8080]}',
        b'{"rootfs": {"id": 1, "location": "x"}, "requestedPorts": [8080]}',
        b'{"rootfs": {"id": "a", "location": "x"}, "requestedPorts": ["8080"]}',
        b'{"rootfs": {"id": "a", "location": "x"}, "requestedPorts": [70000]}',
        b'{"rootfs": {"id": "a", "location": "x"}, "requestedPorts": [8080, 8080]}',
        b'{"rootfs": {"id": "a", "location": "x"}, "requestedPorts": 8080}',
    ],
)
def test_malformed_spawn_is_400_and_creates_nothing(
    client: httpx.Client, lambdo: RunningLambdo, body: bytes
) -> None:
    resp = client.post("/spawn", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.headers["content-type"].startswith("text/plain")
    assert resp.text.strip()
    assert lambdo.driver.list() == []


def test_destroy_unknown_is_404_and_routes_are_checked(client: httpx.Client) -> None:
    assert client.delete("/destroy/does-not-exist").status_code == 404
    assert client.get("/spawn").status_code == 405
    assert client.get("/nowhere").status_code == 404


def test_vms_lists_what_runs(client: httpx.Client) -> None:
    before = time.time()
    a = client.post("/spawn", json=spawn_body([8080])).json()
    b = client.post("/spawn", json=spawn_body([8080, 9090], id="other_1")).json()
    vms = {vm["id"]: vm for vm in client.get("/vms").json()["vms"]}
    assert set(vms) == {a["id"], b["id"]}
    assert vms[a["id"]]["rootfs_id"] == f"{FUNCTION}_1700000000"
    assert vms[b["id"]]["rootfs_id"] == "other_1"
    assert sorted(map(tuple, vms[b["id"]]["port_mapping"])) == sorted(map(tuple, b["port_mapping"]))
    assert before <= vms[a["id"]]["created_unix"] <= time.time()
    client.delete(f"/destroy/{a['id']}")
    assert [vm["id"] for vm in client.get("/vms").json()["vms"]] == [b["id"]]


def test_start_honours_fixed_host_ports(client: httpx.Client) -> None:
    body = {
        "kernel": "/boot/vmlinux",
        "initrd": "/boot/initrd",
        "bootArgs": "console=ttyS0 --env=A=1",
        "disks": [{"id": "disk-1", "path": "examples.hello"}],
        "portMapping": [[0, 8080], [15555, 9090]],
    }
    resp = client.post("/start", json=body)
    assert resp.status_code == 200, resp.text
    mapping = {g: h for h, g in resp.json()["port_mapping"]}
    assert mapping[9090] == 15555
    assert 10000 <= mapping[8080] <= 19999 and mapping[8080] != 15555
    assert client.post("/start", json={**body, "portMapping": [[1, 2, 3]]}).status_code == 400
    # a host port outside --port-range (the registry's, sshd's...) is refused, nothing starts
    running = {vm["id"] for vm in client.get("/vms").json()["vms"]}
    for port in (22, 9999, 20000, 50052):
        resp = client.post("/start", json={**body, "portMapping": [[port, 8080]]})
        assert resp.status_code == 400 and "outside this host's range 10000-19999" in resp.text
    assert {vm["id"] for vm in client.get("/vms").json()["vms"]} == running


def test_request_id_makes_spawn_idempotent(client: httpx.Client, lambdo: RunningLambdo) -> None:
    body = {**spawn_body(), "requestId": "spawn-42"}
    first = client.post("/spawn", json=body).json()
    second = client.post("/spawn", json=body).json()
    assert first["id"] == second["id"]
    assert len(lambdo.driver.list()) == 1


def test_spawns_of_different_request_ids_run_side_by_side() -> None:
    # the host once held one of 64 crc32 bucket locks across each whole create
    same = same_bucket_ids(4)
    running = serve_lambdo(driver=MeetingDriver(len(same)))
    try:
        with (
            httpcalls.client(base_url=running.url, timeout=30) as http,
            concurrent.futures.ThreadPoolExecutor(len(same)) as pool,
        ):
            answers = list(
                pool.map(
                    lambda rid: http.post("/spawn", json={**spawn_body(), "requestId": rid}), same
                )
            )
        assert [a.status_code for a in answers] == [200] * len(same)
        assert len({a.json()["id"] for a in answers}) == len(same)
    finally:
        running.stop()


def test_a_caller_that_hangs_up_mid_call_leaves_no_traceback_and_its_vm_runs(
    lambdo: RunningLambdo, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    lambdo.agent.inject("spawn", Fault.delay(0.5))
    capsys.readouterr()
    with (
        caplog.at_level(logging.INFO),
        httpcalls.client(base_url=lambdo.url, timeout=0.2) as impatient,
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.post("/spawn", json=spawn_body())  # gone before its answer
    eventually(lambda: len(lambdo.driver.list()) == 1, 10, "the spawn to finish")
    with httpcalls.client(base_url=lambdo.url, timeout=10) as c:
        assert c.get("/vms").status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "Traceback" not in capsys.readouterr().err


def test_bearer_token_is_required_when_configured() -> None:
    with serve_lambdo(token="t0ken") as running, httpcalls.client(base_url=running.url) as c:
        assert c.get("/vms").status_code == 401
        assert c.get("/vms", headers={"Authorization": "Bearer wrong"}).status_code == 401
        denied = c.post("/spawn", json=spawn_body())
        assert denied.status_code == 401 and running.driver.list() == []
        ok = c.post("/spawn", json=spawn_body(), headers={"Authorization": "Bearer t0ken"})
        assert ok.status_code == 200
        assert [kind for kind, _ in running.agent.calls] == ["spawn"]


def test_faults_play_in_order_then_normal_service(
    client: httpx.Client, lambdo: RunningLambdo
) -> None:
    lambdo.agent.inject(
        "spawn",
        Fault.abort(500, "disk full"),
        Fault.abort(400, "bad rootfs"),
        Fault.delay(0.3),
        Fault.reply(200, "not json", "text/plain"),
        Fault.hangup(),
    )
    r = client.post("/spawn", json=spawn_body())
    assert (r.status_code, r.text.strip()) == (500, "disk full")
    assert r.headers["content-type"].startswith("text/plain")
    assert client.post("/spawn", json=spawn_body()).status_code == 400
    t0 = time.monotonic()
    delayed = client.post("/spawn", json=spawn_body())
    assert time.monotonic() - t0 >= 0.3 and delayed.status_code == 200
    canned = client.post("/spawn", json=spawn_body())
    assert (canned.status_code, canned.text) == (200, "not json")
    with pytest.raises(httpx.TransportError):
        client.post("/spawn", json=spawn_body())
    normal = client.post("/spawn", json=spawn_body())
    assert normal.status_code == 200
    assert {vm.vmid for vm in lambdo.driver.list()} == {delayed.json()["id"], normal.json()["id"]}
    assert len(lambdo.agent.calls_of("spawn")) == 6

    lambdo.agent.inject("destroy", Fault.abort(500, "stuck"))
    assert client.delete(f"/destroy/{normal.json()['id']}").status_code == 500
    assert client.delete(f"/destroy/{normal.json()['id']}").status_code == 204
    with pytest.raises(ValueError, match="unknown operation 'spawnn'"):
        lambdo.agent.inject("spawnn", Fault.delay(0))


def test_main_rejects_a_bad_port_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--listen", "127.0.0.1:0", "--port-range", "5-1"])
    assert exc.value.code == 2
    assert "port range" in capsys.readouterr().err
