"""Adaptive keep-alive on replayed traces (testkit.keepalive_replay): the fleet's own code."""

from __future__ import annotations

import pytest

from testkit import keepalive_replay as kr
from workers.autoscale import keepalive
from workers.autoscale.idletimes import Shape
from workers.autoscale.keepalive import KeepAlivePolicy

SHAPE = Shape()
HALF_HOUR = 1800.0


def timer(days: float = 2.0, period: float = HALF_HOUR) -> kr.App:
    """A timer every ``period`` seconds, each call a second long."""
    n = int(days * kr.DAY // period)
    return kr.App("t", "timer", [(10.0 + k * period, 1.0) for k in range(n)])


def replay(app: kr.App, policy: kr.Policy, days: float = 2.0) -> kr.Outcome:
    return kr.Replay(policy, SHAPE, kr.Cadence(), 0.5, days * kr.DAY).run(app.calls)


def test_a_half_hourly_timer_is_prewarmed_once_its_pattern_is_learnt() -> None:
    app = timer()
    fixed = replay(app, kr.Policy("fixed 10 min", 600.0))
    adaptive = replay(app, kr.Policy("adaptive", 600.0, KeepAlivePolicy()))
    assert fixed.cold == fixed.calls == 96  # every call: 30 min is past 10
    # learning: the first call, then 5 idle times before the histogram is trusted
    # and a pre-warm before every later call (and one for the call after the trace ends)
    assert adaptive.cold == 6 and adaptive.prewarms == 91
    # per call: from the pre-warm (26.1 min in) to the call, plus the reaper's next pass
    assert adaptive.idle_s < 0.6 * fixed.idle_s
    assert adaptive.modes["histogram"] > 0


def test_a_frequent_function_is_kept_warm_by_every_policy() -> None:
    app = timer(period=45.0)
    for policy in (kr.Policy("fixed", 600.0), kr.Policy("a", 600.0, KeepAlivePolicy())):
        out = replay(app, policy)
        assert out.cold == 1 and out.alive_s == pytest.approx(2 * kr.DAY - 10.0)


def test_the_replay_decides_with_the_fleets_code(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[float] = []
    real = keepalive.Plan.release_before

    def spy(self: keepalive.Plan, now: float) -> float | None:
        asked.append(now)
        return real(self, now)

    monkeypatch.setattr(keepalive.Plan, "release_before", spy)
    replay(timer(days=1.0), kr.Policy("adaptive", 600.0, KeepAlivePolicy()), days=1.0)
    assert asked and all(t % 60.0 == pytest.approx(30.0) for t in asked)  # on reaper passes


def test_the_workload_is_shaped_like_the_paper_and_seeded() -> None:
    apps = kr.workload(300, 3.0, seed=5)
    assert [len(a.calls) for a in apps] == [len(a.calls) for a in kr.workload(300, 3.0, 5)]
    gaps = [a.mean_gap_s for a in apps]
    assert 0.35 < sum(g >= 3600 for g in gaps) / len(apps) < 0.55  # paper: 45% at most hourly
    assert 0.75 < sum(g >= 60 for g in gaps) / len(apps) < 0.95  # paper: 81% at most 1/min
    assert {a.kind for a in apps} == {"timer", "poisson", "bursty", "heavy"}
