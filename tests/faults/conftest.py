"""What the fault tests share: the registry on loopback, the pools a worker runs, short limits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks.maintenance import QUEUE
from tests.fixtures import Env
from workers.registry.service import RunningRegistry, serve_registry

POOLS = pytest.mark.parametrize("pool", ["threads", "prefork"])  # the default, and prefork
"""Each pool on each store (the store's own parametrization): four runs.

For tests where both axes matter: the store's rows, locks and connections meet how the
pool runs and ends tasks (a prefork child forked with the parent's connections, a worker
killed with rows owned or a transaction open, deliveries racing in processes or threads).
"""

#: (pool, store) of each run of a :data:`POOL_PER_STORE` test
POOL_STORE_PAIRS = (("threads", "postgres"), ("prefork", "sqlite"))
POOL_PER_STORE = pytest.mark.parametrize(
    ("pool", "store_url"),
    POOL_STORE_PAIRS,
    indirect=["store_url"],
    ids=[f"{pool}-{store}" for pool, store in POOL_STORE_PAIRS],
)
"""Each pool once and each store once: two runs, the production pair (threads on
PostgreSQL) and prefork on SQLite.

For tests whose subject depends on one axis only: how the pool lands a fault (a hard
limit's kill, a restart, a stalled log pipe) with store work that is incidental, or what
the store keeps (a maybe's rows) whichever pool wrote it. The other two runs of the
product would prove the same again; :data:`POOLS` keeps all four where both matter.
"""

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
