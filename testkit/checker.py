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

What a fault may cost is bounded too (judged at the end, each kind with its evidence):

* ``maybes_beyond_inflight`` (:func:`maybes_beyond_inflight`): a node never has more
  creates of unknown outcome from one moment than ``CORRAL_NODE_MAX_INFLIGHT`` calls
  could have been in flight to it - after a kill or a freeze only the calls that had
  started become maybes;
* ``no_capacity_while_free`` (:func:`no_capacity_while_free`): no operation failed "no
  capacity" while every sample during it saw two free slots on nodes it could use, the
  same nodes free in each, free by the VMs running there and by the rows that are not
  maybes (and maybes up to the in-flight bound) - and the store's own record of its
  rows (:class:`SlotHistory`) says those slots were free at the moment placement
  refused, too: samples a second apart miss a slot taken and another freed between them;
* ``hard_limit_restarts``: ``corral worker`` never had to kill its worker because a
  task outlived its hard time limit (its kill line in the worker's log);
* ``request_ids_twice`` (:func:`request_ids_twice`): on an agent that deduplicates
  creates, one request id never made two VMs, and one VM never served two requests;
* ``ops_slow`` (:func:`ops_slow`): every operation finished within :func:`op_bound` of
  its creation.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
from sqlalchemy import func, select

from config.settings import Settings
from testkit.history import compare
from testkit.nsfleet import CALLED, FUNCTIONS, Fleet
from workers.base import clock
from workers.replicas.maybes import MARK
from workers.store.models import (
    FINAL_STATES,
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
    # each sample's time (the store's clock), free slots of each placeable node (backend,
    # node: free), and each node's part (name: capacity/slots taken/live rows/maybes/VMs;
    # "-": not placeable)
    free: list[tuple[datetime, dict[tuple[str, str], int], str]] = field(default_factory=list)
    inflight_bound: int = 16

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
            stamp = clock.now()
            nodes = {
                n.id: (n.name, n.capacity, _placeable(n, stamp), n.live)
                for n in s.scalars(select(Node))
            }
            rows = dict(
                s.execute(
                    select(Replica.node_id, func.count())
                    .where(Replica.status.in_(LIVE_STATES))
                    .group_by(Replica.node_id)
                ).all()
            )
            maybes = dict(
                s.execute(
                    select(Replica.node_id, func.count())
                    .where(Replica.status.in_(LIVE_STATES), Replica.request_id.contains(MARK))
                    .group_by(Replica.node_id)
                ).all()
            )
        at = time.monotonic() - self.t0
        self.samples += 1
        free: dict[tuple[str, str], int] = {}
        parts = []
        for node_id, (name, capacity, placeable, live) in nodes.items():
            n_rows, running = rows.get(node_id, 0), frozenset(vms.get(name, ()))
            self.peak_rows[name] = max(self.peak_rows[name], n_rows)
            self.peak_vms[name] = max(self.peak_vms[name], len(running))
            if n_rows > capacity:
                self.rows_over.append(f"{name}: {n_rows} > {capacity} at {at:.0f}s")
            if len(running) > capacity:
                self.crowded.append((name, capacity, at, running))
            n_maybes = maybes.get(node_id, 0)
            parts.append(
                f"{name}{'' if placeable else '-'} "
                f"{capacity}/{live}/{n_rows}/{n_maybes}/{len(running)}"
            )
            if placeable is not None:
                held = n_rows - n_maybes + min(n_maybes, self.inflight_bound)
                free[placeable, name] = max(0, capacity - max(len(running), held))
        self.free.append((stamp, free, ", ".join(sorted(parts))))

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


def _placeable(node: Node, at: datetime) -> str | None:
    """The node's backend if placement may use it now (healthy, not draining, not in
    quarantine), else None."""
    quarantined = node.quarantined_until is not None and node.quarantined_until > at
    if not node.healthy or node.draining or quarantined:
        return None
    return str(getattr(node.kind, "value", node.kind))


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


def maybes_beyond_inflight(
    maybes: Iterable[tuple[str, datetime, str]], bound: int, window_s: float
) -> list[str]:
    """Nodes with more maybes sent within ``window_s`` of one another than ``bound`` calls
    could have had in flight, from ``(node, sent_at, request id)`` of every maybe ever made."""
    by_node: dict[str, list[tuple[datetime, str]]] = {}
    for node, sent_at, request_id in maybes:
        by_node.setdefault(node, []).append((sent_at, request_id))
    out = []
    for node, sent in sorted(by_node.items()):
        sent.sort()
        first = 0
        worst: list[tuple[datetime, str]] = []
        for last in range(len(sent)):
            while (sent[last][0] - sent[first][0]).total_seconds() > window_s:
                first += 1
            if last - first + 1 > max(bound, len(worst)):
                worst = sent[first : last + 1]
        if worst:
            ids = [rid.split(MARK, 1)[0] for _, rid in worst]
            out.append(
                f"{node}: {len(worst)} maybes sent within {window_s:g}s (bound {bound}) "
                f"from {worst[0][0]:%H:%M:%S}: {ids[:6]}"
            )
    return out


def maybes_of(fleet: Fleet) -> list[tuple[str, datetime, str]]:
    """Every maybe the store has (whatever its state now): node, when sent, request id."""
    with fleet.db().read() as s:
        return [
            (name, sent_at, rid)
            for name, sent_at, rid in s.execute(
                select(Node.name, Replica.sent_at, Replica.request_id)
                .join(Node, Node.id == Replica.node_id)
                .where(Replica.request_id.contains(MARK))
            )
            if sent_at is not None
        ]


FREE_SLOTS = 2
SAMPLED_S = 1.5  # samples come once a second: one on each side of an operation within this
# A sample's time is the harness's reading of the store's clock, an operation's a worker's:
# each process measures the store's clock to within half a round trip, so two readings of
# one moment may disagree by this much on a loaded machine. A sample counts as before or
# after an operation only this far from it (the partition run's first 20 minutes: five
# spawns that took or found fc6's last two slots at 01:05:28.1-28.3 were judged against
# a sample stamped after them that read the store before their rows).
CLOCKS_AGREE_S = 1.0
_NO_CAPACITY = re.compile(r"no capacity for \S+ on any healthy")  # (not: on node N)


@dataclass(frozen=True)
class SlotHistory:
    """Which rows held which node's slots when, from the store: each row holds a slot of
    its node from its creation to its final transition (its last update), and each
    placement refused "no capacity" when its row was failed for it (by operation)."""

    capacity: Mapping[tuple[str, str], int]  # (backend, node) -> slots
    held: list[tuple[str, str, datetime, datetime | None]]  # backend, node, from, to (None: live)
    refused: Mapping[str, list[datetime]]  # operation -> when its placements were refused

    def free_at(self, at: datetime, nodes: Iterable[tuple[str, str]]) -> int:
        """Slots free on ``nodes`` at ``at`` by the rows, counting every row that held one
        within :data:`CLOCKS_AGREE_S` of it (each time is one worker's reading of the
        store's clock): a slot that changed hands then counts as taken."""
        taken: Counter[tuple[str, str]] = Counter()
        for backend, node, began, ended in self.held:
            if (began - at).total_seconds() <= CLOCKS_AGREE_S and (
                ended is None or (at - ended).total_seconds() <= CLOCKS_AGREE_S
            ):
                taken[(backend, node)] += 1
        return sum(max(0, self.capacity.get(n, 0) - taken[n]) for n in nodes)


def slot_history(fleet: Fleet) -> SlotHistory:
    """The run's :class:`SlotHistory`, read from the store."""
    final = {int(state) for state in FINAL_STATES}
    with fleet.db().read() as s:
        names = {
            n.id: (str(getattr(n.kind, "value", n.kind)), n.name, n.capacity)
            for n in s.scalars(select(Node))
        }
        rows = s.execute(
            select(
                Replica.node_id,
                Replica.status,
                Replica.created_at,
                Replica.updated_at,
                Replica.retired_at,
                Replica.request_id,
                Replica.error,
            )
        ).all()
    held: list[tuple[str, str, datetime, datetime | None]] = []
    refused: dict[str, list[datetime]] = {}
    for node_id, status, created, updated, retired, request_id, error in rows:
        if node_id in names:
            ended = updated if int(status) in final else None
            kind, name, _capacity = names[node_id]
            held.append((kind, name, created, ended))
        elif _NO_CAPACITY.search(error or ""):
            refused.setdefault(request_id.split(".", 1)[0], []).append(retired or updated)
    capacity = {(kind, name): slots for kind, name, slots in names.values()}
    return SlotHistory(capacity, held, refused)


def no_capacity_while_free(
    failures: Iterable[tuple[str, datetime, datetime, str, str, frozenset[str]]],
    free: list[tuple[datetime, dict[tuple[str, str], int], str]],
    history: SlotHistory | None = None,
) -> list[str]:
    """Operations that failed "no capacity" on any node (``(op, created at, finished at,
    backend, error, nodes its rows were on)``) while the samples around them - one before
    they began and one after they ended, at least, each :data:`CLOCKS_AGREE_S` away, and
    every sample in between within :data:`SAMPLED_S` more - saw :data:`FREE_SLOTS` free
    slots of their backend on nodes other than theirs (a move avoids the node it leaves),
    counting each node at the least it had free in any of them: slots free on one node in
    one sample and on another in the next are no evidence (the partition run, cis86: one
    node filled and another emptied within a second, and a spawn placed in between found
    none, while every sample had seen two free somewhere); with the last of those samples
    (each node's capacity / slots taken / live rows / maybes / VMs). With a ``history``,
    an operation whose placements were each refused when the rows say those nodes were
    full is no anomaly either: samples a second apart miss a slot taken and another freed
    between them (cis493: a spawn took fc1's and fc2's last slots at :15.52, two more
    were refused at :15.63, scale-downs freed three from :15.67; the samples at :15 and
    :16 each saw two free)."""
    out = []
    reach = SAMPLED_S + CLOCKS_AGREE_S
    for op_id, began, ended, backend, error, theirs in failures:
        if not _NO_CAPACITY.search(error or ""):
            continue
        seen = [
            (t, f, p)
            for t, f, p in free
            if (began - t).total_seconds() <= reach and (t - ended).total_seconds() <= reach
        ]
        before = any((began - t).total_seconds() >= CLOCKS_AGREE_S for t, _f, _p in seen)
        after = any((t - ended).total_seconds() >= CLOCKS_AGREE_S for t, _f, _p in seen)
        if not (before and after):
            continue
        nodes = {node for _t, f, _p in seen for kind, node in f if kind == backend}
        all_along = sum(
            min(f.get((backend, node), 0) for _t, f, _p in seen) for node in nodes - theirs
        )
        refused = history.refused.get(op_id, []) if history is not None else []
        if history is not None and refused:
            usable = {(backend, node) for node in nodes - theirs}
            if max(history.free_at(at, usable) for at in refused) < FREE_SLOTS:
                continue  # the rows held those slots each time placement refused
        if all_along >= FREE_SLOTS:
            out.append(
                f"op {op_id} {began:%H:%M:%S}-{ended:%H:%M:%S}: {error[:100]!r} while "
                f"{backend} nodes had {all_along}+ slots free ({seen[-1][2]})"
            )
    return out


def nodes_of_ops(
    ops: set[str], replicas: Iterable[tuple[str | None, str | None, str, str]]
) -> dict[str, set[str]]:
    """The nodes each of ``ops`` put rows on, from ``(operation id, maybe of, request id,
    node)`` of every replica: an operation's own rows are found by their request ids
    (``<op>.<n>...``), since a row's operation id is cleared once it ends."""
    on: dict[str, set[str]] = {}
    for op_id, maybe_of, request_id, node in replicas:
        for op in {op_id, maybe_of, request_id.split(".", 1)[0]}:
            if op in ops:
                on.setdefault(op, set()).add(node)
    return on


def capacity_failures(
    fleet: Fleet,
) -> list[tuple[str, datetime, datetime, str, str, frozenset[str]]]:
    """Operations of the run's functions that ended with "no capacity" in their error,
    each with the nodes its rows were on."""
    from workers.store.models import Function

    backends = {name: str(spec.get("backend", "fcdaemon")) for name, spec in FUNCTIONS.items()}
    with fleet.db().read() as s:
        rows = s.execute(
            select(
                Operation.id,
                Operation.created_at,
                Operation.finished_at,
                Function.name,
                Operation.error,
            )
            .join(Function, Function.id == Operation.function_id)
            .where(Operation.error.contains("no capacity"))
        ).all()
        every = select(Replica.operation_id, Replica.maybe_of, Replica.request_id, Node.name)
        on = nodes_of_ops(
            {r[0] for r in rows}, s.execute(every.join(Node, Node.id == Replica.node_id)).all()
        )
    return [
        (op, began, ended, backends.get(fn, "fcdaemon"), err or "", frozenset(on.get(op, ())))
        for op, began, ended, fn, err in rows
        if ended is not None
    ]


_MADE = re.compile(r"CreateReplica image=\S+ requestId=(\S+): (\S+) at ")
_ALREADY = re.compile(r"CreateReplica requestId=(\S+): already running as (\S+)")


def request_ids_twice(logs: Mapping[str, str], rows: Iterable[tuple[str, str, str]]) -> list[str]:
    """From the logs of agents that deduplicate creates (by node) and ``(node, vmid,
    request id)`` of every row: a request id that made more than one VM on a node, or a VM
    that answered more than one request (rows of different request ids holding one VM)."""
    out = []
    for node, text in sorted(logs.items()):
        made: dict[str, set[str]] = {}
        for rid, vmid in _MADE.findall(text):
            made.setdefault(rid, set()).add(vmid)
        out += [
            f"{node}: requestId {rid} made {len(vms)} VMs: {sorted(vms)[:4]}"
            for rid, vms in made.items()
            if len(vms) > 1
        ]
        answered: dict[str, set[str]] = {}
        for rid, vmid in _ALREADY.findall(text):
            answered.setdefault(vmid, set()).add(rid)
        for rid, vmids in made.items():
            for vmid in vmids:
                answered.setdefault(vmid, set()).add(rid)
        out += [
            f"{node}: VM {vmid} answered {len(rids)} request ids: {sorted(rids)[:4]}"
            for vmid, rids in answered.items()
            if len(rids) > 1
        ]
    held: dict[tuple[str, str], set[str]] = {}
    for node, vmid, request_id in rows:
        if node in logs and vmid:
            held.setdefault((node, vmid), set()).add(request_id.split(MARK, 1)[0])
    out += [
        f"{node}: VM {vmid} held by rows of {len(rids)} request ids: {sorted(rids)[:4]}"
        for (node, vmid), rids in held.items()
        if len(rids) > 1
    ]
    return out


def extended_history(fleet: Fleet) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """The logs of the agents that deduplicate creates (by node name), and every row's
    ``(node, vmid, request id)``."""
    lay = fleet.layout
    logs = {
        lay.node_name(host): fleet.procs[host].log.read_text(errors="replace")
        for host in lay.agent_names
        if not lay.seed(host)
    }
    with fleet.db().read() as s:
        rows = [
            (name, vmid, rid)
            for name, vmid, rid in s.execute(
                select(Node.name, Replica.vmid, Replica.request_id).join(
                    Node, Node.id == Replica.node_id
                )
            )
            if vmid is not None
        ]
    return logs, rows


def op_bound(settings: Settings) -> float:
    """The longest an operation may take under the nemesis: its message back after a
    worker's visibility timeout and redriven, a maybe it waits on to its creating
    deadline, and three tasks run to their hard time limit."""
    return (
        settings.visibility_timeout_s
        + settings.redrive_after_s
        + settings.creating_deadline_s
        + 3 * settings.task_time_limit_s
        + SLACK_S
    )


def ops_slow(
    ops: Iterable[tuple[str, str, datetime, datetime | None]], bound_s: float, at: datetime
) -> list[str]:
    """Operations (``(id, kind, created at, finished at or None)``) that took, or have been
    open, longer than ``bound_s``."""
    out = []
    for op_id, kind, created, finished in ops:
        took = ((finished or at) - created).total_seconds()
        if took > bound_s:
            state = "finished" if finished is not None else "still open"
            out.append(f"{kind} {op_id}: {state} after {took:.0f}s (bound {bound_s:g}s)")
    return out


def operations(fleet: Fleet) -> list[tuple[str, str, datetime, datetime | None]]:
    """Every operation: id, kind, created and finished at."""
    with fleet.db().read() as s:
        return [
            (op_id, str(getattr(kind, "value", kind)), created, finished)
            for op_id, kind, created, finished in s.execute(
                select(Operation.id, Operation.kind, Operation.created_at, Operation.finished_at)
            )
        ]


def longest_op(fleet: Fleet) -> tuple[float, str]:
    """The longest any finished operation took (seconds) and its kind."""
    took = [
        ((finished - created).total_seconds(), kind)
        for _id, kind, created, finished in operations(fleet)
        if finished is not None
    ]
    return max(took, default=(0.0, "-"))


def cost_anomalies(fleet: Fleet, settings: Settings, sampler: Sampler) -> dict[str, list[str]]:
    """What the faults cost beyond their bounds, by kind (empty lists where nothing)."""
    logs, rows = extended_history(fleet)
    return {
        "maybes_beyond_inflight": maybes_beyond_inflight(
            maybes_of(fleet), settings.node_max_inflight, settings.create_timeout_s / 2
        ),
        "no_capacity_while_free": no_capacity_while_free(
            capacity_failures(fleet), sampler.free, slot_history(fleet)
        ),
        "hard_limit_restarts": fleet.hard_limit_restarts(),
        "request_ids_twice": request_ids_twice(logs, rows),
        "ops_slow": ops_slow(operations(fleet), op_bound(settings), clock.now()),
    }


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
