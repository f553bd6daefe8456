"""The task base class's retry backoff: exponential, capped, with equal jitter."""

from __future__ import annotations

from config.settings import load_settings
from workers.celery import backoff_s


def test_each_wait_is_half_to_all_of_its_doubling_capped_ceiling() -> None:
    settings = load_settings(retry_backoff_s=0.5, retry_backoff_max_s=30)
    for retries in range(10):
        ceiling = min(30.0, 0.5 * 2**retries)
        waits = [backoff_s(settings, retries) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (retries, min(waits))
        # jittered: spread over the range, not one value (0.8^200 odds of a false alarm)
        assert min(waits) < 0.6 * ceiling and max(waits) > 0.9 * ceiling


def test_the_retries_of_a_budget_span_at_least_half_their_ceilings() -> None:
    # Equal, not full, jitter: five retries give an agent that is down at least
    # 0.25 + 0.5 + 1 + 2 + 4 = 7.75 s to come back before the task gives up.
    settings = load_settings(retry_backoff_s=0.5, retry_backoff_max_s=30, retry_max=5)
    for _ in range(200):
        assert sum(backoff_s(settings, r) for r in range(settings.retry_max)) >= 7.75


def test_a_zero_backoff_retries_at_once() -> None:
    settings = load_settings(retry_backoff_s=0, retry_backoff_max_s=0)
    assert backoff_s(settings, 3) == 0
