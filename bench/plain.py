"""A plain Celery app with a no-op task: :mod:`bench.spawn`'s outside baseline (not corral's app).

Configured as the issue measured it: late acks, prefetch 1, JSON, results in
Redis. The broker and result URLs come from ``BENCH_BROKER_URL`` and
``BENCH_RESULT_BACKEND``. Run by ``celery -A bench.plain worker``.
"""

from __future__ import annotations

import os

from celery import Celery


def make_app(broker: str, backend: str) -> Celery:
    """The plain app on ``broker`` with results in ``backend``, with its no-op task."""
    plain = Celery("plain", broker=broker, backend=backend)
    plain.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=False,
    )

    @plain.task(name="plain.noop", shared=False)
    def noop() -> None:
        """Do nothing."""

    return plain


app = make_app(
    os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"),
    os.environ.get("BENCH_RESULT_BACKEND", "redis://127.0.0.1:6379/1"),
)
