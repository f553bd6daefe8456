"""functions: keep_alive, fixed or adaptive (workers.autoscale.keepalive)"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from workers.store.ddl import drop_columns

revision, down_revision = "0007", "0006"


def upgrade() -> None:
    # Existing functions keep their behaviour: the fixed idle timeout.
    op.add_column(
        "functions",
        sa.Column("keep_alive", sa.String(8), server_default="fixed", nullable=False),
    )


def downgrade() -> None:
    drop_columns("functions", "keep_alive")
