"""The store: replica, node, GPU, function and operation rows, sessions and migrations."""

from workers.errors import SchemaError
from workers.store.db import Database, get_database
from workers.store.migrate import check_schema, upgrade
from workers.store.models import (
    COUNTED_STATES,
    FINAL_STATES,
    LIVE_STATES,
    Function,
    Gpu,
    Lease,
    Node,
    Operation,
    OpStatus,
    Replica,
    ReplicaState,
)

__all__ = [
    "COUNTED_STATES", "FINAL_STATES", "LIVE_STATES", "Database", "Function", "Gpu", "Lease",
    "Node", "OpStatus", "Operation", "Replica", "ReplicaState", "SchemaError", "check_schema",
    "get_database", "upgrade",
]
