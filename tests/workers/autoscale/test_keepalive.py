"""The keep-alive policy (pure): windows from histograms, plans at a moment, the floor."""

from __future__ import annotations

import pytest

from workers.autoscale.decision import Facts, Observation, Policy, Window, decide
from workers.autoscale.keepalive import (
    IdleHistogram,
    KeepAlivePolicy,
    Plan,
    Windows,
    coefficient_of_variation,
    percentile_bin,
    windows,
)

POLICY = KeepAlivePolicy()  # 5th / 99th percentiles, 10% margin, CV 2, 5 idle times
MIN = 60.0


def hist(*idle_s: float, bin_s: float = MIN, range_s: float = 240 * MIN) -> IdleHistogram:
    h = IdleHistogram.empty(bin_s, range_s)
    h.add_all(idle_s, 10_000)
    return h


def test_no_history_or_too_little_is_fixed() -> None:
    assert windows(POLICY, None) == Windows("fixed", 0.0, None, 0, "no idle times recorded")
    few = windows(POLICY, hist(600, 610, 620, 630))
    assert few.mode == "fixed" and few.keep_s is None and few.idle_times == 4
    assert "not yet representative (needs 5)" in few.reason


def test_a_regular_period_gives_a_prewarm_and_a_keep_window() -> None:
    """A timer every 30 minutes, give or take a few seconds: head and tail in bin 29."""
    w = windows(POLICY, hist(*(1790 + i % 7 for i in range(40))))
    assert w.mode == "histogram"
    assert w.prewarm_s == pytest.approx(29 * MIN * 0.9)  # let go after use, back at 26 min
    assert w.keep_s == pytest.approx(30 * MIN * 1.1)  # kept until 33 min
    assert "head in bin 29, tail in bin 29" in w.reason


def test_a_busy_function_is_kept_from_the_end_of_its_calls() -> None:
    w = windows(POLICY, hist(*([1.0] * 490 + [200.0] * 10)))
    assert w.mode == "histogram" and w.prewarm_s == 0.0
    assert w.keep_s == pytest.approx(4 * MIN * 1.1)  # 2% in bin 3: the 99th percentile
    rare_gaps = windows(POLICY, hist(*([1.0] * 500 + [200.0] * 3)))
    assert rare_gaps.keep_s == pytest.approx(MIN * 1.1)  # 0.6%: beyond the tail


def test_head_and_tail_are_percentiles_of_the_counts() -> None:
    idle = [130.0] * 10 + [600.0] * 180 + [1500.0] * 10  # 5% in bin 2, 99% by bin 25
    w = windows(POLICY, hist(*idle))
    assert w.prewarm_s == pytest.approx(2 * MIN * 0.9)
    assert w.keep_s == pytest.approx(26 * MIN * 1.1)


def test_a_flat_histogram_shows_no_pattern() -> None:
    w = windows(POLICY, hist(*(i * MIN + 5 for i in range(240))))
    assert w.mode == "fixed" and "no clear pattern" in w.reason


def test_a_daily_job_beyond_the_range_is_forecast() -> None:
    day = 86_400.0
    w = windows(POLICY, hist(day - 300, day + 120, day - 60, day + 240, day, day + 30))
    assert w.mode == "forecast"
    spread = 540.0
    pad = max(MIN, 0.1 * spread)
    assert w.prewarm_s == pytest.approx(day - 300 - pad)
    assert w.keep_s == pytest.approx(day + 240 + pad)


@pytest.mark.parametrize(
    ("idle", "why"),
    [
        ((5 * 3600, 9 * 3600, 20 * 3600, 30 * 3600, 6 * 3600), "too irregular"),
        ((86_400.0, 86_410.0, 30.0, 40.0, 50.0), "too few to forecast"),
    ],
)
def test_idle_times_beyond_the_range_that_disagree_or_are_few_are_fixed(
    idle: tuple[float, ...], why: str
) -> None:
    policy = KeepAlivePolicy(oob_threshold=0.4)
    w = windows(policy, hist(*idle))
    assert w.mode == "fixed" and why in w.reason


def test_cv_and_percentiles() -> None:
    assert coefficient_of_variation([0, 0, 0]) == 0.0
    assert coefficient_of_variation([5, 5, 5, 5]) == 0.0
    assert coefficient_of_variation([10, 0, 0, 0]) == pytest.approx(2.0)
    assert percentile_bin([1, 1, 1, 1], 0.5) == 1
    assert percentile_bin([0, 0, 4, 0], 0.05) == 2
    assert percentile_bin([0, 0, 0], 0.5) == 2  # nothing counted: the last bin


# -- plans at a moment -------------------------------------------------------------------------


HOURLY = Windows("histogram", 3000.0, 4000.0, 50, "test")


@pytest.mark.parametrize(
    ("since", "warm", "cutoff"),
    [
        (10.0, False, 0.0),  # right after use: the next call is far, every idle replica may go
        (2999.0, False, 0.0),
        (3000.0, True, -4000.0),  # pre-warmed: kept (only those idle over 4000 s go)
        (3999.0, True, -4000.0),
        (4000.0, False, 0.0),  # past the tail: nothing kept
    ],
)
def test_a_plan_warms_inside_its_windows_and_releases_outside(
    since: float, warm: bool, cutoff: float
) -> None:
    plan = Plan(HOURLY, last=1000.0)
    now = 1000.0 + since
    assert plan.warm(now) is warm
    assert plan.release_before(now) == pytest.approx(now + cutoff)


def test_a_plan_without_a_last_activity_or_windows_leaves_it_to_the_fixed_rule() -> None:
    unknown = Plan(HOURLY, last=None)
    assert unknown.warm(5000.0) is None
    assert unknown.release_before(5000.0) == 1000.0  # each replica's own idle clock
    fixed = Plan(windows(POLICY, None), last=1000.0)
    assert fixed.warm(5000.0) is None and fixed.release_before(5000.0) is None


def test_keep_from_the_end_of_the_call_when_the_head_is_zero() -> None:
    plan = Plan(Windows("histogram", 0.0, 66.0, 50, "busy"), last=100.0)
    assert plan.warm(100.0) and plan.warm(165.0) and not plan.warm(166.0)
    assert plan.release_before(130.0) == pytest.approx(64.0)


# -- the autoscaler's floor with adaptive keep-alive -------------------------------------------


def autoscaled(**kw: object) -> Facts:
    base: dict[str, object] = {
        "min_replicas": 0,
        "max_replicas": 10,
        "exec_envs": 1,
        "ready": 0,
        "target": 0,
        "counted": 0,
        "at_zero": True,
        "scale_to_zero_after_s": 600.0,
    }
    base.update(kw)
    return Facts(**base)  # type: ignore[arg-type]


def test_an_adaptive_function_at_zero_is_prewarmed_without_demand() -> None:
    d, _ = decide(Policy(), autoscaled(), Window(), Observation(1000.0, 0.0, 10.0, warm=True))
    assert d.desired == 1 and d.floor == 1


def test_outside_its_windows_an_adaptive_function_goes_to_zero_at_once() -> None:
    """Right after use, the head says the next call is far: no scale-to-zero delay."""
    one = autoscaled(ready=1, target=1, counted=1, at_zero=False)
    window = Window([(930.0, 0.0)], None, 0.0)  # the last request's sample left the window
    d, _ = decide(Policy(), one, window, Observation(1000.0, 0.0, 990.0, warm=False))
    assert d.desired == 0  # the request clock (600 s) would have kept it


def test_demand_and_min_still_win_over_the_windows() -> None:
    busy = autoscaled(ready=1, target=1, counted=1, at_zero=False)
    d, _ = decide(
        Policy(), busy, Window([(995.0, 0.7)]), Observation(1000.0, 0.7, 999.0, warm=False)
    )
    assert d.desired == 1
    floor, _ = decide(
        Policy(),
        autoscaled(min_replicas=2, ready=2, target=2, counted=2, at_zero=False),
        Window([(930.0, 0.0)]),
        Observation(1000.0, 0.0, None, warm=False),
    )
    assert floor.desired == 2


def test_without_scale_to_zero_the_windows_never_take_the_last_replica() -> None:
    keep = autoscaled(ready=1, target=1, counted=1, at_zero=False, scale_to_zero_after_s=None)
    d, _ = decide(
        Policy(), keep, Window([(930.0, 0.0)]), Observation(1000.0, 0.0, None, warm=False)
    )
    assert d.desired == 1
