"""Fixtures for the autoscaler's tests that run real replicas behind a real gateway."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agents import ProcessDriver, RunningAgent, serve_fcdaemon
from tests.fixtures import Env
from workers.fleet.nodes import upsert_node


@pytest.fixture
def agent(broker_env: Env) -> Iterator[RunningAgent]:
    """A process agent (its replicas are processes serving HTTP on loopback) as ``node1``."""
    running = serve_fcdaemon("127.0.0.1:0", driver=ProcessDriver())
    with broker_env.db.transaction() as s:
        upsert_node(s, running.address, name="node1", capacity=64)
    yield running
    running.stop(grace=0)
