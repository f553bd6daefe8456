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

The **hybrid policy** reads two windows off it, both measured from the end of the
function's last invocation:

* the *pre-warm window* - the histogram's head (the ``head`` percentile, 5th), less a
  ``margin`` (10%): no replica is needed before it. When it is not 0 the pattern says
  the next call is far, so the replica is let go right after use and one is started
  again when the pre-warm window ends;
* the *keep-alive window* - the histogram's tail (the ``tail`` percentile, 99th, to the
  end of its bin), plus the margin: past it the call is not coming soon, so no replica
  is kept.

It trusts the histogram only when it is representative: at least ``min_idle_times``
idle times, and concentrated - the coefficient of variation (CV) of its bin counts at
least ``cv_threshold`` (2); a flat histogram says nothing about when the next call
comes. While it is not, the function keeps its **fixed** keep-alive (its idle timeout
for the reaper, ``--scale-to-zero-after`` for the autoscaler). When at least
``oob_threshold`` (half) of the idle times are beyond the range, the histogram cannot
say where the next one falls: the paper forecasts it with ARIMA, corral with the last
few such idle times (:data:`RECENT_OOB`) when they agree - a daily job's are all about
24 h - and from their spread: pre-warm at the shortest less a pad, keep until the
longest plus it (the pad: ``margin`` of the spread, at least one bin). Idle times beyond
the range that do not agree fall back to fixed.

:class:`Plan` applies the windows to a moment: :meth:`Plan.warm` says whether one
replica should be up now (the autoscaler's floor, the pre-warm spawn), and
:meth:`Plan.release_before` which idle replicas may go (the reaper's idle selection).
``python -m bench.keepalive`` replays traces through exactly these.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["fixed", "histogram", "forecast"]
MODES: tuple[Mode, ...] = ("fixed", "histogram", "forecast")

RECENT_OOB = 8  # out-of-bounds idle times kept as they are, newest last
FORECAST_MIN = 3  # out-of-bounds idle times that must agree before a forecast is made


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


@dataclass(frozen=True)
class KeepAlivePolicy:
    """The hybrid policy's knobs (``CORRAL_KEEPALIVE_*``)."""

    head: float = 0.05  # the percentile (as a fraction) whose bin starts the pre-warm window
    tail: float = 0.99  # the percentile whose bin ends the keep-alive window
    margin: float = 0.10  # taken off the pre-warm window, added to the keep-alive window
    cv_threshold: float = 2.0  # bin counts at least this concentrated: a pattern
    min_idle_times: int = 5  # fewer idle times than this are not representative
    oob_threshold: float = 0.5  # at least this share beyond the range: forecast instead

    @classmethod
    def from_settings(cls, settings: Any) -> KeepAlivePolicy:
        """The policy of a :class:`config.settings.Settings`."""
        return cls(
            head=settings.keepalive_head_percentile / 100,
            tail=settings.keepalive_tail_percentile / 100,
            margin=settings.keepalive_margin,
            cv_threshold=settings.keepalive_cv_threshold,
            min_idle_times=settings.keepalive_min_idle_times,
            oob_threshold=settings.keepalive_oob_threshold,
        )


@dataclass(frozen=True)
class Windows:
    """What the policy makes of one function's idle times, from the end of its last call."""

    mode: Mode  # fixed: the function's own fixed keep-alive decides
    prewarm_s: float  # no replica needed before this (0: keep one from the end of the call)
    keep_s: float | None  # keep one until this, none after (None: the fixed rule)
    idle_times: int  # how many the histogram holds
    reason: str  # why this mode, in words

    def as_dict(self) -> dict[str, Any]:
        """The windows as plain data (``functions show``, metrics, task results)."""
        return {
            "mode": self.mode,
            "prewarm_s": round(self.prewarm_s, 3),
            "keep_s": None if self.keep_s is None else round(self.keep_s, 3),
            "idle_times": self.idle_times,
            "reason": self.reason,
        }


def fixed(reason: str, idle_times: int = 0) -> Windows:
    """The windows of a function whose fixed keep-alive decides."""
    return Windows("fixed", 0.0, None, idle_times, reason)


def windows(policy: KeepAlivePolicy, hist: IdleHistogram | None) -> Windows:
    """The pre-warm and keep-alive windows a function's idle times call for."""
    if hist is None:
        return fixed("no idle times recorded")
    total = hist.total
    if total < policy.min_idle_times:
        return fixed(
            f"{total} idle times, not yet representative (needs {policy.min_idle_times})", total
        )
    if hist.oob / total >= policy.oob_threshold:
        return _forecast(policy, hist)
    cv = coefficient_of_variation(hist.counts)
    if cv < policy.cv_threshold:
        return fixed(f"no clear pattern (CV {cv:.2f} < {policy.cv_threshold:g})", total)
    head = percentile_bin(hist.counts, policy.head)
    tail = percentile_bin(hist.counts, policy.tail)
    return Windows(
        "histogram",
        head * hist.bin_s * (1 - policy.margin),
        (tail + 1) * hist.bin_s * (1 + policy.margin),
        total,
        f"CV {cv:.2f}: head in bin {head}, tail in bin {tail}",
    )


def _forecast(policy: KeepAlivePolicy, hist: IdleHistogram) -> Windows:
    """Windows for idle times mostly beyond the range: from the latest of them, if they agree."""
    recent = hist.recent_oob
    total = hist.total
    share = f"{hist.oob} of {total} idle times beyond {hist.range_s:g}s"
    if len(recent) < FORECAST_MIN:
        return fixed(f"{share}, too few to forecast", total)
    middle = statistics.median(recent)
    spread = max(recent) - min(recent)
    if spread > middle / 2:
        return fixed(
            f"{share}, too irregular to forecast ({min(recent):.0f}s to {max(recent):.0f}s)", total
        )
    pad = max(hist.bin_s, policy.margin * spread)
    return Windows(
        "forecast",
        max(0.0, min(recent) - pad),
        max(recent) + pad,
        total,
        f"{share}: next about {middle:.0f}s after the last",
    )


def coefficient_of_variation(counts: list[int]) -> float:
    """Standard deviation over mean of the bin counts (0 for an empty histogram)."""
    n = len(counts)
    total = sum(counts)
    if n < 2 or total == 0:
        return 0.0
    mean = total / n
    var = sum((c - mean) ** 2 for c in counts) / (n - 1)
    return math.sqrt(var) / mean


def percentile_bin(counts: list[int], fraction: float) -> int:
    """The first bin at which the counts reach ``fraction`` of their sum."""
    total = sum(counts)
    running = 0
    for i, c in enumerate(counts):
        running += c
        if total and running >= fraction * total:
            return i
    return len(counts) - 1


@dataclass(frozen=True)
class Plan:
    """A function's windows and the end of its last invocation: what to do at a moment."""

    windows: Windows
    last: float | None  # epoch seconds of the function's newest activity (None: unknown)

    def warm(self, now: float) -> bool | None:
        """Whether one replica should be up now (None: the fixed rule decides)."""
        w = self.windows
        if w.keep_s is None or self.last is None:
            return None
        return w.prewarm_s <= now - self.last < w.keep_s

    def release_before(self, now: float) -> float | None:
        """Idle replicas idle since this moment or earlier may go now (None: the fixed rule).

        Outside the windows (the next call is not due yet, or not any more) every idle
        replica may go; inside, those idle longer than the keep-alive window.
        """
        w = self.windows
        if w.keep_s is None:
            return None
        if self.last is not None and self.warm(now) is False:
            return now
        return now - w.keep_s
