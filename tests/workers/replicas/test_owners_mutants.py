"""``owners.let_go`` gives up only rows never sent: a row whose create went out stays owned.

A one-line mutation (``_LET_GO`` without ``sent_at IS NULL``) went uncaught by the other
tests: a handler that failed after sending some creates would give up rows whose create
is out, and the next handler would take them as never sent and send them again - to a
seed agent, a second VM. Kept apart from test_owners.py while owners.py is reworked; the
lead folds it in at merge.
"""

from __future__ import annotations

from sqlalchemy import select

from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn
from workers.replicas.owners import Budget, let_go, mark_sent, owner_token, take
from workers.replicas.plan import SpawnJob
from workers.replicas.spawn import place
from workers.store.models import Replica


def test_let_go_gives_up_the_unsent_rows_and_keeps_the_sent_ones(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env, seed_only=True)
    fn_id = deploy_fn(corral_env, "hello", max=5)
    settings = corral_env.settings
    place(corral_env.db, settings, None, fn_id, [SpawnJob("sent"), SpawnJob("unsent")])
    token = owner_token()
    taken = take(
        corral_env.db, settings, ["sent", "unsent"], token, Budget.of(settings).own_until()
    )
    pending = {p.request_id: p for p in taken.pending}
    assert mark_sent(corral_env.db, token, [pending["sent"]]) == {pending["sent"].replica_id}
    let_go(corral_env.db, token, [p.replica_id for p in pending.values()])  # after an error
    with corral_env.db.read() as s:
        rows = {r.request_id: r for r in s.scalars(select(Replica))}
    assert (rows["unsent"].owner, rows["unsent"].owner_until, rows["unsent"].sent_at) == (
        None,
        None,
        None,
    )
    assert rows["sent"].owner == token and rows["sent"].sent_at is not None
    assert rows["sent"].owner_until is not None  # it lapses with its owner, as it must


def test_let_go_gives_up_only_its_own_rows(corral_env: Env, start_agents: StartAgents) -> None:
    start_agents(1, env=corral_env)
    fn_id = deploy_fn(corral_env, "hello", max=5)
    settings = corral_env.settings
    place(corral_env.db, settings, None, fn_id, [SpawnJob("theirs")])
    theirs = owner_token()
    take(corral_env.db, settings, ["theirs"], theirs, Budget.of(settings).own_until())
    let_go(corral_env.db, owner_token(), [r.id for r in _rows(corral_env)])  # another handler
    assert [r.owner for r in _rows(corral_env)] == [theirs]


def _rows(env: Env) -> list[Replica]:
    with env.db.read() as s:
        return list(s.scalars(select(Replica)))
