"""What the fault tests share: the registry on loopback, the pools a worker runs, short limits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks.maintenance import QUEUE
from tests.fixtures import Env
from workers.registry.service import RunningRegistry, serve_registry

POOLS = pytest.mark.parametrize("pool", ["threads", "prefork"])  # the default, and prefork

# Short limits so redelivery happens within a test: a task's creates must end within its
# soft limit (calls of 2 s), its ownership of a row lapses at its hard limit, and a killed
# worker's message comes back after the visibility timeout.
SHORT = {
    "CORRAL_TASK_SOFT_TIME_LIMIT_S": "4",
    "CORRAL_TASK_TIME_LIMIT_S": "5",
    "CORRAL_VISIBILITY_TIMEOUT_S": "6",
}


def apply_limits(env: Env, limits: dict[str, str]) -> None:
    """Set these ``CORRAL_*`` variables in the test's own settings (the workers get them too)."""
    env.set(**{k[len("CORRAL_") :].lower(): v for k, v in limits.items()})


@pytest.fixture
def registry(broker_env: Env) -> Iterator[RunningRegistry]:
    """corral's registry on loopback, for agents to register with and report READY to."""
    running = serve_registry(broker_env.settings, "127.0.0.1:0", queue=QUEUE)
    yield running
    running.stop(grace=0)
