"""What the gateway knows of each function: its limit, cached, and its admission gate.

A function's limit (``max_replicas x exec_envs``, the most requests it can serve at
once) comes from the store and is kept for ``FUNCTION_TTL_S``; past that the cached
limit still serves while one refresh runs in the background, so a request never waits
for the store to learn a limit it already had. A function removed from the store is
forgotten at its next refresh (its next request is a 404). Each function known here
has a :class:`workers.gateway.admission.Gate`, resized when its limit changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from workers.base.errors import CorralError, NotFound
from workers.functions import get_function
from workers.gateway.admission import Gate
from workers.gateway.background import Background
from workers.store.db import Database

log = logging.getLogger(__name__)

FUNCTION_TTL_S = 2.0  # how long a function's limits are cached


@dataclass(frozen=True)
class FunctionInfo:
    """What the gateway needs to know about a function."""

    name: str
    limit: int  # max_replicas x exec_envs: the most requests it can serve at once


class Catalog:
    """The functions this gateway has served: limits (cached) and gates."""

    def __init__(self, db: Database, background: Background, queue: int) -> None:
        self.db = db
        self.background = background
        self.queue = queue
        self.gates: dict[str, Gate] = {}
        self._known: dict[str, tuple[FunctionInfo, float]] = {}
        self._refreshing: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._known

    async def get(self, name: str) -> FunctionInfo:
        """The function's limits; raises :class:`NotFound` (or a bad name's CorralError)."""
        cached = self._known.get(name)
        if cached is None:
            return await self._lookup(name)
        if time.monotonic() - cached[1] >= FUNCTION_TTL_S and name not in self._refreshing:
            self._refreshing.add(name)
            self.background.soon(self._refresh(name))
        return cached[0]

    async def _refresh(self, name: str) -> None:
        try:
            await self._lookup(name)
        except CorralError:
            pass  # removed: forgotten, so the next request for it is answered 404
        except Exception as exc:  # the store is away: keep the old limits, try again later
            log.warning("gateway: could not refresh function %s: %s", name, exc)
        finally:
            self._refreshing.discard(name)

    async def _lookup(self, name: str) -> FunctionInfo:
        try:
            info = await self.background.store(self._load, name)
        except NotFound:
            self._known.pop(name, None)
            raise
        self._known[name] = (info, time.monotonic())
        gate = self.gates.get(name)
        if gate is None:
            self.gates[name] = Gate(info.limit, self.queue)
        elif gate.limit != info.limit:
            gate.resize(info.limit, self.queue)
        return info

    def _load(self, name: str) -> FunctionInfo:
        with self.db.read() as s:
            fn = get_function(s, name)
            return FunctionInfo(fn.name, max(1, fn.max_replicas * fn.exec_envs))
