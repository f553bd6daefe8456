"""How listings and progress look: plain text off a terminal, rich tables and a bar on one."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from corral.api import OperationView
from corral.cli import _output

ROWS = [
    {"name": "hello", "live": 3, "error": None},
    {"name": "a-much-longer-name", "live": 10, "error": "[bold]not markup[/bold]"},
]


def _view(done: int, failed: int, status: str, total: int = 4) -> OperationView:
    return {
        "id": "0" * 32,
        "kind": "spawn",
        "status": status,
        "params": {},
        "total": total,
        "done": done,
        "failed": failed,
        "result": None,
        "error": None,
        "created_at": None,
        "started_at": None,
        "finished_at": None,
        "progress_at": None,
        "redrives": 0,
        "maybes": {},
    }


def test_off_a_terminal_a_listing_is_plain_aligned_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_output, "on_terminal", lambda: False)
    assert _output.table(ROWS, ["name", "live", "error"]) == (
        "NAME                LIVE  ERROR\n"
        "hello               3\n"
        "a-much-longer-name  10    [bold]not markup[/bold]"
    )
    assert _output.table([], ["name"]) == "(none)"


def test_on_a_terminal_a_listing_is_a_rich_table_of_the_same_cells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_output, "on_terminal", lambda: True)
    monkeypatch.setattr(
        _output,
        "Console",
        lambda: Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None),
    )
    drawn = _output.table(ROWS, ["name", "live", "error"])
    lines = drawn.splitlines()
    assert [w for w in lines[0].split()] == ["NAME", "LIVE", "ERROR"]
    assert any(set(line.strip()) <= set("─ ") and line.strip() for line in lines)  # the rule
    assert "hello" in drawn and "a-much-longer-name" in drawn
    assert "[bold]not markup[/bold]" in drawn  # a value is shown as it is, never as markup


def test_the_progress_bar_counts_done_and_failed_of_the_total() -> None:
    out = io.StringIO()
    bar = _output.ProgressBar(Console(file=out, force_terminal=True, width=100, color_system=None))
    bar.update(_view(0, 0, "running"))
    bar.update(_view(2, 1, "running"))
    bar.update(_view(3, 1, "partial"))
    bar.close()
    text = out.getvalue()
    assert "4/4" in text and "(1 failed)" in text and "spawn partial" in text


def test_no_bar_for_a_single_replica() -> None:
    out = io.StringIO()
    bar = _output.ProgressBar(Console(file=out, force_terminal=True, color_system=None))
    bar.update(_view(1, 0, "succeeded", total=1))
    bar.close()
    assert out.getvalue() == ""
