"""The docs are references: benchmarks.md stays short, and dated runs live in the history.

docs/benchmarks.md holds each benchmark's method, aims and current figures; every dated
run, what moved a figure and the misses go to docs/benchmarks-history.md. A date in any
other doc or the README is a lab notebook creeping back, and fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "docs" / "benchmarks-history.md"
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def test_benchmarks_md_holds_at_most_300_lines() -> None:
    lines = (ROOT / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines <= 300, f"docs/benchmarks.md has {lines} lines: move history to {HISTORY.name}"


def test_no_dated_run_outside_the_history() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    dated = {
        f"{doc.relative_to(ROOT)}:{n}": line.strip()
        for doc in docs
        if doc != HISTORY
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if DATE.search(line)
    }
    assert not dated, dated
