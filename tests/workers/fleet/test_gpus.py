"""GPU inventory from a real GPUResc server on loopback: add, refresh, ports, list, remove."""

from __future__ import annotations

import json

import grpc
import pytest

from agents import Fault
from agents.gpus import serve_gpus
from corral import api
from corral.cli import main
from testkit.services import free_port
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, spawn_ok
from tests.workers.fleet.helpers import gpus_by_uuid, live
from workers.base.errors import InputError, NotFound, PermanentBackendError, TransientBackendError
from workers.fleet.gpus import add_gpu_server, list_gpus, remove_gpu, server_address

pytestmark = pytest.mark.timeout(60)

A, B, C = "GPU-bbbb-0001", "GPU-cccc-0002", "GPU-aaaa-0003"


def test_add_records_each_gpu_with_slots_ports_and_manager(corral_env: Env) -> None:
    with serve_gpus(gpus={B: 16000, A: 8000}) as server:
        gpus = add_gpu_server(corral_env.db, corral_env.settings, server.address)
        assert [call for call, _ in server.agent.calls] == ["GetGPUResource"]
    # ports are handed out in sorted-UUID order, 4 slots (the default) per GPU
    assert [(g.uuid, g.first_port) for g in gpus] == [(A, 4000), (B, 4004)]
    rows = gpus_by_uuid(corral_env)
    assert (rows[A].mem_total_mb, rows[A].mem_free_mb) == (8000, 8000)
    assert (rows[B].mem_total_mb, rows[B].mem_free_mb) == (16000, 16000)
    assert all((g.slots_total, g.slots_free) == (4, 4) for g in rows.values())
    assert {g.mngr_addr for g in rows.values()} == {"127.0.0.1:3333"}
    assert {g.server for g in rows.values()} == {server.address}


def test_settings_choose_slots_first_port_and_manager_port(corral_env: Env) -> None:
    settings = corral_env.set(workers_per_gpu=2, first_worker_port=5000, gpu_manager_port=4444)
    with serve_gpus(gpus={A: 8000, B: 8000}) as server:
        gpus = add_gpu_server(corral_env.db, settings, server.address)
        assert [(g.first_port, g.slots_total) for g in gpus] == [(5000, 2), (5002, 2)]
        assert gpus[0].mngr_addr == "127.0.0.1:4444"
        gpus = add_gpu_server(corral_env.db, settings, server.address, mngr_addr="127.1.2.3")
        assert {g.mngr_addr for g in gpus} == {"127.1.2.3:4444"}
        with pytest.raises(InputError, match="invalid AvA manager address 'a:b'"):
            add_gpu_server(corral_env.db, settings, server.address, mngr_addr="a:b")


def test_re_add_refreshes_totals_keeps_ports_and_appends_new_gpus(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1)
    with serve_gpus(gpus={A: 8000, B: 16000}) as server:
        add_gpu_server(corral_env.db, corral_env.settings, server.address)
        deploy_fn(corral_env, "g", gpu_mem=6000)
        spawn_ok("g", 1, timeout=10)
        # best fit put it on A (8000 MB); now the server reports more memory and a new GPU
        # whose UUID sorts first: it must not take A's ports.
        server.agent.gpus = {A: 10000, B: 16000, C: 24000}
        gpus = add_gpu_server(corral_env.db, corral_env.settings, server.address)
    assert [(g.uuid, g.first_port) for g in gpus] == [(A, 4000), (B, 4004), (C, 4008)]
    rows = gpus_by_uuid(corral_env)
    assert (rows[A].mem_total_mb, rows[A].mem_free_mb) == (10000, 4000)
    assert (rows[A].slots_total, rows[A].slots_free) == (4, 3)
    assert (rows[C].mem_total_mb, rows[C].slots_free) == (24000, 4)


def test_refresh_refuses_to_shrink_below_what_replicas_hold(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1)
    with serve_gpus(gpus={A: 8000}) as server:
        add_gpu_server(corral_env.db, corral_env.settings, server.address)
        deploy_fn(corral_env, "g", gpu_mem=6000)
        spawn_ok("g", 1, timeout=10)
        server.agent.gpus = {A: 4000}
        with pytest.raises(InputError, match="hold 6000 MB"):
            add_gpu_server(corral_env.db, corral_env.settings, server.address)
    assert gpus_by_uuid(corral_env)[A].mem_total_mb == 8000  # nothing changed


def test_more_slots_never_grow_into_the_next_gpus_ports(corral_env: Env) -> None:
    with serve_gpus(gpus={A: 8000, B: 8000}) as server:
        add_gpu_server(corral_env.db, corral_env.settings, server.address)
        settings = corral_env.set(workers_per_gpu=6)
        gpus = add_gpu_server(corral_env.db, settings, server.address)
    # A (4000-4003) is followed by B at 4004: it stays at 4 slots; B, the last, gets 6
    assert [(g.uuid, g.first_port, g.slots_total) for g in gpus] == [(A, 4000, 4), (B, 4004, 6)]


def test_a_gpu_known_on_another_server_is_refused(corral_env: Env) -> None:
    with serve_gpus(gpus={A: 8000}) as one, serve_gpus(gpus={A: 8000}) as two:
        add_gpu_server(corral_env.db, corral_env.settings, one.address)
        with pytest.raises(InputError, match=f"GPU {A} is recorded on server"):
            add_gpu_server(corral_env.db, corral_env.settings, two.address)


def test_server_errors_become_clear_corral_errors(corral_env: Env) -> None:
    with serve_gpus(gpus={A: 8000}) as server:
        server.agent.inject("GetGPUResource", Fault.abort(grpc.StatusCode.UNAVAILABLE, "busy"))
        with pytest.raises(TransientBackendError, match="GetGPUResource failed: UNAVAILABLE"):
            add_gpu_server(corral_env.db, corral_env.settings, server.address)
        server.agent.inject("GetGPUResource", Fault.abort(grpc.StatusCode.INTERNAL, "boom"))
        with pytest.raises(PermanentBackendError, match="INTERNAL: boom"):
            add_gpu_server(corral_env.db, corral_env.settings, server.address)
        server.agent.gpus = {}
        with pytest.raises(PermanentBackendError, match="reports no GPUs"):
            add_gpu_server(corral_env.db, corral_env.settings, server.address)
    port = free_port()  # a port nobody listens on
    with pytest.raises(TransientBackendError, match=f"GPU server 127.0.0.1:{port}"):
        add_gpu_server(corral_env.db, corral_env.settings, f"127.0.0.1:{port}")
    for bad in ("", "host:99999", "a b", "host:port"):
        with pytest.raises(InputError, match="invalid GPU server address"):
            add_gpu_server(corral_env.db, corral_env.settings, bad)
    with corral_env.db.read() as s:
        assert list_gpus(s) == []


def test_default_port_is_50053() -> None:
    assert server_address("gpu-7") == "gpu-7:50053"
    assert server_address(" 127.0.0.5:6000 ") == "127.0.0.5:6000"


def test_cli_add_list_remove(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    start_agents(1)
    with serve_gpus(gpus={A: 8000, B: 16000}) as server:
        assert main(["gpus", "add", server.address, "--json"]) == 0
        added = json.loads(capsys.readouterr().out)
        assert [(g["uuid"], g["first_port"]) for g in added] == [(A, 4000), (B, 4004)]
        assert main(["gpus", "add", server.address]) == 0
        text = capsys.readouterr().out
        assert f"GPU server {server.address}: 2 GPU(s)" in text
        assert "0/8000 MB" in text and "4000-4003" in text
    deploy_fn(corral_env, "g", gpu_mem=6000)
    spawn_ok("g", 1, timeout=10)
    assert main(["gpus", "remove", A]) == 1
    assert "is in use: 1 slot(s) and 6000 MB" in capsys.readouterr().err
    assert main(["gpus", "remove", B]) == 0
    assert capsys.readouterr().out.strip() == f"removed GPU {B}"
    assert main(["gpus", "list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["uuid"], row["mem_used_mb"], row["slots_used"]) == (A, 6000, 1)
    assert main(["gpus", "remove", "GPU-nope"]) == 1
    assert "unknown GPU 'GPU-nope'" in capsys.readouterr().err


def test_remove_after_replicas_are_gone(corral_env: Env, start_agents: StartAgents) -> None:
    start_agents(1)
    with serve_gpus(gpus={A: 8000}) as server:
        add_gpu_server(corral_env.db, corral_env.settings, server.address)
    deploy_fn(corral_env, "g", gpu_mem=6000)
    spawn_ok("g", 1, timeout=10)
    with corral_env.db.transaction() as s, pytest.raises(InputError, match="in use"):
        remove_gpu(s, A)
    (replica,) = live(corral_env)
    assert replica.gpu_id == gpus_by_uuid(corral_env)[A].id
    assert api.wait(api.delete(replica.id), timeout=10)["status"] == "succeeded"
    with corral_env.db.transaction() as s:
        remove_gpu(s, A)  # the deleted replica's row keeps no reference to it
    with corral_env.db.read() as s:
        assert list_gpus(s) == []
        with pytest.raises(NotFound):
            remove_gpu(s, A)
