"""corral on many hosts made of network namespaces, under partitions (``bench/partition.py``).

The short fixed run (an agent host isolated, then a worker cut from Redis) runs as its own
process, as in CI: it must leave no anomaly and nothing behind - no namespace, no link,
no process. The pieces it stands on are tested here too: the cuts really cut (and only
what they name), the schedule is the seed's, and cleanup finds what a dead run left.

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
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from config.settings import get_settings
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from testkit import checker, nemesis
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
from testkit.nsprocs import Layout, NsPostgres
from testkit.services import make_shared_tempdir
from tests.fixtures import NO_BROKER
from tests.requirements import NETNS, needs
from workers.gateway import serve_gateway
from workers.gateway.asgi import RETRY_AFTER_S
from workers.store.db import Database, is_transient
from workers.store.migrate import upgrade

ROOT = Path(__file__).resolve().parents[2]
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
    assert {"isolate", "cut", "unreachable", "freeze", "redis", "postgres"} <= set(kinds)
    assert all(f.at_s + f.duration_s < 1200.0 for f in faults)  # all healed before the end
    targets = {t for f in faults for t in f.targets}
    assert "ctl" not in targets  # the harness's own host is never cut
    assert not [f for f in faults if f.kind == "isolate" and f.targets == ("gw",)]


def test_the_ci_schedule_isolates_a_seed_agent_then_cuts_a_worker_from_redis() -> None:
    lay = Layout(workers=2, agents=3, seed_only=1)
    faults = nemesis.ci_schedule(45.0, lay)
    assert [(f.kind, f.targets) for f in faults] == [
        ("isolate", ("fc3",)),
        ("cut", ("w1", "redis")),
    ]
    assert lay.seed("fc3")
    assert all(f.at_s + f.duration_s < 45.0 for f in faults)


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


@needs_netns
@pytest.mark.slow
@pytest.mark.postgres
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
        gateway = serve_gateway(settings, "127.0.0.1:0", queue=HereFirst(QUEUE), db=db)
        url = f"{gateway.url}/function/nothing-by-this-name"
        try:
            with db.read() as s:
                assert s.scalar(text("SELECT 1")) == 1  # a pooled connection, in use below
            assert httpx.get(url, timeout=30).status_code == 404  # the store says so
            net.link("pg", False)  # the store's cable out: nothing answers, nothing refuses
            for what in ("a pooled connection", "a new connection"):
                started = time.monotonic()
                with pytest.raises(OperationalError) as caught, db.read() as s:
                    s.scalar(text("SELECT 1"))
                took = time.monotonic() - started
                assert took < 30, f"{what}: {took:.0f}s"
                assert is_transient(caught.value)  # the task retries it
                answer = httpx.get(url, timeout=60)
                assert answer.status_code == 503, answer.text
                assert answer.headers["retry-after"] == str(RETRY_AFTER_S)
                assert "the store is unavailable" in answer.text
            net.heal()
            with db.read() as s:
                assert s.scalar(text("SELECT 1")) == 1
            eventually(lambda: httpx.get(url, timeout=30).status_code == 404, 30, "a 404 again")
        finally:
            gateway.stop()
            db.dispose()


@needs_netns
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(300)
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
        stdout, _ = run.communicate(timeout=280)
    finally:
        run.kill()
    tail = stdout[-4000:]
    assert out.exists(), tail
    figures = json.loads(out.read_text())
    assert figures["anomalies"] == dict.fromkeys(figures["anomalies"], 0), tail
    assert figures["faults"]["isolate"] == 1 and figures["faults"]["cut"] == 1, tail
    assert figures["submitted"] >= 40, tail  # the load really ran: ~2 actions a second
    assert figures["gateway"]["calls"] >= 30, tail
    assert figures["samples"] >= 30, tail
    assert run.returncode == 0, tail
    assert str(run.pid) not in run_namespaces()
    assert _links() == links_before  # nothing made in this namespace
