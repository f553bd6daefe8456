"""replicas: the owner of a create in flight; op_parts: each part of an operation counted once"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0008", "0007"


def upgrade() -> None:
    # Rows Creating when this runs had their create sent by the old code, outcome unknown:
    # they stay NULL (not sent), which the old code's redelivery treated the same way.
    op.add_column("replicas", sa.Column("owner", sa.String(length=32), nullable=True))
    op.add_column("replicas", sa.Column("owner_until", sa.DateTime(), nullable=True))
    op.create_table(
        "op_parts",
        sa.Column("operation_id", sa.String(length=32), nullable=False),
        sa.Column("part", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("operation_id", "part"),
    )


def downgrade() -> None:
    op.drop_table("op_parts")
    with op.batch_alter_table("replicas") as batch:  # SQLite rebuilds the table
        batch.drop_column("owner_until")
        batch.drop_column("owner")
