"""A batch of agent calls inside a task's time: sent at once, recorded as they land, cut cleanly.

A batch's calls run on the process's event loop (:mod:`workers.backends.inflight`, bounded
per node and per process) while the task's thread waits in short slices: every
:data:`FLUSH_S` it hands the calls that succeeded meanwhile to the caller, which records
them (a guest's READY must find its vmid without waiting for the batch's slowest call).
Each slice is also where the running task's soft time limit is checked
(:mod:`workers.base.timelimits`): past it, :func:`run` cancels the calls still in flight (on
the event loop: cancelling is cooperative, nothing is raised into a thread) and returns
what it knows - the calls that ended, the ones that were started and cut off (their
outcome is unknown), the ones never started - instead of letting the calls run on behind
a task that has ended. The soft limit is then delivered: the task is wrapping up
(:func:`workers.base.timelimits.wrap_up`), and the transactions that record what landed and
hand the rest on go ahead (the hard limit still bounds them). No call starts after the
handler's :class:`~workers.replicas.owners.Budget` says it could outlive the task.

**Admission.** A caller may ask that each call be admitted right before it starts
(``admit``): once the call holds its node's slot, it awaits ``admit(item)`` on the loop
(a spawn marks its create sent there: :func:`workers.replicas.owners.mark_sent_soon`,
grouped with every other call of the process admitted at that moment). So what a worker
killed mid-batch leaves admitted and unanswered is at most the calls that held slots - a
node's in-flight bound - never the ones still queued behind them. An admission that
raises stops all further ones (the calls already out finish and are handed on), and
:attr:`Ran.error` holds what it raised, for the caller to raise once it has recorded what
landed.

**What the caller could not take.** If ``on_landed`` raises (the store refused until the
hand-off gave up), the batch ends there; the calls that succeeded after the ones it was
given - waiting their turn, or ending as the batch unwinds - go to ``on_dropped`` (a spawn
keeps them in Redis for the next handler of their rows), never nowhere.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from config.settings import Settings
from workers.backends import inflight, node_slots
from workers.base import timelimits
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
    admit: Callable[[T], Awaitable[bool]] | None = None,
    on_dropped: Callable[[list[tuple[T, Any]]], None] | None = None,
) -> Ran[T]:
    """Run every call of ``work`` (a list of items per node) within ``budget``; what happened.

    ``await admit(item)`` (on the loop) admits a call that holds its slots: false, it is
    :meth:`Ran.not_ours`; raising, it and every call after it are not sent. If
    ``on_landed`` raises, the successes it was not given go to ``on_dropped``.
    """
    items = [item for group in work.values() for item in group]
    ran: Ran[T] = Ran(inflight.Batch(), items)
    landed: queue.SimpleQueue[tuple[T, Any]] = queue.SimpleQueue()
    unwound = threading.Event()
    door = _Door(admit, ran) if admit is not None else None

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
    raised = False
    try:
        while True:
            try:
                future.result(timeout=_slice())
                break
            except concurrent.futures.TimeoutError:
                try:
                    timelimits.check("handing on the calls that landed")
                    _hand_on(ran, landed, on_landed)
                except timelimits.OutOfTime:  # delivered: the task is now wrapping up
                    ran.cut = True  # what landed and was not handed on is in ran.landed()
                    break
    except BaseException:
        raised = True
        raise
    finally:  # never leave calls running behind the task, whatever ended the wait
        if door is not None:
            door.shut = True  # nothing more is admitted
        if not future.done():
            future.cancel()
            if not unwound.wait(CANCEL_WAIT_S):
                log.warning("calls of a cut batch did not unwind within %gs", CANCEL_WAIT_S)
        if raised:
            _drop(landed, on_dropped)
    if ran.cut:
        log.warning(
            "soft time limit: %d of %d calls ended, %d cut off, the rest not sent",
            len(ran.batch.results),
            len(items),
            len(ran.batch.started) - len(ran.batch.results),
        )
    return ran


class _Door(Generic[T]):
    """Admission on the loop: the caller's ``admit``, and what it said, kept in :class:`Ran`.

    After an admission raised (or the batch ended), every call is refused without asking.
    """

    def __init__(self, admit: Callable[[T], Awaitable[bool]], ran: Ran[T]) -> None:
        self.admit = admit
        self.ran = ran
        self.shut = False

    async def ask(self, item: T) -> bool:
        """Whether ``item``'s call may start now."""
        if self.shut:
            self.ran.unadmitted.add(id(item))
            return False
        try:
            ok = await self.admit(item)
        except Exception as exc:  # the store, say: send no more; what is out finishes
            if self.ran.error is None:
                log.warning("admitting a call failed; sending no more: %s", exc)
                self.ran.error = exc
            self.shut = True
            self.ran.unadmitted.add(id(item))
            return False
        if not ok:
            self.ran.refused.add(id(item))
        return ok


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
    new = _drain(landed)
    if new:
        on_landed(new)
        ran.handed.update(id(item) for item, _ in new)


def _drop(
    landed: queue.SimpleQueue[tuple[T, Any]],
    on_dropped: Callable[[list[tuple[T, Any]]], None] | None,
) -> None:
    """Give the successes never handed on to ``on_dropped``; its failure is logged, not raised."""
    left = _drain(landed)
    if not left:
        return
    if on_dropped is None:
        log.error("%d call(s) succeeded after the batch failed; nobody takes them", len(left))
        return
    try:
        on_dropped(left)
    except Exception:  # the batch's own error is the one to raise
        log.exception("%d call(s) that succeeded after the batch failed were lost", len(left))


def _drain(landed: queue.SimpleQueue[tuple[T, Any]]) -> list[tuple[T, Any]]:
    """Everything in the queue now."""
    out = []
    while True:
        try:
            out.append(landed.get_nowait())
        except queue.Empty:
            return out
