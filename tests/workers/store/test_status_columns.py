"""The status columns read as their enums and refuse values that are not members."""

from __future__ import annotations

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import StatementError

from tests.fixtures import Env
from workers.base.kinds import OpKind
from workers.functions import deploy, spec_from
from workers.operations import create_operation
from workers.store.models import Operation, OpStatus, Replica, ReplicaState


def test_status_columns_read_as_enums_and_store_plain_values(store_env: Env) -> None:
    with store_env.db.transaction() as s:
        fn, _ = deploy(s, spec_from(name="hello", image="i", kernel="/k"), store_env.settings)
        op = create_operation(s, OpKind.SPAWN, {}, function_id=fn.id, total=1)
        s.add(
            Replica(
                request_id="r-enum",
                function_id=fn.id,
                build_version=fn.build_version,
                status=ReplicaState.IDLE,
            )
        )
        op_id = op.id
    with store_env.db.read() as s:
        replica = s.scalars(select(Replica).where(Replica.request_id == "r-enum")).one()
        assert replica.status is ReplicaState.IDLE
        stored = s.scalar(select(Operation.status).where(Operation.id == op_id))
        assert stored is OpStatus.PENDING
        # the schema is unchanged: the seed's number and the status string
        raw = s.execute(text("SELECT status FROM replicas WHERE request_id = 'r-enum'")).one()
        assert raw[0] == 0
        raw = s.execute(text("SELECT status FROM operations WHERE id = :i"), {"i": op_id}).one()
        assert raw[0] == "pending"


def test_a_status_that_is_no_member_is_refused_and_nothing_changes(store_env: Env) -> None:
    with store_env.db.transaction() as s:
        op_id = create_operation(s, OpKind.REAP, {}).id
    # the statement fails at commit, when the transaction block ends: the block is the call
    with (  # noqa: PT012
        pytest.raises(StatementError, match="'done' is not a valid OpStatus"),
        store_env.db.transaction() as s,
    ):
        op = s.get(Operation, op_id)
        assert op is not None
        op.status = "done"  # type: ignore[assignment]  # what a typo would do at runtime
    with store_env.db.read() as s:
        assert s.scalar(select(Operation.status).where(Operation.id == op_id)) is OpStatus.PENDING
