"""`python -m bench.keepalive`: a replay through the fleet's policy code; figures without a plot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import keepalive as bench
from workers.autoscale import keepalive
from workers.autoscale.idletimes import Shape
from workers.autoscale.keepalive import KeepAlivePolicy

SHAPE = Shape()
HALF_HOUR = 1800.0


def timer(days: float = 2.0, period: float = HALF_HOUR) -> bench.App:
    """A timer every ``period`` seconds, each call a second long."""
    n = int(days * bench.DAY // period)
    return bench.App("t", "timer", [(10.0 + k * period, 1.0) for k in range(n)])


def replay(app: bench.App, policy: bench.Policy, days: float = 2.0) -> bench.Outcome:
    return bench.Replay(policy, SHAPE, bench.Cadence(), 0.5, days * bench.DAY).run(app.calls)


def test_a_half_hourly_timer_is_prewarmed_once_its_pattern_is_learnt() -> None:
    app = timer()
    fixed = replay(app, bench.Policy("fixed 10 min", 600.0))
    adaptive = replay(app, bench.Policy("adaptive", 600.0, KeepAlivePolicy()))
    assert fixed.cold == fixed.calls == 96  # every call: 30 min is past 10
    # learning: the first call, then 5 idle times before the histogram is trusted
    # and a pre-warm before every later call (and one for the call after the trace ends)
    assert adaptive.cold == 6 and adaptive.prewarms == 91
    # per call: from the pre-warm (26.1 min in) to the call, plus the reaper's next pass
    assert adaptive.idle_s < 0.6 * fixed.idle_s
    assert adaptive.modes["histogram"] > 0


def test_a_frequent_function_is_kept_warm_by_every_policy() -> None:
    app = timer(period=45.0)
    for policy in (bench.Policy("fixed", 600.0), bench.Policy("a", 600.0, KeepAlivePolicy())):
        out = replay(app, policy)
        assert out.cold == 1 and out.alive_s == pytest.approx(2 * bench.DAY - 10.0)


def test_the_replay_decides_with_the_fleets_code(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[float] = []
    real = keepalive.Plan.release_before

    def spy(self: keepalive.Plan, now: float) -> float | None:
        asked.append(now)
        return real(self, now)

    monkeypatch.setattr(keepalive.Plan, "release_before", spy)
    replay(timer(days=1.0), bench.Policy("adaptive", 600.0, KeepAlivePolicy()), days=1.0)
    assert asked and all(t % 60.0 == pytest.approx(30.0) for t in asked)  # on reaper passes


def test_the_workload_is_shaped_like_the_paper_and_seeded() -> None:
    apps = bench.workload(300, 3.0, seed=5)
    assert [len(a.calls) for a in apps] == [len(a.calls) for a in bench.workload(300, 3.0, 5)]
    gaps = [a.mean_gap_s for a in apps]
    assert 0.35 < sum(g >= 3600 for g in gaps) / len(apps) < 0.55  # paper: 45% at most hourly
    assert 0.75 < sum(g >= 60 for g in gaps) / len(apps) < 0.95  # paper: 81% at most 1/min
    assert {a.kind for a in apps} == {"timer", "poisson", "bursty", "heavy"}


def test_it_prints_its_figures_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    png = tmp_path / "k.png"
    assert bench.main(["--apps", "30", "--days", "1", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for policy in ("fixed 10 min", "fixed 20 min", "adaptive"):
        assert policy in out
    assert "cold starts p75" in out and "idle replica-h" in out
    assert "no plot: matplotlib is not installed" in out and not png.exists()


def test_it_writes_a_plot_when_matplotlib_is_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "k.png"
    assert bench.main(["--apps", "20", "--days", "1", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in capsys.readouterr().out


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        bench.main(["--apps", "0"])
    assert refused.value.code == 2 and "--apps must be at least 1" in capsys.readouterr().err
