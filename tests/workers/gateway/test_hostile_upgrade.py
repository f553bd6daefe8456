"""A replica's 101 answer is refused by the gateway, and its replica kept (issue 29).

Whether a refused answer retires its replica is the store's business, so this runs on
both stores, each with a gateway process of its own (:mod:`.gateway_process`); the
other attacks share one gateway (:mod:`.test_hostile_answers`).
"""

from __future__ import annotations

from pathlib import Path

from testkit import httpcalls
from testkit.eventually import eventually
from tests.workers.gateway.conftest import Stack
from tests.workers.gateway.gateway_process import AUTH, gateway_process


def test_a_101_is_refused_without_a_traceback_and_its_replica_kept(
    stack: Stack, tmp_path: Path
) -> None:
    with gateway_process(stack, tmp_path) as gateway:
        answer = httpcalls.get(f"{gateway.url}/function/evil/upgrade", headers=AUTH, timeout=30)
        log = gateway.log.read_text(errors="replace")
        assert "Traceback" not in log and "HttpParserUpgrade" not in log, log[-2000:]
        assert answer.status_code == 502
        # (HAProxy, which refuses a 101 nobody asked for, says it in its own words)
        assert stack.haproxy or "switched protocols" in answer.text
        eventually(lambda: gateway.refused("upgrade") == 1, 10, "the refusal counted")
        assert len(stack.replicas("evil")) == 1  # an answer refused: no replica retired
