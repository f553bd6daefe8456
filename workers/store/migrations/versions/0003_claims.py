"""claims: each claimed execution environment is a row with an expiry (a lease)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 03:40:00
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# Environments in use when this runs were claimed before claims had ids: each gets a
# claim row expiring after the default CORRAL_CLAIM_TTL_S, so the reaper gives it back
# if nobody releases it (a guest's FINISHED still gives back the oldest).
LEGACY_TTL_S = 300


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "claims",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("replica_id", sa.String(length=32), nullable=False),
        sa.Column("function_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["replica_id"], ["replicas.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_claims_replica", "claims", ["replica_id", "created_at"], unique=False)
    op.create_index("ix_claims_expires", "claims", ["expires_at"], unique=False)
    conn = op.get_bind()
    at = datetime.now(UTC).replace(tzinfo=None)
    rows = conn.execute(
        sa.text("SELECT id, function_id, envs_in_use FROM replicas WHERE envs_in_use > 0")
    ).all()
    claims = sa.table(
        "claims", sa.column("id", sa.String), sa.column("replica_id", sa.String),
        sa.column("function_id", sa.String), sa.column("created_at", sa.DateTime),
        sa.column("expires_at", sa.DateTime),
    )
    values = [
        {"id": uuid_hex(), "replica_id": rid, "function_id": fid, "created_at": at,
         "expires_at": at + timedelta(seconds=LEGACY_TTL_S)}
        for rid, fid, n in rows for _ in range(int(n))
    ]
    if values:
        op.bulk_insert(claims, values)


def uuid_hex() -> str:
    """A fresh row id."""
    import uuid

    return uuid.uuid4().hex


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("ix_claims_expires", table_name="claims")
    op.drop_index("ix_claims_replica", table_name="claims")
    op.drop_table("claims")
