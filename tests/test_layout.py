"""docs/architecture.md's layout table names every package there is, and none that is not.

The table ("The rooms": ``| path | holds |``) is the one map of the tree: a row for each
top-level package and each package of ``workers``, and in the ``workers/`` row each of
its own modules as ``name.py``. A package or module added, moved or removed without its
mention fails here, as does a mention left for one that is gone. The contract that keeps
``workers.base`` under everything else in ``workers`` lists everything else by name: a
new member of ``workers`` missing from it fails here too.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `([^`]+)/`")


def _rows() -> list[str]:
    """The layout table's rows."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rooms = doc[doc.index("## The rooms") :]
    rooms = rooms[: rooms.index("\n## ", 1)]
    table = rooms[rooms.index("| path | holds |") :]
    return [line for line in table.splitlines() if line.startswith("|")]


def _table() -> list[str]:
    """The paths of the layout table's rows that name a directory (``x/``, ``workers/x/``)."""
    return [m.group(1) for line in _rows() if (m := ROW.match(line))]


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


def test_the_workers_row_names_each_of_its_own_modules_and_no_other() -> None:
    (row,) = [line for line in _rows() if line.startswith("| `workers/` |")]
    named = set(re.findall(r"`(\w+)\.py`", row))
    modules = {p.stem for p in (ROOT / "workers").glob("*.py")} - {"__init__"}
    assert named == modules


def _members_of_workers() -> set[str]:
    modules = {p.stem for p in (ROOT / "workers").glob("*.py")} - {"__init__"}
    return {f"workers.{name}" for name in modules | _packages(ROOT / "workers")}


def _contract(name: str) -> dict[str, list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == name]
    return contract  # type: ignore[no-any-return]


def test_workers_base_is_kept_under_every_other_member_of_workers() -> None:
    contract = _contract("workers.base imports nothing of workers above it")
    assert contract["source_modules"] == ["workers.base"]
    assert set(contract["forbidden_modules"]) == _members_of_workers() - {"workers.base"}


def test_the_observability_basics_are_kept_under_the_rest_of_workers() -> None:
    contract = _contract(
        "The observability basics (metric catalog, traces, logs, clock offsets) stand on "
        "workers.base alone"
    )
    others = _members_of_workers() - {"workers.base", "workers.observability"}
    assert others <= set(contract["forbidden_modules"])
