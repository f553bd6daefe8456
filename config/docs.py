"""The settings reference, ``docs/settings.md``, written from :mod:`config.settings`.

Every setting is a field of one of the groups that :class:`~config.settings.Settings`
derives from, described by the string on the line below it. This module reads those
strings from each group's source (:func:`described`: here, not at every import of the
settings, where pydantic's ``use_attribute_docstrings`` would parse the source of every
group in every process, some 45 ms each), and each field's type, bounds and default from
the model (``model_fields``), and writes one table per group, in the order the groups
are declared, each headed by the group's docstring. A setting without its string is an
error here, not a blank cell.

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
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from config.settings import Settings, is_secret

TARGET = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
HEADER = (
    "<!-- Written by `python -m config.docs` from config/settings.py: edit the strings "
    "there, then run it. -->"
)
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")


class UndocumentedSetting(Exception):
    """A setting has no description string below it in ``config/settings.py``."""


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


def accepts(name: str, info: FieldInfo) -> str:
    """What setting ``name`` accepts, in words: its kind and bounds (``_s``: seconds)."""
    annotation = info.annotation
    if get_origin(annotation) is Literal:
        return ", ".join(f"`{v}`" for v in get_args(annotation))
    if is_secret(info):
        return "secret (never shown)"
    kinds = {a for a in get_args(annotation) if a is not type(None)} or {annotation}
    if kinds == {bool}:
        return "`true` / `false`"
    if kinds == {Path}:
        return "a path"
    if kinds == {str}:
        return "text"
    kind = "seconds" if name.endswith("_s") else ("integer" if kinds == {int} else "number")
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


def _doc(obj: Any) -> str:
    """An object's own docstring, dedented (not one it inherits)."""
    return inspect.cleandoc(obj.__doc__ or "")


def _groups(model: type[BaseSettings]) -> list[type[Any]]:
    return [base for base in model.__bases__ if base is not BaseSettings]


def described(model: type[BaseSettings]) -> dict[str, str]:
    """Each setting of ``model`` with a string on the line below it in its group's source."""
    found: dict[str, str] = {}
    for group in _groups(model):
        for name, text in _strings(group).items():
            found.setdefault(name, text)
    return found


def _strings(cls: type[Any]) -> dict[str, str]:
    """The fields of ``cls``'s own body that a string follows, and that string."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a class made at run time)
        return {}
    tree = ast.parse(source).body[0]
    if not isinstance(tree, ast.ClassDef):
        return {}
    found: dict[str, str] = {}
    for field, after in zip(tree.body, tree.body[1:], strict=False):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[field.target.id] = inspect.cleandoc(after.value.value)
    return found


def render(model: type[BaseSettings] = Settings) -> str:
    """The Markdown reference of every setting of ``model``, one table per group."""
    prefix = model.model_config.get("env_prefix") or ""
    lines = ["# Settings", "", HEADER, ""]
    intro = _doc(sys.modules[model.__module__])
    for paragraph in (intro, _doc(model).partition("\n")[2].strip()):
        lines += [markdown(paragraph), ""] if paragraph else []
    missing: list[str] = []
    seen: set[str] = set()
    strings = described(model)
    for group in _groups(model):
        title, _, rest = _doc(group).partition("\n")
        lines += [f"## {markdown(title).rstrip('.')}", ""]
        if rest.strip():
            lines += [markdown(rest.strip()), ""]
        lines += ["| variable | default | accepts | meaning |", "|---|---|---|---|"]
        for name in group.model_fields:
            info = model.model_fields.get(name)
            if info is None or name in seen:
                continue
            seen.add(name)
            meaning = info.description or strings.get(name)
            if not meaning:
                missing.append(name)
                continue
            lines.append(
                f"| `{prefix}{name.upper()}` | {default(info)} | "
                f"{accepts(name, info)} | {_one_line(meaning)} |"
            )
        lines.append("")
    missing += sorted(set(model.model_fields) - seen)
    if missing:
        raise UndocumentedSetting(
            "settings without a description (a string on the line below the field in "
            "config/settings.py, in a group derived from _Group): "
            f"{', '.join(f'{prefix}{m.upper()}' for m in missing)}"
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
