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

Bounds, both per process:

* at most ``CORRAL_NODE_MAX_INFLIGHT`` calls in flight to one node
  (:func:`slot` takes a per-node semaphore), so a node sees at most that many
  concurrent calls from a process (times the worker processes from a fleet);
* at most ``CORRAL_MAX_INFLIGHT`` calls in flight from the process to all nodes.

:func:`lanes` runs a batch of calls grouped by node with those bounds, plus two
rules of its own per node: a node on **probation** (it never created a VM, or its
last creates failed) is sent only as many calls as it may still fail before
quarantine, until one succeeds; and after ``stop_after`` failures in a row in this
batch the node's remaining calls are not sent at all (returned untried), so a
broken node costs a batch at most a few calls, not one per replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


class _Loop:
    """The process's event loop thread and what lives on it."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.node_limits: dict[Hashable, asyncio.Semaphore] = {}
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
    """Run ``coro`` on this process's loop and wait for its result."""
    return submit(coro).result(timeout)


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


@asynccontextmanager
async def slot(node: Hashable, per_node: int, total: int) -> Any:
    """Hold one of ``per_node`` call slots of ``node`` and one of the process's ``total``."""
    here = _get()
    sem = here.node_limits.get(node)
    if sem is None or getattr(sem, "_corral_bound", None) != per_node:
        sem = asyncio.Semaphore(per_node)
        sem._corral_bound = per_node  # type: ignore[attr-defined]
        here.node_limits[node] = sem
    if here.total is None or getattr(here.total, "_corral_bound", None) != total:
        here.total = asyncio.Semaphore(total)
        here.total._corral_bound = total  # type: ignore[attr-defined]
    whole = here.total
    async with whole, sem:
        yield


@dataclass
class Lane:
    """How one node's calls of a batch are sent: how many at once, and when to stop."""

    node: Hashable
    bound: int  # calls at once
    stop_after: int  # failures in a row (in this batch) after which the rest are not sent
    probation: int | None = None  # on probation: calls sent in all until one succeeds
    failures: int = 0  # in a row, in this batch
    succeeded: bool = False
    untried: list[Any] = field(default_factory=list)
    log: list[BaseException | None] = field(default_factory=list)  # outcomes, as they came
    last_error: BaseException | None = None


@dataclass(frozen=True)
class Result:
    """What one call came back with: ``value`` or ``error`` (an exception)."""

    value: Any = None
    error: BaseException | None = None


async def lanes(
    work: Mapping[K, Sequence[T]],
    lane_of: Callable[[K], Lane],
    call: Callable[[T], Awaitable[Any]],
    *,
    failed: Callable[[BaseException], bool],
    total: int,
    on_result: Callable[[T, Result], object] | None = None,
) -> tuple[dict[int, Result], dict[K, Lane]]:
    """Run every item's ``call``, node by node, with the bounds; results by ``id(item)``.

    ``failed(exc)`` says whether an error counts as a failure of the node (for
    the stop rule); items a lane did not send are in its ``untried``.
    ``on_result(item, result)`` runs (on the loop) as each call ends.
    """
    results: dict[int, Result] = {}
    state: dict[K, Lane] = {}

    async def run_lane(key: K, items: Sequence[T]) -> None:
        lane = state[key] = lane_of(key)
        queue: deque[T] = deque(items)
        running: set[asyncio.Task[None]] = set()

        def stopped() -> bool:
            return lane.failures >= lane.stop_after

        async def one(item: T) -> None:
            async with slot(lane.node, lane.bound, total):
                try:
                    value = await call(item)
                except Exception as exc:
                    results[id(item)] = Result(error=exc)
                    if on_result is not None:
                        on_result(item, results[id(item)])
                    lane.log.append(exc)
                    if failed(exc):
                        lane.failures += 1
                        lane.last_error = exc
                    return
            results[id(item)] = Result(value=value)
            if on_result is not None:
                on_result(item, results[id(item)])
            lane.log.append(None)
            lane.failures = 0
            lane.succeeded = True

        while queue or running:
            # On probation a failed call does not free its place: until one succeeds, at
            # most ``probation`` calls are sent in all.
            width = lane.bound
            if lane.probation is not None and not lane.succeeded:
                width = min(width, lane.probation - lane.failures)
            while queue and len(running) < width and not stopped():
                running.add(asyncio.ensure_future(one(queue.popleft())))
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            running -= done
        lane.untried = list(queue)

    await asyncio.gather(*(run_lane(k, v) for k, v in work.items()))
    return results, state
