"""initial schema: functions, GPUs, leases, nodes, operations, replicas"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0001", None

# A partial index, the same on both stores.
GPU_SLOT_TAKEN = "gpu_slot IS NOT NULL"


def upgrade() -> None:
    op.create_table(
        "functions",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("backend", sa.String(length=16), nullable=False),
        sa.Column("image", sa.String(length=1024), nullable=False),
        sa.Column("kernel", sa.String(length=1024), nullable=False),
        sa.Column("initrd", sa.String(length=1024), nullable=False),
        sa.Column("kernel_args", sa.Text(), nullable=False),
        sa.Column("vm_type", sa.String(length=16), nullable=False),
        sa.Column("cpu", sa.Integer(), nullable=False),
        sa.Column("mem_mb", sa.Integer(), nullable=False),
        sa.Column("min_replicas", sa.Integer(), nullable=False),
        sa.Column("max_replicas", sa.Integer(), nullable=False),
        sa.Column("target", sa.Integer(), nullable=True),
        sa.Column("replica_count", sa.Integer(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("image_storage", sa.String(length=1024), nullable=False),
        sa.Column("inet_dev", sa.String(length=64), nullable=False),
        sa.Column("name_server", sa.String(length=255), nullable=False),
        sa.Column("aws_access_key_id", sa.String(length=256), nullable=True),
        sa.Column("aws_secret_access_key", sa.String(length=256), nullable=True),
        sa.Column("rootfs", sa.String(length=2048), nullable=True),
        sa.Column("build_version", sa.String(length=32), nullable=False),
        sa.Column("ports", sa.JSON(), nullable=False),
        sa.Column("idle_timeout_s", sa.Float(), nullable=True),
        sa.Column("readiness", sa.String(length=8), nullable=False),
        sa.Column("exec_envs", sa.Integer(), nullable=False),
        sa.Column("gpu_mem_mb", sa.Integer(), nullable=False),
        sa.Column("placement", sa.String(length=16), nullable=True),
        sa.Column("rr_last_node", sa.String(length=63), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("exec_envs >= 1", name="ck_fn_envs"),
        sa.CheckConstraint("gpu_mem_mb >= 0", name="ck_fn_gpu_mem"),
        sa.CheckConstraint(
            "min_replicas >= 0 AND min_replicas <= max_replicas", name="ck_fn_minmax"
        ),
        sa.CheckConstraint("replica_count >= 0", name="ck_fn_replica_count"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "gpus",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("uuid", sa.String(length=128), nullable=False),
        sa.Column("server", sa.String(length=255), nullable=False),
        sa.Column("mngr_addr", sa.String(length=255), nullable=False),
        sa.Column("mem_total_mb", sa.Integer(), nullable=False),
        sa.Column("mem_free_mb", sa.Integer(), nullable=False),
        sa.Column("slots_total", sa.Integer(), nullable=False),
        sa.Column("slots_free", sa.Integer(), nullable=False),
        sa.Column("first_port", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("mem_free_mb >= 0 AND mem_free_mb <= mem_total_mb", name="ck_gpu_mem"),
        sa.CheckConstraint("slots_free >= 0 AND slots_free <= slots_total", name="ck_gpu_slots"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("uuid"),
    )
    op.create_index("ix_gpus_fit", "gpus", ["mem_free_mb"])
    op.create_table(
        "leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("external_id", sa.String(length=255), nullable=True),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("live", sa.Integer(), nullable=False),
        sa.Column("healthy", sa.Boolean(), nullable=False),
        sa.Column("draining", sa.Boolean(), nullable=False),
        sa.Column("misses", sa.Integer(), nullable=False),
        sa.Column("unhealthy_since", sa.DateTime(), nullable=True),
        sa.Column("last_seen_at", sa.DateTime(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("can_list", sa.Boolean(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("capacity >= 0", name="ck_node_capacity"),
        sa.CheckConstraint("live >= 0", name="ck_node_live"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("external_id"),
        sa.UniqueConstraint("name"),
    )
    op.create_index("ix_nodes_place", "nodes", ["kind", "healthy", "draining", "live"])
    op.create_table(
        "operations",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("function_id", sa.String(length=32), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("done", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_operations_created", "operations", ["created_at"])
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("function_id", sa.String(length=32), nullable=False),
        sa.Column("node_id", sa.String(length=32), nullable=True),
        sa.Column("operation_id", sa.String(length=32), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("vmid", sa.String(length=255), nullable=True),
        sa.Column("address", sa.String(length=255), nullable=True),
        sa.Column("build_version", sa.String(length=32), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("envs_total", sa.Integer(), nullable=False),
        sa.Column("envs_in_use", sa.Integer(), nullable=False),
        sa.Column("gpu_id", sa.String(length=32), nullable=True),
        sa.Column("gpu_slot", sa.Integer(), nullable=True),
        sa.Column("gpu_mem_mb", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("ready_at", sa.DateTime(), nullable=True),
        sa.Column("last_used_at", sa.DateTime(), nullable=True),
        sa.Column("idle_since", sa.DateTime(), nullable=True),
        sa.Column("reap_at", sa.DateTime(), nullable=True),
        sa.Column("deadline_at", sa.DateTime(), nullable=True),
        sa.Column("retired_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint("envs_in_use >= 0 AND envs_in_use <= envs_total", name="ck_rep_envs"),
        sa.ForeignKeyConstraint(["function_id"], ["functions.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["gpu_id"], ["gpus.id"]),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("request_id"),
    )
    op.create_index("ix_replicas_claim", "replicas", ["function_id", "status", "build_version"])
    op.create_index("ix_replicas_deadline", "replicas", ["status", "deadline_at"])
    op.create_index("ix_replicas_fn_status", "replicas", ["function_id", "status"])
    op.create_index("ix_replicas_idle", "replicas", ["status", "idle_since"])
    op.create_index("ix_replicas_node_status", "replicas", ["node_id", "status"])
    op.create_index("ix_replicas_op", "replicas", ["operation_id"])
    op.create_index("ix_replicas_reap", "replicas", ["status", "reap_at"])
    op.create_index("ix_replicas_vmid", "replicas", ["vmid"])
    op.create_index(
        "ux_replicas_gpu_slot",
        "replicas",
        ["gpu_id", "gpu_slot"],
        unique=True,
        sqlite_where=sa.text(GPU_SLOT_TAKEN),
        postgresql_where=sa.text(GPU_SLOT_TAKEN),
    )


def downgrade() -> None:
    for table in ("replicas", "operations", "nodes", "leases", "gpus", "functions"):
        op.drop_table(table)  # its indexes go with it
