"""replicas: when a create was marked sent, the operation a maybe was made for; nodes: READY seen"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0010", "0009"


def upgrade() -> None:
    op.add_column("replicas", sa.Column("sent_at", sa.DateTime(), nullable=True))
    op.add_column("replicas", sa.Column("maybe_of", sa.String(length=32), nullable=True))
    op.create_index(
        "ix_replicas_maybe_of",
        "replicas",
        ["maybe_of"],
        sqlite_where=sa.text("maybe_of IS NOT NULL"),
        postgresql_where=sa.text("maybe_of IS NOT NULL"),
    )
    op.add_column("nodes", sa.Column("ready_seen_at", sa.DateTime(), nullable=True))
    # A Creating row owned when this runs may have had its create sent (the code before
    # this revision took owning as sending): mark it sent, so it is never sent again blindly.
    op.execute(
        "UPDATE replicas SET sent_at = COALESCE(updated_at, created_at) "
        "WHERE status = 2 AND owner IS NOT NULL"
    )


def downgrade() -> None:
    # The code before this revision knows no maybe: end each Dead, giving back its slot.
    op.execute(
        "UPDATE nodes SET live = live - (SELECT COUNT(*) FROM replicas r "
        "WHERE r.status = 240 AND r.node_id = nodes.id)"
    )
    op.execute(
        "UPDATE gpus SET slots_free = slots_free + (SELECT COUNT(*) FROM replicas r "
        "WHERE r.status = 240 AND r.gpu_id = gpus.id AND r.gpu_slot IS NOT NULL), "
        "mem_free_mb = mem_free_mb + (SELECT COALESCE(SUM(r.gpu_mem_mb), 0) FROM replicas r "
        "WHERE r.status = 240 AND r.gpu_id = gpus.id AND r.gpu_slot IS NOT NULL)"
    )
    op.execute(
        "UPDATE replicas SET status = 13, gpu_slot = NULL, deadline_at = NULL, "
        "retired_at = COALESCE(retired_at, updated_at) WHERE status = 240"
    )
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("ready_seen_at")
    op.drop_index("ix_replicas_maybe_of", table_name="replicas")
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("maybe_of")
        batch.drop_column("sent_at")
