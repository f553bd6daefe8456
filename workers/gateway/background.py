"""Work the gateway does off a request's own path: store calls in threads, background tasks.

The store is synchronous (SQLAlchemy): every store call runs in a bounded thread pool
(``CORRAL_GATEWAY_STORE_THREADS``; one on SQLite, which takes one write at a time
anyway) while the event loop serves other requests. The demand and idle-time reports go
to Redis through a thread of their own (:meth:`Background.report`): a statistic must not
wait in line behind store calls (on SQLite the one store thread may wait for the
database's write lock for up to its busy timeout, 30 s, call after call, and a sample
that waited behind them is stale when it lands: the autoscaler sees no demand). Some
work must finish even when the request that started it is cancelled (giving a claim
back, queueing a suspect replica's delete): :meth:`Background.shielded` runs it as a
tracked task the request no longer owns. :meth:`Background.close` waits for every
tracked task, then for the threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Background:
    """The store's thread pool and the gateway's tracked background tasks."""

    def __init__(self, threads: int) -> None:
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="gateway-store")
        self._reports = ThreadPoolExecutor(1, thread_name_prefix="gateway-report")
        self._tasks: set[asyncio.Future[Any]] = set()

    async def store(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a (synchronous) store call in the thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def report(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a (synchronous) Redis report in the reports' own thread, never behind the store."""
        return await asyncio.get_running_loop().run_in_executor(self._reports, fn, *args)

    async def shielded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a store call that completes even if the caller is cancelled meanwhile."""
        return await asyncio.shield(
            self.keep(asyncio.ensure_future(self.store(lambda: fn(*args, **kwargs))))
        )

    def soon(self, work: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Start ``work`` as a tracked task."""
        return self.keep(asyncio.ensure_future(work))

    def keep(self, task: asyncio.Future[T]) -> asyncio.Future[T]:
        """Track a task until it ends (``close`` waits for the rest)."""
        self._tasks.add(task)
        task.add_done_callback(self._settled)
        return task

    def _settled(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # whoever needed it saw it; nobody else must be told

    async def settle(self) -> None:
        """Wait for every tracked task."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        """Wait for the running store calls and reports, and stop the threads."""
        self._threads.shutdown(wait=True)
        self._reports.shutdown(wait=True)
