"""Text from the network reaches an operator's terminal (and Flower) escaped, never played.

Issue 29's reproduction (6): an agent's error carrying ANSI and OSC sequences was stored
as is and printed by ``corral nodes list`` (LAST_ERROR), where it erased the line and
painted "HEALTHY-LOOKING TEXT" in green. Against a real agent on loopback.
"""

from __future__ import annotations

import grpc
import pytest
from sqlalchemy import select

from agents.faults import Fault
from agents.fcdaemon import serve_fcdaemon
from corral import api
from corral.cli import main
from protos import fcdaemon_pb2
from tasks.maintenance import QUEUE
from tests.fixtures import Env
from tests.helpers import deploy_fn
from workers.fleet.nodes import upsert_node
from workers.maintenance.reconcile import reconcile
from workers.store.models import Function

HOSTILE = "\x1b[2K\r\x1b[32mHEALTHY-LOOKING TEXT\x1b[0m\x1b]0;title\x07"


def _controls(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on (a line break between lines aside)."""
    return [
        ch
        for ch in text
        if ch != "\n" and (ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F or not ch.isprintable())
    ]


def test_an_agents_error_is_stored_and_listed_escaped(
    corral_env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    corral_env.set(retry_max="0")
    agent = serve_fcdaemon("127.0.0.1:0")
    try:
        with corral_env.db.transaction() as s:
            upsert_node(s, agent.address, name="n1")
        deploy_fn(corral_env)
        agent.agent.inject("CreateReplica", Fault.abort(grpc.StatusCode.INTERNAL, HOSTILE))
        view = api.wait(api.spawn("hello", 1), timeout=30)
        assert view["status"] == "failed"
    finally:
        agent.stop(grace=0)
    shown = {}
    for argv in (["nodes", "list"], ["replicas", "--all"], ["ops"], ["nodes", "list", "--json"]):
        capsys.readouterr()
        assert main(argv) == 0
        shown[" ".join(argv)] = capsys.readouterr().out
    assert "\\x1b[32mHEALTHY-LOOKING TEXT\\x1b[0m\\x1b]0;title\\x07" in shown["nodes list"]
    for what, out in shown.items():
        assert _controls(out) == [], (what, out)


def test_tenant_text_is_listed_and_shown_escaped(
    corral_env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36 (8): what a tenant gave reached the terminal raw through ``functions
    list/show``. Deploys now refuse it (tests/corral/cli/test_bad_input.py); rows an older
    corral stored as given are printed escaped."""
    deploy_fn(corral_env)
    with corral_env.db.transaction() as s:
        fn = s.scalars(select(Function).where(Function.name == "hello")).one()
        fn.image = "i\nhello2  evil  " + HOSTILE  # a forged row, then a repainted line
        fn.kernel, fn.initrd, fn.rootfs = HOSTILE, "\u202eevil", "\x9b2J"
        fn.kernel_args = "quiet " + HOSTILE
        fn.labels = {"A": HOSTILE}
    shown = {}
    for argv in (["functions", "list"], ["functions", "show", "hello"]):
        capsys.readouterr()
        assert main(argv) == 0
        shown[" ".join(argv)] = capsys.readouterr().out
    assert len(shown["functions list"].splitlines()) == 2  # the header and one row
    assert "i\\x0ahello2  evil  \\x1b[2K" in shown["functions list"]
    for what, out in shown.items():
        assert _controls(out) == [], (what, out)


def test_a_listed_vmid_that_is_no_id_is_never_acted_on(corral_env: Env) -> None:
    """A VM id in a listing is checked as one in a create's reply: a hostile one is
    reported (escaped), never released nor echoed raw into the pass's report."""
    corral_env.set(orphan_grace_s="0")
    agent = serve_fcdaemon("127.0.0.1:0")
    try:
        with corral_env.db.transaction() as s:
            upsert_node(s, agent.address, name="n1")
        listing = fcdaemon_pb2.ReplicaList(
            replicas=[fcdaemon_pb2.ReplicaInfo(vmid=HOSTILE, ip="127.0.0.1", port=1)]
        )
        agent.agent.inject("ListReplicas", Fault.reply(listing))
        report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
        assert report.orphans_destroyed == [] and agent.agent.calls_of("ReleaseVMSetup") == []
        assert len(report.errors) == 1 and "malformed vmid" in report.errors[0]
        assert _controls(str(report.as_dict())) == []
    finally:
        agent.stop(grace=0)
