"""Fixtures for the agent tests: agents with real drivers, a recording registry."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from agents import MemoryDriver, ProcessDriver, RunningAgent, serve_fcdaemon
from protos import fcdaemon_grpc
from tests.agents.helpers import RecordingRegistry, start_registry


@pytest.fixture
def registry() -> Iterator[tuple[str, RecordingRegistry]]:
    """A recording registry on loopback: (address, servicer)."""
    server, address, servicer = start_registry()
    yield address, servicer
    server.stop(0).wait()


@pytest.fixture
def process_agent() -> Iterator[RunningAgent]:
    """A node agent whose replicas are real processes."""
    running = serve_fcdaemon(driver=ProcessDriver())
    yield running
    running.stop()


@pytest.fixture
def memory_agent() -> Iterator[RunningAgent]:
    """A node agent whose VMs are records."""
    running = serve_fcdaemon(driver=MemoryDriver())
    yield running
    running.stop()


def stub_for(running: RunningAgent) -> fcdaemon_grpc.FcServiceStub:
    """A FcService stub on a fresh channel to ``running``."""
    return fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(running.address))


@pytest.fixture
def process_stub(process_agent: RunningAgent) -> fcdaemon_grpc.FcServiceStub:
    """Stub for :func:`process_agent`."""
    return stub_for(process_agent)


@pytest.fixture
def memory_stub(memory_agent: RunningAgent) -> fcdaemon_grpc.FcServiceStub:
    """Stub for :func:`memory_agent`."""
    return stub_for(memory_agent)
