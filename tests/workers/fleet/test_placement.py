"""Node placement policies over three real agents: where each policy puts replicas."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

import pytest
from sqlalchemy import event, select, update
from sqlalchemy.orm import Session

from corral import api
from testkit.fleets import decide, populate
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, spawn_ok
from tests.workers.fleet.helpers import live, per_node
from workers.base import clock
from workers.base.errors import CapacityError, InputError
from workers.fleet.placement import (
    MAX_ATTEMPTS,
    reserve_gpu,
    reserve_node,
    reserve_nodes,
    spread_nodes,
)
from workers.locks import lock_nodes
from workers.store.models import Function, Gpu, Node, Replica, ReplicaState

pytestmark = pytest.mark.timeout(60)


def _order(env: Env) -> list[str]:
    """Node names of live replicas in creation order."""
    with env.db.read() as s:
        names = {n.id: n.name for n in s.scalars(select(Node))}
    return [names[r.node_id] for r in live(env) if r.node_id]


Spawned = Callable[..., dict[str, int]]


@pytest.fixture
def spawned(corral_env: Env, start_agents: StartAgents) -> Spawned:
    """``spawned(placement, count, capacity=64)``: on three agents, deploy ``f`` with
    ``placement`` and spawn ``count`` replicas; the live replicas per node."""

    def run(placement: str, count: int, capacity: int = 64) -> dict[str, int]:
        start_agents(3, capacity=capacity)
        deploy_fn(corral_env, "f", placement=placement)
        spawn_ok("f", count, timeout=20)
        return per_node(corral_env)

    return run


def test_loadbalance_is_the_default_and_evens_out(
    corral_env: Env, start_agents: StartAgents
) -> None:
    a, b, c = start_agents(3)
    deploy_fn(corral_env, "f")
    spawn_ok("f", 6, timeout=20)
    assert per_node(corral_env) == {"node1": 2, "node2": 2, "node3": 2}
    assert [len(x.agent.calls_of("CreateReplica")) for x in (a, b, c)] == [2, 2, 2]
    # a node that already runs more gets fewer of the next ones
    deploy_fn(corral_env, "g", placement="pack")
    spawn_ok("g", 3, timeout=20)
    assert per_node(corral_env) == {"node1": 5, "node2": 2, "node3": 2}
    spawn_ok("f", 3, timeout=20)
    assert per_node(corral_env) == {"node1": 5, "node2": 4, "node3": 3}


def test_pack_fills_one_node_to_capacity_first(corral_env: Env, spawned: Spawned) -> None:
    assert spawned("pack", 6, capacity=4) == {"node1": 4, "node2": 2, "node3": 0}
    view = api.wait(api.spawn("f", 7), timeout=20)
    assert (view["status"], view["done"], view["failed"]) == ("partial", 6, 1)
    assert "no capacity for f on any healthy fcdaemon node" in (view["error"] or "")
    assert per_node(corral_env) == {"node1": 4, "node2": 4, "node3": 4}


def test_roundrobin_cycles_in_name_order_across_operations(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(3)
    deploy_fn(corral_env, "f", placement="roundrobin")
    spawn_ok("f", 4, timeout=20)
    assert _order(corral_env) == ["node1", "node2", "node3", "node1"]
    spawn_ok("f", 2, timeout=20)
    assert _order(corral_env) == ["node1", "node2", "node3", "node1", "node2", "node3"]


def test_roundrobin_skips_a_full_node(corral_env: Env, start_agents: StartAgents) -> None:
    start_agents(3)
    with corral_env.db.transaction() as s:
        s.execute(update(Node).where(Node.name == "node2").values(capacity=1))
    deploy_fn(corral_env, "f", placement="roundrobin")
    spawn_ok("f", 5, timeout=20)
    assert _order(corral_env) == ["node1", "node2", "node3", "node1", "node3"]


def test_spread_puts_n_on_every_healthy_node(corral_env: Env, start_agents: StartAgents) -> None:
    start_agents(3)
    deploy_fn(corral_env, "f", placement="spread")
    view = api.wait(api.spawn("f", 2), timeout=20)
    assert (view["status"], view["total"]) == ("succeeded", 6)
    assert per_node(corral_env) == {"node1": 2, "node2": 2, "node3": 2}
    with corral_env.db.transaction() as s:
        s.execute(update(Node).where(Node.name == "node3").values(healthy=False))
    view = api.wait(api.spawn("f", 1), timeout=20)
    assert (view["status"], view["total"]) == ("succeeded", 2)
    assert per_node(corral_env) == {"node1": 3, "node2": 3, "node3": 2}


def test_random_stays_within_capacity_and_uses_every_node(spawned: Spawned) -> None:
    assert spawned("random", 9, capacity=3) == {"node1": 3, "node2": 3, "node3": 3}
    view = api.wait(api.spawn("f", 1), timeout=20)
    assert view["status"] == "failed" and "no capacity" in (view["error"] or "")


def test_random_uses_more_than_one_node(spawned: Spawned) -> None:
    counts = spawned("random", 15)
    # all 15 on one node has probability 3 * (1/3)**15, about 2e-7
    assert sum(1 for n in counts.values() if n) > 1


def test_global_placement_setting_applies_unless_the_function_names_one(
    corral_env: Env, start_agents: StartAgents
) -> None:
    corral_env.set(placement="pack")
    start_agents(3)
    deploy_fn(corral_env, "packed")
    deploy_fn(corral_env, "even", placement="loadbalance")
    spawn_ok("packed", 3, timeout=20)
    assert per_node(corral_env) == {"node1": 3, "node2": 0, "node3": 0}
    spawn_ok("even", 3, timeout=20)
    assert per_node(corral_env) == {"node1": 3, "node2": 2, "node3": 1}


@pytest.mark.parametrize("policy", ["loadbalance", "roundrobin", "spread", "random", "pack"])
def test_no_policy_places_on_unhealthy_draining_or_full_nodes(
    corral_env: Env, start_agents: StartAgents, policy: str
) -> None:
    start_agents(4, capacity=5)
    with corral_env.db.transaction() as s:
        s.execute(update(Node).where(Node.name == "node1").values(healthy=False))
        s.execute(update(Node).where(Node.name == "node2").values(draining=True))
        s.execute(update(Node).where(Node.name == "node3").values(capacity=0))
    deploy_fn(corral_env, "f", placement=policy)
    view = api.wait(api.spawn("f", 3), timeout=20)
    counts = per_node(corral_env)
    assert counts["node4"] == 3 and counts["node1"] == counts["node2"] == counts["node3"] == 0
    if policy == "spread":  # one per healthy, non-draining node: node3 (full) and node4
        assert (view["total"], view["done"], view["failed"]) == (6, 3, 3)
        assert view["error"] == "3 of 6 failed; first: no capacity for f on node node3"
    else:
        assert view["status"] == "succeeded"


def test_unknown_policy_is_refused_at_deploy(corral_env: Env) -> None:
    with pytest.raises(InputError, match="unknown placement policy 'fastest'"):
        deploy_fn(corral_env, "f", placement="fastest")


def test_a_placement_decision_over_a_populated_fleet_changes_nothing(corral_env: Env) -> None:
    fn_id = populate(corral_env.db, 5, 8)

    def snapshot() -> tuple[list[int], list[int], int]:
        with corral_env.db.read() as s:
            return (
                [n.live for n in s.scalars(select(Node).order_by(Node.name))],
                [g.mem_free_mb for g in s.scalars(select(Gpu).order_by(Gpu.uuid))],
                len(list(s.scalars(select(Replica.id)))),
            )

    before = snapshot()
    for policy in ("loadbalance", "roundrobin", "random", "pack"):
        decide(corral_env.db, fn_id, policy, "best", None)
    assert snapshot() == before


# -- GPUs and spread nodes, one decision at a time (the edges mutation testing found) --------


def _gpus(env: Env, *specs: tuple[str, int, int, int]) -> dict[str, str]:
    """GPUs (uuid, free MB, free slots, first port), each of 4 slots and 16 GB, created in
    order a second apart; their ids by uuid."""
    with env.db.transaction() as s:
        for i, (uuid, free_mb, slots_free, port) in enumerate(specs):
            s.add(
                Gpu(
                    uuid=uuid,
                    server="gs:1",
                    mngr_addr="gm:1",
                    mem_total_mb=16_000,
                    mem_free_mb=free_mb,
                    slots_total=4,
                    slots_free=slots_free,
                    first_port=port,
                    created_at=datetime(2030, 1, 1, 0, 0, i),
                )
            )
    with env.db.read() as s:
        return {g.uuid: g.id for g in s.scalars(select(Gpu))}


def _reserve(env: Env, fit: str) -> tuple[str, int, dict[str, tuple[int, int]]]:
    """Reserve one GPU for ``f`` (3,000 MB) and commit; (its uuid, slot, every GPU's free)."""
    with env.db.transaction() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        grant = reserve_gpu(s, fn, fit)
    with env.db.read() as s:
        free = {g.uuid: (g.mem_free_mb, g.slots_free) for g in s.scalars(select(Gpu))}
        uuid = s.scalars(select(Gpu.uuid).where(Gpu.id == grant.gpu_id)).one()
    assert grant.mem_mb == 3_000
    return uuid, grant.slot, free


def test_best_fit_takes_the_fullest_gpu_that_fits_exactly_or_more(corral_env: Env) -> None:
    deploy_fn(corral_env, "f", gpu_mem=3_000)
    _gpus(
        corral_env,
        ("g-roomy", 9_000, 4, 4000),
        ("g-short", 2_999, 4, 4004),  # a megabyte short
        ("g-exact", 3_000, 2, 4008),  # exactly enough: the best fit
        ("g-noslot", 3_000, 0, 4012),  # memory, but no worker slot
    )
    uuid, slot, free = _reserve(corral_env, "best")
    assert (uuid, slot) == ("g-exact", 0)
    assert free == {
        "g-roomy": (9_000, 4),
        "g-short": (2_999, 4),
        "g-exact": (0, 1),
        "g-noslot": (3_000, 0),
    }
    uuid, _, free = _reserve(corral_env, "best")  # nothing exact left: the roomy one
    assert uuid == "g-roomy" and free["g-roomy"] == (6_000, 3)


def test_best_fit_breaks_ties_by_uuid_and_first_fit_takes_the_first_recorded(
    corral_env: Env,
) -> None:
    deploy_fn(corral_env, "f", gpu_mem=3_000)
    _gpus(
        corral_env,
        ("g-b", 5_000, 4, 4000),  # recorded first
        ("g-a", 5_000, 4, 4004),
        ("g-c", 4_000, 4, 4008),
    )
    assert _reserve(corral_env, "best")[0] == "g-c"  # the least free that fits
    assert _reserve(corral_env, "best")[0] == "g-a"  # g-a and g-b equal: by uuid
    assert _reserve(corral_env, "first")[0] == "g-b"  # the first recorded


def test_first_fit_orders_gpus_recorded_together_by_port_then_uuid(corral_env: Env) -> None:
    deploy_fn(corral_env, "f", gpu_mem=3_000)
    with corral_env.db.transaction() as s:
        for uuid, port in (("g-a", 4004), ("g-c", 4000), ("g-b", 4000)):
            s.add(
                Gpu(uuid=uuid, server="gs:1", mngr_addr="gm:1", mem_total_mb=16_000,
                    mem_free_mb=16_000, slots_total=4, slots_free=4, first_port=port,
                    created_at=datetime(2030, 1, 1))
            )  # fmt: skip
    assert _reserve(corral_env, "first")[0] == "g-b"  # the lowest port, then the uuid
    with corral_env.db.transaction() as s:
        s.execute(update(Gpu).where(Gpu.uuid == "g-b").values(slots_free=0))
    assert _reserve(corral_env, "first")[0] == "g-c"  # the same port: by uuid
    with corral_env.db.transaction() as s:
        s.execute(update(Gpu).where(Gpu.uuid == "g-c").values(slots_free=0))
    assert _reserve(corral_env, "first")[0] == "g-a"


def test_a_gpu_whose_slots_replicas_hold_is_given_back_and_another_taken(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "f", gpu_mem=3_000)
    ids = _gpus(corral_env, ("g-lying", 3_000, 1, 4000), ("g-true", 8_000, 4, 4004))
    # the counters say g-lying has a slot; replica rows hold all four
    with corral_env.db.transaction() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        for slot in range(4):
            held = Replica(request_id=f"held-{slot}", function_id=fn.id, build_version="b",
                           status=int(ReplicaState.DEAD))  # fmt: skip
            held.gpu_id, held.gpu_slot = ids["g-lying"], slot
            s.add(held)
    uuid, slot, free = _reserve(corral_env, "best")
    assert (uuid, slot) == ("g-true", 0)
    assert free == {"g-lying": (3_000, 1), "g-true": (5_000, 3)}  # g-lying's given back


@pytest.mark.parametrize("fit", ["best", "first"])
def test_gpus_short_of_memory_or_slots_use_none_of_the_attempts(corral_env: Env, fit: str) -> None:
    deploy_fn(corral_env, "f", gpu_mem=3_000)
    short = [(f"g-short-{i:02}", 2_999, 4, 4000 + 4 * i) for i in range(MAX_ATTEMPTS)]
    full = [(f"g-full-{i:02}", 3_000, 0, 4100 + 4 * i) for i in range(MAX_ATTEMPTS)]
    # more GPUs that cannot take it than a reservation makes attempts, each ahead of the
    # one that can in either order (less free memory; recorded earlier)
    _gpus(corral_env, *short, *full, ("g-fits", 9_000, 4, 4200))
    uuid, slot, free = _reserve(corral_env, fit)
    assert (uuid, slot) == ("g-fits", 0)
    assert free["g-fits"] == (6_000, 3)
    assert all(free[g[0]] == (g[1], g[2]) for g in (*short, *full))


def test_no_gpu_that_fits_is_a_capacity_error_that_changes_nothing(corral_env: Env) -> None:
    deploy_fn(corral_env, "f", gpu_mem=3_000)
    _gpus(corral_env, ("g-small", 2_000, 4, 4000), ("g-full", 9_000, 0, 4004))
    with corral_env.db.transaction() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        with pytest.raises(CapacityError, match=r"no GPU capacity for f \(3000 MB\)"):
            reserve_gpu(s, fn, "best")
    with corral_env.db.read() as s:
        assert {g.uuid: (g.mem_free_mb, g.slots_free) for g in s.scalars(select(Gpu))} == {
            "g-small": (2_000, 4),
            "g-full": (9_000, 0),
        }


def test_spread_puts_replicas_on_every_placeable_node_of_its_kind_by_name(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(4, env=corral_env)
    deploy_fn(corral_env, "f")
    with corral_env.db.transaction() as s:
        s.add(Node(name="aa-lambdo", kind="lambdo", address="127.0.0.1:9", capacity=4))
        kind = s.scalars(select(Node.kind).where(Node.name == "node1")).one()
        s.add(Node(name="node0", kind=kind, address="127.0.0.1:9", capacity=4))  # added last
        s.execute(update(Node).where(Node.name == "node2").values(healthy=False))
        s.execute(update(Node).where(Node.name == "node3").values(draining=True))
        s.execute(
            update(Node)
            .where(Node.name == "node4")
            .values(quarantined_until=clock.now() + timedelta(minutes=5))
        )
    with corral_env.db.read() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        names = {n.id: n.name for n in s.scalars(select(Node))}
        assert [names[i] for i in spread_nodes(s, fn)] == ["node0", "node1"]
    with corral_env.db.transaction() as s:  # the quarantine is over: node4 again, in order
        s.execute(update(Node).values(quarantined_until=clock.now() - timedelta(seconds=1)))
    with corral_env.db.read() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        assert [names[i] for i in spread_nodes(s, fn)] == ["node0", "node1", "node4"]


def test_a_batch_takes_the_least_loaded_nodes_one_slot_at_a_time_up_to_capacity(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(3, env=corral_env)
    deploy_fn(corral_env, "f")
    loads = {"node1": (3, 4), "node2": (0, 1), "node3": (1, 4)}  # live, capacity
    with corral_env.db.transaction() as s:
        for name, (live, capacity) in loads.items():
            s.execute(update(Node).where(Node.name == name).values(live=live, capacity=capacity))

    def reserve(n: int) -> list[str]:
        with corral_env.db.transaction() as s:
            fn = s.scalars(select(Function).where(Function.name == "f")).one()
            lock_nodes(s, fn.backend)
            return [node.name for node in reserve_nodes(s, fn, n)]

    assert reserve(2) == ["node2", "node3"]  # node2's one slot, then the next least loaded
    assert reserve(3) == ["node3", "node1", "node3"]  # 2/4 and 3/4: ties by name
    with corral_env.db.read() as s:
        assert {n.name: n.live for n in s.scalars(select(Node))} == {
            "node1": 4,
            "node2": 1,
            "node3": 4,
        }
    assert reserve(1) == []  # all full


def _nodes(env: Env, **loads: tuple[int, int]) -> None:
    """Nodes of ``f``'s kind (live, capacity), added in the order given."""
    with env.db.transaction() as s:
        kind = s.scalars(select(Function.backend).where(Function.name == "f")).one()
        for name, (live, capacity) in loads.items():
            s.add(Node(name=name, kind=kind, address="127.0.0.1:9", live=live, capacity=capacity))


def test_a_batch_breaks_ties_by_name_and_fills_every_free_slot(corral_env: Env) -> None:
    deploy_fn(corral_env, "f")
    _nodes(corral_env, node2=(0, 4), node1=(0, 4), node0=(0, 4))  # added against name order

    def reserve(n: int) -> list[tuple[str, int]]:
        with corral_env.db.transaction() as s:
            fn = s.scalars(select(Function).where(Function.name == "f")).one()
            lock_nodes(s, fn.backend)
            # each node as the session holds it after: its live count with the slots taken
            return [(node.name, node.live) for node in reserve_nodes(s, fn, n)]

    assert reserve(1) == [("node0", 1)]  # of three equally loaded, the first by name
    with corral_env.db.transaction() as s:
        s.execute(update(Node).where(Node.name != "node0").values(live=Node.capacity))
    assert reserve(4) == [("node0", 4)] * 3  # the rest of node0, to its last slot


def _lives(env: Env) -> dict[str, int]:
    """Each node's taken slots, by name, as the store has them."""
    with env.db.read() as s:
        return {name: live for name, live in s.execute(select(Node.name, Node.live))}


def _reserve_one(env: Env, policy: str, avoid: Sequence[str] = ()) -> str:
    """The name of the node ``reserve_node`` takes a slot on for ``f`` (not one of ``avoid``)."""
    with env.db.transaction() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        ids = list(s.scalars(select(Node.id).where(Node.name.in_(avoid))))
        return reserve_node(s, fn, policy, avoid=ids).name


def test_pack_takes_the_fullest_node_with_room_whatever_its_name(corral_env: Env) -> None:
    deploy_fn(corral_env, "f")
    _nodes(corral_env, node1=(0, 4), node2=(2, 4))
    assert [_reserve_one(corral_env, "pack") for _ in range(3)] == ["node2", "node2", "node1"]


@pytest.mark.parametrize("policy", ["loadbalance", "spread"])
def test_a_node_to_avoid_leaves_the_least_loaded_of_the_rest(corral_env: Env, policy: str) -> None:
    deploy_fn(corral_env, "f")
    _nodes(corral_env, node1=(3, 8), node2=(1, 8), node3=(0, 8))
    assert _reserve_one(corral_env, policy, avoid=["node3"]) == "node2"  # not the first by name


def test_roundrobin_goes_by_name_whatever_the_load(corral_env: Env) -> None:
    deploy_fn(corral_env, "f")
    _nodes(corral_env, node1=(5, 8), node2=(0, 8))
    picks = [_reserve_one(corral_env, "roundrobin") for _ in range(3)]
    assert picks == ["node1", "node2", "node1"]  # by load, node2 would take all three


def test_random_is_not_the_least_loaded_node_every_time(corral_env: Env) -> None:
    deploy_fn(corral_env, "f")
    _nodes(corral_env, node1=(0, 64), node2=(30, 64), node3=(30, 64))
    picks = {_reserve_one(corral_env, "random") for _ in range(12)}
    # by load, all twelve would go to node1; at random that has probability 3**-12 (2e-6)
    assert picks - {"node1"}


def _fill_before_the_update(s: Session, fill: Callable[[Session], object]) -> None:
    """Run ``fill`` on ``s``'s connection just before its next UPDATE: what a concurrent
    transaction would have committed between the choice and the taking."""
    filled: list[bool] = []

    def before(_conn: object, clause: object, *_args: object) -> None:
        if getattr(clause, "is_update", False) and not filled:
            filled.append(True)
            fill(s)

    event.listen(s.connection(), "before_execute", before)


def test_a_node_filled_between_the_choice_and_the_taking_is_passed_over_for_the_next(
    corral_env: Env,
) -> None:
    deploy_fn(corral_env, "f")
    _nodes(corral_env, node1=(0, 2), node2=(1, 2))
    with corral_env.db.transaction() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        _fill_before_the_update(
            s, lambda s: s.execute(update(Node).where(Node.name == "node1").values(live=2))
        )
        node = reserve_node(s, fn, "roundrobin")
        # the session holds what the UPDATE wrote: its slot taken, the function's last node
        assert (node.name, node.live, fn.rr_last_node) == ("node2", 2, "node2")
    assert _lives(corral_env) == {"node1": 2, "node2": 2}
    with corral_env.db.read() as s:
        assert s.scalar(select(Function.rr_last_node)) == "node2"


def test_a_pinned_node_that_is_full_missing_or_avoided_is_a_capacity_error_naming_it(
    corral_env: Env,
) -> None:
    deploy_fn(corral_env, "f")
    _nodes(corral_env, full=(2, 2), free=(0, 2))
    with corral_env.db.transaction() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        ids = {name: id_ for name, id_ in s.execute(select(Node.name, Node.id))}
        with pytest.raises(CapacityError, match=r"^no capacity for f on node full$"):
            reserve_node(s, fn, "loadbalance", pinned=ids["full"])
        with pytest.raises(CapacityError, match=r"^no capacity for f on node no-such-node$"):
            reserve_node(s, fn, "loadbalance", pinned="no-such-node")
        with pytest.raises(CapacityError, match=r"^no capacity for f on node free$"):
            reserve_node(s, fn, "loadbalance", pinned=ids["free"], avoid=[ids["free"]])
        assert reserve_node(s, fn, "loadbalance", pinned=ids["free"]).live == 1
    assert _lives(corral_env) == {"full": 2, "free": 1}


def test_a_batch_whose_nodes_filled_meanwhile_is_refused_rather_than_overbooked(
    corral_env: Env,
) -> None:
    deploy_fn(corral_env, "f")
    _nodes(corral_env, node1=(0, 2))
    with corral_env.db.transaction() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        _fill_before_the_update(s, lambda s: s.execute(update(Node).values(live=Node.capacity)))
        with pytest.raises(RuntimeError) as refused:
            reserve_nodes(s, fn, 1)  # not under the node locks: another took the slot
    assert str(refused.value) == "reserve_nodes needs the backend's node locks held"


def test_a_gpu_granted_meanwhile_is_checked_again_and_another_taken(corral_env: Env) -> None:
    deploy_fn(corral_env, "f", gpu_mem=3_000)
    ids = _gpus(corral_env, ("g-best", 3_000, 4, 4000), ("g-next", 8_000, 4, 4004))

    def granted(s: Session) -> None:  # a concurrent grant takes g-best's memory
        s.execute(update(Gpu).where(Gpu.uuid == "g-best").values(mem_free_mb=0, slots_free=3))

    with corral_env.db.transaction() as s:
        fn = s.scalars(select(Function).where(Function.name == "f")).one()
        _fill_before_the_update(s, granted)
        grant = reserve_gpu(s, fn, "best")
    with corral_env.db.read() as s:
        free = {g.uuid: (g.mem_free_mb, g.slots_free) for g in s.scalars(select(Gpu))}
    assert (grant.gpu_id, grant.slot) == (ids["g-next"], 0)
    assert free == {"g-best": (0, 3), "g-next": (5_000, 3)}
