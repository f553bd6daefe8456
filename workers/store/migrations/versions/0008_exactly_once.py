"""replicas: the owner of a create in flight; op_parts: each part of an operation counted once"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from workers.store.ddl import create_table, drop_columns, drop_table

revision, down_revision = "0008", "0007"

OP_PARTS = """
    operation_id str32
    part str128
    primary key operation_id part
"""


def upgrade() -> None:
    # Rows Creating when this runs had their create sent by the old code, outcome unknown:
    # they stay NULL (not sent), which the old code's redelivery treated the same way.
    op.add_column("replicas", sa.Column("owner", sa.String(length=32), nullable=True))
    op.add_column("replicas", sa.Column("owner_until", sa.DateTime(), nullable=True))
    create_table("op_parts", OP_PARTS)


def downgrade() -> None:
    drop_table("op_parts", OP_PARTS)
    drop_columns("replicas", "owner_until", "owner")
