"""initial schema"""

from __future__ import annotations

from workers.store.ddl import create_table, drop_table

revision, down_revision = "0001", None

FUNCTIONS = """
    id str32
    name str63
    backend str16
    image str1024
    kernel str1024
    initrd str1024
    kernel_args text
    vm_type str16
    cpu int
    mem_mb int
    min_replicas int
    max_replicas int
    target int null
    replica_count int
    labels json
    env json
    image_storage str1024
    inet_dev str64
    name_server str255
    aws_access_key_id str256 null
    aws_secret_access_key str256 null
    rootfs str2048 null
    build_version str32
    ports json
    idle_timeout_s float null
    readiness str8
    exec_envs int
    gpu_mem_mb int
    placement str16 null
    rr_last_node str63 null
    created_at datetime
    updated_at datetime
    check ck_fn_envs: exec_envs >= 1
    check ck_fn_gpu_mem: gpu_mem_mb >= 0
    check ck_fn_minmax: min_replicas >= 0 AND min_replicas <= max_replicas
    check ck_fn_replica_count: replica_count >= 0
    primary key id
    unique name
"""
GPUS = """
    id str32
    uuid str128
    server str255
    mngr_addr str255
    mem_total_mb int
    mem_free_mb int
    slots_total int
    slots_free int
    first_port int
    created_at datetime
    check ck_gpu_mem: mem_free_mb >= 0 AND mem_free_mb <= mem_total_mb
    check ck_gpu_slots: slots_free >= 0 AND slots_free <= slots_total
    primary key id
    unique uuid
    index ix_gpus_fit: mem_free_mb
"""
LEASES = """
    name str64
    holder str128
    expires_at datetime
    primary key name
"""
NODES = """
    id str32
    name str63
    kind str16
    address str255
    external_id str255 null
    capacity int
    live int
    healthy bool
    draining bool
    misses int
    unhealthy_since datetime null
    last_seen_at datetime null
    last_error text null
    can_list bool null
    created_at datetime
    check ck_node_capacity: capacity >= 0
    check ck_node_live: live >= 0
    primary key id
    unique external_id
    unique name
    index ix_nodes_place: kind healthy draining live
"""
OPERATIONS = """
    id str32
    kind str16
    function_id str32 null
    params json
    status str16
    total int
    done int
    failed int
    result json null
    error text null
    created_at datetime
    started_at datetime null
    finished_at datetime null
    primary key id
    index ix_operations_created: created_at
"""
REPLICAS = """
    id str32
    request_id str128
    function_id str32
    node_id str32 null
    operation_id str32 null
    status int
    vmid str255 null
    address str255 null
    build_version str32
    error text null
    envs_total int
    envs_in_use int
    gpu_id str32 null
    gpu_slot int null
    gpu_mem_mb int
    created_at datetime
    updated_at datetime
    ready_at datetime null
    last_used_at datetime null
    idle_since datetime null
    reap_at datetime null
    deadline_at datetime null
    retired_at datetime null
    check ck_rep_envs: envs_in_use >= 0 AND envs_in_use <= envs_total
    foreign key function_id -> functions.id on delete cascade
    foreign key gpu_id -> gpus.id
    foreign key node_id -> nodes.id
    primary key id
    unique request_id
    index ix_replicas_claim: function_id status build_version
    index ix_replicas_deadline: status deadline_at
    index ix_replicas_fn_status: function_id status
    index ix_replicas_idle: status idle_since
    index ix_replicas_node_status: node_id status
    index ix_replicas_op: operation_id
    index ix_replicas_reap: status reap_at
    index ix_replicas_vmid: vmid
    unique index ux_replicas_gpu_slot: gpu_id gpu_slot where gpu_slot IS NOT NULL
"""
# in the order they are made (dropped in reverse)
TABLES = {
    "functions": FUNCTIONS,
    "gpus": GPUS,
    "leases": LEASES,
    "nodes": NODES,
    "operations": OPERATIONS,
    "replicas": REPLICAS,
}


def upgrade() -> None:
    for name, block in TABLES.items():
        create_table(name, block)


def downgrade() -> None:
    for name, block in reversed(TABLES.items()):
        drop_table(name, block)
