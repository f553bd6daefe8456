"""The settings reference, ``docs/settings.md``, written from :mod:`config.settings`.

Every setting is a field of one of the groups in ``config/settings.py``, described by
the string on the line below it. This module reads those strings from the source
(with :mod:`ast`, so importing the settings costs nothing more at run time), the
types, bounds and defaults from the model, and writes one table per group, in the
order the groups are declared. A setting without its string is an error here, not a
blank cell.

``python -m config.docs`` rewrites the file; ``python -m config.docs --check`` exits 1
while the file differs from what the code says. ``tests/config/test_docs.py`` runs the
check, so CI fails when a setting changes and its reference does not.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from config import settings as settings_module
from config.settings import ENV_PREFIX, Settings

TARGET = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
HEADER = (
    "<!-- Written by `python -m config.docs` from config/settings.py: edit the strings "
    "there, then run it. -->"
)
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")


class UndocumentedSetting(Exception):
    """A setting has no description string below it in ``config/settings.py``."""


@dataclass(frozen=True)
class _Declared:
    """What the source says of one group: its docstring and each field's string."""

    doc: str
    fields: dict[str, tuple[str, str | None]]  # name -> (annotation as written, string)


def _declared(source: str) -> dict[str, _Declared]:
    """Every class in ``source``: its docstring and its annotated fields' strings."""
    out: dict[str, _Declared] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, tuple[str, str | None]] = {}
        body = node.body
        for i, item in enumerate(body):
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            after = body[i + 1] if i + 1 < len(body) else None
            doc = None
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                doc = inspect.cleandoc(after.value.value)
            fields[item.target.id] = (ast.unparse(item.annotation), doc)
        out[node.name] = _Declared(ast.get_docstring(node) or "", fields)
    return out


def markdown(text: str) -> str:
    """reStructuredText roles and literals as Markdown code spans."""
    text = _ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)
    return text.replace("``", "`")


def _one_line(text: str) -> str:
    return " ".join(markdown(text).split()).replace("|", "\\|")


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _bounds(info: FieldInfo) -> str:
    low = high = ""
    for item in info.metadata:
        if isinstance(item, annotated_types.Gt):
            low = f"> {_number(item.gt)}"
        elif isinstance(item, annotated_types.Ge):
            low = f">= {_number(item.ge)}"
        elif isinstance(item, annotated_types.Lt):
            high = f"< {_number(item.lt)}"
        elif isinstance(item, annotated_types.Le):
            high = f"<= {_number(item.le)}"
    if low.startswith(">=") and high.startswith("<="):
        return f"{low[3:]} to {high[3:]}"
    return ", ".join(b for b in (low, high) if b)


def accepts(info: FieldInfo, written: str) -> str:
    """What a setting accepts, in words: its kind and bounds."""
    annotation = info.annotation
    if get_origin(annotation) is Literal:
        return ", ".join(f"`{v}`" for v in get_args(annotation))
    kinds = {a for a in get_args(annotation) if a is not type(None)} or {annotation}
    if written == "Secret":
        return "secret (never shown)"
    if kinds == {bool}:
        return "`true` / `false`"
    if kinds == {Path}:
        return "a path"
    if kinds == {str}:
        return "text"
    kind = (
        "seconds" if written.startswith("Seconds") else ("integer" if kinds == {int} else "number")
    )
    bounds = _bounds(info)
    return f"{kind}, {bounds}" if bounds else kind


def default(info: FieldInfo) -> str:
    """A setting's default as it would be written in the environment."""
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int | float):
        return f"`{_number(value).replace(',', '')}`"
    return f"`{value}`"


def _groups(model: type[BaseSettings]) -> list[type]:
    return [base for base in model.__bases__ if base is not BaseSettings]


def render(model: type[BaseSettings] = Settings, source: str | None = None) -> str:
    """The Markdown reference of every setting of ``model``, one table per group."""
    source = source if source is not None else Path(settings_module.__file__).read_text()
    declared = _declared(source)
    lines = ["# Settings", "", HEADER, ""]
    intro = ast.get_docstring(ast.parse(source)) or ""
    model_doc = declared[model.__name__].doc if model.__name__ in declared else ""
    for paragraph in (intro, model_doc.partition("\n")[2].strip()):
        lines += [markdown(paragraph), ""] if paragraph else []
    missing: list[str] = []
    seen: set[str] = set()
    for group in _groups(model):
        found = declared.get(group.__name__)
        if found is None:
            raise UndocumentedSetting(f"no class {group.__name__} in the settings source")
        title, _, rest = found.doc.partition("\n")
        lines += [f"## {markdown(title).rstrip('.')}", ""]
        if rest.strip():
            lines += [markdown(inspect.cleandoc(rest)), ""]
        lines += ["| variable | default | accepts | meaning |", "|---|---|---|---|"]
        for name, (written, doc) in found.fields.items():
            info = model.model_fields.get(name)
            if info is None or name in seen:
                continue
            seen.add(name)
            if not doc:
                missing.append(name)
                continue
            lines.append(
                f"| `{ENV_PREFIX}{name.upper()}` | {default(info)} | "
                f"{accepts(info, written)} | {_one_line(doc)} |"
            )
        lines.append("")
    missing += sorted(set(model.model_fields) - seen)
    if missing:
        raise UndocumentedSetting(
            "settings without a description (a string on the line below the field in "
            f"config/settings.py): {', '.join(f'{ENV_PREFIX}{m.upper()}' for m in missing)}"
        )
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write the settings reference, or with ``--check`` say whether it is current."""
    parser = argparse.ArgumentParser(
        prog="python -m config.docs", description=__doc__ and __doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if the file differs from what the code says; write nothing",
    )
    parser.add_argument("--output", type=Path, default=TARGET, help=f"default: {TARGET}")
    args = parser.parse_args(argv)
    try:
        text = render()
    except UndocumentedSetting as exc:
        print(f"config.docs: error: {exc}", file=sys.stderr)
        return 1
    current = args.output.read_text() if args.output.exists() else None
    if args.check:
        if current == text:
            return 0
        print(
            f"config.docs: {args.output} does not match config/settings.py; "
            "run `python -m config.docs` to rewrite it",
            file=sys.stderr,
        )
        return 1
    if current != text:
        args.output.write_text(text)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
