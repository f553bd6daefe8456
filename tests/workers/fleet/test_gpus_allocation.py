"""GPU memory and AvA worker slots handed to replicas, against a real GPUResc server."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from sqlalchemy import select

from agents.gpus import RunningGpus, serve_gpus
from corral import api
from corral.cli import main
from protos import mngrinfo_grpc, mngrinfo_pb2
from tasks.maintenance import QUEUE
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, one_agent, spawn_ok
from tests.workers.fleet.helpers import audit_gpus, gpus_by_uuid, live
from workers.fleet.gpus import add_gpu_server, manager_info, record_gpus
from workers.registry.service import serve_registry
from workers.store.models import Gpu, Node, Replica, ReplicaState

pytestmark = pytest.mark.timeout(60)

G0, G1 = "GPU-0a000000-0000-0000-0000-000000000000", "GPU-1b000000-0000-0000-0000-000000000001"


@pytest.fixture
def gpu_server() -> Iterator[RunningGpus]:
    """A GPUResc server on loopback reporting two GPUs of 16000 MB."""
    with serve_gpus(gpus={G0: 16000, G1: 16000}) as server:
        yield server


@pytest.fixture
def gpu_node(corral_env: Env, start_agents: StartAgents, gpu_server: RunningGpus) -> None:
    """One agent, and the GPU server's two GPUs recorded in the store."""
    start_agents(1)
    add_gpu_server(corral_env.db, corral_env.settings, gpu_server.address)


def _gpu_and_port(gpus: dict[str, Gpu], replica: Replica) -> tuple[Gpu, int]:
    """The GPU a replica holds and its AvA worker port."""
    assert replica.gpu_id is not None and replica.gpu_slot is not None
    gpu = gpus[replica.gpu_id]
    return gpu, gpu.first_port + replica.gpu_slot


def _dead(env: Env) -> list[Replica]:
    with env.db.read() as s:
        return list(s.scalars(select(Replica).where(Replica.status == ReplicaState.DEAD)))


def test_four_fit_the_fifth_fails_and_a_delete_makes_room(
    corral_env: Env,
    start_agents: StartAgents,
    gpu_server: RunningGpus,
    capsys: pytest.CaptureFixture[str],
) -> None:
    start_agents(1)
    assert main(["gpus", "add", gpu_server.address, "--json"]) == 0
    capsys.readouterr()
    deploy_fn(corral_env, "infer", gpu_mem=6000)

    view = api.wait(api.scale("infer", 5), timeout=20)
    # the scale reports how many it could place
    assert (view["status"], view["done"], view["failed"], view["total"]) == ("partial", 4, 1, 5)
    assert view["error"] == "1 of 5 failed; first: no GPU capacity for infer (6000 MB)"
    (dead,) = _dead(corral_env)
    assert dead.error == "no GPU capacity for infer (6000 MB)"
    assert (dead.gpu_slot, dead.gpu_id) == (None, None)

    replicas = live(corral_env)
    assert len(replicas) == 4
    gpus = gpus_by_uuid(corral_env)
    by_gpu = Counter(r.gpu_id for r in replicas)
    assert by_gpu == {gpus[G0].id: 2, gpus[G1].id: 2}
    for g in gpus.values():
        assert (g.mem_free_mb, g.slots_free) == (4000, 2)  # slots are still free: memory binds
    with corral_env.db.read() as s:
        assert s.scalars(select(Node)).one().live == 4  # the failed one holds no node slot
        assert audit_gpus(s) == []

    assert main(["gpus", "list", "--json"]) == 0
    rows = {r["uuid"]: r for r in json.loads(capsys.readouterr().out)}
    assert {
        (r["mem_used_mb"], r["mem_total_mb"], r["slots_used"], r["slots_total"])
        for r in rows.values()
    } == {(12000, 16000, 2, 4)}
    assert (rows[G0]["first_port"], rows[G1]["first_port"]) == (4000, 4004)
    assert {r["mngr_addr"] for r in rows.values()} == {"127.0.0.1:3333"}
    assert {r["server"] for r in rows.values()} == {gpu_server.address}

    victim = replicas[0]
    assert api.wait(api.delete(victim.id), timeout=10)["status"] == "succeeded"
    freed = gpus_by_uuid(corral_env)
    assert sum(g.mem_free_mb for g in freed.values()) == 4000 + 4000 + 6000
    spawn_ok("infer", 1, timeout=10)
    newest = live(corral_env)[-1]
    assert newest.gpu_id == victim.gpu_id  # the only GPU with room
    view = api.wait(api.spawn("infer", 1), timeout=10)
    assert (view["status"], view["error"]) == ("failed", "no GPU capacity for infer (6000 MB)")
    with corral_env.db.read() as s:
        assert audit_gpus(s) == []
        assert s.scalars(select(Node)).one().live == 4


@pytest.mark.usefixtures("gpu_node")
def test_slots_bind_when_memory_does_not(corral_env: Env) -> None:
    deploy_fn(corral_env, "small", gpu_mem=100)
    view = api.wait(api.scale("small", 9), timeout=20)
    assert (view["status"], view["done"], view["failed"]) == ("partial", 8, 1)
    replicas = live(corral_env)
    gpus = {g.id: g for g in gpus_by_uuid(corral_env).values()}
    # every slot of each GPU is used once: worker ports 4000-4007 all handed out
    assert sorted(_gpu_and_port(gpus, r)[1] for r in replicas) == list(range(4000, 4008))
    assert {g.slots_free for g in gpus.values()} == {0}


@pytest.mark.usefixtures("gpu_node")
def test_manager_info_answers_for_gpu_replicas_only(corral_env: Env) -> None:
    deploy_fn(corral_env, "infer", gpu_mem=6000)
    deploy_fn(corral_env, "plain")
    spawn_ok("infer", 3, timeout=10)
    spawn_ok("plain", 1, timeout=10)
    gpus = {g.id: g for g in gpus_by_uuid(corral_env).values()}
    ports = set()
    with corral_env.db.read() as s:
        for r in live(corral_env, "infer"):
            assert r.vmid
            gpu, port = _gpu_and_port(gpus, r)
            assert manager_info(s, r.vmid) == (gpu.uuid, "127.0.0.1:3333", port)
            ports.add(port)
        (plain,) = live(corral_env, "plain")
        assert plain.vmid and manager_info(s, plain.vmid) is None
        assert manager_info(s, "no-such-vm") is None
        assert manager_info(s, "") is None
    assert len(ports) == 3
    gone = live(corral_env, "infer")[0]
    assert api.wait(api.delete(gone.id), timeout=10)["status"] == "succeeded"
    with corral_env.db.read() as s:
        assert manager_info(s, gone.vmid or "") is None


@pytest.mark.usefixtures("gpu_node")
def test_manager_info_over_grpc(corral_env: Env) -> None:
    deploy_fn(corral_env, "infer", gpu_mem=6000)
    spawn_ok("infer", 2, timeout=10)
    deploy_fn(corral_env, "plain")
    spawn_ok("plain", 1, timeout=10)
    registry = serve_registry(corral_env.settings, "127.0.0.1:0", queue=QUEUE)  # the real one
    try:
        with grpc.insecure_channel(registry.address) as channel:
            stub = mngrinfo_grpc.AvAManagerInfoStub(channel)
            gpus = {g.id: g for g in gpus_by_uuid(corral_env).values()}
            for r in live(corral_env, "infer"):
                reply = stub.GetAvAManagerInfo(
                    mngrinfo_pb2.AvAManagerInfoRequest(vmid=r.vmid or ""), timeout=5
                )
                gpu, port = _gpu_and_port(gpus, r)
                assert (reply.gpu_uuid, reply.mngr_addr, reply.worker_port) == (
                    gpu.uuid,
                    gpu.mngr_addr,
                    port,
                )
            (no_gpu,) = live(corral_env, "plain")
            for vmid in ("x", no_gpu.vmid or ""):  # unknown, and a replica without a GPU
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetAvAManagerInfo(mngrinfo_pb2.AvAManagerInfoRequest(vmid=vmid), timeout=5)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        registry.stop(0)


@pytest.mark.parametrize(("fit", "expected"), [("best", "GPU-a-small"), ("first", "GPU-z-big")])
def test_best_fit_and_first_fit_choose_different_gpus(
    corral_env: Env, start_agents: StartAgents, fit: str, expected: str
) -> None:
    settings = corral_env.set(gpu_fit=fit)
    start_agents(1)
    with corral_env.db.transaction() as s:  # the big GPU is recorded first
        record_gpus(s, settings, "gpu-1:50053", {"GPU-z-big": 16000})
    with corral_env.db.transaction() as s:
        record_gpus(s, settings, "gpu-2:50053", {"GPU-a-small": 8000})
    deploy_fn(corral_env, "infer", gpu_mem=6000)
    spawn_ok("infer", 1, timeout=10)
    (replica,) = live(corral_env)
    assert replica.gpu is not None and replica.gpu.uuid == expected
    # best fit then still has room for an 11000 MB replica; first fit has split the big GPU
    deploy_fn(corral_env, "large", gpu_mem=11000)
    view = api.wait(api.spawn("large", 1), timeout=10)
    assert view["status"] == ("succeeded" if fit == "best" else "failed"), view


def test_without_gpus_a_gpu_function_fails_and_frees_its_node_slot(
    corral_env: Env, start_agents: StartAgents
) -> None:
    one_agent(corral_env, start_agents, "infer", gpu_mem=1)
    view = api.wait(api.spawn("infer", 2), timeout=10)
    assert (view["status"], view["failed"]) == ("failed", 2)
    assert view["error"] == "2 of 2 failed; first: no GPU capacity for infer (1 MB)"
    with corral_env.db.read() as s:
        assert s.scalars(select(Node)).one().live == 0
