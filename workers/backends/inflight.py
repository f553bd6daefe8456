"""Many agent calls in flight per worker process, bounded per node and per process.

The model
---------
Speed comes from overlapping waits: a batch of creates or releases is sent to the
agents all at once and its results are gathered, instead of waiting out each RPC
in turn. Each worker process has **one asyncio event loop**, run by a daemon thread
started on first use and re-made after a fork (the pid is checked), so a prefork
child never shares a loop, a ``grpc.aio`` channel or an ``httpx.AsyncClient`` with
its parent. Task code stays synchronous: :func:`run` hands a coroutine to the loop
and blocks until it is done; calls from several threads (a thread pool) share the
loop, and so share its bounds.

Bounds:

* at most ``CORRAL_NODE_MAX_INFLIGHT`` calls in flight to one node (:func:`slot`
  takes one of the node's slots through a per-node gate: waiters in order, a
  freed slot handed straight to the next one). With a :class:`Source` the slots
  are leases shared by the whole fleet (:mod:`workers.backends.node_slots`, in Redis), so
  the node sees at most that many calls from all processes and hosts together;
  without one (eager mode, no Redis broker) the bound is the process's own;
* at most ``CORRAL_MAX_INFLIGHT`` calls in flight from the process to all nodes
  (a semaphore, taken before the node's slot).

:func:`lanes` runs a batch of calls grouped by node with those bounds, plus two
rules of its own per node: a node on **probation** (it never created a VM, or its
last creates failed) is sent only as many calls as it may still fail before
quarantine, until one succeeds; and after ``stop_after`` failures in a row in this
batch the node's remaining calls are not sent at all (returned untried), so a
broken node costs a batch at most a few calls, not one per replica.

A call may have to be **admitted** once it holds its slots and before it starts
(``admit``): a create is marked sent in the store only then
(:mod:`workers.replicas.calls`), so what a dead worker leaves marked is at most the
calls that held a node's slots, never the ones still waiting for one. A call refused
there is not sent, and counts for nothing in its lane.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Hashable,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from workers.base import timelimits
from workers.base.errors import BackendError
from workers.base.waiting import hand_over

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


class _Loop:
    """The process's event loop thread and what lives on it."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.gates: dict[tuple[Hashable, Any], _Gate] = {}
        self.total: asyncio.Semaphore | None = None
        self.resources: dict[str, Any] = {}  # channels and clients, made on the loop
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="corral-inflight", daemon=True)
        self.thread.start()
        self.ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self.ready.set)
        self.loop.run_forever()


_current: _Loop | None = None
_lock = threading.Lock()
_closers: list[Callable[[dict[str, Any]], Awaitable[None]]] = []


def _get() -> _Loop:
    global _current
    with _lock:
        if _current is None or _current.pid != os.getpid():
            _current = _Loop()  # a loop inherited across fork has no thread here: never reuse
        return _current


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on this process's loop and wait for its result, within the running task's time.

    In a task the wait ends at its soft limit (or, wrapping up, just before its hard one):
    ``coro`` is cancelled - its node's slot lapses as for any call cut short - and
    :class:`~workers.base.timelimits.OutOfTime` raised, so a call stuck behind a frozen
    node's slots retries the task instead of outliving its hard limit (which kills the
    worker and every task it runs). ``timeout`` ends it too (``TimeoutError``).
    """
    try:
        timelimits.check("an agent call")
    except timelimits.OutOfTime:
        coro.close()  # never started
        raise
    future = submit(coro)
    left = timelimits.wait_left()
    cut = left is not None and (timeout is None or left < timeout)
    try:
        return future.result(max(0.0, left) if cut and left is not None else timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        if not cut:
            raise
        deadline = timelimits.current()
        wrapping = deadline is not None and deadline.wrapping_up
        when = "near its hard time limit" if wrapping else "past its soft time limit"
        timelimits.wrap_up()
        raise timelimits.OutOfTime(f"the task is {when}: an agent call cut off") from None


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start ``coro`` on this process's loop; its future, to wait on from any thread."""
    return asyncio.run_coroutine_threadsafe(coro, _get().loop)


def resource(name: str, make: Callable[[], T]) -> T:
    """A per-process object made once on the loop (call from coroutines running on it)."""
    res = _get().resources
    if name not in res:
        res[name] = make()
    return res[name]  # type: ignore[no-any-return]


def on_reset(closer: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Register how a module closes its resources when the loop is reset."""
    _closers.append(closer)


def reset() -> None:
    """Close this process's loop and its resources (at shutdown, or after fork: forget them)."""
    global _current
    with _lock:
        current, _current = _current, None
    if current is None or current.pid != os.getpid():
        return

    async def close_all() -> None:
        for closer in _closers:
            with contextlib.suppress(Exception):  # closing is best effort
                await closer(current.resources)
        current.resources.clear()

    with suppress(Exception):
        asyncio.run_coroutine_threadsafe(close_all(), current.loop).result(5)
    current.loop.call_soon_threadsafe(current.loop.stop)
    current.thread.join(5)


class Source(Protocol):
    """Where node call slots are leased beyond this process (:mod:`workers.backends.node_slots`)."""

    @property
    def need_s(self) -> float:
        """How long a call may hold its lease: a lease with less left is renewed first."""

    async def acquire(self, node: Hashable, bound: int, want: int) -> list[Lease]:
        """Up to ``want`` of the node's ``bound`` slots, at once (fewer when others hold them)."""

    async def renew(self, node: Hashable, lease: Lease) -> bool:
        """Push a held lease's expiry out again; False when it had lapsed (it is gone)."""

    async def release(self, node: Hashable, leases: Sequence[Lease]) -> None:
        """Give leases back."""


@dataclass
class Lease:
    """One call slot of a node: a token, and (on this process's loop clock) when it lapses."""

    token: str
    expires_at: float = float("inf")


POLL_MIN_S = 0.002  # a node's slots are all held elsewhere: ask again after this...
POLL_MAX_S = 0.025  # ...doubling up to this while none come free


class _Gate:
    """One node's call slots as this process takes them: waiters in order, leases handed on.

    A call that ends hands its lease straight to the next waiter of the process (no
    round trip); with no waiter the lease goes back to the source, a batch of them
    at a time. One pump task per gate asks the source for slots while calls wait.
    """

    def __init__(self, node: Hashable, source: Source | None) -> None:
        self.node = node
        self.source = source
        self.waiters: deque[asyncio.Future[Lease]] = deque()
        self.in_use = 0
        self.bound = 1
        self.pump: asyncio.Task[None] | None = None
        self.freed = asyncio.Event()
        self.returning: list[Lease] = []
        self.flushing: asyncio.Task[None] | None = None

    async def take(self, bound: int) -> Lease:
        self.bound = bound
        while True:
            fut: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            self._kick()
            try:
                lease = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self.give(fut.result())
                with suppress(ValueError):
                    self.waiters.remove(fut)
                raise
            loop_now = asyncio.get_running_loop().time()
            if self.source is None or lease.expires_at - loop_now >= self.source.need_s:
                return lease
            try:
                renewed = await self.source.renew(self.node, lease)
            except BaseException:
                self.give(lease)
                raise
            if renewed:
                return lease
            self.in_use -= 1  # it lapsed (this process stalled): queue again
            self.freed.set()

    def give(self, lease: Lease) -> None:
        """A call ended: hand its lease to the next waiter, or back to the source."""
        if hand_over(self.waiters, lease):
            return
        self.in_use -= 1
        if self.source is None:
            self.freed.set()
            return
        self.returning.append(lease)
        if self.flushing is None:
            self.flushing = asyncio.ensure_future(self._flush())

    def lapse(self, lease: Lease) -> None:
        """A call ended that may still run on the node: its lease is left to lapse, not given back.

        A source's lease lapses by itself at most :data:`~workers.backends.node_slots.SLACK_S`
        after the call's deadline (it was taken or renewed for the call's whole time), so the
        node's bound still counts the call the agent may still be carrying out. Without a
        source the slot is this process's only and comes back at once.
        """
        if self.source is None:
            self.give(lease)
            return
        self.in_use -= 1
        self.freed.set()

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # leases freed in the same pass go back together
        try:
            while self.returning:
                leases, self.returning = self.returning, []
                assert self.source is not None  # noqa: S101 - narrows for mypy
                with suppress(Exception):  # an unreturned lease lapses by itself
                    await self.source.release(self.node, leases)
        finally:
            self.flushing = None
            self.freed.set()

    def _kick(self) -> None:
        if self.pump is None or self.pump.done():
            self.pump = asyncio.ensure_future(self._run_pump())

    async def _run_pump(self) -> None:
        delay = POLL_MIN_S
        while True:
            self.freed.clear()  # set by any slot that comes back from here on
            live = [f for f in self.waiters if not f.done()]
            if not live:
                return
            room = min(len(live), self.bound - self.in_use)
            got: list[Lease] = []
            if room > 0:
                if self.source is None:
                    got = [Lease("local") for _ in range(room)]
                else:
                    try:
                        got = await self.source.acquire(self.node, self.bound, room)
                    except Exception as exc:  # every waiter fails, also those come meanwhile
                        for fut in self.waiters:
                            if not fut.done():
                                fut.set_exception(exc)
                        self.waiters.clear()
                        return
            for lease in got:
                self.in_use += 1
                self.give(lease)
            if not any(not f.done() for f in self.waiters):
                return
            if room > 0 and len(got) < room:  # the rest are held elsewhere: poll, backing off
                delay = POLL_MIN_S if got else delay
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.freed.wait(), delay)
                delay = min(delay * 2, POLL_MAX_S)
            elif room <= 0:
                await self.freed.wait()  # all held by this process: one comes back
            # else every slot asked for came: ask again for callers who came meanwhile


@asynccontextmanager
async def slot(
    node: Hashable, per_node: int, total: int, source: Source | None = None
) -> AsyncIterator[None]:
    """Hold one of the process's ``total`` call slots and one of ``node``'s ``per_node``.

    With a ``source`` the node's slot is a lease shared by every process that uses
    the same source (fleet-wide); without, the bound is this process's alone.
    """
    here = _get()
    if here.total is None or getattr(here.total, "_corral_bound", None) != total:
        here.total = asyncio.Semaphore(total)
        here.total._corral_bound = total  # type: ignore[attr-defined]
    gate = here.gates.get((node, source))
    if gate is None:
        gate = here.gates[(node, source)] = _Gate(node, source)
    async with here.total:
        lease = await gate.take(per_node)
        try:
            yield
        except BaseException as exc:
            if _may_still_run(exc):
                gate.lapse(lease)
            else:
                gate.give(lease)
            raise
        gate.give(lease)


def _may_still_run(exc: BaseException) -> bool:
    """Whether a call that ended with ``exc`` may still be running on its node.

    A call cancelled, or sent and never answered (a deadline, a connection lost mid-call:
    ``nothing_done`` False), may still hold the agent's attention; an answer or an error
    before sending proves the agent is done with it.
    """
    if isinstance(exc, asyncio.CancelledError):
        return True
    return isinstance(exc, BackendError) and not exc.nothing_done


@dataclass
class Lane:
    """How one node's calls of a batch are sent: how many at once, and when to stop."""

    node: Hashable
    bound: int  # calls at once
    stop_after: int  # failures in a row (in this batch) after which the rest are not sent
    probation: int | None = None  # on probation: calls sent in all until one succeeds
    failures: int = 0  # in a row, in this batch
    succeeded: bool = False
    untried: list[Any] = field(default_factory=list)  # not sent: the node failed too often
    late: list[Any] = field(default_factory=list)  # not sent: the batch's start deadline passed
    log: list[BaseException | None] = field(default_factory=list)  # outcomes, as they came
    last_error: BaseException | None = None


@dataclass(frozen=True)
class Result:
    """What one call came back with: ``value`` or ``error`` (an exception)."""

    value: Any = None
    error: BaseException | None = None


@dataclass
class Batch:
    """Where :func:`lanes` leaves what it did, readable even when it was cancelled midway.

    ``results`` by ``id(item)`` for every call that ended; ``started`` holds the ``id`` of
    every item whose call began (one started with no result was cut off: its outcome is
    unknown); ``lanes`` by key.
    """

    results: dict[int, Result] = field(default_factory=dict)
    started: set[int] = field(default_factory=set)
    lanes: dict[Any, Lane] = field(default_factory=dict)


async def lanes(  # noqa: PLR0913 - keyword-only options with defaults
    work: Mapping[K, Sequence[T]],
    lane_of: Callable[[K], Lane],
    call: Callable[[T], Awaitable[Any]],
    *,
    failed: Callable[[BaseException], bool],
    total: int,
    on_result: Callable[[T, Result], object] | None = None,
    source: Source | None = None,
    batch: Batch | None = None,
    start_before: float | None = None,
    admit: Callable[[T], Awaitable[bool]] | None = None,
) -> tuple[dict[int, Result], dict[K, Lane]]:
    """Run every item's ``call``, node by node, with the bounds; results by ``id(item)``.

    ``failed(exc)`` says whether an error counts as a failure of the node (for
    the stop rule); items a lane did not send are in its ``untried``.
    ``on_result(item, result)`` runs (on the loop) as each call ends. With a
    ``source``, node slots are leased from it (:func:`slot`). With ``start_before``
    (the loop's clock: ``time.monotonic()``) no call but the batch's first starts after
    it: the rest are in their lane's ``late``. With ``admit``, a call holding its slots starts
    only if ``await admit(item)`` is true (else it is not sent, and has no result). Cancelled,
    it cancels the calls in flight and returns nothing; ``batch`` (filled as it goes) then
    tells what had happened.
    """
    batch = batch if batch is not None else Batch()
    run = _LaneRun(batch, call, failed, total, on_result, source, start_before, admit)
    await asyncio.gather(*(run.lane(lane_of(k), k, v) for k, v in work.items()))
    return batch.results, batch.lanes


@dataclass
class _LaneRun:
    """What every lane of one :func:`lanes` call shares."""

    batch: Batch
    call: Callable[[Any], Awaitable[Any]]
    failed: Callable[[BaseException], bool]
    total: int
    on_result: Callable[[Any, Result], object] | None
    source: Source | None
    start_before: float | None
    admit: Callable[[Any], Awaitable[bool]] | None = None

    def _ended(self, lane: Lane, item: Any, result: Result) -> None:
        self.batch.results[id(item)] = result
        if self.on_result is not None:
            self.on_result(item, result)
        lane.log.append(result.error)
        if result.error is None:
            lane.failures = 0
            lane.succeeded = True
        elif self.failed(result.error):
            lane.failures += 1
            lane.last_error = result.error

    async def one(self, lane: Lane, item: Any) -> None:
        """Send one item's call inside a slot, and note how it ended."""
        try:
            async with slot(lane.node, lane.bound, self.total, self.source):
                if self.admit is not None and not await self.admit(item):
                    return  # not sent: the caller's admit knows why
                self.batch.started.add(id(item))
                value = await self.call(item)
        except Exception as exc:  # the call's error, or the slot source's
            self._ended(lane, item, Result(error=exc))
            return
        self._ended(lane, item, Result(value=value))

    def _too_late(self) -> bool:
        # The first call of a batch always goes, so that every batch makes progress.
        return (
            self.start_before is not None
            and bool(self.batch.started)
            and asyncio.get_running_loop().time() >= self.start_before
        )

    async def lane(self, lane: Lane, key: Any, items: Sequence[Any]) -> None:
        """Send one node's calls, at most its bound at once, until done or told to stop."""
        self.batch.lanes[key] = lane
        queue: deque[Any] = deque(items)
        running: set[asyncio.Task[None]] = set()

        def stopped() -> bool:
            return lane.failures >= lane.stop_after

        try:
            while queue or running:
                # On probation a failed call does not free its place: until one succeeds, at
                # most ``probation`` calls are sent in all.
                width = lane.bound
                if lane.probation is not None and not lane.succeeded:
                    width = min(width, lane.probation - lane.failures)
                while queue and len(running) < width and not stopped() and not self._too_late():
                    running.add(asyncio.ensure_future(self.one(lane, queue.popleft())))
                if not running:
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                running -= done
        finally:
            for task in running:  # cancelled: the calls in flight go with the batch
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        if self._too_late() and not stopped():
            lane.late = list(queue)
        else:
            lane.untried = list(queue)
