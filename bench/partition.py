"""corral on many hosts under a partition nemesis, judged by a checker.

Run: ``python -m bench.partition [--seed S] [--minutes M] [--agents N] [--json FILE]``
(root: it makes network namespaces; ``--ci`` is the short fixed run of
``tests/faults/test_partition.py``).

What it does, in order:

1. removes what an earlier run left (:func:`testkit.netns.cleanup_stale`);
2. builds the hosts (:mod:`testkit.netns`: a switch namespace and one namespace per host,
   each with its address in 10.231.0.0/24, agents with a replica network each) and
   starts corral on them (:mod:`testkit.nsfleet`): Redis, PostgreSQL, the registry, N
   fcdaemon agents (some seed-only) and a Lambdo host, two or more workers, beat and the
   gateway - every listener on its host's address and behind its token;
3. for ``--minutes``: the load generator (:class:`testkit.history.Load`: spawn, scale,
   delete, claim, re-deploy), gateway callers and a capacity sampler
   (:mod:`testkit.checker`) record a history while the nemesis (:mod:`testkit.nemesis`)
   partitions hosts, heals them, kills workers, freezes agents, sets a worker's clock
   off, stalls a worker's log pipe and restarts Redis and PostgreSQL on a schedule drawn
   from ``--seed``;
4. heals everything, stops the load, waits ``--quiet`` seconds, then checks the final
   state against the history until it is clean or ``--settle`` seconds have passed;
5. prints the figures (operations, calls, faults, anomalies) and tears everything down
   - also on Ctrl-C, SIGTERM or a failure. Exit status 0 only with no anomaly.

``--inject DEFECT`` runs the workers and the gateway with a known defect
(:mod:`bench.defects`), to show the checker catches it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from config.settings import get_settings
from testkit import checker, nemesis
from testkit.history import Load, Tracked, outcomes
from testkit.netns import Launcher, Network, available, cleanup, cleanup_stale
from testkit.nsfleet import FUNCTIONS, Fleet
from testkit.nsprocs import Layout
from testkit.services import make_shared_tempdir

CI = {
    "minutes": 0.75,
    "agents": 3,
    "seed_only": 1,
    "quiet": 10.0,
    "settle": 60.0,
    "seed_create_delay": nemesis.CI_SEED_CREATE_DELAY_S,
}


@dataclass
class Results:
    """The history's log and the run's figures."""

    minutes: float
    seed: int
    ops: list[Tracked] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    claims: Counter[str] = field(default_factory=Counter)
    figures: dict[str, Any] = field(default_factory=dict)
    anomalies: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No anomaly at all."""
        return bool(self.figures) and not any(self.anomalies.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            **self.figures,
            "anomalies": {k: len(v) for k, v in self.anomalies.items()},
            "examples": {k: v[:5] for k, v in self.anomalies.items() if v},
            "ok": self.ok,
        }


def _raise_on(signum: int, _frame: FrameType | None) -> None:
    """Stop the run (once: a second signal does not cut the teardown short)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def run(args: argparse.Namespace, say: Any = print) -> Results:
    """Build the fleet, run load, callers and nemesis, check, tear down; the results."""
    lay = Layout(args.workers, args.agents, args.seed_only, args.capacity)
    results = Results(args.minutes, args.seed)
    duration = args.minutes * 60
    faults = (
        nemesis.ci_schedule(duration, lay)
        if args.ci
        else nemesis.schedule(args.seed, duration, lay)
    )
    removed = cleanup_stale()
    if removed:
        say(f"removed {len(removed)} namespaces an earlier run left")
    tmp = make_shared_tempdir("corral-pt-")
    net = Network(str(os.getpid()))
    launcher: Launcher | None = None
    fleet: Fleet | None = None
    began, load0 = time.monotonic(), os.getloadavg()
    try:
        net.create(lay.hosts())
        launcher = Launcher(net)
        net.move_here("ctl")
        fleet = Fleet(
            lay, net, launcher, tmp, say, inject=args.inject, seed_delay=args.seed_create_delay
        )
        say(f"starting corral on {len(net.hosts)} hosts (logs under {tmp / 'logs'})")
        fleet.start()
        say(f"fleet up after {time.monotonic() - began:.0f}s; {len(faults)} faults scheduled")
        _exercise(args, fleet, net, faults, results, say, began, load0)
    finally:
        if fleet is not None:
            fleet.stop()
        if launcher is not None:
            launcher.close()
        cleanup(net.run, keep=os.getpid())
        if results.ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            say(f"logs kept under {tmp}")
    return results


def _exercise(  # noqa: PLR0913 - one run's parts
    args: argparse.Namespace,
    fleet: Fleet,
    net: Network,
    faults: list[nemesis.Fault],
    results: Results,
    say: Any,
    began: float,
    load0: tuple[float, float, float],
) -> None:
    """Load, callers, sampler and nemesis for the run's length; then heal, settle, check."""
    settings = get_settings()
    t0 = time.monotonic()
    load = Load(fleet.db, FUNCTIONS, results, args.rate, args.seed, t0)
    callers = checker.Callers(fleet, checker.call_deadline(settings), t0)
    sampler = checker.Sampler(
        fleet, t0, checker.vm_grace(settings), inflight_bound=settings.node_max_inflight
    )
    nem = nemesis.Nemesis(net, fleet, faults, t0, say)
    threads = [threading.Thread(target=t, daemon=True) for t in (load.run, sampler.run, nem.run)]
    for t in threads:
        t.start()
    threads += callers.start()
    try:
        while time.monotonic() < t0 + args.minutes * 60:
            fleet.supervise()
            time.sleep(1.0)
        load.stop.set()
        threads[2].join()  # every fault's window closes before the end
    finally:
        load.stop.set()
        callers.stop.set()
        nem.heal_all()
    say(f"[{time.monotonic() - t0:6.1f}s] healed; load stopped; quiet for {args.quiet:g}s")
    # the load's last action ends first: a claim it was still making would be held after
    # every other was released (cis656: 22 claimed, 21 released, one claim row left)
    threads[0].join(checker.call_deadline(settings) + 15)
    load.release_all(within_s=30)
    for t in threads:
        if t is not threads[1]:
            t.join(checker.call_deadline(settings) + 15)
    time.sleep(args.quiet)
    quiet_at = time.monotonic()
    while True:
        fleet.supervise()
        final = checker.final_state(fleet)
        if not any(final.values()) or time.monotonic() > quiet_at + args.settle:
            break
        time.sleep(3)
    settled = time.monotonic() - quiet_at if not any(final.values()) else None
    sampler.stop.set()
    threads[1].join(10)
    vms_over, vm_excess = sampler.vms_over()
    got = outcomes(fleet.db(), results.ops, args.minutes)
    results.anomalies = {
        "ops_failed_by_a_bug": checker.failed_by_a_bug(got.reasons),
        **final,
        "rows_over_capacity": sampler.rows_over,
        "vms_over_capacity": vms_over,
        **callers.anomalies(),
        **checker.cost_anomalies(fleet, settings, sampler),
        "nemesis_failed": [f"{d.fault}: {d.error}" for d in nem.done if d.error],
    }
    results.figures = {
        "seed": args.seed,
        "minutes": args.minutes,
        "hosts": sorted(net.hosts),
        "seed_only_agents": [a for a in fleet.layout.agent_names if fleet.layout.seed(a)],
        "load_average": {"start": load0, "end": os.getloadavg()},
        "submitted": len(results.ops),
        "final": dict(got.final),
        "failure_reasons": dict(got.reasons.most_common(8)),
        "refused": dict(results.refused),
        "producer_errors": dict(results.errors),
        "claims": dict(results.claims),
        "spawn_p50_s": got.spawn_p50_s,
        "spawn_p99_s": got.spawn_p99_s,
        "gateway": callers.figures(),
        "faults": nemesis.counts(nem.done),
        "samples": sampler.samples,
        "sample_errors": dict(sampler.errors),
        "peak_rows": dict(sampler.peak_rows),
        "peak_vms": dict(sampler.peak_vms),
        "vms_over_capacity_s": vm_excess,
        "worker_exits": list(fleet.exits),
        "hard_limit_restarts": fleet.hard_limit_restarts(),
        "op_bound_s": checker.op_bound(settings),
        "longest_op": [round(checker.longest_op(fleet)[0], 1), checker.longest_op(fleet)[1]],
        "settled_after_s": None if settled is None else round(settled, 1),
        "wall_s": round(time.monotonic() - began, 1),
    }


def report(results: Results) -> str:
    """The figures and anomalies as text."""
    f = results.figures
    if not f:
        return "RESULT: FAILED (the run did not get as far as its checks)"
    lines = [
        f"corral partition run: seed {f['seed']}, {f['minutes']:g} min, hosts {f['hosts']} "
        f"(seed-only: {f['seed_only_agents']}); load average {f['load_average']}",
        f"operations submitted: {f['submitted']}; final: {f['final']}; refused: {f['refused']}; "
        f"producer errors: {f['producer_errors']}; claims: {f['claims']}",
        *(f"  failed or partial ({n}): {r}" for r, n in f["failure_reasons"].items()),
        f"spawn completion p50 {f['spawn_p50_s']}, p99 {f['spawn_p99_s']}",
        f"gateway calls: {f['gateway']}",
        f"faults injected: {f['faults']}",
        f"capacity samples: {f['samples']} (errors {f['sample_errors']}); peak rows "
        f"{f['peak_rows']}; peak VMs {f['peak_vms']} (longest over capacity, s: "
        f"{f['vms_over_capacity_s']})",
        f"workers that exited by themselves (restarted): {f['worker_exits']}; restarted by "
        f"corral worker at a hard time limit: {f['hard_limit_restarts']}",
        f"longest operation: {f['longest_op'][0]}s ({f['longest_op'][1]}; bound "
        f"{f['op_bound_s']:g}s)",
        f"settled after the quiet period: {f['settled_after_s']}s; wall {f['wall_s']}s",
        "anomalies (all must be 0):",
    ]
    for kind, found in results.anomalies.items():
        lines.append(f"  {kind:<20} {len(found)}" + (f"   e.g. {found[:3]}" if found else ""))
    lines.append("RESULT: " + ("ok" if results.ok else "FAILED"))
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench.partition", description=__doc__.split("\n")[0]
    )
    p.add_argument("--seed", type=int, default=1, help="the nemesis schedule's and load's seed")
    p.add_argument("--minutes", type=float, default=5.0, help="load and faults for this long")
    p.add_argument(
        "--agents", type=int, default=6, help="fcdaemon agent hosts (plus a Lambdo host)"
    )
    p.add_argument("--seed-only", type=int, default=2, help="of which speak only the seed protocol")
    p.add_argument(
        "--seed-create-delay",
        type=float,
        default=0.0,
        help="seconds each create takes on the seed-only agents (fcdaemon --create-delay)",
    )
    p.add_argument("--workers", type=int, default=2, help="worker hosts")
    p.add_argument("--capacity", type=int, default=4, help="each node's capacity")
    p.add_argument("--rate", type=float, default=2.0, help="load actions per second")
    p.add_argument("--quiet", type=float, default=20.0, help="seconds of quiet after healing")
    p.add_argument("--settle", type=float, default=150.0, help="then wait this long to settle")
    p.add_argument("--ci", action="store_true", help="the short fixed run of the CI test")
    p.add_argument("--inject", help="run workers and gateway with this defect (bench.defects)")
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument("--keep", action="store_true", help="keep the logs even when the run passes")
    p.add_argument("--cleanup", action="store_true", help="only remove what earlier runs left")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run it and print the figures; 0 only with no anomaly."""
    args = parser().parse_args(argv)
    why = available()
    if why is not None:
        print(f"bench.partition: {why}", file=sys.stderr)
        return 2
    if args.cleanup:
        print(f"removed: {cleanup_stale()}")
        return 0
    if args.ci:
        for key, value in CI.items():
            setattr(args, key, value)
    if args.minutes <= 0 or args.agents < 2 or not 0 <= args.seed_only < args.agents:
        print(
            "bench.partition: need --minutes > 0 and 0 <= --seed-only < --agents", file=sys.stderr
        )
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on)
    results = Results(args.minutes, args.seed)
    try:
        results = run(args, say=lambda m: print(m, flush=True))
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'Ctrl-C'}); everything torn down", flush=True)
        return 130
    finally:
        with contextlib.suppress(Exception):
            print(report(results), flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps(results.as_dict(), indent=2, default=str))
    return 0 if results.ok else 1


if __name__ == "__main__":
    sys.exit(main())
