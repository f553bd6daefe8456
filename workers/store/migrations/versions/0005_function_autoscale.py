"""functions: autoscale opt-in and scale-to-zero delay (workers.autoscale.decision)"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from workers.store.ddl import drop_columns

revision, down_revision = "0005", "0004"


def upgrade() -> None:
    # Existing functions keep their behaviour: not autoscaled, never scaled to zero.
    op.add_column(
        "functions",
        sa.Column("autoscale", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.add_column("functions", sa.Column("scale_to_zero_after_s", sa.Float(), nullable=True))


def downgrade() -> None:
    drop_columns("functions", "scale_to_zero_after_s", "autoscale")
