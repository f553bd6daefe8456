"""operations: progress time and re-send count (workers.maintenance.redrive)"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0002", "0001"


def upgrade() -> None:
    op.add_column("operations", sa.Column("progress_at", sa.DateTime(), nullable=True))
    op.add_column(
        "operations",
        sa.Column("redrives", sa.Integer(), server_default="0", nullable=False),
    )
    # Operations still open when this runs count as having moved now: the first
    # redrive sweep gives them the full CORRAL_REDRIVE_AFTER_S before re-sending.
    # Naive UTC like every timestamp corral writes (CURRENT_TIMESTAMP would be local
    # time on a PostgreSQL server whose time zone is not UTC).
    op.execute(
        sa.text(
            "UPDATE operations SET progress_at = :at WHERE status IN ('pending', 'running')"
        ).bindparams(at=datetime.now(UTC).replace(tzinfo=None))
    )
    op.create_index(
        "ix_operations_status_progress", "operations", ["status", "progress_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_operations_status_progress", table_name="operations")
    with op.batch_alter_table("operations") as batch:  # SQLite rebuilds the table
        batch.drop_column("redrives")
        batch.drop_column("progress_at")
