"""What the soak and the partition run share: the load they send, and how they judge the end.

The model
---------
A run has a *history* and a *final state*. The history is what the load generator
(:class:`Load`) asked for - each operation it got an id for (:class:`Tracked`), each
refusal and each error it saw - while faults were injected. The final state is read
after the faults are over and the fleet had time to settle: the replica rows, the VMs
each node runs, the operations. The judgement compares the two:

* :func:`compare` - every VM a node runs has exactly one live row, and every live row's
  VM runs on its node (``orphan_vms``, ``duplicate_rows``, ``rows_without_vm``);
* :func:`not_final` - every operation the history holds has succeeded, failed or
  partly failed;
* :func:`outcomes` - what became of the operations (final states, failure reasons,
  operations per minute, spawn completion percentiles): figures, not verdicts.

How a run knows what a node runs is its own: the soak asks each node over its protocol,
the partition run reads the processes in each agent host.
"""

from __future__ import annotations

import math
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import select

from config.settings import get_settings
from corral import api
from workers.base.errors import InputError
from workers.functions import deploy, spec_from
from workers.replicas.claims import NoIdleReplica
from workers.store.db import Database
from workers.store.models import OP_FINISHED, Operation, Replica, ReplicaState

REDEPLOY_EVERY_S = 30.0


@dataclass
class Tracked:
    """An operation the load generator got an id for."""

    op_id: str
    kind: str
    submitted_s: float  # seconds into the run


class LoadLog(Protocol):
    """Where :class:`Load` writes what it did and saw."""

    ops: list[Tracked]
    refused: Counter[str]  # clear refusals (InputError, NoIdleReplica)
    errors: Counter[str]  # faults seen by the producer
    claims: Counter[str]


@dataclass
class Outcomes:
    """What became of the tracked operations (figures, not verdicts)."""

    final: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)  # why ops failed (first error)
    per_minute: list[dict[str, int]] = field(default_factory=list)
    spawn_p50_s: float | None = None
    spawn_p99_s: float | None = None
    spawns_timed: int = 0


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def reason(error: str) -> str:
    """An operation's error without its ids and counts, so alike failures group together."""
    text = error.split("first: ", 1)[-1]
    return re.sub(r"[0-9a-f]{32}(\.[0-9.]+)?|\b\d+(\.\d+)?\b", "#", text)[:100]


class Load:
    """The load generator: one action every ``1 / rate`` seconds until stopped.

    Actions, by weight: spawn one or two replicas (3), scale to a random target in
    [min, 6] (2), delete a random Idle or Creating replica (3), claim an environment and
    release it one to four seconds later (3); and every 30 s a re-deploy (a new build).
    """

    def __init__(  # noqa: PLR0913 - the run's parts, by name
        self,
        db: Callable[[], Database],
        functions: Mapping[str, Mapping[str, Any]],
        log: LoadLog,
        rate: float,
        seed: int,
        t0: float,
    ) -> None:
        self.db, self.specs, self.log = db, functions, log
        self.names = list(functions)
        self.rate = rate
        self.rng = random.Random(seed)
        self.t0 = t0
        self.stop = threading.Event()
        self.held: list[tuple[float, str]] = []  # (release at, claim id)
        self.builds = 0

    def run(self) -> None:
        """Issue actions at the steady rate until :attr:`stop` is set."""
        next_at = time.monotonic()
        next_deploy = time.monotonic() + REDEPLOY_EVERY_S
        actions = [(self.spawn, 3), (self.scale, 2), (self.delete, 3), (self.claim, 3)]
        population = [a for a, w in actions for _ in range(w)]
        while not self.stop.is_set():
            self.release_due()
            if time.monotonic() >= next_deploy:
                next_deploy += REDEPLOY_EVERY_S
                self.attempt(self.redeploy)
            self.attempt(self.rng.choice(population))
            next_at += 1.0 / self.rate
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def attempt(self, action: Callable[[], None]) -> None:
        """Run one action; count a refusal or an error instead of stopping."""
        try:
            action()
        except (InputError, NoIdleReplica) as exc:  # unknown, above max, nothing idle
            self.log.refused[type(exc).__name__] += 1
        except Exception as exc:  # the broker or the store is down: the producer sees it
            self.log.errors[type(exc).__name__] += 1

    def _track(self, op_id: str, kind: str) -> None:
        self.log.ops.append(Tracked(op_id, kind, time.monotonic() - self.t0))

    def spawn(self) -> None:
        """Ask for one or two more replicas of a random function."""
        self._track(api.spawn(self.rng.choice(self.names), self.rng.randint(1, 2)), "spawn")

    def scale(self) -> None:
        """Scale a random function to a random target in [min, 6]."""
        name = self.rng.choice(self.names)
        low = int(self.specs[name].get("min", 0))
        self._track(api.scale(name, self.rng.randint(low, 6)), "scale")

    def delete(self) -> None:
        """Delete a random Idle or Creating replica."""
        with self.db().read() as s:
            ids = list(
                s.scalars(
                    select(Replica.id).where(
                        Replica.status.in_([ReplicaState.IDLE, ReplicaState.CREATING])
                    )
                )
            )
        if ids:
            self._track(api.delete(self.rng.choice(ids)), "delete")

    def claim(self) -> None:
        """Claim an environment of a random function; it is released 1-4 s later."""
        got = api.claim(self.rng.choice(self.names))
        self.log.claims["claimed"] += 1
        self.held.append((time.monotonic() + self.rng.uniform(1, 4), got["claim_id"]))

    def release_due(self, everything: bool = False) -> None:
        """Release the claims whose time has come (all of them with ``everything``)."""
        now = time.monotonic()
        keep = []
        for at, claim_id in self.held:
            if not everything and at > now:
                keep.append((at, claim_id))
                continue
            try:
                api.release(claim_id)
                self.log.claims["released"] += 1
            except Exception as exc:
                self.log.errors[f"release: {type(exc).__name__}"] += 1
                keep.append((at, claim_id))  # the store was down: try again
        self.held = keep

    def release_all(self, within_s: float) -> None:
        """Release every claim still held, retrying for up to ``within_s``."""
        until = time.monotonic() + within_s
        while self.held and time.monotonic() < until:
            self.release_due(everything=True)
            if self.held:
                time.sleep(1)

    def redeploy(self) -> None:
        """Deploy a random function again with a new build (the reaper retires the old)."""
        self.builds += 1
        name = self.rng.choice(self.names)
        spec = spec_from(name=name, **self.specs[name], env={"BUILD": str(self.builds)})
        with self.db().transaction() as s:
            deploy(s, spec, get_settings())
        self.log.claims["redeploys"] += 1


Row = tuple[str, str, str | None, Any]  # (replica id, node id, vmid, status)


def compare(
    rows: Iterable[Row], listed: Mapping[str, tuple[str, Iterable[str] | Exception]]
) -> dict[str, list[str]]:
    """Live rows against what each node runs (node id -> (name, its vmids or why unknown))."""
    bad: dict[str, list[str]] = {"orphan_vms": [], "duplicate_rows": [], "rows_without_vm": []}
    by_vm: dict[tuple[str, str], list[str]] = {}
    for rid, node_id, vmid, status in rows:
        if vmid is None:
            bad["rows_without_vm"].append(f"{rid} (status {status}, no VM yet)")
            continue
        by_vm.setdefault((node_id, vmid), []).append(rid)
    seen: set[tuple[str, str]] = set()
    for node_id, (name, vms) in listed.items():
        if isinstance(vms, Exception):
            bad["rows_without_vm"].append(f"node {name} cannot list: {vms}")
            continue
        for vmid in vms:
            key = (node_id, vmid)
            seen.add(key)
            owners = by_vm.get(key, [])
            if not owners:
                bad["orphan_vms"].append(f"{name}/{vmid}")
            elif len(owners) > 1:
                bad["duplicate_rows"].append(f"{name}/{vmid}: {owners}")
    for key, owners in by_vm.items():
        if key not in seen:
            bad["rows_without_vm"].extend(f"{rid} (VM {key[1]} not on its node)" for rid in owners)
    return bad


def not_final(db: Database, ops: list[Tracked]) -> list[str]:
    """The tracked operations that are not succeeded, failed or partial."""
    with db.read() as s:
        status = dict(
            s.execute(
                select(Operation.id, Operation.status).where(
                    Operation.id.in_([o.op_id for o in ops])
                )
            ).all()
        )
    return [
        f"{o.kind} {o.op_id} ({status.get(o.op_id)})"
        for o in ops
        if status.get(o.op_id) not in OP_FINISHED
    ]


def outcomes(db: Database, ops: list[Tracked], minutes: float) -> Outcomes:
    """Final states, failure reasons, operations per minute and spawn completion times."""
    out = Outcomes()
    with db.read() as s:
        rows = {
            r.id: r
            for r in s.scalars(select(Operation).where(Operation.id.in_([o.op_id for o in ops])))
        }
    n = max(1, int(minutes + 0.999))
    per = [{"minute": m + 1, "submitted": 0, "completed": 0} for m in range(n)]
    spawn_s: list[float] = []
    for tracked in ops:
        per[min(n - 1, int(tracked.submitted_s // 60))]["submitted"] += 1
        op = rows.get(tracked.op_id)
        if op is None:
            continue
        out.final[str(getattr(op.status, "value", op.status))] += 1
        if op.error:
            out.reasons[f"{tracked.kind}: {reason(op.error)}"] += 1
        if op.finished_at is None:
            continue
        took = (op.finished_at - op.created_at).total_seconds()
        per[min(n - 1, int((tracked.submitted_s + took) // 60))]["completed"] += 1
        if tracked.kind == "spawn" and op.status == "succeeded":
            spawn_s.append(took)
    out.per_minute = per
    out.spawn_p50_s = percentile(spawn_s, 50)
    out.spawn_p99_s = percentile(spawn_s, 99)
    out.spawns_timed = len(spawn_s)
    return out
