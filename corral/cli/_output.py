"""Output helpers shared by every command: JSON or tables, progress bars, waiting.

On a terminal, listings are drawn as rich tables and ``--wait`` shows a rich progress
bar (on stderr); anywhere else (a pipe, a file, the tests) a listing is plain aligned
text - the same columns, one row a line - and there is no bar. ``--json`` output is
the same either way.

Every cell and value printed is escaped (:func:`config.redact.escape_controls`): what
a tenant, an agent or an older corral stored may hold control or bidirectional
characters, which a terminal would act on (a newline forges a row, an escape sequence
repaints the screen); they show as ``\x1b``, ``\u202e``. JSON escapes them itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from config.redact import escape_controls
from config.settings import Settings
from corral import api
from corral.api import OperationView


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    """Print ``data`` as JSON with ``--json``, else as ``human`` renders it."""
    if getattr(args, "json", False):
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        text = human(data)
        if text:
            print(text)


def on_terminal() -> bool:
    """Whether stdout is a terminal (then listings are drawn as rich tables)."""
    return sys.stdout.isatty()


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """Rows as a table: rich on a terminal, else aligned plain text."""
    if not rows:
        return "(none)"
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    if on_terminal():
        return rich_table(columns, cells)
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def rich_table(
    columns: Sequence[str], cells: list[list[str]], console: Console | None = None
) -> str:
    """Cells drawn as a rich table for ``console`` (stdout's by default), as text to print.

    Long values fold within their column; a table that cannot fit the terminal even so
    is drawn wider (the terminal wraps it) rather than losing a column.
    """
    console = console or Console()
    drawn = Table(
        box=box.SIMPLE_HEAD, header_style="bold", show_edge=False, padding=(0, 1, 0, 0)
    )  # with the box's divider: two spaces, as in plain text
    for column in columns:
        drawn.add_column(column.upper(), overflow="fold", min_width=len(column))
    for row in cells:
        drawn.add_row(*(Text(value) for value in row))  # values are data, never markup
    console.width = max(console.width, sum(len(column) + 3 for column in columns))
    with console.capture() as captured:
        console.print(drawn)
    return "\n".join(line.rstrip() for line in captured.get().splitlines())


def kv(data: Mapping[str, Any]) -> str:
    """A mapping as aligned ``key  value`` lines."""
    width = max(len(k) for k in data)
    return "\n".join(f"{escape_controls(k).ljust(width)}  {fmt(v)}" for k, v in data.items())


def cell(value: Any) -> str:
    """One value as a table's cell, its control characters escaped."""
    return "" if value is None else escape_controls(str(value))


def fmt(value: Any) -> str:
    """One value as table text, its control characters escaped."""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)  # escapes them itself
    return "" if value is None else escape_controls(str(value))


def wait_and_report(args: argparse.Namespace, settings: Settings, op_id: str) -> int:
    """Print the operation id, or with ``--wait`` follow it and report how it ended."""
    if not args.wait:
        if args.json:
            print(json.dumps({"operation": op_id}))
        else:
            print(op_id)
        return 0
    bar = ProgressBar() if sys.stderr.isatty() and not args.json else None
    try:
        view = api.wait(
            op_id, timeout=args.timeout, settings=settings, progress=bar.update if bar else None
        )
    finally:
        if bar:
            bar.close()
    if args.json:
        print(json.dumps(view, indent=2, sort_keys=True, default=str))
    else:
        line = f"operation {op_id} {view['status']}: {view['done']} done"
        if view["failed"]:
            line += f", {view['failed']} failed"
        if view["maybes"].get("open"):  # creates with unknown outcomes, replaced at once
            line += f" ({view['maybes']['open']} maybe(s) still open: see `corral ops {op_id}`)"
        print(line)
        note = ((view.get("result") or {}).get("plan") or {}).get("note")
        if note:
            print(f"note: {note}")
        if view["error"]:
            print(f"corral: error: {view['error']}", file=sys.stderr)
    return 0 if view["status"] == "succeeded" else 1


class ProgressBar:
    """A rich progress bar on stderr for multi-replica operations (shown once total > 1)."""

    def __init__(self, console: Console | None = None) -> None:
        self._console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def update(self, view: OperationView) -> None:
        """Show the operation's progress: replicas done or failed of its total."""
        total = view["total"]
        if total <= 1:
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("({task.fields[failed]} failed)"),
                TimeElapsedColumn(),
                console=self._console,
            )
            self._progress.start()
            self._task = self._progress.add_task(view["kind"], total=total, failed=0)
        assert self._task is not None  # noqa: S101 - narrows for mypy: set in __enter__
        self._progress.update(
            self._task,
            total=total,
            completed=view["done"] + view["failed"],
            failed=view["failed"],
            description=f"{view['kind']} {view['status']}",
        )

    def close(self) -> None:
        """Leave the bar's last state on screen."""
        if self._progress is not None:
            self._progress.stop()
