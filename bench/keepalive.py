"""``python -m bench.keepalive``: fixed 10 and 20 minutes against adaptive keep-alive, on a trace.

What it measures
----------------
A synthetic trace shaped like Azure Functions' production workload as Shahrad et al.
characterise it ("Serverless in the Wild", USENIX ATC 2020) is replayed in simulated time
- no sleeping - through three keep-alive policies:

* **fixed 10 min** and **fixed 20 min**: an idle replica is reaped once it has been idle
  that long (AWS Lambda's and Azure Functions' windows; corral's ``--idle-timeout``);
* **adaptive**: corral's ``--keep-alive adaptive`` with its defaults (fixed 10 minutes
  while a function's histogram is not representative).

Each application has at most one replica, as in the paper's simulation. The replay runs
the very code the fleet runs: every idle time goes into a
:class:`workers.autoscale.keepalive.IdleHistogram` (the class the Redis script is tested
against), and every decision is :func:`workers.autoscale.keepalive.windows` plus
:meth:`~workers.autoscale.keepalive.Plan.release_before` (the reaper's idle selection)
or :meth:`~workers.autoscale.keepalive.Plan.warm` (the autoscaler's pre-warm), taken at
the moments those passes run: a reaper pass every ``CORRAL_REAP_INTERVAL_S`` (60 s), an
autoscaler pass every ``CORRAL_AUTOSCALE_INTERVAL_S`` (2 s), each application on its own
phase; a pre-warmed replica is ready ``--boot`` seconds after it is asked for. The
policy's knobs are the settings' (``CORRAL_KEEPALIVE_*``), so a changed setting is
measured as it would run.

The figures, per policy: **cold starts** - an invocation that found no ready replica -
as the paper reports them, the 75th percentile over applications of each application's
cold-start percentage, and in all; and **idle replica-time** - the time replicas exist
without running an invocation (their boot included), summed over applications. A plot of
the two (one point per policy) is written with ``--plot PATH`` when matplotlib is
installed (``pip install -e '.[bench]'``); the figures are printed either way.

The trace
---------
``--apps`` applications (default 400) over ``--days`` days (7), from a seeded generator
(``--seed``). Each application's mean inter-arrival time follows the paper's CDF of
invocation rates - 45% of applications invoked at most once an hour on average, 81% at
most once a minute (log-uniform within each band; the busiest capped at 2 a minute, which
every policy keeps warm anyway) - and its kind the paper's mix of triggers and patterns:

* *timer* (35%): the cron-like period nearest that mean (1 minute to 1 day), each firing
  a few seconds late (half-normal, sigma 2 s + 0.5% of the period); 1 in 50 missed;
* *poisson* (35%): exponential inter-arrival times;
* *bursty* (15%): bursts of 2 to 20 calls 0.5 to 5 s apart, the bursts exponential;
* *heavy* (15%): Pareto inter-arrival times of shape 1.1 to 1.6.

Execution times are log-normal (median 0.7 s, sigma 2, at most 10 minutes): half under a
second, as in the paper. The first day is included in the figures: adaptive keep-alive
has to learn, and what it loses while learning is part of its cost.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from config.settings import load_settings
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


# -- figures -------------------------------------------------------------------------------------


@dataclass
class Figures:
    """One policy over the whole trace."""

    policy: str
    outcomes: dict[str, Outcome]  # by application

    def select(self, apps: Sequence[App]) -> list[Outcome]:
        """The outcomes of these applications."""
        return [self.outcomes[a.name] for a in apps]

    @staticmethod
    def p75_cold(outcomes: Sequence[Outcome]) -> float:
        """The 75th percentile of the applications' cold-start percentages."""
        pcts = sorted(o.cold_pct for o in outcomes if o.calls)
        if not pcts:
            return 0.0
        return pcts[min(len(pcts) - 1, math.ceil(0.75 * len(pcts)) - 1)]

    @staticmethod
    def idle_hours(outcomes: Sequence[Outcome]) -> float:
        """Idle replica-time, in hours."""
        return sum(o.idle_s for o in outcomes) / 3600


def replay_all(  # noqa: PLR0913 - the replay's inputs, by name
    apps: Sequence[App],
    policies: Sequence[Policy],
    shape: Shape,
    cadence: Cadence,
    horizon: float,
    seed: int,
) -> list[Figures]:
    """Every application under every policy."""
    rng = random.Random(seed + 1)
    phases = {a.name: rng.random() for a in apps}
    return [
        Figures(
            p.label,
            {a.name: Replay(p, shape, cadence, phases[a.name], horizon).run(a.calls) for a in apps},
        )
        for p in policies
    ]


def report(apps: Sequence[App], figures: Sequence[Figures], days: float, elapsed: float) -> str:
    """The figures as text."""
    calls = sum(len(a.calls) for a in apps)
    gaps = [a.mean_gap_s for a in apps]
    hourly = sum(1 for g in gaps if g >= 3600) / len(apps)
    minutely = sum(1 for g in gaps if g >= 60) / len(apps)
    base = figures[0]
    lines = [
        f"trace: {len(apps)} applications, {calls:,} invocations over {days:g} days "
        f"(replayed in {elapsed:.1f} s); invoked at most hourly on average: "
        f"{100 * hourly:.0f}%, at most once a minute: {100 * minutely:.0f}%",
        "",
        f"{'policy':<16}{'cold starts p75':>16}{'cold starts':>20}"
        f"{'idle replica-h':>16}{'vs ' + base.policy:>20}",
    ]
    for f in figures:
        every = f.select(apps)
        cold = sum(o.cold for o in every)
        idle = Figures.idle_hours(every)
        lines.append(
            f"{f.policy:<16}{Figures.p75_cold(every):>15.1f}%"
            f"{cold:>12,} ({100 * cold / calls:4.1f}%)"
            f"{idle:>16,.1f}{100 * idle / Figures.idle_hours(base.select(apps)):>19.0f}%"
        )
    groups: list[tuple[str, list[App]]] = [(k, [a for a in apps if a.kind == k]) for k, _ in KINDS]
    groups += [
        (
            band,
            [a for a in apps if low <= a.mean_gap_s and (a.mean_gap_s < high or high == math.inf)],
        )
        for band, low, high in BANDS
    ]
    lines += [
        "",
        "by kind of application, and by how often it is called: "
        "cold starts p75 / idle replica-hours",
    ]
    header = f"{'':<14}{'apps':>6}"
    for f in figures:
        header += f"{f.policy:>26}"
    lines.append(header)
    for label, members in groups:
        row = f"{label:<14}{len(members):>6}"
        for f in figures:
            sel = f.select(members)
            row += f"{Figures.p75_cold(sel):>13.1f}% / {Figures.idle_hours(sel):>8,.1f}"
        lines.append(row)
    adaptive = figures[-1].select(apps)
    modes: dict[str, int] = {}
    for o in adaptive:
        for mode, n in o.modes.items():
            modes[mode] = modes.get(mode, 0) + n
    total = sum(modes.values()) or 1
    lines += [
        "",
        f"{figures[-1].policy}: reaper decisions by mode "
        + ", ".join(f"{m} {100 * n / total:.0f}%" for m, n in sorted(modes.items()))
        + f"; pre-warms {sum(o.prewarms for o in adaptive):,}",
    ]
    return "\n".join(lines)


def plot(figures: Sequence[Figures], apps: Sequence[App], path: Path) -> str:
    """Cold starts against idle replica-time, one point per policy, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            f"no plot: matplotlib is not installed (pip install -e '.[bench]'); {path} not written"
        )
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    base = Figures.idle_hours(figures[0].select(apps))
    calls = sum(len(a.calls) for a in apps)
    idle = [100 * Figures.idle_hours(f.select(apps)) / base for f in figures]
    p75 = [Figures.p75_cold(f.select(apps)) for f in figures]
    every = [100 * sum(o.cold for o in f.select(apps)) / calls for f in figures]
    for ax, cold, label in (
        (axes[0], p75, "cold starts, 75th percentile of applications (%)"),
        (axes[1], every, "cold starts, all invocations (%)"),
    ):
        for i, f in enumerate(figures):
            ax.scatter([idle[i]], [cold[i]], s=60)
            ax.annotate(
                f.policy,
                (idle[i], cold[i]),
                textcoords="offset points",
                xytext=(8, 8 if i % 2 == 0 else -14),
            )
        ax.set_xlabel(f"idle replica-time (% of {figures[0].policy})")
        ax.set_ylabel(label)
        ax.set_xlim(0, 1.35 * max(idle))
        ax.set_ylim(0, 1.15 * max(max(cold), 1e-9))
        ax.grid(alpha=0.3)
    fig.suptitle("Keep-alive policies on the replayed trace (lower left is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv: Sequence[str] | None = None) -> int:
    """Replay the trace under the three policies and print the figures."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.keepalive", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--apps", type=int, default=400, help="applications (default 400)")
    parser.add_argument("--days", type=float, default=7.0, help="days of trace (default 7)")
    parser.add_argument("--seed", type=int, default=2020, help="the trace's seed (default 2020)")
    parser.add_argument(
        "--boot",
        type=float,
        default=2.0,
        help="seconds from asking for a replica to it being ready (default 2)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="write cold starts against idle time as a PNG (needs matplotlib)",
    )
    args = parser.parse_args(argv)
    if args.apps < 1 or args.days <= 0 or args.boot < 0:
        parser.error("--apps must be at least 1, --days above 0, --boot not negative")
    settings = load_settings()
    shape = Shape.from_settings(settings)
    cadence = Cadence(settings.reap_interval_s, settings.autoscale_interval_s, args.boot)
    fixed = settings.idle_timeout_s if settings.idle_timeout_s > 0 else 600.0
    policies = [
        Policy("fixed 10 min", 600.0),
        Policy("fixed 20 min", 1200.0),
        Policy("adaptive", fixed, KeepAlivePolicy.from_settings(settings)),
    ]
    started = time.perf_counter()
    apps = workload(args.apps, args.days, args.seed)
    figures = replay_all(apps, policies, shape, cadence, args.days * DAY, args.seed)
    print(report(apps, figures, args.days, time.perf_counter() - started))
    if args.plot is not None:
        print(plot(figures, apps, args.plot))
    return 0


__all__ = ["App", "Cadence", "Figures", "Policy", "Replay", "main", "replay_all", "workload"]

if __name__ == "__main__":
    sys.exit(main())
