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

Each application has at most one replica, and every decision is the fleet's own code
(:mod:`testkit.keepalive_replay`), taken at the moments its passes run: a reaper pass every
``CORRAL_REAP_INTERVAL_S`` (60 s), an autoscaler pass every ``CORRAL_AUTOSCALE_INTERVAL_S``
(2 s); a pre-warmed replica is ready ``--boot`` seconds after it is asked for. The policy's
knobs are the settings' (``CORRAL_KEEPALIVE_*``), so a changed setting is measured as it
would run.

The figures, per policy: **cold starts** - an invocation that found no ready replica -
as the paper reports them, the 75th percentile over applications of each application's
cold-start percentage, and in all; and **idle replica-time** - the time replicas exist
without running an invocation (their boot included), summed over applications. A plot of
the two (one point per policy) is written with ``--plot PATH`` when matplotlib is
installed (``pip install -e '.[bench]'``); the figures are printed either way.

The trace: ``--apps`` applications over ``--days`` days from ``--seed``, shaped as
:mod:`testkit.keepalive_replay` describes.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from config.settings import load_settings
from testkit.keepalive_replay import (
    BANDS,
    DAY,
    KINDS,
    App,
    Cadence,
    Outcome,
    Policy,
    Replay,
    workload,
)
from workers.autoscale.idletimes import Shape
from workers.autoscale.keepalive import KeepAlivePolicy

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


__all__ = ["Figures", "main", "replay_all", "report"]

if __name__ == "__main__":
    sys.exit(main())
