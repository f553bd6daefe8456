"""functions: keep_alive, fixed or adaptive (workers.autoscale.keepalive)"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0007", "0006"


def upgrade() -> None:
    # Existing functions keep their behaviour: the fixed idle timeout.
    op.add_column(
        "functions",
        sa.Column("keep_alive", sa.String(8), server_default="fixed", nullable=False),
    )


def downgrade() -> None:
    with op.batch_alter_table("functions") as batch:  # SQLite rebuilds the table
        batch.drop_column("keep_alive")
