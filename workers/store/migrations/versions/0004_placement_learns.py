"""nodes: failed creates in a row and quarantine; replicas: placements tried"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0004", "0003"


def upgrade() -> None:
    op.add_column(
        "nodes", sa.Column("create_failures", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column("nodes", sa.Column("last_create_ok_at", sa.DateTime(), nullable=True))
    op.add_column("nodes", sa.Column("quarantined_until", sa.DateTime(), nullable=True))
    op.add_column("nodes", sa.Column("quarantine_s", sa.Float(), nullable=True))
    op.add_column(
        "replicas", sa.Column("placements", sa.Integer(), server_default="1", nullable=False)
    )


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:  # SQLite rebuilds the table
        batch.drop_column("placements")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("quarantine_s")
        batch.drop_column("quarantined_until")
        batch.drop_column("last_create_ok_at")
        batch.drop_column("create_failures")
