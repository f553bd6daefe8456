"""The soak of ``bench/soak.py``, cut to 45 seconds for CI: every fault fires, nothing breaks.

It runs as its own process (``python -m bench.soak``), with its own PostgreSQL,
Redis, workers, beat, registry and nodes, so nothing it sets leaks into the other
tests; the figures come back as JSON. The schedule shrinks to fit: three worker kills
(the first while the delayed agent's creates are in flight), Redis stopped for 5 s,
PostgreSQL restarted, an agent stopped for 7.5 s, a re-deploy; every invariant is
checked as in the long soak.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.history import percentile
from testkit.soak_plan import FAULT_KINDS, schedule

ROOT = Path(__file__).resolve().parent.parent.parent
CI_S = 45.0  # the soak's length here


def test_a_short_schedule_still_has_every_fault_kind() -> None:
    events = schedule(CI_S)
    kinds = {e.kind for e in events}
    assert kinds == set(FAULT_KINDS)
    assert all(e.at_s + e.duration_s < CI_S for e in events)  # every window closes in time
    assert [e.at_s for e in events if e.kind == "worker_kill"] == [11.25, 22.5, 33.75]
    delay = next(e for e in events if e.kind == "agent_delay")  # a kill lands inside it
    assert delay.at_s < 11.25 < delay.at_s + delay.duration_s
    long = schedule(600.0)
    assert {e.kind: e.duration_s for e in long if e.kind != "worker_kill"} == {
        "agent_delay": 60.0,
        "redis_stop": 10.0,
        "postgres_restart": 0.0,
        "agent_stop": 30.0,
    }
    assert sum(e.kind == "worker_kill" for e in long) == 29


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


@pytest.mark.slow
@pytest.mark.long(70)
def test_a_short_soak_keeps_every_invariant(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--minutes",
            str(CI_S / 60),
            "--quiesce",
            "120",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert {k: figures["faults"].get(k, 0) >= 1 for k in FAULT_KINDS} == dict.fromkeys(
        FAULT_KINDS, True
    ), run.stdout[-3000:]
    assert figures["violations"] == dict.fromkeys(figures["violations"], 0), run.stdout[-4000:]
    assert figures["submitted"] >= 30  # the load really ran: ~2 actions a second
    assert run.returncode == 0, run.stdout[-3000:]
