"""The store: replica, node, GPU, function and operation rows, sessions and migrations.

Importing it loads SQLAlchemy and the models, not Alembic: :mod:`workers.store.migrate`
is imported by what migrates.
"""

from workers.base.errors import SchemaError
from workers.store.db import Database, get_database
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
from workers.store.revisions import check_schema

__all__ = [
    "COUNTED_STATES",
    "FINAL_STATES",
    "LIVE_STATES",
    "Database",
    "Function",
    "Gpu",
    "Lease",
    "Node",
    "OpStatus",
    "Operation",
    "Replica",
    "ReplicaState",
    "SchemaError",
    "check_schema",
    "get_database",
]
