"""Secrets stay secret: no password from a URL in errors, no agent-echoed secret stored,
AWS keys without argv, and a stack file trusted only if it is ours."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, quote_plus

import grpc
import pytest
from sqlalchemy import select

from agents.faults import Fault
from agents.fcdaemon import serve_fcdaemon
from agents.lambdo import serve_lambdo
from config.settings import load_settings
from corral import api
from corral.cli import main
from protos import fcdaemon_pb2
from tests.fixtures import Env
from workers.backends import inflight
from workers.backends.fcdaemon import AgentClient, TlsFiles
from workers.backends.lambdo import LambdoClient
from workers.base.errors import BackendError
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.store.models import Function, Node, Operation, Replica

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "hunter2pw-Secret"
AWS_ID = "AKIAEXAMPLEKEY000001"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"


@pytest.mark.parametrize(
    ("variable", "url"),
    [
        ("CORRAL_DATABASE_URL", f"postgres://bob:{PASSWORD}@127.0.0.1:1/corral"),
        ("CORRAL_DATABASE_URL", f"postgresql+psycopg://bob:{PASSWORD}@127.0.0.1:1/corral"),
        ("CORRAL_DATABASE_URL", f"postgresql+psycopg://bob:{PASSWORD}@127.0.0.1:notaport/corral"),
        ("CORRAL_BROKER_URL", f"amqp://bob:{PASSWORD}@127.0.0.1:1/"),
    ],
)
def test_a_bad_url_with_a_password_never_prints_it(tmp_path: Path, variable: str, url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    env.update({variable: url, "CORRAL_STATE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)})
    for argv in (["functions", "list"], ["db", "check"]):
        done = subprocess.run(
            [sys.executable, "-m", "corral.cli", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode != 0
        assert PASSWORD not in done.stdout + done.stderr, done.stderr


def test_agent_error_text_is_redacted_before_it_is_stored(corral_env: Env) -> None:
    agent = serve_fcdaemon("127.0.0.1:0", require_token="agent-t0ken-value")
    corral_env.set(agent_token="agent-t0ken-value", retry_max="0")
    try:
        with corral_env.db.transaction() as s:
            upsert_node(s, agent.address, name="n1")
            deploy(
                s,
                spec_from(
                    name="hello",
                    image="examples.hello",
                    kernel="/k",
                    aws_access_key_id=AWS_ID,
                    aws_secret_access_key=AWS_SECRET,
                ),
                corral_env.settings,
            )
        # a hostile or careless agent echoes what it was sent
        agent.agent.inject(
            "CreateReplica",
            Fault.abort(
                grpc.StatusCode.INTERNAL,
                f"bad creds {AWS_ID}/{AWS_SECRET} with Bearer agent-t0ken-value, "
                f"db postgresql://u:{PASSWORD}@db/x password={PASSWORD} "
                # the same again, URL-encoded, as in a query string
                f"?key={quote(AWS_SECRET, safe='')}&alt={quote_plus(AWS_SECRET)}"
                f"&db=postgresql%3A%2F%2Fu%3A{PASSWORD}%40db",
            ),
        )
        view = api.wait(api.spawn("hello", 1), timeout=30)
        assert view["status"] == "failed" and "bad creds" in (view["error"] or "")
        with corral_env.db.read() as s:
            stored = [
                str(v)
                for v in (
                    *[(o.error, o.result) for o in s.scalars(select(Operation))],
                    *[r.error for r in s.scalars(select(Replica))],
                    *[n.last_error for n in s.scalars(select(Node))],
                )
            ]
        text = " ".join(stored)
        assert "bad creds" in text
        for secret in (
            AWS_ID,
            AWS_SECRET,
            "agent-t0ken-value",
            PASSWORD,
            quote(AWS_SECRET, safe=""),
            quote_plus(AWS_SECRET),
        ):
            assert secret not in text, text
        assert "<redacted>" not in text and "***" in text  # one mask
    finally:
        agent.stop(grace=0)


def test_a_lambdo_error_body_is_redacted_with_the_calls_token(
    corral_env: Env, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's reproduction: a host that echoes the token it was sent, bare."""
    token = "lambdo-t0ken-value"
    host = serve_lambdo("127.0.0.1:0", token=token)
    corral_env.set(lambdo_token=token, retry_max="0")
    try:
        with corral_env.db.transaction() as s:
            upsert_node(s, host.url, name="l1", kind="lambdo")
            deploy(
                s,
                spec_from(
                    name="fn", image="examples.hello", backend="lambdo", rootfs="examples.hello"
                ),
                corral_env.settings,
            )
        for _ in range(20):  # every try of it
            host.agent.inject("spawn", Fault.abort(500, f"no such key {token} here"))
        view = api.wait(api.spawn("fn", 1), timeout=30)
        assert view["status"] == "failed" and "no such key *** here" in (view["error"] or ""), view
        assert main(["nodes", "list"]) == 0
        with corral_env.db.read() as s:
            stored = " ".join(
                str(v)
                for v in (
                    *[(o.error, o.result) for o in s.scalars(select(Operation))],
                    *[r.error for r in s.scalars(select(Replica))],
                    *[n.last_error for n in s.scalars(select(Node))],
                )
            )
        shown = capsys.readouterr()
        assert "no such key *** here" in stored
        for text in (stored, caplog.text, shown.out, shown.err):
            assert token not in text
    finally:
        host.stop()


def test_a_bad_setting_names_the_variable_and_never_a_secret(tmp_path: Path) -> None:
    """Before: a rule between settings printed every setting, tokens and passwords too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    env.update(
        {
            "CORRAL_STATE_DIR": str(tmp_path),
            "PYTHONPATH": str(ROOT),
            "CORRAL_DATABASE_URL": f"postgresql+psycopg://bob:{PASSWORD}@127.0.0.1:1/c",
            "CORRAL_AGENT_TOKEN": "agent-t0ken-value",
            "CORRAL_AWS_SECRET_ACCESS_KEY": AWS_SECRET,
            "CORRAL_FLOWER_PASSWORD": "flower-pw-value",
        }
    )
    for bad, named in (
        ({"CORRAL_TASK_SOFT_TIME_LIMIT_S": "100"}, "CORRAL_TASK_SOFT_TIME_LIMIT_S"),
        ({"CORRAL_NODE_CAPACITY": "lots"}, "CORRAL_NODE_CAPACITY"),
        ({"CORRAL_REGISTRY_TOKEN": ""}, None),  # empty: fine, nothing to say
        ({"CORRAL_NODE_CAPACITY": "-1", "CORRAL_METRICS_TOKEN": "m" * 3}, "CORRAL_NODE_CAPACITY"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "corral.cli", "nodes", "list"],
            cwd=tmp_path,
            env={**env, **bad},
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = done.stdout + done.stderr
        if named is not None:
            assert done.returncode != 0 and f"bad setting: {named}" in out, out
        for secret in (PASSWORD, "agent-t0ken-value", AWS_SECRET, "flower-pw-value"):
            assert secret not in out, out


def test_aws_keys_from_a_file_or_the_environment(
    corral_env: Env,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    secret_file = tmp_path / "aws-secret"
    secret_file.write_text(AWS_SECRET + "\n")
    assert (
        main(
            [
                "functions",
                "deploy",
                "f1",
                "--image",
                "examples.hello",
                "--kernel",
                "/k",
                "--aws-access-key-id",
                AWS_ID,
                "--aws-secret-access-key-file",
                str(secret_file),
            ]
        )
        == 0
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", AWS_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET + "2")
    assert (
        main(
            [
                "functions",
                "deploy",
                "f2",
                "--image",
                "examples.hello",
                "--kernel",
                "/k",
                "--aws-keys-from-env",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "functions",
                "deploy",
                "f3",
                "--image",
                "examples.hello",
                "--kernel",
                "/k",
                "--aws-secret-access-key-file",
                str(tmp_path / "missing"),
            ]
        )
        == 1
    )
    out = capsys.readouterr()
    assert AWS_SECRET not in out.out + out.err
    with corral_env.db.read() as s:
        keys = {
            f.name: (f.aws_access_key_id, f.aws_secret_access_key)
            for f in s.scalars(select(Function))
        }
    assert keys == {"f1": (AWS_ID, AWS_SECRET), "f2": (AWS_ID, AWS_SECRET + "2")}


def test_the_stack_file_is_trusted_only_if_ours_and_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in list(os.environ):
        if key.startswith("CORRAL_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    planted = f"sqlite:///{tmp_path / 'planted.sqlite'}"
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"pid": os.getpid(), "settings": {"database_url": planted}}))
    stack.chmod(0o600)
    assert load_settings().database_url == planted
    for mode in (0o666, 0o620, 0o602):
        stack.chmod(mode)
        assert load_settings().database_url != planted, oct(mode)
    if os.getuid() == 0:  # root can hand the file to someone else
        stack.chmod(0o600)
        os.chown(stack, 65534, 65534)
        assert load_settings().database_url != planted


def test_a_token_or_aws_keys_in_plain_text_off_loopback_are_warned(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.WARNING, logger="workers.base.untrusted")
    AgentClient("127.0.0.1:1", token="t", shared=False)  # loopback: fine
    LambdoClient("http://127.0.0.1:1", token="t")
    assert caplog.text == ""
    (tmp_path / "ca.pem").write_text("")
    AgentClient(
        "192.0.2.10:50051", token="t", shared=False, tls=TlsFiles(tmp_path / "ca.pem")
    )  # TLS: fine
    assert caplog.text == ""
    plain = AgentClient(
        "192.0.2.11:50051", token="t", shared=False, timeout_s=0.2, create_timeout_s=0.2
    )
    LambdoClient("http://192.0.2.12:3000", token="t")
    with pytest.raises(BackendError):  # TEST-NET: nothing answers
        inflight.run(
            plain.create_replica(fcdaemon_pb2.CreateRequest(imageName="i", awsSecretAccessKey="s"))
        )
    inflight.run(plain.close())
    for what, host in (
        ("the agent token", "192.0.2.11"),
        ("AWS keys", "192.0.2.11"),
        ("the Lambdo token", "192.0.2.12"),
    ):
        assert f"{what} travel(s) in plain text to {host}" in caplog.text


def test_functions_show_masks_env_values_unless_asked(
    corral_env: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 29: ``functions show --json`` printed every env value and ``--env=`` kernel
    argument in clear; only the AWS keys were masked."""
    clear = ("db-pass-0001", "api-key-0002", "label-key-0003")
    deploys = (
        ["functions", "deploy", "web", "--image", "i", "--kernel", "/k", "--env",
         f"DB_PASS={clear[0]}", "--env", "LOG_LEVEL=debug", "--kernel-args",
         f"console=ttyS0 --env=API_KEY={clear[1]} quiet", "--json"],
        ["functions", "deploy", "--file", str(tmp_path / "fn.toml"), "--json"],
    )  # fmt: skip
    (tmp_path / "fn.toml").write_text(
        'name = "seed"\nimage = "i"\n'
        f'[labels]\nKERNEL_IMAGE_PATH = "/k"\nKERNEL_ARGS = "--env=TOKEN_X={clear[2]}"\n'
    )
    shown = ""
    for argv in (
        *deploys,
        ["functions", "show", "web"],
        ["functions", "show", "web", "--json"],
        ["functions", "show", "seed", "--json"],
        ["functions", "list", "--json"],
    ):
        assert main(argv) == 0, argv
        shown += capsys.readouterr().out
    for value in clear:
        assert value not in shown
    assert "--env=API_KEY=*** quiet" in shown and '"DB_PASS": "***"' in shown
    assert '"KERNEL_ARGS": "--env=TOKEN_X=***"' in shown
    assert main(["functions", "show", "web", "--show-secrets", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["env"] == {"DB_PASS": clear[0], "LOG_LEVEL": "debug"}
    assert view["kernel_args"] == f"console=ttyS0 --env=API_KEY={clear[1]} quiet"
