"""functions: autoscale opt-in and scale-to-zero delay (workers.autoscale.decision)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 04:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    # Existing functions keep their behaviour: not autoscaled, never scaled to zero.
    op.add_column(
        "functions",
        sa.Column("autoscale", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.add_column("functions", sa.Column("scale_to_zero_after_s", sa.Float(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("functions") as batch:
        batch.drop_column("scale_to_zero_after_s")
        batch.drop_column("autoscale")
