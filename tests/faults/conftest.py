"""What the fault tests share: corral's registry on loopback, and the pools a worker runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks.maintenance import QUEUE
from tests.fixtures import Env
from workers.registry.service import RunningRegistry, serve_registry

POOLS = pytest.mark.parametrize("pool", ["threads", "prefork"])  # the default, and prefork


@pytest.fixture
def registry(broker_env: Env) -> Iterator[RunningRegistry]:
    """corral's registry on loopback, for agents to register with and report READY to."""
    running = serve_registry(broker_env.settings, "127.0.0.1:0", queue=QUEUE)
    yield running
    running.stop(grace=0)
