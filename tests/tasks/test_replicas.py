"""The replica tasks' port (tasks/replicas.py): each message of the plan becomes its task.

The wire format is the tasks' and must not change (messages in flight depend on it):
each message names one task and carries exactly its arguments, a retry after the sending
task's backoff counted as a first retry. Signatures are built, not sent: no broker.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from config import lazy
from tasks import replicas as replica_tasks
from workers import replicas
from workers.replicas.plan import DeleteBatch, DeleteOne, Message, SpawnBatch, SpawnJob, SpawnOne


@pytest.fixture
def port() -> Any:
    """The port of a spawn batch task, outside a run (no retries made yet)."""
    return replica_tasks._Port(replica_tasks.spawn_batch)


@pytest.mark.parametrize(
    ("message", "task", "args", "after_backoff"),
    [
        (
            SpawnBatch("op", "fn", (SpawnJob("r1"), SpawnJob("r2", "n1"))),
            "corral.spawn_batch",
            ("op", "fn", [["r1", None], ["r2", "n1"]]),
            False,
        ),
        (SpawnOne("op", "r1", "fn"), "corral.spawn_replica", ("op", "r1", "fn"), False),
        (
            SpawnOne(None, "r1", "fn", after_backoff=True),
            "corral.spawn_replica",
            (None, "r1", "fn"),
            True,
        ),
        (DeleteBatch("op", ("a", "b")), "corral.delete_batch", ("op", ["a", "b"]), False),
        (DeleteOne("a", None), "corral.delete_replica", ("a", None), True),
    ],
)
def test_each_message_is_its_task_with_its_arguments(
    port: Any, message: Message, task: str, args: tuple[Any, ...], after_backoff: bool
) -> None:
    signature = port._signature(message)
    assert signature.task == task
    assert tuple(signature.args) == args
    assert [type(a) for a in signature.args] == [type(a) for a in args]  # lists stay lists
    assert signature.immutable
    if after_backoff:
        assert signature.options["retries"] == 1
        assert signature.options["countdown"] > 0
    else:
        assert "countdown" not in signature.options and "retries" not in signature.options


def test_every_name_of_the_face_is_its_modules_own() -> None:
    for name in replicas.__all__:
        module, attr = lazy.split(replicas._FACE[name])
        assert attr == name
        assert getattr(replicas, name) is getattr(importlib.import_module(module), name), name
    with pytest.raises(AttributeError, match="no attribute 'run_batch'"):
        _ = replicas.run_batch  # type: ignore[attr-defined]  # not on the face
