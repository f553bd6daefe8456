"""corral on many hosts made of network namespaces, under partitions (``bench/partition.py``).

The short fixed run (a seed agent frozen and every worker killed while creates are in
flight to it, a worker's clock off and its log pipe stalled, the agent's host isolated,
then a worker cut from Redis) runs as its own process, as in CI: it must leave no anomaly
and nothing behind - no namespace, no link, no process. The pieces it stands on are
tested here too: the cuts really cut (and only what they name), the schedule is the
seed's, a stall stops a worker's writes and a skew moves its wall clock only, cleanup
finds what a dead run left, and each kind of anomaly the checker names is found in the
evidence a defect of ``bench/defects.py`` leaves (the defects themselves are run with
``python -m bench.partition --ci --inject DEFECT``: docs/reliability.md).

Needs root and iproute2 (CI runs as root and installs iproute2); elsewhere these tests are
skipped, saying why, unless the run requires them (``CI=true`` or
``CORRAL_REQUIRE_NETNS=1``: tests/requirements.py), when they fail instead.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from agents.fcdaemon import serve_fcdaemon
from config.settings import get_settings
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from testkit import checker, httpcalls, nemesis
from testkit.eventually import eventually
from testkit.netns import (
    NETNS_DIR,
    PREFIX,
    Host,
    Launcher,
    Network,
    available,
    cleanup,
    cleanup_stale,
    run_namespaces,
)
from testkit.nsfleet import SKEWCLOCK, Fleet
from testkit.nsprocs import Layout, NsPostgres, Proc
from testkit.services import make_shared_tempdir
from tests.conftest import threads_elsewhere
from tests.fixtures import NO_BROKER
from tests.requirements import NETNS, needs
from workers.backends import inflight
from workers.gateway import serve_gateway
from workers.gateway.asgi import RETRY_AFTER_S
from workers.store.db import Database, is_transient
from workers.store.migrate import upgrade

ROOT = Path(__file__).resolve().parents[2]
CI_CREATE_DELAY_S = nemesis.CI_SEED_CREATE_DELAY_S
why = available()
needs_netns = needs(NETNS, None if why is None else f"no network namespaces here: {why}")


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return {line.split(":")[1].strip() for line in out.stdout.splitlines()}


def test_the_schedule_is_the_seeds_and_a_twenty_minute_run_meets_the_bar() -> None:
    lay = Layout(workers=2, agents=6, seed_only=2)
    faults = nemesis.schedule(7, 1200.0, lay)
    assert faults == nemesis.schedule(7, 1200.0, lay)
    assert faults != nemesis.schedule(8, 1200.0, lay)
    kinds = [f.kind for f in faults]
    assert sum(k in nemesis.PARTITIONS for k in kinds) >= 30
    assert kinds.count("kill") >= 10
    assert set(kinds) == set(nemesis.KINDS) - {"spawns"}
    assert {f.offset_s for f in faults if f.kind == "skew"} <= set(nemesis.SKEWS_S)
    assert all(f.at_s + f.duration_s < 1200.0 for f in faults)  # all healed before the end
    targets = {t for f in faults for t in f.targets}
    assert "ctl" not in targets  # the harness's own host is never cut
    assert not [f for f in faults if f.kind == "isolate" and f.targets == ("gw",)]


def test_the_ci_schedule_kills_every_worker_while_creates_are_in_flight() -> None:
    lay = Layout(workers=2, agents=3, seed_only=1)
    faults = nemesis.ci_schedule(45.0, lay)
    assert [(f.kind, f.targets) for f in faults] == [
        ("skew", ("w2",)),
        ("spawns", ("pt-b",)),
        ("kill", ("w1", "w2")),
        ("freeze", ("fc3",)),
        ("stall", ("w1",)),
        ("isolate", ("fc3",)),
        ("cut", ("w1", "redis")),
    ]
    assert lay.seed("fc3")
    spawns, kill, freeze = faults[1:4]
    assert spawns.at_s < kill.at_s < spawns.at_s + 2 * CI_CREATE_DELAY_S  # creates in flight
    assert kill.at_s < freeze.at_s < kill.at_s + 1
    assert spawns.count == 6  # round-robin: two on each agent
    assert all(f.at_s + f.duration_s < 45.0 for f in faults)
    assert str(faults[0]) == "skew w2 +8s for 35s"


def _at(s: float) -> datetime:
    return datetime(2026, 1, 1) + timedelta(seconds=s)


def test_maybes_beyond_the_inflight_bound_are_found_per_node_and_moment() -> None:
    # no-inflight-bound: a round of 4 creates went out to fc3 at once; all became maybes
    maybes = [("pt-fc3", _at(10 + i * 0.1), f"r{i}~x{i}") for i in range(4)]
    maybes += [("pt-fc3", _at(30), "r8~x8"), ("pt-fc3", _at(30.5), "r9~x9")]  # 2: within
    maybes += [("pt-fc2", _at(10 + i * 6), f"s{i}~y{i}") for i in range(4)]  # spread out
    found = checker.maybes_beyond_inflight(maybes, bound=2, window_s=5.0)
    assert found == [
        "pt-fc3: 4 maybes sent within 5s (bound 2) from 00:00:10: ['r0', 'r1', 'r2', 'r3']"
    ]
    assert checker.maybes_beyond_inflight(maybes, bound=4, window_s=5.0) == []


def test_no_capacity_while_every_sample_saw_a_free_slot_is_an_anomaly() -> None:
    def free_at(t: int) -> dict[tuple[str, str], int]:
        return {("fcdaemon", "fc1"): 2 if t < 20 else 0, ("fcdaemon", "fc2"): 1 if t < 25 else 0}

    free = [(_at(t), free_at(t), f"sample {t}") for t in range(30)]
    anywhere = "2 of 2 failed; first: no capacity for pt-{} on any healthy {} node"
    fc, lb = anywhere.format("a", "fcdaemon"), anywhere.format("l", "lambdo")
    none: frozenset[str] = frozenset()
    failures = [
        ("half-full", _at(10.2), _at(11.5), "fcdaemon", fc, none),
        ("full", _at(26.0), _at(27.0), "fcdaemon", fc, none),
        ("both", _at(24.5), _at(26.0), "fcdaemon", fc, none),
        ("moved", _at(21.0), _at(22.0), "fcdaemon", fc, frozenset({"fc2"})),  # avoids fc2
        ("lambdo", _at(5.0), _at(6.0), "lambdo", lb, none),
        ("pinned", _at(5.0), _at(6.0), "fcdaemon", "no capacity for pt-a on node fc1", none),
        ("other", _at(5.0), _at(6.0), "fcdaemon", "pt-a is at its max of 10 replicas", none),
    ]
    found = checker.no_capacity_while_free(failures, free)
    assert len(found) == 1 and found[0].startswith("op half-full "), found
    assert "3+ slots free (sample 14)" in found[0]
    only_before = [("now", _at(29.5), _at(29.6), "fcdaemon", fc, none)]  # no sample after
    assert checker.no_capacity_while_free(only_before, [(_at(29), free_at(3), "x")]) == []


def test_a_sample_stamped_after_a_refusal_but_read_before_it_is_no_evidence() -> None:
    """The partition run's first 20 minutes, 01:05:28: a scale took fc6's last two slots
    and failed its other three spawns, four spawns right after it found no room; a sample
    the harness stamped 0.2 s after them had read fc6 before their rows (each process
    reads the store's clock to within half a round trip), the next came 1.6 s later."""

    def fc6(free: int) -> dict[tuple[str, str], int]:
        return {("fcdaemon", "fc6"): free, ("fcdaemon", "fc1"): 0}

    free = [(_at(27.0), fc6(2), "27"), (_at(28.55), fc6(2), "28.55"), (_at(30.1), fc6(0), "30")]
    error = "no capacity for pt-a on any healthy fcdaemon node"
    failures = [
        ("scale", _at(28.086), _at(28.176), "fcdaemon", "3 of 5 failed; first: " + error,
         frozenset({"fc6"})),
        ("spawn", _at(28.317), _at(28.343), "fcdaemon", error, frozenset()),
    ]  # fmt: skip
    assert checker.no_capacity_while_free(failures, free) == []
    # room on fc6 all along is still found
    free_all_along = [(t, fc6(2), p) for t, _f, p in free]
    found = checker.no_capacity_while_free(failures[1:], free_all_along)
    assert len(found) == 1 and found[0].startswith("op spawn "), found


def test_free_slots_that_move_from_node_to_node_between_samples_are_no_evidence() -> None:
    """The partition run (cis86, 01:21:53-58): a spawn waited in the queue while its
    workers were killed and ran at :58.30. fc3's last two slots went at :57.99 and :58.27,
    fc1 and fc2 freed theirs from :58.56: the samples a second apart each saw two free,
    never on one node, and the spawn, placed in between, rightly found none."""

    def nodes(fc1: int, fc2: int, fc3: int) -> dict[tuple[str, str], int]:
        return {("fcdaemon", "fc1"): fc1, ("fcdaemon", "fc2"): fc2, ("fcdaemon", "fc3"): fc3}

    free = [(_at(t), nodes(0, 0, 2), f"{t}") for t in (51.5, 52.5, 53.5, 54.5, 55.5, 56.5, 57.5)]
    free += [(_at(t), nodes(2, 1, 0), f"{t}") for t in (58.7, 59.7, 60.7)]
    error = "no capacity for pt-b on any healthy fcdaemon node"
    spawn = [("spawn", _at(53.94), _at(58.33), "fcdaemon", error, frozenset[str]())]
    assert checker.no_capacity_while_free(spawn, free) == []
    # fc3's two slots free all along are still found
    fc3_free = [(t, {**f, ("fcdaemon", "fc3"): 2}, p) for t, f, p in free]
    found = checker.no_capacity_while_free(spawn, fc3_free)
    assert len(found) == 1 and "2+ slots free (60.7)" in found[0], found


def test_a_slot_taken_and_another_freed_between_two_samples_is_no_evidence() -> None:
    """The partition run (cis493, 18:40:15): a spawn took fc1's and fc2's last slots at
    :15.52, a spawn of pt-a was refused at :15.63, scale-downs freed three slots from
    :15.67; the samples at :15.0 and :16.0 each saw a slot free on both nodes. The rows
    say both nodes were full when placement refused."""

    def nodes(fc1: int, fc2: int) -> dict[tuple[str, str], int]:
        return {("fcdaemon", "fc1"): fc1, ("fcdaemon", "fc2"): fc2}

    free = [(_at(13.0), nodes(1, 1), "13"), (_at(15.0), nodes(1, 1), "15")]
    free += [(_at(16.0), nodes(1, 2), "16"), (_at(17.0), nodes(1, 2), "17")]
    error = "no capacity for pt-a on any healthy fcdaemon node"
    spawn = [("spawn", _at(14.05), _at(15.65), "fcdaemon", error, frozenset[str]())]
    capacity = {("fcdaemon", "fc1"): 4, ("fcdaemon", "fc2"): 4}
    before: list[tuple[str, str, datetime, datetime | None]] = [  # three rows on each node,
        ("fcdaemon", "fc1", _at(1), None),  # one or two of them retiring later
        ("fcdaemon", "fc1", _at(2), None),
        ("fcdaemon", "fc1", _at(3), _at(15.68)),
        ("fcdaemon", "fc2", _at(1), None),
        ("fcdaemon", "fc2", _at(2), _at(15.83)),
        ("fcdaemon", "fc2", _at(3), _at(15.87)),
    ]
    took: list[tuple[str, str, datetime, datetime | None]] = [
        ("fcdaemon", "fc1", _at(15.52), None),
        ("fcdaemon", "fc2", _at(15.52), None),
    ]
    refused = {"spawn": [_at(15.63)]}
    assert checker.no_capacity_while_free(spawn, free) != []  # the samples alone: an anomaly
    full = checker.SlotHistory(capacity, before + took, refused)
    assert full.free_at(_at(15.63), capacity) == 0
    assert checker.no_capacity_while_free(spawn, free, full) == []
    # one refusal when the nodes were full does not excuse another when they were not
    twice = checker.SlotHistory(capacity, before + took, {"spawn": [_at(15.63), _at(20.0)]})
    assert len(checker.no_capacity_while_free(spawn, free, twice)) == 1
    # had nothing taken those slots, the refusal is still found
    room = checker.SlotHistory(capacity, before, refused)
    assert room.free_at(_at(15.63), capacity) == 2
    found = checker.no_capacity_while_free(spawn, free, room)
    assert len(found) == 1 and found[0].startswith("op spawn "), found
    # a slot freed long before the refusal is free; one freed within the clocks' margin is not
    assert room.free_at(_at(20.0), capacity) == 5
    assert room.free_at(_at(16.5), capacity) == 2


def test_an_operations_nodes_are_found_by_its_request_ids_once_its_rows_let_it_go() -> None:
    replicas = [
        (None, None, "op1.0", "fc6"),  # ended: its operation id cleared
        (None, None, "op1.2.1", "fc2"),
        ("op2", None, "op7.0", "fc1"),  # deleted by op2
        (None, "op3", "op9.1~abc", "fc3"),  # a maybe of op3 and op9
        (None, None, "op8.0", "fc4"),
    ]
    assert checker.nodes_of_ops({"op1", "op2", "op3", "op9"}, replicas) == {
        "op1": {"fc6", "fc2"},
        "op2": {"fc1"},
        "op3": {"fc3"},
        "op9": {"fc3"},
    }


def test_a_request_id_that_made_two_vms_or_a_vm_that_served_two_ids_is_found() -> None:
    made = "CreateReplica image=examples.hello requestId={}: {} at 10.232.1.5:20481\n"
    again = "CreateReplica requestId={}: already running as {}\n"
    logs = {
        "pt-fc1": made.format("a", "vm1") + again.format("a", "vm1") + made.format("a", "vm2"),
        "pt-fc2": made.format("b", "vm3") + again.format("c", "vm3"),
        "pt-fc4": made.format("d", "vm4") + again.format("d", "vm4"),  # a retry: fine
    }
    rows = [("pt-fc4", "vm4", "d"), ("pt-fc4", "vm4", "d~r1"), ("pt-fc1", "vm9", "e")]
    rows += [("pt-fc1", "vm9", "f"), ("pt-fc5", "vm7", "g"), ("pt-fc5", "vm7", "h")]  # seed
    assert checker.request_ids_twice(logs, rows) == [
        "pt-fc1: requestId a made 2 VMs: ['vm1', 'vm2']",
        "pt-fc2: VM vm3 answered 2 request ids: ['b', 'c']",
        "pt-fc1: VM vm9 held by rows of 2 request ids: ['e', 'f']",
    ]


def test_operations_past_the_bound_finished_or_not_are_slow() -> None:
    ops = [
        ("fast", "spawn", _at(0), _at(12)),
        ("late", "spawn", _at(0), _at(200)),
        ("open", "scale", _at(50), None),
        ("young", "scale", _at(250), None),
    ]
    assert checker.ops_slow(ops, 120.0, _at(300)) == [
        "spawn late: finished after 200s (bound 120s)",
        "scale open: still open after 250s (bound 120s)",
    ]
    settings = get_settings().model_copy(
        update={"visibility_timeout_s": 30, "redrive_after_s": 15.0, "creating_deadline_s": 45.0,
                "task_time_limit_s": 20.0}
    )  # fmt: skip
    assert checker.op_bound(settings) == 30 + 15 + 45 + 3 * 20 + checker.SLACK_S


def test_corral_workers_kill_lines_are_hard_limit_restarts(tmp_path: Path) -> None:
    fleet = Fleet(Layout(workers=2), None, None, tmp_path, print)  # type: ignore[arg-type]
    (fleet.logs / "w1.log").write_text(
        "[INFO] ready.\ncorral worker: task corral.check_health outlived its hard time limit "
        "of 20s: killed the worker (pid 42)\n"
    )
    (fleet.logs / "w2.log").write_text("[INFO] ready.\n")
    assert fleet.hard_limit_restarts() == [
        "w1: corral worker: task corral.check_health outlived its hard time limit of 20s: "
        "killed the worker (pid 42)"
    ]


class _HereLauncher:
    """Starts processes in this namespace (what a Launcher does in a host's)."""

    def popen(self, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, start_new_session=True, **kwargs)


def test_a_stalled_log_pipe_blocks_the_writer_until_it_is_read_again(tmp_path: Path) -> None:
    go, done = tmp_path / "go", tmp_path / "done"
    write = (
        f"import os, sys, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        f"for i in range(2000): print('line', i, 'x' * 60)\nopen({str(done)!r}, 'w')"
    )
    proc = Proc("w1", "w1", [sys.executable, "-c", write], {}, tmp_path / "w1.log", piped=True)
    proc.start(_HereLauncher())  # type: ignore[arg-type]
    stop = threading.Event()
    stall = threading.Thread(target=proc.stall, args=(600.0, stop))
    stall.start()
    try:
        eventually(lambda: not proc._reading.is_set(), 10, "the pipe no longer read")
        go.touch()
        wchan = Path(f"/proc/{proc.pid}/wchan")
        eventually(lambda: "pipe_write" in wchan.read_text(), 30, "the writer blocked on its pipe")
        assert not done.exists()
    finally:
        stop.set()
        stall.join()
    eventually(done.exists, 30, "the writer done once read again")
    assert proc.popen is not None and proc.popen.wait(10) == 0
    eventually(lambda: "line 1999" in proc.log.read_text(), 10, "every line in the log")


def test_a_skew_moves_a_workers_wall_clock_and_not_its_monotonic_clock(tmp_path: Path) -> None:
    fleet = Fleet(Layout(workers=1), None, None, tmp_path, print)  # type: ignore[arg-type]
    env = {**os.environ, **fleet._clock_env("w1"), "PYTHONPATH": str(SKEWCLOCK)}
    show = "import time; time.sleep(0.01); print(time.time(), time.monotonic())"

    def clocks() -> tuple[float, float]:
        out = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True,
                             text=True, check=True)  # fmt: skip
        wall, mono = map(float, out.stdout.split())
        return wall - time.time(), mono - time.monotonic()

    assert abs(clocks()[0]) < 30
    stop = threading.Event()
    skew = threading.Thread(target=fleet.skew, args=("w1", 600.0, 600.0, stop))
    skew.start()
    try:
        eventually(lambda: fleet._clock_file("w1").read_text() == "+600\n", 10, "skewed")
        wall, mono = clocks()
        assert 570 < wall < 630 and abs(mono) < 30
    finally:
        stop.set()
        skew.join()
    assert fleet._clock_file("w1").read_text() == "+0\n"
    assert abs(clocks()[0]) < 30


# A skewed worker calling a real agent: its health probe and its reconcile listing
# (workers.backends), with the partition run's timeouts, from a process whose time.time is
# off as a skewed worker's is; it prints what it was told and how long each call took.
_CALLS_WHILE_SKEWED = """
import sys, time
from config.settings import get_settings
from workers import backends
from workers.store.models import Node
settings = get_settings()
node = Node(id="n1", name="n1", kind="fcdaemon", address=sys.argv[1], capacity=4)
for what, call in (("probe", backends.probe), ("list", backends.list_vms)):
    began = time.monotonic()
    try:
        out = repr(call(node, settings))
    except Exception as exc:
        out = type(exc).__name__ + ": " + str(exc)[:200]
    print(what, round(time.monotonic() - began, 1), out, flush=True)
"""


def _skewed_calls(tmp_path: Path, offset: str, address: str) -> dict[str, tuple[float, str]]:
    """Run :data:`_CALLS_WHILE_SKEWED` with this host's clock ``offset``; what each call got."""
    fleet = Fleet(Layout(workers=1), None, None, tmp_path, print)  # type: ignore[arg-type]
    fleet._clock_file("w1").write_text(f"{offset}\n")
    env = {
        **os.environ,
        **fleet._clock_env("w1"),
        "PYTHONPATH": f"{SKEWCLOCK}{os.pathsep}{ROOT}",
        "CORRAL_RPC_TIMEOUT_S": "5",
        "CORRAL_HEALTH_TIMEOUT_S": "1",
        "CORRAL_BROKER_URL": NO_BROKER,
    }
    out = subprocess.run(
        [sys.executable, "-c", _CALLS_WHILE_SKEWED, address],
        env=env, capture_output=True, text=True, timeout=90, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    calls = {}
    for line in out.stdout.splitlines():
        what, took, told = line.split(" ", 2)
        calls[what] = (float(took), told)
    return calls


def test_a_worker_whose_clock_is_behind_still_reaches_its_agents(tmp_path: Path) -> None:
    """gRPC's Python makes a call's deadline from ``time.time()`` and its C core judges it
    by the real clock: a skew of Python's clock alone put every deadline off by it (8 s
    behind: every health probe and release with a shorter timeout failed at once with
    DEADLINE_EXCEEDED, the partition run's over-capacity nodes). A host whose clock is
    off is off for both, so gRPC keeps the real clock in the skewed worker."""
    agent = serve_fcdaemon("127.0.0.1:0")
    try:
        calls = _skewed_calls(tmp_path, "-8", agent.address)
    finally:
        agent.stop()
    assert calls["probe"][1] == "True", calls
    assert calls["list"][1] == "[]", calls


def test_a_worker_whose_clock_is_ahead_gives_up_on_a_silent_agent_in_its_timeout(
    tmp_path: Path,
) -> None:
    """600 s ahead, a call to an agent that never answers waited until something other
    than its deadline ended it (the partition run's delete_replica and reconcile_pass
    killed at their 20 s hard limit, waiting on a frozen or cut-off agent)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the backlog; nothing ever answers
    try:
        calls = _skewed_calls(tmp_path, "+600", f"127.0.0.1:{silent.getsockname()[1]}")
    finally:
        silent.close()
    # each ends at its own timeout (1 s, 5 s), well before a 20 s hard limit; before, each
    # waited for gRPC's 20 s connect timeout (a connected agent that froze: 605 s)
    for what in ("probe", "list"):
        took, told = calls[what]
        assert told.startswith("TransientBackendError"), calls
        assert took < 15, calls


def test_vms_over_capacity_count_only_runs_past_the_grace() -> None:
    sampler = checker.Sampler(fleet=None, t0=0.0, vm_grace_s=10.0)  # type: ignore[arg-type]
    five = frozenset("abcde")
    sampler.crowded = [("n1", 4, float(t), five) for t in range(0, 9)]  # 8 s: within grace
    sampler.crowded += [("n1", 4, float(t), five) for t in range(20, 40)]  # 19 s: past it
    sampler.crowded += [("n2", 4, float(t), five) for t in range(0, 60, 4)]  # samples missed
    over, longest = sampler.vms_over()
    assert longest == {"n1": 19, "n2": 0}
    assert {o.split(":")[0] for o in over} == {"n1"}
    assert over[0] == "n1: 5 VMs > 4 since 20s, at 31s"


def test_an_operation_failed_by_a_programming_error_is_an_anomaly_an_outcome_is_not() -> None:
    reasons = Counter(
        {
            "spawn: no capacity for pt-l on any healthy lambdo node": 25,
            "delete: node pt-fc1: ReleaseVMSetup failed: DEADLINE_EXCEEDED: Deadline Exceeded": 1,
            "scale: corral.spawn: OperationalError: connection failed": 1,  # past its retries
            "spawn: corral.spawn_replica: ValueError: too many values to unpack (expected #)": 4,
        }
    )
    assert checker.failed_by_a_bug(reasons) == [
        "4 x spawn: corral.spawn_replica: ValueError: too many values to unpack (expected #)"
    ]


@pytest.fixture
def three_hosts() -> Iterator[tuple[Network, Launcher]]:
    """Hosts a, b, c on a switch, and a listener on port 7000 in each."""
    net = Network(str(os.getpid()))
    launcher = None
    try:
        net.create([Host(h, f"10.231.0.{n}") for h, n in (("a", 10), ("b", 11), ("c", 12))])
        launcher = Launcher(net)
        serve = "import socket\ns=socket.socket();s.bind(('0.0.0.0',7000));s.listen()\n"
        serve += "while True: s.accept()[0].close()"
        for h in ("a", "b", "c"):
            launcher.popen(h, [sys.executable, "-c", serve])
        yield net, launcher
    finally:
        if launcher is not None:
            launcher.close()
        cleanup(net.run, keep=os.getpid())


def _reach(net: Network, src: str, dst: str) -> bool:
    with net.entered(src):
        try:
            socket.create_connection((net.hosts[dst].ip, 7000), timeout=1).close()
            return True
        except OSError:
            return False


@needs_netns
def test_cuts_cut_only_what_they_name_and_heal_restores_all(
    three_hosts: tuple[Network, Launcher],
) -> None:
    net, _ = three_hosts
    eventually(lambda: all(_reach(net, "a", d) for d in "bc") and _reach(net, "b", "a"), 30, "up")
    # nothing leaves the namespaces: no route out
    with net.entered("a"), pytest.raises(OSError, match="unreachable"):
        socket.create_connection(("1.1.1.1", 53), timeout=1)

    net.block("a", "b")  # one side dropping is enough for TCP both ways
    assert not _reach(net, "a", "b")
    assert not _reach(net, "b", "a")
    assert _reach(net, "a", "c") and _reach(net, "c", "b")
    net.heal()
    assert _reach(net, "a", "b") and _reach(net, "b", "a")

    net.block("b", "a", syn_only=True)  # a still reaches b; b cannot open to a
    assert _reach(net, "a", "b")
    assert not _reach(net, "b", "a")
    net.heal()

    net.block("a", sports=((7000, 0xFFFF),))  # a's listener unreachable, a reaches out
    assert not _reach(net, "b", "a") and not _reach(net, "c", "a")
    assert _reach(net, "a", "b")
    net.heal()

    net.link("c", False)
    assert not _reach(net, "a", "c") and not _reach(net, "c", "b")
    assert _reach(net, "a", "b")
    net.heal()  # a port brought up again forwards once the bridge and ARP have caught up
    eventually(
        lambda: all(_reach(net, s, d) for s in "abc" for d in "abc" if s != d),
        15,
        "every host reaching every other after heal",
    )
    assert net.faulty == []


@needs_netns
def test_a_process_started_in_a_host_leaves_none_of_this_processes_threads_there() -> None:
    """A fork made inside a host, with gRPC's threads running, started them again there
    (its fork handlers run in the forking thread): every later agent call of the process
    was refused. The launcher forks no more (setpriv instead of a preexec_fn)."""
    agent = serve_fcdaemon("127.0.0.1:0", advertise_ip="127.0.0.1")
    channel = grpc.insecure_channel(agent.address)  # gRPC's threads running, as in the suite
    grpc.channel_ready_future(channel).result(timeout=30)
    net = Network(str(os.getpid()))
    launcher = None
    try:
        net.create([Host("x", "10.231.0.10")])
        launcher = Launcher(net)
        sleepers = [launcher.popen("x", ["sleep", "600"]) for _ in range(5)]
        assert threads_elsewhere() == []  # gRPC's event_engine and lifeguard were, before
        assert sorted(net.pids("x")) == sorted(p.pid for p in sleepers)
    finally:
        channel.close()
        agent.stop(grace=0)
        if launcher is not None:
            launcher.close()
        cleanup(net.run, keep=os.getpid())


@needs_netns
def test_cleanup_finds_a_dead_runs_namespaces_and_kills_what_runs_in_them() -> None:
    harness = subprocess.Popen(["sleep", "600"])  # the run's harness, alive while it is made
    net = Network(str(harness.pid))
    launcher = None
    try:
        net.create([Host("x", "10.231.0.10")])
        launcher = Launcher(net)
        sleeper = launcher.popen("x", ["sleep", "600"])
        assert net.pids("x") == [sleeper.pid]
        cleanup_stale()  # its harness lives: its namespaces stay
        assert sorted(run_namespaces()[net.run]) == sorted([net.ns("sw"), net.ns("x")])
        assert sleeper.poll() is None
        harness.kill()
        harness.wait()
        cleanup_stale()  # (a run starting meanwhile, in another test, may do it first)
        assert net.run not in run_namespaces()
        sleeper.wait(10)
        assert sleeper.returncode == -9
    finally:
        harness.kill()
        if launcher is not None:
            launcher.close()
        cleanup(net.run)


@needs_netns
def test_cleanup_takes_a_dead_runs_namespaces_whose_pid_a_later_process_got() -> None:
    """A SIGKILLed run's pid may belong to another process by the time the next run
    starts: its namespaces are still a dead run's, while a live run's are left alone."""
    harness = subprocess.Popen(["sleep", "600"])
    net = Network(str(harness.pid))
    launcher = later = None
    try:
        net.create([Host("x", "10.231.0.10")])
        launcher = Launcher(net)
        sleeper = launcher.popen("x", ["sleep", "600"])
        made = (NETNS_DIR / net.ns("x")).stat().st_mtime
        eventually(lambda: time.time() > made + 0.5, 5, "the clock past the namespace's birth")
        later = subprocess.Popen(["sleep", "600"])  # as if it got the dead run's pid
        reused = f"{PREFIX}-{later.pid}-x"
        subprocess.run(["ip", "netns", "attach", reused, str(sleeper.pid)], check=True)
        assert str(later.pid) in run_namespaces()
        removed = cleanup_stale()
        assert reused in removed and str(later.pid) not in run_namespaces()
        assert net.run in run_namespaces()  # its harness lives: its own names stay
        assert later.poll() is None  # the process that got the pid is not touched
    finally:
        for proc in (harness, later):
            if proc is not None:
                proc.kill()
                cleanup(str(proc.pid))
        if launcher is not None:
            launcher.close()


@pytest.fixture
def store_host() -> Iterator[tuple[Network, NsPostgres]]:
    """PostgreSQL on host ``pg`` (10.231.0.4), running, and a client host ``cl``."""
    net = Network(str(os.getpid()))
    launcher = None
    directory = make_shared_tempdir("corral-pt-test-pg-")
    try:
        net.create([Host("pg", "10.231.0.4"), Host("cl", "10.231.0.9")])
        launcher = Launcher(net)
        pg = NsPostgres(directory, launcher, "pg", "10.231.0.4", "test-password")
        with net.entered("cl"):
            pg.start()
        yield net, pg
        pg.stop()
    finally:
        if launcher is not None:
            launcher.close()
        cleanup(net.run, keep=os.getpid())
        shutil.rmtree(directory, ignore_errors=True)


def _answers(db: Database) -> bool:
    """Whether the store answers a statement now (a transient error: not yet)."""
    try:
        with db.read() as s:
            return bool(s.scalar(text("SELECT 1")) == 1)
    except OperationalError as exc:
        if not is_transient(exc):
            raise
        return False


@needs_netns
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.long(35)
@pytest.mark.timeout(150)
def test_a_store_behind_a_cut_fails_statements_in_seconds_and_the_gateway_answers_503(
    store_host: tuple[Network, NsPostgres],
) -> None:
    """Found by the partition run: with PostgreSQL cut off every worker hung in libpq (the
    kernel's minutes of retries) until its hard time limit, and exited; and a request the
    gateway had to ask the store about ended in an unhandled error - a 500 and a traceback."""
    net, pg = store_host
    settings = get_settings().model_copy(
        update={"database_url": pg.url_for("postgres"), "broker_url": NO_BROKER}
    )
    with net.entered("cl"):  # the gateway's threads start here: they are on host cl
        db = Database(settings.database_url)
        upgrade(db)
        queue = HereFirst(QUEUE)  # its threads, and the process's call loop, start on cl too
        gateway = serve_gateway(settings, "127.0.0.1:0", queue=queue, db=db)
        url = f"{gateway.url}/function/nothing-by-this-name"
        try:
            with db.read() as s:
                assert s.scalar(text("SELECT 1")) == 1  # a pooled connection, in use below
            assert httpcalls.get(url, timeout=30).status_code == 404  # the store says so
            net.link("pg", False)  # the store's cable out: nothing answers, nothing refuses
            for what in ("a pooled connection", "a new connection"):
                started = time.monotonic()
                with pytest.raises(OperationalError) as caught, db.read() as s:
                    s.scalar(text("SELECT 1"))
                took = time.monotonic() - started
                assert took < 30, f"{what}: {took:.0f}s"
                assert is_transient(caught.value)  # the task retries it
                answer = httpcalls.get(url, timeout=60)
                assert answer.status_code == 503, answer.text
                assert answer.headers["retry-after"] == str(RETRY_AFTER_S)
                assert "the store is unavailable" in answer.text
            net.heal()
            # a connection begun during the cut may still be closed by the server after it
            # (its startup timed out there): the store answers again, as a retried task sees
            eventually(lambda: _answers(db), 30, "the store answering again")
            eventually(lambda: httpcalls.get(url, timeout=30).status_code == 404, 30, "a 404 again")
        finally:
            gateway.stop()
            db.dispose()
            # threads left on cl would make this process's later calls there: a later
            # test's agents refused every create (conftest's namespace check)
            queue.close()
            inflight.reset()


@needs_netns
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.long(110)
@pytest.mark.timeout(420)
def test_the_short_partition_run_has_no_anomaly_and_leaves_nothing(tmp_path: Path) -> None:
    links_before = _links()
    out = tmp_path / "partition.json"
    run = subprocess.Popen(
        [sys.executable, "-m", "bench.partition", "--ci", "--json", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        stdout, _ = run.communicate(timeout=400)
    finally:
        run.kill()
    tail = stdout[-4000:]
    assert out.exists(), tail
    figures = json.loads(out.read_text())
    assert figures["anomalies"] == dict.fromkeys(figures["anomalies"], 0), tail
    assert {k: figures["faults"][k] for k in ("isolate", "cut", "freeze", "kill")} == {
        "isolate": 1, "cut": 1, "freeze": 1, "kill": 1,
    }, tail  # fmt: skip
    assert figures["faults"]["skew"] == 1 and figures["faults"]["stall"] == 1, tail
    assert figures["submitted"] >= 40, tail  # the load really ran: ~2 actions a second
    assert figures["gateway"]["calls"] >= 30, tail
    assert figures["samples"] >= 30, tail
    assert run.returncode == 0, tail
    assert str(run.pid) not in run_namespaces()
    assert _links() == links_before  # nothing made in this namespace
