"""functions: autoscale opt-in and scale-to-zero delay (workers.autoscale.decision)"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0005", "0004"


def upgrade() -> None:
    # Existing functions keep their behaviour: not autoscaled, never scaled to zero.
    op.add_column(
        "functions",
        sa.Column("autoscale", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.add_column("functions", sa.Column("scale_to_zero_after_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("functions") as batch:  # SQLite rebuilds the table
        batch.drop_column("scale_to_zero_after_s")
        batch.drop_column("autoscale")
