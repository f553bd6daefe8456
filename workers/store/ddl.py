"""What the Alembic revisions share: a table declared as a block of lines, one item each.

A revision states a table as data, in the order the table has its parts:

* ``name type [null]``: a column. ``type`` is ``str<N>`` (``VARCHAR(N)``), ``text``,
  ``int``, ``float``, ``bool``, ``json`` or ``datetime``; NOT NULL unless ``null`` follows.
* ``primary key COLUMN``, ``unique COLUMN``, ``check NAME: SQL``,
  ``foreign key COLUMN -> TABLE.COLUMN [on delete cascade]``: constraints.
* ``index NAME: COLUMN ...`` and ``unique index NAME: COLUMN ... [where SQL]``: indexes,
  made after the table (a ``where`` index is partial, on SQLite and PostgreSQL alike).

The helpers issue the operations Alembic's autogenerate wrote when the revisions were
first made, so a database migrated before and one migrated after they existed have the
same schema (``tests/test_schema.py`` compares the result with the models on both stores).
Revisions never import the models: they describe the schema as it was at their time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.types import TypeEngine

TYPES: dict[str, Callable[[], TypeEngine[Any]]] = {
    "text": sa.Text,
    "int": sa.Integer,
    "float": sa.Float,
    "bool": sa.Boolean,
    "json": sa.JSON,
    "datetime": sa.DateTime,
}


@dataclass(frozen=True)
class Index:
    """An index a table block declares."""

    name: str
    columns: list[str]
    unique: bool = False
    where: str | None = None

    def dialect_options(self) -> dict[str, Any]:
        """The partial-index condition, given to both dialects (none when not partial)."""
        if self.where is None:
            return {}
        return {f"{d}_where": sa.text(self.where) for d in ("sqlite", "postgresql")}


def column_type(name: str) -> TypeEngine[Any]:
    """The SQLAlchemy type a column line names (``str<N>`` or one of :data:`TYPES`)."""
    if name.startswith("str"):
        return sa.String(length=int(name[3:]))
    return TYPES[name]()


def parse(block: str) -> tuple[list[Any], list[Index]]:
    """The columns and constraints, then the indexes, a table block declares, in order."""
    items: list[Any] = []
    found: list[Index] = []
    for raw in block.strip().splitlines():
        line = raw.strip()
        head, _, tail = line.partition(":")
        words = head.split()
        if words[:2] == ["primary", "key"]:
            items.append(sa.PrimaryKeyConstraint(*words[2:]))
        elif words[:2] == ["foreign", "key"]:
            items.append(_foreign_key(line))
        elif words[0] == "check":
            items.append(sa.CheckConstraint(tail.strip(), name=words[1]))
        elif words[:2] == ["unique", "index"] or words[0] == "index":
            cols, _, where = tail.partition(" where ")
            found.append(Index(words[-1], cols.split(), words[0] == "unique", where or None))
        elif words[0] == "unique":
            items.append(sa.UniqueConstraint(*words[1:]))
        elif len(words) == 2 or words[2:] == ["null"]:
            items.append(sa.Column(words[0], column_type(words[1]), nullable=len(words) == 3))
        else:
            raise ValueError(f"table line {line!r}: not a column, constraint or index")
    return items, found


def _foreign_key(line: str) -> sa.ForeignKeyConstraint:
    """``foreign key COLUMN -> TABLE.COLUMN [on delete cascade]``."""
    words = line.split()
    ondelete = "CASCADE" if words[5:] == ["on", "delete", "cascade"] else None
    return sa.ForeignKeyConstraint([words[2]], [words[4]], ondelete=ondelete)


def create_table(name: str, block: str) -> sa.Table:
    """Create table ``name`` as its block declares it, then its indexes."""
    items, found = parse(block)
    table = op.create_table(name, *items)
    for ix in found:
        op.create_index(ix.name, name, ix.columns, unique=ix.unique, **ix.dialect_options())
    return table


def drop_table(name: str, block: str) -> None:
    """Drop table ``name``'s indexes (last first), then the table."""
    for ix in reversed(parse(block)[1]):
        op.drop_index(ix.name, table_name=name, **ix.dialect_options())
    op.drop_table(name)


def drop_columns(table: str, *names: str) -> None:
    """Drop columns of ``table`` in the order given (a batch: SQLite rebuilds the table)."""
    with op.batch_alter_table(table) as batch:
        for name in names:
            batch.drop_column(name)
