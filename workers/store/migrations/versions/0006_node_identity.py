"""nodes: identity credential, re-point record, replica networks"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from workers.store.ddl import drop_columns

revision, down_revision = "0006", "0005"


def upgrade() -> None:
    # Existing nodes have no credential: they are pinned to their host, as a seed agent's.
    op.add_column("nodes", sa.Column("credential_hash", sa.String(length=64), nullable=True))
    op.add_column("nodes", sa.Column("repointed_at", sa.DateTime(), nullable=True))
    op.add_column("nodes", sa.Column("repointed_from", sa.String(length=255), nullable=True))
    # None: the node kind's default networks (workers.untrusted.replica_networks)
    op.add_column("nodes", sa.Column("replica_networks", sa.JSON(), nullable=True))


def downgrade() -> None:
    drop_columns("nodes", "replica_networks", "repointed_from", "repointed_at", "credential_hash")
