"""Output helpers shared by every command: JSON or tables, progress bars, waiting."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from config.settings import Settings
from tasks import api
from tasks.api import OperationView


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    """Print ``data`` as JSON with ``--json``, else as ``human`` renders it."""
    if getattr(args, "json", False):
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        text = human(data)
        if text:
            print(text)


def table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows as an aligned text table."""
    if not rows:
        return "(none)"
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def kv(data: dict[str, Any]) -> str:
    """A mapping as aligned ``key  value`` lines."""
    width = max(len(k) for k in data)
    return "\n".join(f"{k.ljust(width)}  {fmt(v)}" for k, v in data.items())


def fmt(value: Any) -> str:
    """One value as table text."""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return "" if value is None else str(value)


def wait_and_report(args: argparse.Namespace, settings: Settings, op_id: str) -> int:
    """Print the operation id, or with ``--wait`` follow it and report how it ended."""
    if not args.wait:
        if args.json:
            print(json.dumps({"operation": op_id}))
        else:
            print(op_id)
        return 0
    bar = ProgressBar() if sys.stderr.isatty() and not args.json else None
    view = api.wait(op_id, timeout=args.timeout, settings=settings,
                    progress=bar.update if bar else None)
    if bar:
        bar.close()
    if args.json:
        print(json.dumps(view, indent=2, sort_keys=True, default=str))
    else:
        line = f"operation {op_id} {view['status']}: {view['done']} done"
        if view["failed"]:
            line += f", {view['failed']} failed"
        print(line)
        note = ((view.get("result") or {}).get("plan") or {}).get("note")
        if note:
            print(f"note: {note}")
        if view["error"]:
            print(f"corral: error: {view['error']}", file=sys.stderr)
    return 0 if view["status"] == "succeeded" else 1


class ProgressBar:
    """A one-line progress bar on stderr for multi-replica operations."""

    def __init__(self) -> None:
        self._shown = False

    def update(self, view: OperationView) -> None:
        total = view["total"]
        if total <= 1:
            return
        done = view["done"] + view["failed"]
        width = 30
        filled = int(width * done / total)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"({view['failed']} failed) {view['status']}   "
        )
        sys.stderr.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
