"""nodes: failed creates in a row and quarantine; replicas: placements tried"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from workers.store.ddl import drop_columns

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
    drop_columns("replicas", "placements")
    drop_columns(
        "nodes", "quarantine_s", "quarantined_until", "last_create_ok_at", "create_failures"
    )
