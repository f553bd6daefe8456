"""Knative's autoscaler scenarios, translated to corral's decision.

Each test names the Knative test it comes from (``pkg/autoscaler/scaling/autoscaler_test.go``
and the scale-to-zero path of ``pkg/reconciler/autoscaling/kpa/scaler.go``). Knative's
``TargetValue`` (concurrency one pod is meant to carry) is corral's ``exec_envs x
target_utilization``: these tests use a utilization of 1, so ``exec_envs`` *is* the
target value and a demand of 50 against a target of 10 asks for 5 replicas, as in Knative.

Two differences of model are kept in mind rather than papered over: Knative's stable
signal is the *mean* concurrency over the stable window, corral's the *largest* sample
(its scale-down delay), so where a Knative test sets a stable value below its panic value
the translation feeds samples with the same intent; and Knative's "reachable" flag has no
counterpart (a corral function is always reachable through its gateways).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from workers.autoscale.decision import Decision, Facts, Observation, Policy, Window, decide

KNATIVE = Policy(
    target_utilization=1.0,
    stable_window_s=60,
    panic_window_s=6,
    panic_threshold=2.0,
    max_scale_up_rate=10,
    max_scale_down_rate=10,
)
DEFAULTS = Policy()  # corral's defaults: Knative's max scale-down rate of 2.0
T0 = 10_000.0


def facts(
    target_value: int = 10, *, ready: int = 1, target: int | None = None, **kw: object
) -> Facts:
    """A function whose replica carries ``target_value`` requests (Knative's TargetValue)."""
    base: dict[str, object] = {
        "min_replicas": 0,
        "max_replicas": 10_000,
        "exec_envs": target_value,
        "ready": ready,
        "target": ready if target is None else target,
    }
    base.update(kw)
    return Facts(**base)  # type: ignore[arg-type]


def warm(at: float = T0, demand: float = 0.0) -> Window:
    """A window with history: one sample a panic window back, inside the stable window."""
    return Window([(at - 10.0, demand)], None, at - 600.0)


class Scaler:
    """One function's autoscaler over time: feeds samples, follows its own target.

    ``ready`` follows the last decision unless a step says otherwise (replicas become
    ready at once), as in Knative's tests where the fake pod counter is set by hand.
    """

    def __init__(
        self, f: Facts, policy: Policy = KNATIVE, window: Window | None = None, at: float = T0
    ) -> None:
        self.facts, self.policy, self.at = f, policy, at
        self.window = warm(at) if window is None else window
        self.last_request: float | None = None

    def step(
        self, demand: float, *, at: float | None = None, ready: int | None = None, dt: float = 2.0
    ) -> Decision:
        self.at = self.at + dt if at is None else at
        if demand > 0:
            self.last_request = self.at
        if ready is not None:
            self.facts = replace(self.facts, ready=ready)
        d, self.window = decide(
            self.policy, self.facts, self.window, Observation(self.at, demand, self.last_request)
        )
        self.facts = replace(
            self.facts, target=d.desired, ready=d.desired if ready is None else self.facts.ready
        )
        return d


# -- lost state: a new autoscaler starts in panic with the ready count as its floor ----------


@pytest.mark.parametrize("ready", [0, 1])
def test_start_in_panic_mode_not_at_zero_or_one(ready: int) -> None:
    """TestStartInPanicMode: created at scale 0 or 1, the autoscaler is not panicking."""
    d, after = decide(KNATIVE, facts(100, ready=ready), Window(), Observation(T0, 10.0))
    assert d.fresh and not d.panicking and after.panic_since is None
    assert d.desired == 1  # static demand 10 against a target of 100


def test_start_in_panic_mode_from_two_ready() -> None:
    """TestStartInPanicMode: created at scale 2, it panics with 2 as the floor."""
    d, after = decide(KNATIVE, facts(100, ready=2), Window(), Observation(T0, 10.0))
    assert d.fresh and d.panicking and after.panic_since == T0 and after.panic_pods == 2
    assert d.desired == 2  # the demand asks for 1, the floor holds the 2 ready


LOST = {
    "missing": None,
    "malformed": b"{not json",
    "wrong shape": b'{"samples": 3}',
    # beat was down for three minutes: the key survived but holds nothing recent
    "expired": Window([(T0 - 180.0, 70.0)], None, T0 - 3600.0).to_json().encode(),
}


@pytest.mark.parametrize("raw", LOST.values(), ids=LOST.keys())
def test_a_lost_window_never_scales_down_on_one_sample(raw: bytes | None) -> None:
    """corral issue 23: 10 ready and momentarily little demand must not drop to 2 at once."""
    f = facts(1, ready=10, scale_to_zero_after_s=30.0)
    d, window = decide(DEFAULTS, f, Window.from_json(raw), Observation(T0, 1.0, None))
    assert d.fresh and d.panicking
    assert d.desired == 10 and d.stable == 2  # one sample asks for 2; the floor is the 10 ready

    # the next, higher sample is no reason to churn: the target simply holds
    run = Scaler(replace(f, target=10), DEFAULTS, window)
    assert run.step(3.0).desired == 10
    # held for a whole stable window while the history fills again...
    held = [run.step(1.0).desired for _ in range(28)]
    assert set(held) == {10}
    # ...then down at the scale-down rate, never straight to what one sample asks for
    assert [run.step(1.0).desired for _ in range(4)] == [5, 2, 2, 2]


def test_a_lost_window_with_two_ready_keeps_both() -> None:
    """corral issue 23: 2 ready must not drop to 1 on one sample."""
    d, _ = decide(DEFAULTS, facts(1, ready=2), Window(), Observation(T0, 0.1))
    assert d.panicking and d.desired == 2


def test_a_lost_window_still_scales_up_at_once() -> None:
    """Panic never holds a rise back: a burst right after a restart is served."""
    d, _ = decide(KNATIVE, facts(10, ready=3), Window(), Observation(T0, 300.0))
    assert d.panicking and d.desired == 30


def test_a_function_at_zero_is_not_woken_without_demand() -> None:
    """AutoscalerNoDataAtZeroNoAutoscale: no data at zero, no scale.

    The window and the last-request key both expired: the request clock restarts, but a
    function that was scaled to zero stays there until a request comes.
    """
    parked = facts(10, ready=0, target=0, counted=0, at_zero=True, scale_to_zero_after_s=30.0)
    d, window = decide(DEFAULTS, parked, Window(), Observation(T0, 0.0, None))
    assert d.desired == 0 and d.floor == 0
    for i in range(1, 60):  # and stays there, pass after pass
        d, window = decide(DEFAULTS, parked, window, Observation(T0 + 2 * i, 0.0, None))
        assert d.desired == 0
    d, _ = decide(DEFAULTS, parked, window, Observation(T0 + 200, 3.0, T0 + 200))
    assert d.desired == 1  # demand wakes it


def test_a_new_function_gets_its_initial_replica() -> None:
    """Knative's initial scale of 1: a function never scaled is not "at zero" yet."""
    new = facts(10, ready=0, target=0, counted=0, scale_to_zero_after_s=30.0)
    d, _ = decide(DEFAULTS, new, Window(), Observation(T0, 0.0, None))
    assert d.desired == 1


# -- panic ------------------------------------------------------------------------------------


def test_panic_then_unpanic_scale_down() -> None:
    """TestAutoscalerPanicThenUnPanicScaleDown."""
    run = Scaler(facts(10, ready=1))
    assert run.step(100.0).desired == 10
    panic_at = run.at + 2
    d = run.step(1000.0, at=panic_at, ready=10)
    assert d.panicking and d.desired == 100
    # traffic dropped off: the scale stays while still in panic
    d = run.step(1.0, at=panic_at + 30, ready=10)
    assert d.panicking and d.desired == 100
    # scale down after the stable window
    d = run.step(1.0, at=panic_at + 61, ready=10)
    assert not d.panicking and d.desired == 1


def test_panic_mode_exponential_track_and_stabilize() -> None:
    """TestAutoscalerPanicModeExponentialTrackAndStabilize: 6, 36, 216, 1296 and hold.

    Knative sets the panic value itself; corral's is the mean of the panic window (6 s),
    so the samples are a panic window apart for each to be the panic value alone.
    """
    run = Scaler(facts(1, ready=1))
    assert run.step(6.0, dt=7).desired == 6
    for demand, ready in ((36.0, 6), (216.0, 36), (1296.0, 216)):
        d = run.step(demand, ready=ready, dt=7)
        assert d.panicking and d.desired == demand and run.window.panic_since == run.at
    d = run.step(1296.0, ready=1296, dt=7)
    assert d.desired == 1296


def test_extend_panic_window() -> None:
    """TestAutoscalerExtendPanicWindow: still surging, the panic time moves on."""
    run = Scaler(facts(1, ready=10))
    d = run.step(25.0, ready=10)
    assert d.panicking and d.desired == 25
    started = run.at
    d = run.step(80.0, at=started + 30, ready=40)
    assert d.desired == 80 and run.window.panic_since == started + 30


def test_unpanic_after_slow_increase() -> None:
    """TestAutoscalerUnpanicAfterSlowIncrease: the panic time stays; panic ends on time."""
    run = Scaler(facts(1, ready=10))
    d = run.step(25.0, ready=10)
    started = run.at
    assert d.panicking and d.desired == 25
    d = run.step(41.0, at=started + 30, ready=40)  # 41 < 2 x 40: not a new crossing
    assert d.panicking and d.desired == 41 and run.window.panic_since == started
    d = run.step(56.0, at=started + 62, ready=55)
    assert not d.panicking and run.window.panic_since is None
    assert d.desired == d.stable  # no longer held by panic


def test_panic_uses_the_stable_count_when_it_is_larger() -> None:
    """AutoscalerPanicStableLargerThanPanic: in panic, the larger of stable and panic."""
    window = Window([(T0 - 30, 50.0), (T0 - 2, 30.0)], T0 - 5, T0 - 600, 5)
    d, _ = decide(KNATIVE, facts(1, ready=5), window, Observation(T0, 30.0))
    assert d.panicking and d.stable == 50 and d.panic == 30 and d.desired == 50


def test_panic_mode_double_pod_count() -> None:
    """AutoscalerPanicModeDoublePodCount: a panic burst takes precedence."""
    d, _ = decide(KNATIVE, facts(10, ready=1), warm(), Observation(T0, 100.0))
    assert d.panicking and d.desired == 10


# -- the scale rates --------------------------------------------------------------------------


def test_rate_limit_scale_down() -> None:
    """TestAutoscalerRateLimitScaleDown: need 1 from 100 ready, at most /10 per pass."""
    run = Scaler(facts(10, ready=100))
    d = run.step(1.0, ready=100)
    assert d.desired == 10 and d.slowed
    d = run.step(1.0, ready=10)
    assert d.desired == 1 and not d.slowed


def test_scale_down_with_a_small_rate() -> None:
    """AutoscalerStableModeDecreaseWithSmallScaleDownRate: 100 ready, rate 1.1 -> 90."""
    run = Scaler(facts(10, ready=100), replace(KNATIVE, max_scale_down_rate=1.1))
    assert run.step(1.0, ready=100).desired == 90


def test_the_default_scale_down_rate_halves_per_pass_down_to_zero() -> None:
    """Knative's default max-scale-down-rate 2.0: 10, 5, 2, 1, 0 - never 10 to 0."""
    quiet = facts(1, ready=10, scale_to_zero_after_s=1.0)
    run = Scaler(quiet, DEFAULTS, Window([(T0 - 10.0, 0.0)], None, T0 - 600.0))
    assert [run.step(0.0).desired for _ in range(5)] == [5, 2, 1, 0, 0]


def test_stable_mode_decrease_within_the_rate() -> None:
    """TestAutoscalerStableModeDecrease: 100 -> 50 concurrency is 10 -> 5 pods."""
    run = Scaler(facts(10, ready=8), window=Window([(T0 - 70, 0.0)], None, T0 - 600))
    assert run.step(100.0, ready=8).desired == 10
    run.window = Window([(run.at - 61, 100.0), (run.at - 10, 50.0)], None, T0 - 600)
    assert run.step(50.0, ready=8).desired == 5


def test_rate_limit_scale_up() -> None:
    """TestAutoscalerRateLimitScaleUp: need 100 pods but only scale x10 per pass."""
    run = Scaler(facts(10, ready=1))
    d = run.step(1000.0, ready=1)
    assert d.desired == 10 and d.capped
    d = run.step(1000.0, ready=10)
    assert d.desired == 100


def test_one_pod_as_minimum_when_none_are_ready() -> None:
    """TestAutoscalerUseOnePodAsMinimumIfEndpointsNotFound: 0 ready counts as 1."""
    run = Scaler(facts(10, ready=0, target=0))
    assert run.step(888.0, ready=0).desired == 10


# -- scale to zero ----------------------------------------------------------------------------


def test_stable_mode_no_traffic_scale_to_zero_after_the_grace() -> None:
    """TestAutoscalerStableModeNoTrafficScaleToZero, with kpa's grace before zero.

    Knative keeps one pod until the revision was inactive for the grace period; corral's
    grace is ``scale_to_zero_after_s`` since the last request, and the stable window
    holds the last request's replica too.
    """
    run = Scaler(facts(10, ready=1, scale_to_zero_after_s=30.0), DEFAULTS)
    assert run.step(1.0).desired == 1
    last = run.at
    held = [run.step(0.0).desired for _ in range(29)]  # 58 s after the last request
    assert held == [1] * 29
    assert run.step(0.0).desired == 0 and run.at - last == 60


def test_grace_longer_than_the_stable_window() -> None:
    run = Scaler(facts(10, ready=1, scale_to_zero_after_s=120.0), DEFAULTS)
    run.step(1.0)
    last = run.at
    desired = [(run.step(0.0).desired, run.at - last) for _ in range(61)]
    assert all(d == 1 for d, since in desired if since < 120)
    assert all(d == 0 for d, since in desired if since >= 120)


def test_scale_to_zero_is_not_held_by_the_scale_down_rate() -> None:
    """One replica ready: floor(1 / 2) = 0, so the rate never keeps a last replica."""
    run = Scaler(
        facts(10, ready=1, scale_to_zero_after_s=1.0),
        DEFAULTS,
        Window([(T0 - 100.0, 0.0)], None, T0 - 600.0),
    )
    d = run.step(0.0)
    assert d.desired == 0 and not d.slowed
