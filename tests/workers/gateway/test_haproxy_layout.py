"""The warm path's private directories: locked while their gateway lives, removed once it is dead.

A gateway killed outright cannot remove its HAProxy's directory; the next gateway of the
same user beside it does. "Dead" here is a real process holding a layout, SIGKILLed.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.gateway.haproxy import layout as layout_mod
from workers.gateway.haproxy.layout import MARK, PREFIXES, SWEEP_MAX, Layout, sweep

HOLDER = """
import sys, threading
from pathlib import Path
from workers.gateway.haproxy.layout import Layout
made = Layout.make(Path(sys.argv[1]))
print(made.dir, flush=True)
threading.Event().wait()  # holds the layout until it is killed
"""


@pytest.fixture
def short() -> Iterator[Path]:
    """A directory with a path short enough for the sockets (pytest's own may be too long)."""
    made = Path(tempfile.mkdtemp(prefix="hl-", dir="/tmp"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def held_by_another(path: Path) -> bool:
    """True if an exclusive lock on ``path`` is held (by anyone but this open)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def holder(state_dir: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process that made a layout in ``state_dir`` and lives on; its directory."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(state_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the holder said nothing"
    return proc, Path(line)


def test_a_layout_is_private_marked_and_locked_until_removed(short: Path) -> None:
    made = Layout.make(short)
    assert made.dir.parent == short and made.dir.name.startswith(PREFIXES[0])
    assert made.dir.stat().st_mode & 0o777 == 0o700
    assert (made.dir / MARK).exists()
    assert held_by_another(made.dir)
    assert fcntl.fcntl(made.lock_fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # HAProxy gets none
    assert sweep(short) == [] and made.dir.exists()  # a live one is kept
    assert [p.name for p in short.iterdir()] == [made.dir.name]  # no hidden one left
    made.remove()
    made.remove()  # idempotent
    assert not made.dir.exists() and made.lock_fd == -1


def test_a_dead_gateways_directory_is_removed_by_the_next_and_a_live_ones_kept(
    short: Path,
) -> None:
    dead, dead_dir = holder(short)
    live, live_dir = holder(short)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert dead_dir.exists() and not held_by_another(dead_dir)
        made = Layout.make(short)
        assert not dead_dir.exists()  # its gateway is gone: nobody else would remove it
        assert live_dir.exists() and (live_dir / MARK).exists()  # its gateway lives
        assert made.dir.exists() and made.dir not in (dead_dir, live_dir)
        made.remove()
    finally:
        live.kill()
        live.wait(10)


def test_what_is_not_a_dead_gateways_directory_is_left_alone(short: Path) -> None:
    unmarked = short / f"{PREFIXES[0]}unmarked"  # an older version's: its owner may live
    unmarked.mkdir()
    a_file = short / f"{PREFIXES[0]}file"
    a_file.write_text("x")
    target = short / "elsewhere"
    target.mkdir()
    (target / MARK).touch()
    link = short / f"{PREFIXES[0]}link"
    link.symlink_to(target)
    other = short / "other-dir"
    other.mkdir()
    (other / MARK).touch()
    assert sweep(short) == []
    for path in (unmarked, a_file, target, link, other):
        assert path.exists(), path


def test_one_start_removes_at_most_sweep_max_directories(short: Path) -> None:
    for i in range(SWEEP_MAX + 3):
        left = short / f"{PREFIXES[0]}{i:08d}"
        left.mkdir()
        (left / MARK).touch()  # marked, and nobody holds its lock: left by the dead
    assert len(sweep(short)) == SWEEP_MAX
    assert len(sweep(short)) == 3
    assert list(short.iterdir()) == []


def test_a_state_directory_too_long_for_a_socket_uses_the_temporary_one(
    short: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = short / "t"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    deep = tmp_path / ("d" * 100)
    left = tmp / f"{PREFIXES[1]}leftover"
    left.mkdir()
    (left / MARK).touch()
    made = Layout.make(deep)
    assert made.dir.parent == tmp and made.dir.name.startswith(PREFIXES[1])
    assert len(str(made.activator)) <= layout_mod.SOCKET_PATH_MAX
    assert not left.exists()  # the sweep looks where the layout is made
    made.remove()
