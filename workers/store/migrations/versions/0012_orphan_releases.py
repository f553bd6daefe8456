"""orphan_releases: VMs no replica took, kept until their node released them"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0012", "0011"


def upgrade() -> None:
    op.create_table(
        "orphan_releases",
        sa.Column("node_id", sa.String(length=32), nullable=False),
        sa.Column("vmid", sa.String(length=128), nullable=False),
        sa.Column("noted_at", sa.DateTime(), nullable=False),
        sa.Column("due_at", sa.DateTime(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("node_id", "vmid"),
    )
    op.create_index("ix_orphan_releases_due", "orphan_releases", ["due_at"])


def downgrade() -> None:
    op.drop_index("ix_orphan_releases_due", table_name="orphan_releases")
    op.drop_table("orphan_releases")
