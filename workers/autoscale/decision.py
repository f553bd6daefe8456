"""The autoscaler's decision: from a function's demand over time to a replica target.

Pure and typed: no store, no Redis, no clock. :func:`decide` takes a function's
facts (:class:`Facts`, from the store), its window state (:class:`Window`, kept
between passes) and this pass's observation (:class:`Observation`, from the
gateways' demand, :mod:`workers.autoscale.demand`), and returns the target to set and the
new window state. :mod:`workers.autoscale.passes` does the I/O around it.

The model (Knative's, with corral's units)
------------------------------------------
* **Observed demand** is the requests in flight plus those queued for an
  execution environment, summed over every gateway (their time-weighted
  ``concurrency``). One replica serves ``exec_envs`` requests at once and is
  meant to run at ``target_utilization`` (0.7) of that, so the demand of one
  sample asks for ``ceil(demand / (exec_envs x 0.7))`` replicas.
* **Stable window** (60 s): the target is the *largest* such count over the
  samples of the last ``stable_window_s``. A rise shows at once (the newest
  sample is in the window), a fall only after the whole window has seen less:
  scale-up is immediate, scale-down waits out the window (Knative's
  scale-down delay).
* **Scale-up rate**: one pass raises the target to at most
  ``max_scale_up_rate`` x the ready replicas (at least 1 counted), never lower
  than the current target: a burst cannot ask for a thousand VMs off one sample.
* **Scale-down rate**: one pass lowers the target to no less than the ready
  replicas divided by ``max_scale_down_rate`` (Knative's default 2.0: at most
  halve per pass), so a function with 10 ready replicas goes 10, 5, 2, 1 and
  not 10, 1; one replica ready (or none) may still go to zero.
* **Panic mode**: the *panic window* (6 s) averages the recent samples; when
  that asks for at least ``panic_threshold`` (2) x the ready replicas, the
  function panics. While panicking the target never goes down (it stays at least
  the current target and the largest the panic asked for); panic ends once a
  whole stable window has passed without crossing the threshold again.
* **Lost state**: the window lives in Redis between passes and can be lost (it
  expired while beat was down, Redis lost it, it is malformed), or hold nothing
  recent enough to count. A window with no sample inside the stable window is
  *fresh*, and one sample is no basis for a scale-down: like a new Knative
  autoscaler, a fresh window with more than one replica ready starts in panic
  mode with the ready replicas as the floor, so the function keeps what it has
  for a stable window while the history fills again (it still scales up at
  once).
* **Bounds**: the result is clamped to ``[floor, max]``. The floor is the
  function's min, raised to 1 unless the function may go to zero: it has a
  ``scale_to_zero_after_s`` and no request arrived in that long (the newest
  request at any gateway, or since the autoscaler first saw it if none ever
  did). Demand still in flight keeps the stable window above zero, so a long
  request is never scaled away under. A function already at zero (its target
  0, nothing running) stays there until demand arrives: a lost request clock
  does not wake it. With adaptive keep-alive (``Observation.warm``) the function's
  keep-alive windows (:mod:`workers.autoscale.keepalive`) decide instead of the
  request clock: one replica while the next call is due - started before it when the
  pattern is clear (pre-warming, also from zero) - none outside those windows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# A demand within this of a whole number of replicas does not ask for one more
# (0.7 x 3 envs is 2.0999999999999996 in floating point).
EPSILON = 1e-9


@dataclass(frozen=True)
class Policy:
    """The autoscaler's knobs (``CORRAL_AUTOSCALE_*``)."""

    target_utilization: float = 0.7
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 10.0
    max_scale_down_rate: float = 2.0

    @classmethod
    def from_settings(cls, settings: Any) -> Policy:
        """The policy of a :class:`config.settings.Settings`."""
        return cls(
            target_utilization=settings.autoscale_target_utilization,
            stable_window_s=settings.autoscale_stable_window_s,
            panic_window_s=settings.autoscale_panic_window_s,
            panic_threshold=settings.autoscale_panic_threshold,
            max_scale_up_rate=settings.autoscale_max_scale_up_rate,
            max_scale_down_rate=settings.autoscale_max_scale_down_rate,
        )


@dataclass(frozen=True)
class Facts:
    """What the store says about one function now."""

    min_replicas: int
    max_replicas: int
    exec_envs: int  # requests one replica serves at once
    ready: int  # replicas Idle or Allocated
    target: int  # the target now (the last scale's, or the replica count if never scaled)
    scale_to_zero_after_s: float | None = None
    counted: int | None = None  # replicas Creating, Starting, Idle or Allocated (None: target)
    at_zero: bool = False  # scaled to zero (target 0) and nothing counted: parked


@dataclass(frozen=True)
class Observation:
    """One pass's reading of the gateways' demand for one function."""

    at: float  # epoch seconds
    demand: float  # in flight + queued, summed over gateways
    last_request_at: float | None = None  # newest request at any gateway, epoch seconds
    # adaptive keep-alive (workers.autoscale.keepalive): one replica wanted now or not;
    # None: the request clock and scale_to_zero_after_s decide
    warm: bool | None = None


@dataclass
class Window:
    """A function's state between passes: recent samples and panic mode."""

    samples: list[tuple[float, float]] = field(default_factory=list)  # (at, demand), oldest first
    panic_since: float | None = None  # when the threshold was last crossed, while panicking
    first_seen: float | None = None  # the first pass that saw this function
    panic_pods: int = 0  # while panicking: the most replicas the panic asked for (the floor)

    def to_json(self) -> str:
        """The state as a JSON document (kept in Redis between passes)."""
        return json.dumps(
            {
                "samples": self.samples,
                "panic_since": self.panic_since,
                "first_seen": self.first_seen,
                "panic_pods": self.panic_pods,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> Window:
        """A state read back; missing or malformed data is a fresh window."""
        if not raw:
            return cls()
        try:
            data = json.loads(raw)
            samples = [(_finite(a), _finite(d)) for a, d in data.get("samples", [])]
            panic = data.get("panic_since")
            first = data.get("first_seen")
            pods = data.get("panic_pods", 0)
            if isinstance(pods, bool) or not isinstance(pods, int) or pods < 0:
                raise ValueError(f"panic_pods {pods!r}")  # pragma: no mutate - never shown
            return cls(
                samples,
                None if panic is None else _finite(panic),
                None if first is None else _finite(first),
                pods,
            )
        except (ValueError, TypeError, AttributeError):
            return cls()


def _finite(value: Any) -> float:
    """``value`` as a finite float, else ValueError (JSON may say NaN or Infinity)."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {value!r}")  # pragma: no mutate - never shown
    return number


@dataclass(frozen=True)
class Decision:
    """What one pass decided for one function, and why."""

    desired: int  # the target to hold
    stable: int  # replicas the stable window asks for (max over its samples)
    panic: int  # replicas the panic window asks for (its mean)
    panicking: bool
    floor: int  # the lower bound applied (min, 1, or 0 when allowed to go to zero)
    capped: bool  # the scale-up rate limited the rise
    slowed: bool = False  # the scale-down rate limited the fall
    fresh: bool = False  # no history: a new or lost window (panic with the ready as floor)

    def as_dict(self) -> dict[str, Any]:
        """The decision as plain data (task results, logs)."""
        return {
            "desired": self.desired,
            "stable": self.stable,
            "panic": self.panic,
            "panicking": self.panicking,
            "floor": self.floor,
            "capped": self.capped,
            "slowed": self.slowed,
            "fresh": self.fresh,
        }


def replicas_for(demand: float, exec_envs: int, utilization: float) -> int:
    """Replicas that serve ``demand`` concurrent requests at the target utilization."""
    return max(0, math.ceil(demand / (max(1, exec_envs) * utilization) - EPSILON))


def decide(
    policy: Policy, facts: Facts, window: Window, obs: Observation
) -> tuple[Decision, Window]:
    """The target for this pass and the window state to keep for the next."""
    now = obs.at
    horizon = now - policy.stable_window_s
    samples = [(a, d) for a, d in window.samples if horizon < a <= now]
    fresh = not samples  # nothing recent to judge by: lost, expired, or new
    samples.append((now, max(0.0, obs.demand)))
    first_seen = window.first_seen if window.first_seen is not None else now

    def need(demand: float) -> int:
        return replicas_for(demand, facts.exec_envs, policy.target_utilization)

    stable = max(need(d) for _, d in samples)
    recent = [d for a, d in samples if a > now - policy.panic_window_s]
    panic = need(sum(recent) / len(recent))
    ready = max(1, facts.ready)

    panic_since, panic_pods = window.panic_since, window.panic_pods
    if fresh and facts.ready > 1:
        # Knative's new autoscaler: start in panic, the replicas ready now as the floor.
        panic_since, panic_pods = now, max(panic_pods, facts.ready)
    if panic >= policy.panic_threshold * ready:
        panic_since = now  # enter panic, or stay in it
    elif panic_since is not None and now - panic_since >= policy.stable_window_s:
        panic_since, panic_pods = None, 0  # a whole stable window without crossing: calm again
    panicking = panic_since is not None

    desired = max(stable, panic)
    slowed = False
    least = math.floor(ready / policy.max_scale_down_rate)
    if desired < least:
        desired, slowed = least, True  # at most the scale-down rate per pass
    if panicking:
        desired = max(desired, facts.target, panic_pods)  # never scale down in panic
        panic_pods = desired
    capped = False
    ceiling = max(facts.target, math.ceil(ready * policy.max_scale_up_rate))
    if desired > ceiling:  # a rise past the scale-up rate (never below the target)
        desired, capped = ceiling, True

    floor = floor_for(facts, first_seen, obs)
    desired = max(floor, min(desired, facts.max_replicas))
    decision = Decision(desired, stable, panic, panicking, floor, capped, slowed, fresh)
    return decision, Window(samples, panic_since, first_seen, panic_pods)


def floor_for(facts: Facts, first_seen: float, obs: Observation) -> int:
    """The least replicas to keep: min, raised to 1 unless the function may be at zero now."""
    floor = facts.min_replicas
    after = facts.scale_to_zero_after_s
    quiet_since = obs.last_request_at if obs.last_request_at is not None else first_seen
    if after is None:
        may_be_zero = False  # pragma: no mutate - read as a boolean: None is the same
    elif obs.warm is not None:  # adaptive keep-alive: its windows, not the request clock
        may_be_zero = not obs.warm
    else:
        may_be_zero = facts.at_zero or obs.at - quiet_since >= after
    if not may_be_zero:
        floor = max(floor, 1)
    return min(floor, facts.max_replicas)


def should_scale(decision: Decision, facts: Facts, scale_open: bool) -> bool:
    """Whether to ask for a scale: no scale of the function is open, and the target moves
    or fewer replicas exist than it (the reaper took some, spawns failed)."""
    if scale_open:
        return False
    counted = facts.target if facts.counted is None else facts.counted
    return decision.desired != facts.target or decision.desired > counted
