"""An operation's times: started when its work begins, finished when its last part settles."""

from __future__ import annotations

from datetime import datetime

from corral import api
from tests.fixtures import Env, StartAgents
from workers.functions import spec_from


def _times(view: api.OperationView) -> tuple[datetime, datetime]:
    assert view["started_at"] is not None and view["finished_at"] is not None
    return datetime.fromisoformat(view["started_at"]), datetime.fromisoformat(view["finished_at"])


def test_spawn_and_hogs_record_when_they_started_not_only_when_they_ended(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(2)
    api.deploy(spec_from(name="hello", image="i", kernel="/k"))
    spawned = api.wait(api.spawn("hello", 3), timeout=60)
    assert spawned["status"] == "succeeded"
    started, finished = _times(spawned)
    assert started < finished  # planned, then three creates, then done
    hogs = api.wait(api.hogs("start", 1), timeout=20)
    assert hogs["status"] == "succeeded"
    started, finished = _times(hogs)
    assert started < finished
