"""calls: asynchronous invocations (workers.invocations); functions: their attempts and age"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0011", "0010"


def upgrade() -> None:
    op.create_table(
        "calls",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("function", sa.String(length=63), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("query", sa.Text(), nullable=False),
        sa.Column("headers", sa.JSON(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("client", sa.String(length=64), nullable=True),
        sa.Column("scheme", sa.String(length=8), nullable=False),
        sa.Column("trace", sa.JSON(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("attempt_limit", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("owner", sa.String(length=32), nullable=True),
        sa.Column("lease_until", sa.DateTime(), nullable=True),
        sa.Column("next_at", sa.DateTime(), nullable=False),
        sa.Column("resend_at", sa.DateTime(), nullable=True),
        sa.Column("redrives", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("answer_status", sa.Integer(), nullable=True),
        sa.Column("answer_headers", sa.JSON(), nullable=True),
        sa.Column("answer_body", sa.LargeBinary(), nullable=True),
        sa.Column("answer_truncated", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("callback_url", sa.Text(), nullable=True),
        sa.Column("callback_state", sa.String(length=16), nullable=True),
        sa.Column("callback_attempts", sa.Integer(), nullable=False),
        sa.Column("callback_at", sa.DateTime(), nullable=True),
        sa.Column("callback_status", sa.Integer(), nullable=True),
        sa.Column("callback_error", sa.Text(), nullable=True),
        sa.CheckConstraint("attempts >= 0 AND attempt_limit >= 1", name="ck_call_attempts"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ux_calls_key", "calls", ["function", "idempotency_key"], unique=True)
    op.create_index("ix_calls_status_created", "calls", ["status", "created_at"])
    op.create_index("ix_calls_function_created", "calls", ["function", "created_at"])
    op.create_index("ix_calls_resend", "calls", ["resend_at"])
    op.create_index("ix_calls_finished", "calls", ["finished_at"])
    op.create_index("ix_calls_callback", "calls", ["callback_at"])
    op.add_column("functions", sa.Column("call_attempts", sa.Integer(), nullable=True))
    op.add_column("functions", sa.Column("call_max_age_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("functions") as batch:  # SQLite rebuilds the table
        batch.drop_column("call_max_age_s")
        batch.drop_column("call_attempts")
    op.drop_table("calls")  # its indexes go with it
