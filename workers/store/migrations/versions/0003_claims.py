"""claims: each claimed execution environment is a row with an expiry (a lease)"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

from workers.store.ddl import create_table, drop_table

revision, down_revision = "0003", "0002"

# Environments in use when this runs were claimed before claims had ids: each gets a
# claim row expiring after the default CORRAL_CLAIM_TTL_S, so the reaper gives it back
# if nobody releases it (a guest's FINISHED still gives back the oldest).
LEGACY_TTL_S = 300

CLAIMS = """
    id str32
    replica_id str32
    function_id str32
    created_at datetime
    expires_at datetime
    foreign key replica_id -> replicas.id on delete cascade
    primary key id
    index ix_claims_replica: replica_id created_at
    index ix_claims_expires: expires_at
"""


def upgrade() -> None:
    claims = create_table("claims", CLAIMS)
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
    drop_table("claims", CLAIMS)
