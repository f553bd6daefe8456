"""claims: each claimed execution environment is a row with an expiry (a lease)"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0003", "0002"

# Environments in use when this runs were claimed before claims had ids: each gets a
# claim row expiring after the default CORRAL_CLAIM_TTL_S, so the reaper gives it back
# if nobody releases it (a guest's FINISHED still gives back the oldest).
LEGACY_TTL_S = 300


def upgrade() -> None:
    claims = op.create_table(
        "claims",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("replica_id", sa.String(length=32), nullable=False),
        sa.Column("function_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["replica_id"], ["replicas.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_claims_replica", "claims", ["replica_id", "created_at"])
    op.create_index("ix_claims_expires", "claims", ["expires_at"])
    at = datetime.now(UTC).replace(tzinfo=None)
    rows = (
        op.get_bind()
        .execute(sa.text("SELECT id, function_id, envs_in_use FROM replicas WHERE envs_in_use > 0"))
        .all()
    )
    values = [
        {
            "id": uuid.uuid4().hex,
            "replica_id": rid,
            "function_id": fid,
            "created_at": at,
            "expires_at": at + timedelta(seconds=LEGACY_TTL_S),
        }
        for rid, fid, n in rows
        for _ in range(int(n))
    ]
    if values:
        op.bulk_insert(claims, values)


def downgrade() -> None:
    op.drop_table("claims")  # its indexes go with it
