"""The code stays readable in pieces: no module in ``workers`` over 600 lines, no class over 300.

A module past that holds more than one thing (split it by what it holds, as
``workers.replicas.claims`` and ``coldstarts`` were); a class past that does.
"""

from __future__ import annotations

import ast
from pathlib import Path

WORKERS = Path(__file__).resolve().parents[1] / "workers"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def test_no_module_over_600_lines_nor_class_over_300() -> None:
    too_big = []
    for path in sorted(WORKERS.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(WORKERS.parent)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_big.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    too_big.append(f"{where}: class {node.name}: {lines} lines")
    assert len(list(WORKERS.rglob("*.py"))) > 50  # the tree was found
    assert too_big == []
