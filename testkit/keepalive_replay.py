"""A keep-alive trace and its replay through the fleet's own policy code, in simulated time.

The replay
----------
Each application has at most one replica, as in Shahrad et al.'s simulation ("Serverless
in the Wild", USENIX ATC 2020). :class:`Replay` runs the very code the fleet runs: every
idle time goes into a :class:`workers.autoscale.keepalive.IdleHistogram` (the class the
Redis script is tested against), and every decision is
:func:`workers.autoscale.keepalive.windows` plus
:meth:`~workers.autoscale.keepalive.Plan.release_before` (the reaper's idle selection) or
:meth:`~workers.autoscale.keepalive.Plan.warm` (the autoscaler's pre-warm), taken at the
moments those passes run (:class:`Cadence`), each application on its own phase. No
sleeping: a week replays in seconds. ``python -m bench.keepalive`` prints its figures
over a whole trace; the tests replay small traces to check what the policy does.

The trace
---------
:func:`workload`: ``apps`` applications over ``days`` days, from a seeded generator.
Each application's mean inter-arrival time follows the paper's CDF of
invocation rates - 45% of applications invoked at most once an hour on average, 81% at
most once a minute (log-uniform within each band; the busiest capped at 2 a minute, which
every policy keeps warm anyway) - and its kind the paper's mix of triggers and patterns:

* *timer* (35%): the cron-like period nearest that mean (1 minute to 1 day), each firing
  a few seconds late (half-normal, sigma 2 s + 0.5% of the period); 1 in 50 missed;
* *poisson* (35%): exponential inter-arrival times;
* *bursty* (15%): bursts of 2 to 20 calls 0.5 to 5 s apart, the bursts exponential;
* *heavy* (15%): Pareto inter-arrival times of shape 1.1 to 1.6.

Execution times are log-normal (median 0.7 s, sigma 2, at most 10 minutes): half under a
second, as in the paper. The first day is part of every replay: adaptive keep-alive has
to learn, and what it loses while learning is part of its cost.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workers.autoscale.idletimes import Shape
from workers.autoscale.keepalive import IdleHistogram, KeepAlivePolicy, Plan, Windows, windows

DAY = 86_400.0
KINDS = (("timer", 0.35), ("poisson", 0.35), ("bursty", 0.15), ("heavy", 0.15))
BANDS = (("> 1/min", 0.0, 60.0), ("1/min - 1/h", 60.0, 3600.0), ("< 1/h", 3600.0, math.inf))
TIMER_PERIODS_MIN = (1, 2, 5, 10, 15, 20, 30, 60, 120, 180, 240, 360, 720, 1440)


@dataclass(frozen=True)
class App:
    """One application of the trace: its kind and its invocations (arrival, duration)."""

    name: str
    kind: str
    calls: list[tuple[float, float]]

    @property
    def mean_gap_s(self) -> float:
        """Its mean inter-arrival time over the trace (the whole trace if one call)."""
        if len(self.calls) < 2:
            return math.inf
        return (self.calls[-1][0] - self.calls[0][0]) / (len(self.calls) - 1)


def workload(apps: int, days: float, seed: int) -> list[App]:
    """A trace of ``apps`` applications over ``days`` days (deterministic for a seed)."""
    rng = random.Random(seed)
    horizon = days * DAY
    out: list[App] = []
    kinds = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    for i in range(apps):
        kind = rng.choices(kinds, weights)[0]
        arrivals = ARRIVALS[kind](rng, horizon, mean_gap(rng))
        calls = [(a, min(600.0, rng.lognormvariate(math.log(0.7), 2.0))) for a in arrivals]
        out.append(App(f"{kind}-{i}", kind, calls))
    return out


def mean_gap(rng: random.Random) -> float:
    """An application's mean inter-arrival time, from the paper's CDF of invocation rates.

    45% of applications are invoked at most once an hour, 81% at most once a minute;
    the busiest are capped at 2 a minute (every policy keeps those warm anyway).
    """
    u = rng.random()
    lo, hi = (30.0, 60.0) if u < 0.19 else (60.0, 3600.0) if u < 0.55 else (3600.0, 2 * DAY)
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _timer(rng: random.Random, horizon: float, gap: float) -> list[float]:
    """A cron-like period (the one nearest ``gap``), each firing a little late, a few missed."""
    period = 60.0 * min(TIMER_PERIODS_MIN, key=lambda m: abs(math.log(60.0 * m / gap)))
    start = rng.uniform(0, period)
    sigma = 2.0 + 0.005 * period
    return [
        t
        for k in range(int((horizon - start) // period) + 1)
        if rng.random() >= 0.02
        and 0 <= (t := start + k * period + abs(rng.gauss(0, sigma))) < horizon
    ]


def _poisson(rng: random.Random, horizon: float, gap: float) -> list[float]:
    return _renewal(rng, horizon, lambda: rng.expovariate(1 / gap))


def _bursty(rng: random.Random, horizon: float, gap: float) -> list[float]:
    """Bursts of 2 to 20 calls 0.5 to 5 s apart; the bursts exponential, ``gap`` per call."""
    out: list[float] = []
    size = rng.randint(2, 20)
    t = rng.expovariate(1 / (gap * size))
    while t < horizon:
        for _ in range(size):
            if t >= horizon:
                break
            out.append(t)
            t += rng.uniform(0.5, 5.0)
        t += rng.expovariate(1 / (gap * size))
    return out


def _heavy(rng: random.Random, horizon: float, gap: float) -> list[float]:
    """Pareto inter-arrival times of shape 1.1 to 1.6 and mean ``gap``."""
    shape = rng.uniform(1.1, 1.6)
    scale = gap * (shape - 1) / shape
    return _renewal(rng, horizon, lambda: scale * rng.paretovariate(shape))


def _renewal(rng: random.Random, horizon: float, gap: Callable[[], float]) -> list[float]:
    out: list[float] = []
    t = rng.uniform(0, 60)
    while t < horizon:
        out.append(t)
        t += gap()
    return out


ARRIVALS = {"timer": _timer, "poisson": _poisson, "bursty": _bursty, "heavy": _heavy}


# -- the replay ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cadence:
    """When the fleet's passes run, and how long a replica takes to be ready."""

    reap_s: float = 60.0
    autoscale_s: float = 2.0
    boot_s: float = 2.0


@dataclass(frozen=True)
class Policy:
    """One keep-alive policy: a fixed idle timeout, and the adaptive policy on top (or not)."""

    label: str
    fixed_s: float
    adaptive: KeepAlivePolicy | None = None


@dataclass
class Replica:
    """An application's one replica."""

    spawned: float
    ready: float
    idle_since: float  # the end of its last invocation, or when it became ready
    busy_until: float


@dataclass
class Outcome:
    """One application under one policy."""

    calls: int = 0
    cold: int = 0
    alive_s: float = 0.0
    busy_s: float = 0.0
    prewarms: int = 0
    modes: dict[str, int] = field(default_factory=dict)  # decisions taken in each mode

    @property
    def idle_s(self) -> float:
        """Replica time without an invocation running (boots included)."""
        return self.alive_s - self.busy_s

    @property
    def cold_pct(self) -> float:
        """Cold starts as a percentage of its invocations."""
        return 100.0 * self.cold / self.calls if self.calls else 0.0


class Replay:
    """One application replayed under one policy, pass by pass where passes matter."""

    def __init__(
        self, policy: Policy, shape: Shape, cadence: Cadence, phase: float, horizon: float
    ) -> None:
        self.policy, self.shape, self.cadence = policy, shape, cadence
        self.phase, self.horizon = phase, horizon
        self.hist = IdleHistogram.empty(shape.bin_s, shape.range_s)
        self.last_end: float | None = None
        self.replica: Replica | None = None
        self.out = Outcome()
        self._windows: Windows | None = None  # for the histogram as it stands

    def run(self, calls: Sequence[tuple[float, float]]) -> Outcome:
        """Every invocation in order, the passes between them, and the end of the trace."""
        now = 0.0
        for arrival, duration in calls:
            now = self._between(now, arrival)
            self._call(arrival, duration)
        self._between(now, self.horizon)
        if self.replica is not None:
            self.out.alive_s += self.horizon - self.replica.spawned
        return self.out

    # -- the fleet's passes between two arrivals ---------------------------------------------

    def _between(self, now: float, until: float) -> float:
        """Run the reaper's and the autoscaler's passes over [now, until)."""
        while now < until:
            if self.replica is not None:
                gone = self._reaped(now, until)
                if gone is None:
                    return until
                self.out.alive_s += gone - self.replica.spawned
                self.replica, now = None, gone
            else:
                warm_at = self._prewarmed(now, until)
                if warm_at is None:
                    return until
                ready = warm_at + self.cadence.boot_s
                self.replica = Replica(warm_at, ready, ready, ready)
                self.out.prewarms += 1
                now = warm_at
        return until

    def _plan(self) -> Plan | None:
        if self.policy.adaptive is None:
            return None
        if self._windows is None:
            self._windows = windows(self.policy.adaptive, self.hist)
        return Plan(self._windows, self.last_end)

    def _reaped(self, now: float, until: float) -> float | None:
        """The first reaper pass in [now, until) that deletes the replica, if any."""
        replica = self.replica
        assert replica is not None
        start = max(now, replica.busy_until)
        plan = self._plan()
        moments = [start, replica.idle_since + self.policy.fixed_s]
        if plan is not None and plan.windows.keep_s is not None:
            keep = plan.windows.keep_s
            moments += [replica.idle_since + keep]
            if self.last_end is not None:
                moments += [self.last_end + plan.windows.prewarm_s, self.last_end + keep]
        for moment in sorted(m for m in moments if m >= start):
            tick = self._next_tick(moment, self.cadence.reap_s)
            if tick >= until:
                break
            if self._reaper_deletes(plan, replica, tick):
                return tick
        return None

    def _reaper_deletes(self, plan: Plan | None, replica: Replica, at: float) -> bool:
        """What the reaper's idle selection decides for this replica at ``at``."""
        cutoff = None if plan is None else plan.release_before(at)
        mode = "fixed" if cutoff is None else plan.windows.mode  # type: ignore[union-attr]
        self.out.modes[mode] = self.out.modes.get(mode, 0) + 1
        if cutoff is None:  # the fixed rule: reap_at = idle since + the idle timeout
            return replica.idle_since + self.policy.fixed_s <= at
        return replica.idle_since <= cutoff

    def _prewarmed(self, now: float, until: float) -> float | None:
        """The first autoscaler pass in [now, until) that asks for a replica, if any."""
        plan = self._plan()
        if plan is None or plan.last is None or plan.windows.keep_s is None:
            return None
        tick = self._next_tick(
            max(now, plan.last + plan.windows.prewarm_s), self.cadence.autoscale_s
        )
        if tick < until and plan.warm(tick):
            return tick
        return None

    def _next_tick(self, at: float, every: float) -> float:
        """The first pass at or after ``at`` on this application's grid."""
        return self.phase * every + math.ceil((at - self.phase * every) / every) * every

    # -- one invocation ----------------------------------------------------------------------

    def _call(self, arrival: float, duration: float) -> None:
        self.out.calls += 1
        replica = self.replica
        if replica is None or replica.ready > arrival:
            self.out.cold += 1
            if replica is None:
                ready = arrival + self.cadence.boot_s
                replica = self.replica = Replica(arrival, ready, ready, ready)
        start = max(arrival, replica.ready)
        end = start + duration
        self.out.busy_s += max(0.0, end - max(start, replica.busy_until))
        replica.busy_until = max(replica.busy_until, end)
        replica.idle_since = replica.busy_until
        if self.last_end is not None:  # the idle time, as the gateway records it
            self.hist.add(arrival - self.last_end, self.shape.history)
            self._windows = None
        self.last_end = max(self.last_end or end, end)
