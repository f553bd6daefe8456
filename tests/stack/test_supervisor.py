"""``corral up``'s supervisor: children started together are waited for together.

Each child here is a shell script whose readiness is a file it creates; a child that
exits or stays unready past its timeout is named, with the end of its log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stack.supervisor import Child, Supervisor, stop_process
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


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie is gone too


def test_stop_process_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        ["/bin/sh", "-c", "trap '' TERM; touch ready; while :; do sleep 0.05; done"],
        cwd=tmp_path,
    )
    eventually((tmp_path / "ready").exists, 30, "the child to trap SIGTERM")
    assert stop_process(proc, 0.2) == -signal.SIGKILL


def test_stop_process_of_a_group_kills_what_outlives_its_leader(tmp_path: Path) -> None:
    proc = subprocess.Popen(  # the leader exits at once; its child, in its group, stays
        ["/bin/sh", "-c", "sh -c 'trap \"\" TERM; echo $$ > left; exec sleep 600' & exit 0"],
        cwd=tmp_path,
        start_new_session=True,
    )
    eventually(lambda: (tmp_path / "left").exists() and (tmp_path / "left").read_text(), 30)
    left = int((tmp_path / "left").read_text())
    proc.wait(30)
    assert stop_process(proc, 0.2, group=True) == 0
    eventually(lambda: _pid_gone(left), 30, "the leader's child to be killed")


_PARENT = """
import sys, time
from pathlib import Path
from stack.supervisor import Child
here = Path(sys.argv[1])
argv = ["/bin/sh", "-c", "echo $$ > child; exec sleep 600"]
Child("sleeper", argv, {}, here / "c.log", here).start()
time.sleep(600)
"""


@pytest.mark.parametrize("setpriv", [True, False], ids=["setpriv", "preexec_fn"])
def test_a_child_dies_with_its_supervisor_even_one_killed_without_a_word(
    tmp_path: Path, setpriv: bool
) -> None:
    env = dict(os.environ)
    if not setpriv:  # a PATH without util-linux's setpriv: the preexec_fn's prctl instead
        env["PATH"] = str(tmp_path)
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path)], cwd=Path.cwd(), env=env
    )
    try:
        pid_file = tmp_path / "child"
        eventually(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "the child")
        child = int(pid_file.read_text())
        assert not _pid_gone(child)
    finally:
        parent.kill()  # SIGKILL: no stop_all, no atexit; only the kernel can tell the child
        parent.wait(30)
    eventually(lambda: _pid_gone(child), 30, "the child of a killed supervisor to die")
