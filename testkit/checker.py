"""The checker: a history recorded while faults fire, judged against the final state.

In Jepsen's sense: clients record what they asked and what they were told (the
history); once every fault is healed and the fleet had a quiet period, the checker
reads the final state and says where the two disagree. Every disagreement is an
*anomaly*; one is enough to fail the run.

Recorded while the run goes on:

* :class:`Callers` - gateway calls from the ``ctl`` host, each with the status it got
  or the error it met and how long it took. A call must be answered with a status
  (an HTTP answer, 5xx included) before its deadline: the admission wait, then two
  tries of a claim (the cold-start timeout) and the call (the gateway timeout), plus
  :data:`SLACK_S`. ``calls_hung`` (no answer by the deadline), ``calls_unanswered``
  (the connection failed or was cut) and ``calls_500`` (an error the gateway did not
  handle: the functions called answer 200, and the gateway's own refusals are 429,
  502, 503 and 504) are anomalies.
* :class:`Sampler` - once a second, the live rows on every node (the store) and the VMs
  on every agent host (``/proc``), each against the node's capacity:
  ``rows_over_capacity`` / ``vms_over_capacity``.

Judged at the end (:func:`final_state`): every VM an agent runs has exactly one live
row and every live row's VM runs on its node (:func:`testkit.history.compare`, with
``/proc`` as the truth of what runs); ``ops_open``: no operation at all - the load's,
the gateway's cold starts, the housekeeping passes' - is still pending or running;
``ops_failed_by_a_bug``: none ended failed because a task raised a programming error
(``ValueError``, ``TypeError``, ``AttributeError``...: a refusal, a node's answer or a
transient error past its retries is an outcome, that is a bug); ``db_check``:
``corral db check`` exits 0; ``claims_outstanding``; and
``unexpected_deaths``: no process died that the nemesis did not kill (``corral worker``
killing and restarting its worker at a task's hard time limit is by design, and only
counted); and ``seed_creates_twice`` (:func:`seed_creates_twice`), from the agents' own
history: no seed-protocol agent carried out one row's create twice.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import func, select

from config.settings import Settings
from testkit.history import compare
from testkit.nsfleet import CALLED, Fleet
from workers.replicas.maybes import MARK
from workers.store.models import (
    LIVE_STATES,
    OP_FINISHED,
    Claim,
    Node,
    Operation,
    Replica,
    ReplicaState,
)

SLACK_S = 5.0
INTERNAL_ERROR = 500  # the functions called answer 200: a 500 is an error the gateway left


def call_deadline(settings: Settings) -> float:
    """The longest a gateway call may take before it must have an answer."""
    cold, call = settings.gateway_cold_start_timeout_s, settings.gateway_timeout_s
    return cold + 2 * (cold + call) + SLACK_S


@dataclass
class Call:
    """One gateway call: what, when (seconds into the run), how long, and what came back."""

    function: str
    began_s: float
    took_s: float
    status: int | None
    error: str | None = None


@dataclass
class Callers:
    """Threads calling the gateway from ``ctl``, each once every ``every_s`` seconds."""

    fleet: Fleet
    deadline_s: float
    t0: float
    threads: int = 3
    every_s: float = 1.5
    calls: list[Call] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> list[threading.Thread]:
        """Start the callers."""
        out = []
        for i in range(self.threads):
            t = threading.Thread(target=self._loop, args=(i,), name=f"caller{i}", daemon=True)
            t.start()
            out.append(t)
        return out

    def _loop(self, i: int) -> None:
        with self.fleet.gateway() as client:
            n = i
            while not self.stop.wait(self.every_s):
                self.call(client, CALLED[n % len(CALLED)])
                n += 1

    def call(self, client: httpx.Client, function: str) -> Call:
        """One call, recorded."""
        began = time.monotonic()
        status, error = None, None
        try:
            status = client.get(f"/function/{function}", timeout=self.deadline_s + 10).status_code
        except httpx.HTTPError as exc:
            error = type(exc).__name__
        call = Call(function, began - self.t0, time.monotonic() - began, status, error)
        with self._lock:
            self.calls.append(call)
        return call

    def anomalies(self) -> dict[str, list[str]]:
        """Calls with no status, answered past their deadline, or with a 500."""
        hung, unanswered, errored = [], [], []
        for c in self.calls:
            what = f"{c.function} at {c.began_s:.0f}s: {c.status or c.error} after {c.took_s:.1f}s"
            if c.took_s > self.deadline_s:
                hung.append(what)
            elif c.status is None:
                unanswered.append(what)
            elif c.status == INTERNAL_ERROR:
                errored.append(what)
        return {"calls_hung": hung, "calls_unanswered": unanswered, "calls_500": errored}

    def figures(self) -> dict[str, Any]:
        """Calls by outcome, and the slowest."""
        by = Counter(str(c.status or c.error) for c in self.calls)
        return {
            "calls": len(self.calls),
            "by_outcome": dict(sorted(by.items())),
            "slowest_s": round(max((c.took_s for c in self.calls), default=0.0), 1),
        }


@dataclass
class Sampler:
    """Once a second: live rows and running VMs per node, against each node's capacity.

    Live rows above capacity are an anomaly at any sample. VMs above it are one only
    when they stay so for longer than ``vm_grace_s``: a VM can outlive its row (a create
    whose answer was lost, its row retired at its deadline and its slot reused) until
    reconcile or the registry releases it, which takes at most that long (:meth:`vms_over`).
    """

    fleet: Fleet
    t0: float
    vm_grace_s: float
    stop: threading.Event = field(default_factory=threading.Event)
    samples: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    rows_over: list[str] = field(default_factory=list)
    peak_rows: Counter[str] = field(default_factory=Counter)
    peak_vms: Counter[str] = field(default_factory=Counter)
    # samples with more VMs than capacity: (node, capacity, seconds into the run, vmids)
    crowded: list[tuple[str, int, float, frozenset[str]]] = field(default_factory=list)

    def run(self) -> None:
        """Sample until :attr:`stop`."""
        while not self.stop.wait(1.0):
            try:
                self.sample()
            except Exception as exc:  # the store is cut off or restarting: no sample
                self.errors[type(exc).__name__] += 1

    def sample(self) -> None:
        """One sample."""
        vms = self.fleet.vms()
        with self.fleet.db().read() as s:
            nodes = {n.id: (n.name, n.capacity) for n in s.scalars(select(Node))}
            rows = dict(
                s.execute(
                    select(Replica.node_id, func.count())
                    .where(Replica.status.in_(LIVE_STATES))
                    .group_by(Replica.node_id)
                ).all()
            )
        at = time.monotonic() - self.t0
        self.samples += 1
        for node_id, (name, capacity) in nodes.items():
            n_rows, running = rows.get(node_id, 0), frozenset(vms.get(name, ()))
            self.peak_rows[name] = max(self.peak_rows[name], n_rows)
            self.peak_vms[name] = max(self.peak_vms[name], len(running))
            if n_rows > capacity:
                self.rows_over.append(f"{name}: {n_rows} > {capacity} at {at:.0f}s")
            if len(running) > capacity:
                self.crowded.append((name, capacity, at, running))

    def vms_over(self) -> tuple[list[str], dict[str, int]]:
        """Runs of samples with more VMs than capacity longer than the grace; and the longest
        run per node, in seconds."""
        over: list[str] = []
        longest: Counter[str] = Counter()
        since: dict[str, float] = {}
        last: dict[str, float] = {}
        for name, capacity, at, running in self.crowded:
            if len(running) <= capacity:
                continue
            if at - last.get(name, -1e9) > 2.5:  # a sample or two missed ends a run
                since[name] = at
            last[name] = at
            longest[name] = max(longest[name], round(at - since[name]))
            if at - since[name] > self.vm_grace_s:
                over.append(
                    f"{name}: {len(running)} VMs > {capacity} since "
                    f"{since[name]:.0f}s, at {at:.0f}s"
                )
        return over, dict(longest)


_BUG = re.compile(
    r"\b(ValueError|TypeError|AttributeError|KeyError|IndexError|AssertionError|NameError"
    r"|UnboundLocalError|ZeroDivisionError)\b"
)


def failed_by_a_bug(reasons: Counter[str]) -> list[str]:
    """Operations that failed because a task raised a programming error (not a refusal, a
    node's answer or a transient error past its retries): ``ops_failed_by_a_bug``."""
    return [f"{n} x {why}" for why, n in reasons.items() if _BUG.search(why)]


def vm_grace(settings: Settings) -> float:
    """The longest a VM may outlive its row before reconcile or the registry releases it."""
    listed = settings.orphan_grace_s + 2 * settings.reconcile_interval_s
    reported = settings.create_timeout_s + settings.ready_grace_s + settings.reap_interval_s
    return max(listed, reported) + settings.rpc_timeout_s + SLACK_S


def final_state(fleet: Fleet) -> dict[str, list[str]]:
    """Every end-of-run anomaly now, by kind (empty lists where none)."""
    db = fleet.db()
    vms = fleet.vms()
    with db.read() as s:
        nodes = {n.id: n.name for n in s.scalars(select(Node))}
        rows = [
            tuple(r)
            for r in s.execute(
                select(Replica.id, Replica.node_id, Replica.vmid, Replica.status).where(
                    Replica.status.in_(LIVE_STATES)
                )
            )
        ]
        open_ops = [
            f"{kind} {op_id} ({status})"
            for op_id, kind, status in s.execute(
                select(Operation.id, Operation.kind, Operation.status).where(
                    Operation.status.not_in(list(OP_FINISHED))
                )
            )
        ]
        claims = s.scalar(select(func.count()).select_from(Claim)) or 0
    listed = {node_id: (name, vms.get(name, set())) for node_id, name in nodes.items()}
    bad = compare(rows, listed)  # type: ignore[arg-type]
    bad["orphan_vms"] = [_story(db, o) for o in bad["orphan_vms"]]
    bad["ops_open"] = open_ops
    check = fleet.cli("db", "check", check=False)
    bad["db_check"] = [] if check.returncode == 0 else check.stdout.strip().splitlines()[:5]
    bad["claims_outstanding"] = [f"{claims} claim rows"] if claims else []
    bad["unexpected_deaths"] = fleet.dead()
    bad["seed_creates_twice"] = seed_creates_twice(fleet)
    return bad


_SEED_CREATE = re.compile(r"requestId=(\S+) \(ignored: seed protocol\): (\w+) at")


def seed_creates_twice(fleet: Fleet) -> list[str]:
    """Rows whose create a seed-protocol agent received (and carried out) more than once.

    The history from the agents' side: a seed agent logs the request id of every create
    it carries out (it does not use it). A request id is sent once by each row that
    bore it: the row itself and, where a create's outcome was unknown, each *maybe* it
    became (renamed ``<request id>~<row id>``: :mod:`workers.replicas.maybes`) - whose
    replacement is sent again under the same id, by design. More VMs for one request id
    on one such agent than rows that bore it is a row's create sent twice to an agent
    that cannot deduplicate it - what the ownership of rows
    (:mod:`workers.replicas.owners`) exists to prevent.
    """
    made: dict[tuple[str, str], list[str]] = {}
    for host in fleet.layout.agent_names:
        if fleet.layout.seed(host):
            log = fleet.procs[host].log.read_text(errors="replace")
            for rid, vmid in _SEED_CREATE.findall(log):
                made.setdefault((host, rid), []).append(vmid)
    twice = {key: vms for key, vms in made.items() if len(vms) > 1}
    if not twice:
        return []
    with fleet.db().read() as s:
        ids = list(s.scalars(select(Replica.request_id)))
    bore: Counter[str] = Counter(rid.split(MARK, 1)[0] for rid in ids)
    return [
        f"{host}: {rid} -> {vms} ({bore[rid]} rows bore it)"
        for (host, rid), vms in twice.items()
        if len(vms) > bore[rid]
    ]


def _story(db: Any, orphan: str) -> str:
    """An orphan VM (``node/vmid``) with what the store knows of it: the rows that had it."""
    _name, vmid = orphan.rsplit("/", 1)
    with db.read() as s:
        rows = s.execute(
            select(Replica.id, Replica.status, Replica.error).where(Replica.vmid == vmid)
        ).all()
    told = "; ".join(
        f"row {r.id} {ReplicaState(r.status).name} ({(r.error or '')[:120]})" for r in rows
    )
    return f"{orphan}: {told or 'no row ever recorded it'}"
