"""Security: TLS and shared tokens on every gRPC hop, and secrets kept out of sight."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
import trustme
from sqlalchemy import select

from agents.fcdaemon import serve_fcdaemon
from corral import api
from corral.cli import main
from protos import resmngr_grpc, resmngr_pb2
from tasks.maintenance import QUEUE
from tests.fixtures import Env
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.registry.service import serve_registry
from workers.store.models import Node, Operation, Replica, ReplicaState

AWS_ID = "AKIATESTSECRETKEY123"
AWS_SECRET = "verySecret/Value+ThatMustNotLeak"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    d = tmp_path_factory.mktemp("tls")
    paths = {"ca": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    return paths


def test_spawn_over_tls_with_an_agent_token(corral_env: Env, certs: dict[str, Path]) -> None:
    agent = serve_fcdaemon(
        "127.0.0.1:0",
        tls=(certs["key"].read_bytes(), certs["cert"].read_bytes()),
        require_token="agent-s3cret",
    )
    try:
        with corral_env.db.transaction() as s:
            upsert_node(s, agent.address, name="secure")
            deploy(s, spec_from(name="hello", image="i", kernel="/k"), corral_env.settings)
        # no CA configured: corral speaks plaintext and the TLS agent refuses
        view = api.wait(api.spawn("hello", 1), timeout=30)
        assert view["status"] == "failed" and "node secure" in (view["error"] or "")
        # TLS but no token: refused UNAUTHENTICATED (permanent, not retried)
        corral_env.set(agent_tls_ca=certs["ca"], health_misses="100")
        view = api.wait(api.spawn("hello", 1), timeout=30)
        assert view["status"] == "failed" and "UNAUTHENTICATED" in (view["error"] or "")
        corral_env.set(agent_token="agent-s3cret")
        view = api.wait(api.spawn("hello", 1), timeout=30)
        assert view["status"] == "succeeded", view
        assert len(agent.driver.list()) == 1
    finally:
        agent.stop(grace=0)


def test_registry_over_tls(corral_env: Env, certs: dict[str, Path]) -> None:
    settings = corral_env.set(registry_tls_cert=certs["cert"], registry_tls_key=certs["key"])
    running = serve_registry(settings, "127.0.0.1:0", queue=QUEUE)
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes())
        secure = resmngr_grpc.ResMngrServiceStub(grpc.secure_channel(running.address, creds))
        secure.RegisterNode(
            resmngr_pb2.RegisterNodeRequest(ip="127.0.0.1", port=50051, node_id="tls-node"),
            timeout=5,
        )
        plain = resmngr_grpc.ResMngrServiceStub(grpc.insecure_channel(running.address))
        with pytest.raises(grpc.RpcError):
            plain.RegisterNode(
                resmngr_pb2.RegisterNodeRequest(ip="127.0.0.1", port=1, node_id="x"), timeout=2
            )
        with corral_env.db.read() as s:
            assert [n.external_id for n in s.scalars(select(Node))] == ["tls-node"]
    finally:
        running.stop(0)


def test_aws_keys_never_leave_the_store(
    corral_env: Env, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    agent = serve_fcdaemon("127.0.0.1:0")
    try:
        with corral_env.db.transaction() as s:
            upsert_node(s, agent.address, name="n1")
        outputs = []
        for argv in (
            [
                "functions",
                "deploy",
                "hello",
                "--image",
                "i",
                "--kernel",
                "/k",
                "--aws-access-key-id",
                AWS_ID,
                "--aws-secret-access-key",
                AWS_SECRET,
                "--json",
            ],
            ["functions", "deploy", "hello", "--image", "i", "--kernel", "/k"],
            ["functions", "show", "hello", "--json"],
            ["functions", "show", "hello"],
            ["functions", "list", "--json"],
            ["spawn", "hello", "--wait", "--json"],
            ["replicas", "--json"],
            ["ops", "--json"],
        ):
            assert main(argv) == 0
            outputs.append(capsys.readouterr())
        # the agent did get them (they are needed there)
        (req,) = agent.agent.calls_of("CreateReplica")
        assert (req.awsAccessKeyID, req.awsSecretAccessKey) == (AWS_ID, AWS_SECRET)
        shown = "".join(o.out + o.err for o in outputs)
        assert '"aws_credentials": "set"' in shown
        for secret in (AWS_ID, AWS_SECRET):
            assert secret not in shown
            assert secret not in caplog.text
        with corral_env.db.read() as s:
            for op in s.scalars(select(Operation)):
                assert AWS_ID not in str(op.params) + str(op.result) + str(op.error)
            assert s.scalars(select(Replica)).one().status == ReplicaState.IDLE
    finally:
        agent.stop(grace=0)
