"""docs/architecture.md's layout table names every package there is, and none that is not.

The table ("The rooms": ``| path | holds |``) is the one map of the tree: a row for each
top-level package and each package of ``workers``. A package added, moved or removed
without its row fails here, as does a row left for a package that is gone.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `([^`]+)/`")


def _table() -> list[str]:
    """The paths of the layout table's rows that name a directory (``x/``, ``workers/x/``)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rooms = doc[doc.index("## The rooms") :]
    rooms = rooms[: rooms.index("\n## ", 1)]
    table = rooms[rooms.index("| path | holds |") :]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    return [m.group(1) for line in rows if (m := ROW.match(line))]


def _packages(under: Path) -> set[str]:
    return {p.parent.name for p in under.glob("*/__init__.py")}


def test_the_layout_table_names_every_top_level_package_and_no_other() -> None:
    named = {path for path in _table() if "/" not in path}
    assert named == _packages(ROOT)


def test_the_layout_table_names_every_package_of_workers_and_no_other() -> None:
    named = {path.split("/", 1)[1] for path in _table() if path.startswith("workers/")}
    assert named == _packages(ROOT / "workers")


def test_each_package_has_one_row() -> None:
    rows = _table()
    assert len(rows) == len(set(rows)) and "workers" in rows and "tests" in rows
