"""A batch of agent calls inside a task's time: sent at once, recorded as they land, cut cleanly.

A batch's calls run on the process's event loop (:mod:`workers.backends.inflight`, bounded
per node and per process) while the task's thread waits in short slices: every
:data:`FLUSH_S` it hands the calls that succeeded meanwhile to the caller, which records
them (a guest's READY must find its vmid without waiting for the batch's slowest call).
Each slice is also where the running task's soft time limit is checked
(:mod:`workers.timelimits`): past it, :func:`run` cancels the calls still in flight (on
the event loop: cancelling is cooperative, nothing is raised into a thread) and returns
what it knows - the calls that ended, the ones that were started and cut off (their
outcome is unknown), the ones never started - instead of letting the calls run on behind
a task that has ended. The soft limit is then delivered: the task is wrapping up
(:func:`workers.timelimits.wrap_up`), and the transactions that record what landed and
hand the rest on go ahead (the hard limit still bounds them). No call starts after the
handler's :class:`~workers.replicas.owners.Budget` says it could outlive the task.

**Admission.** A caller may ask that each call be admitted right before it starts
(``admit``): once the call holds its node's slot, the loop hands it to the task's thread,
which admits the calls waiting at that moment together (one store transaction for the
group: a spawn marks their creates sent) and tells the loop which may start. So what a
worker killed mid-batch leaves admitted and unanswered is at most the calls that held
slots - a node's in-flight bound - never the ones still queued behind them. The thread
serves admissions as they come, between its slices; an admission that raises stops all
further ones (the calls already out finish and are handed on), and :attr:`Ran.error`
holds what it raised for the caller to raise once it has recorded what landed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from config.settings import Settings
from workers import timelimits
from workers.backends import inflight, node_slots
from workers.replicas.owners import Budget

log = logging.getLogger(__name__)

T = TypeVar("T")
FLUSH_S = 0.2  # while a batch runs, calls that succeeded are handed on this often
CANCEL_WAIT_S = 5.0  # how long a cut batch waits for its calls to unwind


@dataclass
class Ran(Generic[T]):
    """What a batch of calls came to, item by item."""

    batch: inflight.Batch
    items: list[T]
    handed: set[int] = field(default_factory=set)  # ids already given to ``on_landed``
    cut: bool = False  # the task's soft time limit cut the batch short
    refused: set[int] = field(default_factory=set)  # ids ``admit`` did not return: not ours
    unadmitted: set[int] = field(default_factory=set)  # ids never admitted: admission stopped
    error: Exception | None = None  # what an admission raised (the batch sent no more)

    def result(self, item: T) -> inflight.Result | None:
        """The item's result, or None if its call never ended (cut, or never sent)."""
        return self.batch.results.get(id(item))

    def started(self, item: T) -> bool:
        """Whether the item's call was sent."""
        return id(item) in self.batch.started

    def not_ours(self, item: T) -> bool:
        """Whether admission found the item was no longer the caller's to send."""
        return id(item) in self.refused

    @property
    def lanes(self) -> dict[Any, inflight.Lane]:
        """The lanes, by key."""
        return self.batch.lanes

    def landed(self) -> list[tuple[T, Any]]:
        """Successful calls not yet handed to ``on_landed``, with their values."""
        out = []
        for item in self.items:
            r = self.batch.results.get(id(item))
            if r is not None and r.error is None and id(item) not in self.handed:
                out.append((item, r.value))
        return out


def run(  # noqa: PLR0913 - a batch's parts, the rest by name
    settings: Settings,
    budget: Budget,
    work: Mapping[Hashable, Sequence[T]],
    lane_of: Callable[[Hashable], inflight.Lane],
    call: Callable[[T], Awaitable[Any]],
    *,
    failed: Callable[[BaseException], bool],
    on_landed: Callable[[list[tuple[T, Any]]], None] | None = None,
    admit: Callable[[list[T]], Collection[T]] | None = None,
) -> Ran[T]:
    """Run every call of ``work`` (a list of items per node) within ``budget``; what happened.

    ``admit(items)``, on this thread, admits calls that hold their slots (a group at a
    time) and returns those that may start; the others are :meth:`Ran.not_ours`.
    """
    items = [item for group in work.values() for item in group]
    ran: Ran[T] = Ran(inflight.Batch(), items)
    landed: queue.SimpleQueue[tuple[T, Any]] = queue.SimpleQueue()
    unwound = threading.Event()
    wake = threading.Event()
    door = _Door(admit, ran, wake) if admit is not None else None

    def on_result(item: T, result: inflight.Result) -> None:
        if result.error is None:
            landed.put((item, result.value))

    async def body() -> None:
        try:
            await inflight.lanes(
                work,
                lane_of,
                call,
                failed=failed,
                total=settings.max_inflight,
                on_result=on_result,
                source=node_slots.source(settings),
                batch=ran.batch,
                start_before=budget.send_until,
                admit=door.ask if door is not None else None,
            )
        finally:
            unwound.set()

    future = inflight.submit(body())
    future.add_done_callback(lambda _: wake.set())
    handed_at = time.monotonic()
    try:
        while not future.done():
            wake.wait(_slice())
            wake.clear()
            try:
                if door is not None:
                    door.serve()
                if future.done():
                    break
                timelimits.check("handing on the calls that landed")
                if time.monotonic() - handed_at >= FLUSH_S:
                    _hand_on(ran, landed, on_landed)
                    handed_at = time.monotonic()
            except timelimits.OutOfTime:  # delivered: the task is now wrapping up
                ran.cut = True  # what landed and was not handed on is in ran.landed()
                break
    finally:  # never leave calls running behind the task, whatever ended the wait
        if door is not None:
            door.close()
        if not future.done():
            future.cancel()
            if not unwound.wait(CANCEL_WAIT_S):
                log.warning("calls of a cut batch did not unwind within %gs", CANCEL_WAIT_S)
    if ran.cut:
        log.warning(
            "soft time limit: %d of %d calls ended, %d cut off, the rest not sent",
            len(ran.batch.results),
            len(items),
            len(ran.batch.started) - len(ran.batch.results),
        )
    elif not future.cancelled():
        future.result()  # the lanes' own failure (a bug), if any
    return ran


class _Door(Generic[T]):
    """Admission: calls holding their slots wait on the loop; the task's thread admits them.

    :meth:`ask` runs on the loop; :meth:`serve` on the task's thread, which admits every
    call waiting at that moment at once. After an admission raised, or :meth:`close`,
    every call is refused without asking.
    """

    def __init__(
        self, admit: Callable[[list[T]], Collection[T]], ran: Ran[T], wake: threading.Event
    ) -> None:
        self.admit = admit
        self.ran = ran
        self.wake = wake
        self.lock = threading.Lock()
        self.waiting: list[tuple[T, asyncio.Future[bool], asyncio.AbstractEventLoop]] = []
        self.shut = False

    async def ask(self, item: T) -> bool:
        """Wait until the task's thread admits ``item`` (or refuses it)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        with self.lock:
            if self.shut:
                self.ran.unadmitted.add(id(item))
                return False
            self.waiting.append((item, fut, loop))
        self.wake.set()
        return await fut

    def serve(self) -> None:
        """Admit the calls waiting now, in one group (raises :class:`OutOfTime` past the limit)."""
        with self.lock:
            group, self.waiting = self.waiting, []
        if not group:
            return
        try:
            allowed = {id(item) for item in self.admit([item for item, _, _ in group])}
        except timelimits.OutOfTime:
            self._answer(group, set(), unadmitted=True)
            self.close()
            raise
        except Exception as exc:  # the store, say: send no more; what is out finishes
            log.warning("admitting %d call(s) failed; sending no more: %s", len(group), exc)
            self.ran.error = exc
            self._answer(group, set(), unadmitted=True)
            self.close()
            return
        self._answer(group, allowed, unadmitted=False)

    def _answer(
        self,
        group: list[tuple[T, asyncio.Future[bool], asyncio.AbstractEventLoop]],
        allowed: set[int],
        *,
        unadmitted: bool,
    ) -> None:
        for item, fut, loop in group:
            ok = id(item) in allowed
            if not ok:
                (self.ran.unadmitted if unadmitted else self.ran.refused).add(id(item))
            loop.call_soon_threadsafe(_resolve, fut, ok)

    def close(self) -> None:
        """Refuse every call from now on, and those still waiting."""
        with self.lock:
            self.shut = True
            group, self.waiting = self.waiting, []
        self._answer(group, set(), unadmitted=True)


def _resolve(fut: asyncio.Future[bool], ok: bool) -> None:
    if not fut.done():
        fut.set_result(ok)


def _slice() -> float:
    """How long to wait for the batch before handing on and looking at the deadline again."""
    deadline = timelimits.current()
    if deadline is None or deadline.wrapping_up:
        return FLUSH_S
    return max(0.001, min(FLUSH_S, deadline.left()))


def _hand_on(
    ran: Ran[T],
    landed: queue.SimpleQueue[tuple[T, Any]],
    on_landed: Callable[[list[tuple[T, Any]]], None] | None,
) -> None:
    """Give the calls that succeeded since last time to ``on_landed``."""
    if on_landed is None:
        return
    new = []
    while True:
        try:
            new.append(landed.get_nowait())
        except queue.Empty:
            break
    if new:
        on_landed(new)
        ran.handed.update(id(item) for item, _ in new)
