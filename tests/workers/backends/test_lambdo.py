"""Replicas on Lambdo hosts: a real HTTP server on loopback, including its failure modes."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from agents.faults import Fault
from agents.lambdo import LIMITS, RunningLambdo, serve_lambdo
from corral import api
from tests.fixtures import Env
from tests.helpers import spawn_ok
from workers.backends import inflight
from workers.backends.lambdo import LambdoClient
from workers.base.errors import InputError, PermanentBackendError, TransientBackendError
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.store.models import Function, Replica, ReplicaState

ROOTFS = "https://objects.example/functions/6f1c/rootfs.ext4"
# a call these tests do not time: a spawn starts a replica process, seconds on a loaded
# machine (cis27, three suites at once: 2 s was too little)
CALL_S = 15.0


@pytest.fixture
def lambdo(corral_env: Env) -> Iterator[RunningLambdo]:
    host = serve_lambdo("127.0.0.1:0", port_order="reverse")
    with corral_env.db.transaction() as s:
        upsert_node(s, host.url, name="lambdo1", kind="lambdo")
    yield host
    host.stop()


def _deploy(env: Env, **fields: Any) -> Function:
    spec = {
        "name": "fn",
        "image": "examples.hello",
        "backend": "lambdo",
        "rootfs": ROOTFS,
        **fields,
    }
    with env.db.transaction() as s:
        fn, _ = deploy(s, spec_from(**spec), env.settings)
        return fn


def _replicas(env: Env) -> list[Replica]:
    with env.db.read() as s:
        return list(s.scalars(select(Replica)))


def test_spawn_sends_rootfs_id_and_records_the_mapped_port(
    corral_env: Env, lambdo: RunningLambdo
) -> None:
    fn = _deploy(corral_env, ports=[9000, 8080])
    view = api.wait(api.spawn("fn", 1), timeout=10)
    assert view["status"] == "succeeded", view
    (body,) = lambdo.agent.calls_of("spawn")
    assert body["rootfs"] == {"id": f"{fn.id}_{fn.build_version}", "location": ROOTFS}
    assert body["requestedPorts"] == [9000, 8080]
    (replica,) = _replicas(corral_env)
    (vm,) = lambdo.driver.list()
    assert replica.vmid == vm.vmid
    # port_mapping came back in reverse order; the address must use the host port mapped
    # to the function's guest port (its first port, 9000), not the first pair's.
    (listed,) = inflight.run(LambdoClient(lambdo.url, timeout_s=CALL_S).list_vms())
    assert listed.vmid == vm.vmid
    assert replica.address == f"http://127.0.0.1:{listed.port_mapping[9000]}"
    assert listed.port_mapping[9000] != listed.port_mapping[8080]


def test_redeploy_bumps_the_build_and_changes_the_rootfs_id(
    corral_env: Env, lambdo: RunningLambdo
) -> None:
    first = _deploy(corral_env)
    api.wait(api.spawn("fn", 1), timeout=10)
    second = _deploy(corral_env)
    assert second.build_version > first.build_version
    api.wait(api.spawn("fn", 1), timeout=10)
    ids = [b["rootfs"]["id"] for b in lambdo.agent.calls_of("spawn")]
    assert ids == [f"{first.id}_{first.build_version}", f"{first.id}_{second.build_version}"]
    old, new = sorted(_replicas(corral_env), key=lambda r: r.created_at)
    assert old.build_version != second.build_version  # stale
    assert new.build_version == second.build_version


def test_delete_sends_destroy_and_404_counts_as_gone(
    corral_env: Env, lambdo: RunningLambdo
) -> None:
    _deploy(corral_env)
    api.wait(api.spawn("fn", 2), timeout=10)
    a, b = _replicas(corral_env)
    assert api.wait(api.delete(a.id), timeout=10)["status"] == "succeeded"
    lambdo.agent.inject("destroy", Fault.abort(404, "no such vm"))
    assert api.wait(api.delete(b.id), timeout=10)["status"] == "succeeded"
    assert lambdo.agent.calls_of("destroy") == [a.vmid, b.vmid]
    assert {r.status for r in _replicas(corral_env)} == {ReplicaState.DELETED}


def test_500_text_is_retried_then_reported(corral_env: Env, lambdo: RunningLambdo) -> None:
    _deploy(corral_env)
    lambdo.agent.inject("spawn", *[Fault.abort(500, "disk full on /var/lib/lambdo")] * 4)
    view = api.wait(api.spawn("fn", 1), timeout=10)
    assert view["status"] == "failed"
    assert "500: disk full on /var/lib/lambdo" in (view["error"] or "")
    assert "lambdo1" in (view["error"] or "")
    assert len(lambdo.agent.calls_of("spawn")) == 4  # first try + CORRAL_RETRY_MAX (3)
    assert lambdo.driver.list() == []


def test_500_once_then_success(corral_env: Env, lambdo: RunningLambdo) -> None:
    _deploy(corral_env)
    lambdo.agent.inject("spawn", Fault.abort(500, "busy"))
    spawn_ok("fn", 1, timeout=10)
    assert len(lambdo.agent.calls_of("spawn")) == 2


def test_400_is_permanent(corral_env: Env, lambdo: RunningLambdo) -> None:
    _deploy(corral_env)
    lambdo.agent.inject("spawn", Fault.abort(400, "bad rootfs"))
    view = api.wait(api.spawn("fn", 1), timeout=10)
    assert view["status"] == "failed" and "400: bad rootfs" in (view["error"] or "")
    assert len(lambdo.agent.calls_of("spawn")) == 1
    (replica,) = _replicas(corral_env)
    assert replica.status == ReplicaState.DEAD


def test_non_json_answer_fails_clearly(corral_env: Env, lambdo: RunningLambdo) -> None:
    _deploy(corral_env)
    lambdo.agent.inject("spawn", Fault.reply(200, "<html>proxy error</html>", "text/html"))
    view = api.wait(api.spawn("fn", 1), timeout=10)
    assert view["status"] == "failed"
    assert "unreadable body" in (view["error"] or "")


def test_slow_answer_past_the_timeout(lambdo: RunningLambdo) -> None:
    client = LambdoClient(lambdo.url, node="lambdo1", timeout_s=0.2)
    lambdo.agent.inject("spawn", Fault.delay(1.0))
    with pytest.raises(TransientBackendError, match="timed out"):
        inflight.run(client.spawn("x_1", "examples.hello", [8080]))


def test_client_maps_unordered_pairs_and_rejects_garbage(lambdo: RunningLambdo) -> None:
    client = LambdoClient(lambdo.url, node="lambdo1", timeout_s=CALL_S)
    vm = inflight.run(client.spawn("x_1", "examples.hello", [8080, 9090, 7070]))
    assert sorted(vm.port_mapping) == [7070, 8080, 9090]
    assert all(10000 <= h <= 19999 for h in vm.port_mapping.values())
    lambdo.agent.inject(
        "spawn", Fault.reply(200, '{"id": "", "port_mapping": []}', "application/json")
    )
    with pytest.raises(PermanentBackendError, match="empty vmid"):
        inflight.run(client.spawn("x_1", "examples.hello", [8080]))
    lambdo.agent.inject(
        "spawn", Fault.reply(200, '{"id": "a", "port_mapping": 3}', "application/json")
    )
    with pytest.raises(PermanentBackendError, match="unreadable"):
        inflight.run(client.spawn("x_1", "examples.hello", [8080]))
    assert inflight.run(client.destroy(vm.vmid)) is True
    assert inflight.run(client.destroy(vm.vmid)) is False  # 404: already gone
    assert [v.vmid for v in inflight.run(client.list_vms())] == []


def test_bearer_token(corral_env: Env) -> None:
    host = serve_lambdo("127.0.0.1:0", token="s3cret")
    try:
        with pytest.raises(PermanentBackendError, match="401"):
            inflight.run(
                LambdoClient(host.url, timeout_s=CALL_S).spawn("x_1", "examples.hello", [8080])
            )
        vm = inflight.run(
            LambdoClient(host.url, timeout_s=CALL_S, token="s3cret").spawn(
                "x_1", "examples.hello", [8080]
            )
        )
        assert vm.vmid
    finally:
        host.stop()


def test_a_host_over_its_connection_cap_answers_503_and_a_create_is_nothing_done() -> None:
    host = serve_lambdo("127.0.0.1:0", token="s3cret")
    held: list[socket.socket] = []
    try:
        for _ in range(LIMITS.max_connections):  # this address's kept-alive calls, all it may
            sock = socket.create_connection(("127.0.0.1", host.port), timeout=10)
            sock.sendall(b"GET /vms HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer s3cret\r\n\r\n")
            sock.recv(4096)  # 200, or 503 past the cap
            held.append(sock)
        client = LambdoClient(host.url, timeout_s=5, token="s3cret")
        for _ in range(20):  # each on a new connection, its request sent at once
            with pytest.raises(TransientBackendError) as refused:
                inflight.run(client.spawn("x_1", "examples.hello", [8080]))
            assert "503" in str(refused.value) and refused.value.nothing_done, refused.value
        assert not host.agent.calls_of("spawn")
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        with other:  # another address is served meanwhile
            answer = other.get(f"{host.url}/vms", headers={"authorization": "Bearer s3cret"})
        assert answer.status_code == 200
    finally:
        for sock in held:
            sock.close()
        host.stop()


def test_a_lambdo_function_needs_no_image_its_rootfs_is_its_image(corral_env: Env) -> None:
    fn = _deploy(corral_env, image=None)
    assert fn.image == ROOTFS
    with pytest.raises(InputError, match="--image is required"):
        _deploy(
            corral_env,
            name="fc",
            image=None,
            backend="fcdaemon",
            rootfs=None,
            kernel="/boot/vmlinux",
        )
