"""Adaptive keep-alive: a function's idle-time histogram and what it says about its next call.

Pure and typed, like :mod:`workers.autoscale.decision`: no store, no Redis, no clock.
The gateways and the claim API record idle times (:mod:`workers.autoscale.idletimes`
keeps them in Redis); the reaper, the autoscaler and ``python -m bench.keepalive`` all
read them through this module.

The model (Shahrad et al., "Serverless in the Wild", USENIX ATC 2020)
--------------------------------------------------------------------
A function's *idle time* is the time from the end of one invocation to the start of the
next (0 when the next starts while one still runs). Fixed keep-alive (AWS Lambda keeps
an idle instance about 10 minutes, Azure Functions 20) is wrong for most functions:
invocation patterns differ by orders of magnitude between them. So each function gets a
**histogram** of its idle times: ``bin_s`` wide bins (1 minute) over ``range_s`` (4 hours),
and a count of those beyond the range (*out of bounds*). The counts are bounded: once
they hold ``history`` idle times, all are halved, so old behaviour fades and the
histogram stays small.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

RECENT_OOB = 8  # out-of-bounds idle times kept as they are, newest last


@dataclass
class IdleHistogram:
    """One function's idle times: counts per bin, those out of bounds, the latest of those."""

    bin_s: float
    counts: list[int]  # counts[i]: idle times in [i x bin_s, (i + 1) x bin_s)
    oob: int = 0  # idle times of range_s or more
    recent_oob: list[float] = field(default_factory=list)  # the last RECENT_OOB of them

    @classmethod
    def empty(cls, bin_s: float, range_s: float) -> IdleHistogram:
        """A histogram with no idle time yet."""
        return cls(bin_s, [0] * bins_for(bin_s, range_s))

    @property
    def range_s(self) -> float:
        """Idle times below this fall in a bin."""
        return self.bin_s * len(self.counts)

    @property
    def total(self) -> int:
        """Idle times counted, in range and out of bounds."""
        return sum(self.counts) + self.oob

    def add(self, idle_s: float, history: int) -> None:
        """Count one idle time (negative counts as 0); halve everything past ``history``."""
        idle = max(0.0, idle_s)
        i = math.floor(idle / self.bin_s)  # as the recording script computes it
        if i < len(self.counts):
            self.counts[i] += 1
        else:
            self.oob += 1
            self.recent_oob = [*self.recent_oob, idle][-RECENT_OOB:]
        if self.total > history:
            self.halve()

    def add_all(self, idle_times: Iterable[float], history: int) -> None:
        """Count several idle times, in order."""
        for idle in idle_times:
            self.add(idle, history)

    def halve(self) -> None:
        """Halve every count (rounding down): the older half of the history fades."""
        self.counts = [c // 2 for c in self.counts]
        self.oob //= 2


def bins_for(bin_s: float, range_s: float) -> int:
    """How many bins of ``bin_s`` the range holds (at least one)."""
    return max(1, math.ceil(range_s / bin_s - 1e-9))
