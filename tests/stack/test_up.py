"""``corral up``'s port choice: the default unless taken or claimed by another stack starting."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

from stack.redis import free_port
from stack.supervisor import Supervisor
from stack.up import _Launch


@pytest.fixture(autouse=True)
def _claims_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Claims under the test's own directory, not the machine's temporary directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _launch(tmp_path: Path) -> _Launch:
    return _Launch(Supervisor(say=lambda _line: None), {}, tmp_path, tmp_path)


def _close(launch: _Launch) -> None:
    for fd in launch._claims:
        os.close(fd)


def test_a_second_stack_starting_at_once_takes_another_port_until_the_first_ends(
    tmp_path: Path,
) -> None:
    preferred = free_port()
    first, second = _launch(tmp_path), _launch(tmp_path)
    assert first.port(preferred) == preferred  # free and unclaimed: the default
    # the first stack's child has not bound it yet: only the claim keeps the second away
    other = second.port(preferred)
    assert other != preferred
    _close(first)
    assert _launch(tmp_path).port(preferred) == preferred  # the claim ended with its stack
    _close(second)


def test_a_port_in_use_is_not_taken_even_unclaimed(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        launch = _launch(tmp_path)
        assert launch.port(port) != port
        assert launch._claims == []  # a port not taken is not kept claimed
