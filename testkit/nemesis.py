"""The nemesis: a schedule of faults drawn from a seed, and the thread that carries it out.

Kinds of fault (every one ends before the run does; :meth:`Nemesis.heal_all` undoes
whatever an interrupted run left):

========================  ==============================================================
``isolate HOST``          the host's cable out (its switch port down): nothing in or out
``cut A B``               a symmetric partition between two hosts (each drops what it
                          sends the other): a worker from Redis or PostgreSQL, a worker
                          or the gateway from an agent, an agent from the registry...
``unreachable AGENT``     the agent reaches everyone (the registry takes its heartbeats
                          and READYs), no one reaches it or its replicas (its listeners'
                          answers are dropped)
``kill WORKER...``        SIGKILL of each worker's process group; new workers start on
                          the same hosts at once
``freeze AGENT``          SIGSTOP of the agent (its VMs run on), SIGCONT at the end
``redis``                 the broker stopped, then started on the same address
``postgres``              the store restarted
``skew WORKER``           the worker host's wall clock ``offset_s`` off (its Python's
                          ``time.time``; the monotonic clock runs on), put right at the end
``stall WORKER``          the worker's log pipe not read (its writes block once the
                          pipe's 4 KiB are full), read again at the end
``spawns FUNCTION``       not a fault: ``count`` replicas of the function asked for at
                          once (the CI schedule's, so that creates are in flight to the
                          agent it has just frozen; a round-robin function reaches it)
========================  ==============================================================

The first four are *partitions*. The ``ctl`` host (the harness) is never cut from the
gateway, so every gateway call the harness makes can be judged by its answer. The
schedule is a pure function of the seed and the layout (:func:`schedule`); the CI
schedule (:func:`ci_schedule`) is fixed: a seed agent frozen while creates are in
flight and every worker killed meanwhile, a worker's clock off, its log pipe stalled,
the seed agent's host isolated, then a worker cut from Redis.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from corral import api
from testkit.netns import Block, Network
from testkit.nsfleet import Fleet
from testkit.nsprocs import AGENT_PORT, REPLICA_PORT_MASK, Layout

PARTITIONS = ("isolate", "cut", "unreachable")
KINDS = (*PARTITIONS, "kill", "freeze", "redis", "postgres", "skew", "stall", "spawns")
CI_SEED_CREATE_DELAY_S = 4.0  # the short run's seed agent: each create takes this long
SKEWS_S = (-8.0, 8.0, 30.0, 600.0)  # a clock a little off either way, and far ahead
LONG_S = (65.0, 85.0)  # a partition longer than the soak's dead grace (60 s): replicas lost


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule: when (seconds into the run), what, on whom, for how long."""

    at_s: float
    kind: str
    targets: tuple[str, ...] = ()
    duration_s: float = 0.0
    offset_s: float = 0.0  # a skew's
    count: int = 0  # spawns'

    def __str__(self) -> str:
        who = " ".join(self.targets)
        off = f" {self.offset_s:+.0f}s" if self.kind == "skew" else ""
        off += f" x{self.count}" if self.kind == "spawns" else ""
        took = f" for {self.duration_s:.0f}s" if self.duration_s else ""
        return f"{self.kind}{' ' + who if who else ''}{off}{took}"


def _pairs(lay: Layout) -> list[tuple[str, str]]:
    """The host pairs a ``cut`` may separate."""
    agents = [*lay.agent_names, "lb"]
    pairs = [(w, s) for w in lay.worker_names for s in ("redis", "pg")]
    pairs += [(w, a) for w in lay.worker_names for a in agents]
    pairs += [("gw", a) for a in agents] + [("gw", "pg"), ("gw", "redis")]
    pairs += [(a, "reg") for a in lay.agent_names]
    pairs += [("beat", "redis"), ("beat", "pg"), ("reg", "pg")]
    return pairs


def schedule(seed: int, duration_s: float, lay: Layout) -> list[Fault]:
    """The faults of a run of ``duration_s`` seconds: a partition every 12-30 s (a few past
    the dead grace), a worker kill every 40-90 s, a freeze every 45-120 s, a clock skew and
    a log stall every 60-150 s, Redis and PostgreSQL every 200-350 s; each stream drawn
    from its own generator of ``seed``."""
    end = duration_s - 5.0
    isolatable = [*lay.agent_names, "lb", *lay.worker_names, "beat", "reg", "redis", "pg"]
    out: list[Fault] = []

    def stream(name: str, first: tuple[float, float], gap: tuple[float, float]) -> Any:
        rng = random.Random(f"{seed}:{name}")
        t = rng.uniform(*first)
        while t < end - 3:
            yield rng, t
            t += rng.uniform(*gap)

    for rng, t in stream("partition", (4, 12), (12, 30)):
        kind = rng.choices(PARTITIONS, weights=(4, 5, 2))[0]
        long = rng.random() < 0.06 and end - t > LONG_S[1]
        d = rng.uniform(*LONG_S) if long else rng.uniform(4, 30)
        if kind == "isolate":
            targets: tuple[str, ...] = (rng.choice(isolatable),)
        elif kind == "cut":
            targets = rng.choice(_pairs(lay))
        else:
            targets = (rng.choice(lay.agent_names),)
        out.append(Fault(round(t, 1), kind, targets, round(min(d, end - t), 1)))
    for rng, t in stream("kill", (20, 40), (40, 90)):
        out.append(Fault(round(t, 1), "kill", (rng.choice(lay.worker_names),)))
    for rng, t in stream("freeze", (20, 60), (45, 120)):
        who = rng.choice([*lay.agent_names, "lb"])
        out.append(Fault(round(t, 1), "freeze", (who,), round(min(rng.uniform(3, 20), end - t), 1)))
    for rng, t in stream("skew", (30, 90), (60, 150)):
        d = round(min(rng.uniform(20, 90), end - t), 1)
        who = (rng.choice(lay.worker_names),)
        out.append(Fault(round(t, 1), "skew", who, d, rng.choice(SKEWS_S)))
    for rng, t in stream("stall", (30, 90), (60, 150)):
        d = round(min(rng.uniform(5, 15), end - t), 1)
        out.append(Fault(round(t, 1), "stall", (rng.choice(lay.worker_names),), d))
    for rng, t in stream("redis", (60, 150), (200, 350)):
        out.append(Fault(round(t, 1), "redis", (), round(rng.uniform(3, 10), 1)))
    for _rng, t in stream("postgres", (100, 200), (200, 350)):
        out.append(Fault(round(t, 1), "postgres"))
    return sorted(out, key=lambda f: f.at_s)


def ci_schedule(duration_s: float, lay: Layout) -> list[Fault]:
    """The short run's faults: the last worker's clock 8 s ahead for most of the run; two
    replicas per agent of a round-robin function asked for, and every worker killed 4 s
    later, while creates are in flight to the agent that speaks only the seed protocol
    (the short run starts it with a create delay) - so a create one handler sent, another
    may send again; that agent frozen at once; the first worker's log pipe stalled 12 s;
    the agent's host isolated; the first worker cut from Redis."""
    d = round(duration_s / 5, 1)
    agent = lay.agent_names[-1]
    first, last = lay.worker_names[0], lay.worker_names[-1]

    def at(share: float) -> float:
        return round(duration_s * share, 1)

    return [
        Fault(2.0, "skew", (last,), round(duration_s - 10, 1), 8.0),
        Fault(at(0.1), "spawns", ("pt-b",), count=lay.agents * 2),
        Fault(at(0.1) + CI_SEED_CREATE_DELAY_S, "kill", tuple(lay.worker_names)),
        Fault(at(0.1) + 4.5, "freeze", (agent,), d),
        Fault(at(0.4), "stall", (first,), 12.0),
        Fault(at(0.45), "isolate", (agent,), d),
        Fault(at(0.7), "cut", (first, "redis"), d),
    ]


@dataclass
class Done:
    """A fault as it happened: when it began and ended (seconds into the run), any error."""

    fault: Fault
    began_s: float
    ended_s: float | None = None
    error: str | None = None


@dataclass
class Nemesis:
    """Carries out a schedule: each fault in its own thread, at its time."""

    net: Network
    fleet: Fleet
    faults: list[Fault]
    t0: float
    say: Callable[[str], None]
    stop: threading.Event = field(default_factory=threading.Event)
    done: list[Done] = field(default_factory=list)
    _isolated: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _kill_lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        """Fire every fault at its time (or until :attr:`stop`); wait for all to end."""
        threads = []
        for fault in self.faults:
            if self.stop.wait(max(0.0, self.t0 + fault.at_s - time.monotonic())):
                break
            t = threading.Thread(target=self._fire, args=(fault,), name=f"nemesis {fault}")
            t.start()
            threads.append(t)
        for t in threads:
            t.join()

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _fire(self, fault: Fault) -> None:
        record = Done(fault, self._now())
        with self._lock:
            self.done.append(record)
        self.say(f"[{record.began_s:6.1f}s] nemesis: {fault}")
        try:
            self._do(fault)
        except Exception as exc:  # counted and reported; the run goes on
            record.error = f"{type(exc).__name__}: {exc}"[:300]
            self.say(f"[{self._now():6.1f}s] nemesis: {fault} failed: {record.error}")
        record.ended_s = self._now()

    def _do(self, fault: Fault) -> None:
        kind, who, d = fault.kind, fault.targets, fault.duration_s
        if kind == "isolate":
            self._isolate(who[0], d)
        elif kind in ("cut", "unreachable"):
            blocks = self._blocks(kind, who)
            try:
                self.stop.wait(d)
            finally:
                for block in blocks:
                    self.net.unblock(block)
        elif kind == "kill":
            with self._kill_lock:
                self.fleet.kill_workers(who)
        elif kind == "freeze":
            self.fleet.freeze(who[0], d, self.stop)
        elif kind == "skew":
            self.fleet.skew(who[0], fault.offset_s, d, self.stop)
        elif kind == "stall":
            self.fleet.stall(who[0], d, self.stop)
        elif kind == "spawns":
            api.spawn(who[0], fault.count)
        elif kind == "redis":
            self.fleet.restart_redis(d, self.stop)
        elif kind == "postgres":
            self.fleet.restart_postgres()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def _isolate(self, host: str, seconds: float) -> None:
        with self._lock:
            self._isolated[host] += 1
            if self._isolated[host] == 1:
                self.net.link(host, False)
        try:
            self.stop.wait(seconds)
        finally:
            with self._lock:
                self._isolated[host] -= 1
                if self._isolated[host] == 0:
                    self.net.link(host, True)

    def _blocks(self, kind: str, who: tuple[str, ...]) -> list[Block]:
        if kind == "cut":
            a, b = who
            return [self.net.block(a, b), self.net.block(b, a)]
        agent = who[0]
        return [self.net.block(agent, sports=((AGENT_PORT, 0xFFFF), REPLICA_PORT_MASK))]

    def heal_all(self) -> None:
        """Undo every fault still in force (an interrupted run): cables in, blocks gone."""
        self.stop.set()
        self.net.heal()


def counts(done: list[Done]) -> dict[str, int]:
    """Faults carried out, by kind, and ``partitions`` in all (failed ones not counted)."""
    by: Counter[str] = Counter(d.fault.kind for d in done if d.error is None)
    faults = [k for k in KINDS if k != "spawns"]
    return {**{k: by[k] for k in faults}, "partitions": sum(by[k] for k in PARTITIONS)}
