"""The autoscaler's pure decision: windows, panic mode, clamping, the rate caps, zero.

Knative's own autoscaler scenarios (lost state, panic, the scale-down rate, scale to
zero) are in ``test_knative_scenarios.py``.
"""

from __future__ import annotations

import pytest

from config.settings import get_settings
from workers.autoscale.decision import (
    Decision,
    Facts,
    Observation,
    Policy,
    Window,
    decide,
    replicas_for,
    should_scale,
)

POLICY = Policy(
    target_utilization=0.7,
    stable_window_s=60,
    panic_window_s=6,
    panic_threshold=2.0,
    max_scale_up_rate=10,
    max_scale_down_rate=2.0,
)


def facts(**kw: object) -> Facts:
    base: dict[str, object] = {
        "min_replicas": 0,
        "max_replicas": 100,
        "exec_envs": 1,
        "ready": 1,
        "target": 1,
        "scale_to_zero_after_s": None,
    }
    base.update(kw)
    return Facts(**base)  # type: ignore[arg-type]


class Run:
    """Feeds observations every ``step`` seconds, tracking the target as a scaler would.

    The autoscaler has been running: the window holds one quiet sample from a panic
    window before ``start`` (a fresh window is the lost-state case, tested on its own).
    """

    def __init__(self, f: Facts, policy: Policy = POLICY, start: float = 1000.0) -> None:
        self.facts, self.policy, self.now = f, policy, start
        self.window = Window([(start - policy.panic_window_s, 0.0)])
        self.last_request: float | None = None

    def tick(self, demand: float, dt: float = 2.0, ready: int | None = None) -> Decision:
        self.now += dt
        if demand > 0:
            self.last_request = self.now
        f = self.facts
        f = Facts(
            f.min_replicas,
            f.max_replicas,
            f.exec_envs,
            f.target if ready is None else ready,
            f.target,
            f.scale_to_zero_after_s,
        )
        d, self.window = decide(
            self.policy, f, self.window, Observation(self.now, demand, self.last_request)
        )
        self.facts = Facts(
            f.min_replicas, f.max_replicas, f.exec_envs, f.ready, d.desired, f.scale_to_zero_after_s
        )
        return d


@pytest.mark.parametrize(
    ("demand", "envs", "want"),
    [
        (0, 1, 0),
        (0.1, 1, 1),
        (0.7, 1, 1),
        (0.71, 1, 2),
        (1.4, 1, 2),
        (7, 1, 10),
        (2.1, 3, 1),
        (2.11, 3, 2),
        (14, 10, 2),
        (-3, 1, 0),
    ],
)
def test_replicas_for_divides_by_envs_times_utilization(
    demand: float, envs: int, want: int
) -> None:
    assert replicas_for(demand, envs, 0.7) == want


def test_scale_up_is_immediate() -> None:
    run = Run(facts(target=1, ready=1))
    d = run.tick(2.8)  # ceil(2.8 / 0.7) = 4
    assert d.desired == 4 and d.stable == 4


def test_scale_down_waits_out_the_stable_window() -> None:
    run = Run(facts(min_replicas=1, target=1))
    assert run.tick(7.0).desired == 10
    desired = [run.tick(0.7).desired for _ in range(29)]  # 58 s: the peak is still in window
    assert desired == [10] * 29
    # 60 s after the peak it has left the window: down at the scale-down rate (halving)
    assert [run.tick(0.7).desired for _ in range(4)] == [5, 2, 1, 1]


def test_the_stable_window_holds_its_largest_sample() -> None:
    run = Run(facts(target=1))
    run.tick(1.4)  # 2
    run.tick(4.2)  # 6
    run.tick(2.1)  # 3
    d = run.tick(0.0)
    assert d.desired == 6 and d.stable == 6


def test_desired_is_clamped_to_max_and_min() -> None:
    assert Run(facts(max_replicas=5, target=1)).tick(100).desired == 5
    run = Run(facts(min_replicas=3, target=3, ready=3))
    assert run.tick(0.7).desired == 3  # demand for 1, min is 3


def test_scale_up_rate_caps_a_burst_to_rate_times_ready() -> None:
    run = Run(facts(target=2, ready=2, max_replicas=1000))
    d = run.tick(700.0, ready=2)  # wants 1000
    assert d.desired == 20 and d.capped
    d = run.tick(700.0, ready=20)
    assert d.desired == 200 and d.capped


def test_the_cap_never_lowers_the_current_target() -> None:
    run = Run(facts(target=30, ready=0, max_replicas=1000))
    d = run.tick(70.0, ready=0)  # wants 100; ready 0 counts as 1 -> cap 10, but target is 30
    assert d.desired == 30 and d.capped


def test_panic_entered_at_twice_the_ready_replicas() -> None:
    run = Run(facts(target=2, ready=2))
    assert not run.tick(2.1, ready=2).panicking  # asks for 3 < 2 x 2
    d = run.tick(2.8, ready=2)  # panic window mean (2.1 + 2.8) / 2 -> 4 >= 4
    assert d.panicking and d.panic == 4


def test_in_panic_the_target_never_goes_down_even_after_the_stable_window() -> None:
    pol = Policy(stable_window_s=10, panic_window_s=4, panic_threshold=2.0, max_scale_up_rate=10)
    run = Run(facts(min_replicas=1, target=1, ready=1), policy=pol)
    assert run.tick(7.0, ready=1).panicking  # 10 wanted against 1 ready
    # demand falls, but keeps crossing the threshold against one ready replica
    for _ in range(10):
        d = run.tick(1.5, ready=1)  # asks for 3 >= 2 x 1 ready: still panicking
        assert d.panicking and d.desired == 10
    # without panic the stable window (10 s) would have let the target fall to 3 by now


def test_in_panic_a_target_raised_elsewhere_is_not_lowered() -> None:
    # panicking, its floor 2; since then an operator's `corral scale` set the target to 8
    window = Window([(994.0, 0.0)], panic_since=998.0, first_seen=900.0, panic_pods=2)
    d, after = decide(POLICY, facts(target=8, ready=2), window, Observation(1000.0, 3.0, 1000.0))
    assert d.panicking and d.panic == 5  # ceil(3 / 0.7) = 5 >= 2 x 2 ready
    assert d.desired == 8 and after.panic_pods == 8  # not 5: panic never scales down


def test_panic_ends_a_stable_window_after_the_last_crossing() -> None:
    pol = Policy(stable_window_s=10, panic_window_s=2, panic_threshold=2.0, max_scale_up_rate=10)
    run = Run(facts(min_replicas=1, target=1, ready=1), policy=pol)
    assert run.tick(7.0, ready=1).panicking
    states = [run.tick(0.0, ready=10).panicking for _ in range(5)]  # 2, 4, 6, 8, 10 s later
    assert states == [True, True, True, True, False]
    assert run.tick(0.0, ready=10).desired == 5  # calm: down, at most halving per pass


def test_without_scale_to_zero_an_autoscaled_function_keeps_one() -> None:
    run = Run(facts(min_replicas=0, target=3, ready=3))
    for _ in range(100):
        d = run.tick(0.0)
    assert d.desired == 1 and d.floor == 1


def test_scale_to_zero_after_its_delay_without_requests() -> None:
    pol = Policy(stable_window_s=10, panic_window_s=2)
    run = Run(facts(min_replicas=0, target=1, scale_to_zero_after_s=30), policy=pol)
    run.tick(0.7)  # a request now
    desired = [run.tick(0.0).desired for _ in range(15)]  # 30 s of silence, 2 s apart
    assert desired[:14] == [1] * 14  # stable window over after 10 s, but 30 s not yet
    assert desired[14] == 0


def test_scale_to_zero_counts_from_first_sight_when_no_request_ever_came() -> None:
    run = Run(facts(min_replicas=0, target=1, scale_to_zero_after_s=4))
    assert run.tick(0.0).desired == 1  # first seen now
    assert run.tick(0.0).desired == 1  # 2 s
    assert run.tick(0.0).desired == 0  # 4 s


def test_demand_in_flight_keeps_a_replica_even_past_scale_to_zero() -> None:
    run = Run(facts(min_replicas=0, target=1, scale_to_zero_after_s=2))
    run.last_request = run.now - 100  # the last request arrived long ago and is still running
    d, _ = decide(POLICY, run.facts, Window(), Observation(run.now, 0.5, run.now - 100))
    assert d.desired == 1 and d.floor == 0


def test_scale_to_zero_never_goes_below_min() -> None:
    run = Run(facts(min_replicas=2, target=2, ready=2, scale_to_zero_after_s=1))
    for _ in range(50):
        d = run.tick(0.0)
    assert d.desired == 2


def test_samples_older_than_the_window_are_dropped_and_the_state_round_trips() -> None:
    run = Run(facts(target=1))
    for _ in range(100):
        run.tick(0.7)
    assert len(run.window.samples) == 30  # 60 s of 2 s ticks
    again = Window.from_json(run.window.to_json())
    assert again == run.window
    panicked = Window([(1.0, 2.0)], 1.0, 0.5, 7)
    assert Window.from_json(panicked.to_json()) == panicked


@pytest.mark.parametrize(
    "raw",
    [
        None,
        b"",
        b"not json",
        b"[1,2]",
        b'{"samples": [[1]]}',
        b'{"samples": [[1, NaN]]}',
        b'{"samples": [[Infinity, 1]]}',
        b'{"samples": [], "panic_since": "x"}',
        b'{"samples": [], "panic_pods": -1}',
        b'{"samples": [], "panic_pods": 1.5}',
        b'{"samples": [], "panic_pods": true}',
        b'{"samples": {"a": 1}}',
    ],
)
def test_a_missing_or_malformed_state_is_a_fresh_window(raw: bytes | None) -> None:
    assert Window.from_json(raw) == Window()


def test_a_state_written_before_panic_pods_existed_still_reads() -> None:
    old = b'{"samples": [[1.0, 2.0]], "panic_since": 1.0, "first_seen": 0.5}'
    assert Window.from_json(old) == Window([(1.0, 2.0)], 1.0, 0.5, 0)


def test_a_clock_that_went_back_discards_future_samples() -> None:
    window = Window([(2000.0, 70.0)], None, 1000.0)
    d, after = decide(POLICY, facts(target=1), window, Observation(1500.0, 0.0, None))
    assert d.stable == 0 and after.samples == [(1500.0, 0.0)]


def test_should_scale_only_on_a_change_and_with_no_scale_open() -> None:
    f = facts(target=3)
    d = Decision(desired=3, stable=3, panic=3, panicking=False, floor=1, capped=False)
    assert not should_scale(d, f, scale_open=False)
    up = Decision(desired=5, stable=5, panic=5, panicking=False, floor=1, capped=False)
    assert should_scale(up, f, scale_open=False)
    assert not should_scale(up, f, scale_open=True)


def test_should_scale_tops_up_a_target_that_lost_replicas() -> None:
    d = Decision(desired=3, stable=3, panic=3, panicking=False, floor=1, capped=False)
    assert should_scale(d, facts(target=3, counted=1), scale_open=False)  # reaped under it
    assert not should_scale(d, facts(target=3, counted=5), scale_open=False)  # busy surplus
    assert not should_scale(d, facts(target=3, counted=1), scale_open=True)


# -- the edges mutation testing found untested (python -m testkit.mutation) -----------------


def test_a_demand_within_rounding_of_zero_asks_for_no_replica() -> None:
    assert replicas_for(1e-10, 1, 0.7) == 0


def test_a_second_pass_at_the_same_instant_keeps_the_first_ones_sample() -> None:
    window = Window([(994.0, 0.0), (1000.0, 7.0)], None, 900.0)
    d, after = decide(POLICY, facts(target=10, ready=10), window, Observation(1000.0, 0.0))
    assert d.stable == 10 and not d.fresh  # ceil(7 / 0.7): the sample at this very instant
    assert after.samples == [(994.0, 0.0), (1000.0, 7.0), (1000.0, 0.0)]


def test_a_fresh_window_keeps_the_ready_replicas_as_its_floor_above_the_target() -> None:
    # a lost window, five replicas ready while the target says three (a scale-down under way)
    d, after = decide(POLICY, facts(target=3, ready=5), Window(), Observation(1000.0, 0.0))
    assert d.fresh and d.panicking and d.desired == 5 and after.panic_pods == 5


def test_calm_again_the_panic_floor_is_forgotten() -> None:
    pol = Policy(stable_window_s=10, panic_window_s=2, panic_threshold=2.0, max_scale_up_rate=10)
    run = Run(facts(min_replicas=1, target=1, ready=1), policy=pol)
    run.tick(7.0, ready=1)
    assert run.window.panic_pods == 10
    for _ in range(5):
        run.tick(0.0, ready=10)
    assert run.window.panic_since is None and run.window.panic_pods == 0


def test_a_rise_exactly_to_the_cap_is_not_capped() -> None:
    run = Run(facts(target=1, ready=2, max_replicas=1000))
    d = run.tick(14.0, ready=2)  # asks for ceil(14 / 0.7) = 20 = 10 x 2 ready
    assert d.desired == 20 and d.capped is False and d.slowed is False


def test_a_decision_as_plain_data() -> None:
    d = Run(facts(target=1)).tick(2.8)
    assert d.as_dict() == {
        "desired": 4,
        "stable": 4,
        "panic": 4,
        "panicking": True,  # 4 asked for against 1 ready: twice the threshold
        "floor": 1,  # no scale to zero: an autoscaled function keeps one
        "capped": False,
        "slowed": False,
        "fresh": False,
    }


@pytest.mark.parametrize(("warm", "floor"), [(True, 1), (False, 0)])
def test_adaptive_keep_alive_decides_the_floor_instead_of_the_request_clock(
    warm: bool, floor: int
) -> None:
    f = facts(target=1, scale_to_zero_after_s=3600.0)  # the request clock would keep one
    obs = Observation(1000.0, 0.0, last_request_at=999.0, warm=warm)
    d, _ = decide(POLICY, f, Window([(994.0, 0.0)], None, 900.0), obs)
    assert d.floor == floor and d.desired == floor


def test_the_policy_is_the_settings() -> None:
    settings = get_settings().model_copy(
        update={
            "autoscale_target_utilization": 0.5,
            "autoscale_stable_window_s": 30.0,
            "autoscale_panic_window_s": 3.0,
            "autoscale_panic_threshold": 3.0,
            "autoscale_max_scale_up_rate": 4.0,
            "autoscale_max_scale_down_rate": 5.0,
        }
    )
    assert Policy.from_settings(settings) == Policy(0.5, 30.0, 3.0, 3.0, 4.0, 5.0)


def test_a_state_without_samples_keeps_the_rest() -> None:
    assert Window.from_json(b'{"panic_since": 5.0, "first_seen": 1.0, "panic_pods": 2}') == (
        Window([], 5.0, 1.0, 2)
    )
    assert Window.from_json(b'{"samples": [[1.0, 2.0]], "first_seen": null}') == Window(
        [(1.0, 2.0)]
    )
