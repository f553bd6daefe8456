"""``corral up``'s supervisor: children started together are waited for together.

Each child here is a shell script whose readiness is a file it creates; a child that
exits or stays unready past its timeout is named, with the end of its log.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stack.supervisor import Child, Supervisor
from testkit.eventually import eventually


def _child(tmp_path: Path, name: str, script: str) -> Child:
    return Child(
        name, ["/bin/sh", "-c", script], dict(os.environ), tmp_path / f"{name}.log", tmp_path
    )


def test_children_launched_together_may_wait_on_each_other(tmp_path: Path) -> None:
    sup = Supervisor(lambda _: None)
    # `first` is ready only once `second` has run: started one by one, it never would be
    first = sup.launch(
        _child(
            tmp_path, "first", "while [ ! -e second ]; do sleep 0.05; done; touch first; sleep 30"
        )
    )
    second = sup.launch(_child(tmp_path, "second", "touch second; sleep 30"))
    try:
        sup.wait_ready(
            [
                (first, (tmp_path / "first").exists, 30.0),
                (second, (tmp_path / "second").exists, 30.0),
            ]
        )
        assert first.alive and second.alive
    finally:
        sup.stop_all()
    assert not first.alive and not second.alive


def test_a_child_that_exits_or_never_serves_is_named_with_its_log(tmp_path: Path) -> None:
    sup = Supervisor(lambda _: None)
    gone = sup.launch(_child(tmp_path, "gone", "echo cannot bind; exit 3"))
    slow = sup.launch(_child(tmp_path, "slow", "echo still loading; sleep 30"))
    try:
        with pytest.raises(RuntimeError, match=r"gone exited at start:\ncannot bind"):
            sup.wait_ready([(slow, lambda: False, 30.0), (gone, lambda: False, 30.0)])
        eventually(lambda: "loading" in slow.tail(), 30, "slow's first line")
        with pytest.raises(TimeoutError, match=r"slow not ready after 0\.2s:\nstill loading"):
            sup.wait_ready([(slow, lambda: False, 0.2)])
    finally:
        sup.stop_all()
