"""nodes: identity credential, re-point record, replica networks"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0006", "0005"


def upgrade() -> None:
    # Existing nodes have no credential: they are pinned to their host, as a seed agent's.
    op.add_column("nodes", sa.Column("credential_hash", sa.String(length=64), nullable=True))
    op.add_column("nodes", sa.Column("repointed_at", sa.DateTime(), nullable=True))
    op.add_column("nodes", sa.Column("repointed_from", sa.String(length=255), nullable=True))
    # None: the node kind's default networks (workers.base.untrusted.replica_networks)
    op.add_column("nodes", sa.Column("replica_networks", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:  # SQLite rebuilds the table
        batch.drop_column("replica_networks")
        batch.drop_column("repointed_from")
        batch.drop_column("repointed_at")
        batch.drop_column("credential_hash")
