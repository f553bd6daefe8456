"""Settings: typed, named in every error, and found from a running stack."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from config.celery import celery_config
from config.settings import (
    SECRETS as SECRET_SETTINGS,
)
from config.settings import (
    ConfigError,
    Settings,
    load_settings,
    reset_settings,
    reveal,
)
from corral.cli import main


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("CORRAL_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def test_defaults() -> None:
    s = load_settings()
    assert s.database_url == "sqlite:///corral.sqlite"
    assert s.broker_url == "redis://localhost:6379/0"
    assert s.backend_url == s.broker_url
    assert (s.reap_interval_s, s.idle_timeout_s, s.reap_batch) == (60, 600, 100)
    assert s.visibility_timeout_s > s.task_time_limit_s > s.task_soft_time_limit_s
    assert s.broker_poll_s == 1.0  # kombu's own BRPOP timeout


def test_the_statement_timeout_fits_between_the_soft_and_the_hard_limit_unless_set() -> None:
    assert load_settings().statement_timeout_s == 15  # half of 90 - 60
    calls = {"rpc_timeout_s": 1, "create_timeout_s": 1, "lambdo_timeout_s": 1}
    short = load_settings(task_soft_time_limit_s=4, task_time_limit_s=5, **calls)
    assert short.statement_timeout_s == 0.5  # short limits need no setting of their own
    assert load_settings(db_statement_timeout_s=29).statement_timeout_s == 29
    assert load_settings(db_statement_timeout_s=0).statement_timeout_s == 0  # off: allowed


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("CORRAL_REAP_BATCH", "lots", "CORRAL_REAP_BATCH: Input should be a valid integer"),
        ("CORRAL_REAP_BATCH", "0", "CORRAL_REAP_BATCH: Input should be greater than"),
        ("CORRAL_EAGER", "maybe", "CORRAL_EAGER"),
        ("CORRAL_PLACEMENT", "best", "CORRAL_PLACEMENT"),
        ("CORRAL_DATABASE_URL", "mysql://x", "CORRAL_DATABASE_URL"),
        ("CORRAL_BROKER_URL", "amqp://x", "CORRAL_BROKER_URL"),
        ("CORRAL_VISIBILITY_TIMEOUT_S", "60", "CORRAL_VISIBILITY_TIMEOUT_S must exceed"),
        (  # the default limits leave 30 s between the soft and the hard one
            "CORRAL_DB_STATEMENT_TIMEOUT_S",
            "30",
            "CORRAL_DB_STATEMENT_TIMEOUT_S must be below CORRAL_TASK_TIME_LIMIT_S - "
            "CORRAL_TASK_SOFT_TIME_LIMIT_S (30 s)",
        ),
        ("CORRAL_DB_STATEMENT_TIMEOUT_S", "-1", "CORRAL_DB_STATEMENT_TIMEOUT_S: Input should be"),
    ],
)
def test_a_bad_setting_is_named(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert message in str(err.value)


def test_cli_reports_a_bad_setting_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CORRAL_HEALTH_MISSES", "often")
    reset_settings()
    try:
        assert main(["nodes", "list"]) == 1
    finally:
        reset_settings()
    err = capsys.readouterr().err.strip()
    assert err.startswith("corral: error: bad setting: CORRAL_HEALTH_MISSES")
    assert len(err.splitlines()) == 1


def test_running_stack_supplies_addresses_unless_the_environment_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    state = tmp_path / ".corral"
    state.mkdir()
    published = {
        "broker_url": "redis://127.0.0.1:7000/0",
        "database_url": "sqlite:////tmp/stack.sqlite",
    }
    (state / "stack.json").write_text(json.dumps({"pid": os.getpid(), "settings": published}))
    assert load_settings().broker_url == "redis://127.0.0.1:7000/0"
    monkeypatch.setenv("CORRAL_BROKER_URL", "redis://127.0.0.2:6379/0")
    assert load_settings().broker_url == "redis://127.0.0.2:6379/0"
    assert load_settings().database_url == "sqlite:////tmp/stack.sqlite"
    # a stack that is no longer running is ignored
    (state / "stack.json").write_text(json.dumps({"pid": 2**22 + 12345, "settings": published}))
    assert load_settings().database_url == "sqlite:///corral.sqlite"


SECRETS = {
    "CORRAL_LAMBDO_TOKEN": "lambdo-t0ken-value",
    "CORRAL_AGENT_TOKEN": "agent-t0ken-value",
    "CORRAL_REGISTRY_TOKEN": "registry-t0ken-value",
    "CORRAL_AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY000042",
    "CORRAL_AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY",
    "CORRAL_METRICS_TOKEN": "metrics-t0ken-value",
    "CORRAL_GATEWAY_TOKEN": "gateway-t0ken-value",
    "CORRAL_FLOWER_PASSWORD": "flower-pw-value",
    "CORRAL_CALLBACK_KEY": "callback-k3y-value",
}


def _dumps(settings: Settings) -> dict[str, str]:
    """Every way the settings are shown: printed, logged, dumped, handed to Celery."""
    return {
        "repr": repr(settings),
        "str": str(settings),
        "format": f"{settings}",
        "model_dump": str(settings.model_dump()),
        "model_dump json mode": json.dumps(settings.model_dump(mode="json")),
        "model_dump_json": settings.model_dump_json(),
        "vars": str(vars(settings)),
        "celery config": repr(celery_config(settings)),
    }


def test_every_secret_setting_is_a_secretstr_and_masked_in_every_dump(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The secret settings are the SecretStr ones; the names this test sets are all of them.
    assert {f"CORRAL_{name.upper()}" for name in SECRET_SETTINGS} == set(SECRETS)
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert {n: reveal(getattr(settings, n[7:].lower())) for n in SECRETS} == SECRETS
    shown = _dumps(settings)
    # a bad value beside them, and a rule between settings broken: the errors
    for bad in ({"CORRAL_NODE_CAPACITY": "lots"}, {"CORRAL_TASK_SOFT_TIME_LIMIT_S": "100"}):
        with monkeypatch.context() as m:
            for name, value in bad.items():
                m.setenv(name, value)
            with pytest.raises(ConfigError) as caught:
                load_settings()
            shown[f"ConfigError {bad}"] = str(caught.value)
            with pytest.raises(ValidationError) as raw:
                Settings.model_validate({})
            shown[f"ValidationError {bad}"] = str(raw.value)
            reset_settings()
            try:
                assert main(["nodes", "list"]) == 1
            finally:
                reset_settings()
            shown[f"corral nodes list {bad}"] = "".join(capsys.readouterr())
    # a bad value of a secret setting itself (not text): named, never shown
    for name in SECRET_SETTINGS:
        not_text = [SECRETS[f"CORRAL_{name.upper()}"]]
        with pytest.raises(ConfigError, match=f"CORRAL_{name.upper()}") as caught:
            load_settings(**{name: not_text})
        shown[f"ConfigError {name}"] = str(caught.value)
        with pytest.raises(ValidationError) as raw:
            Settings.model_validate({name: not_text})
        shown[f"ValidationError {name}"] = str(raw.value) + repr(raw.value)
    assert "**********" in shown["repr"] and "bad setting: CORRAL_NODE_CAPACITY" in "".join(
        shown.values()
    )
    for what, text in shown.items():
        for secret in SECRETS.values():
            assert secret not in text, f"{what} shows {secret}: {text}"


def test_reveal_gives_the_value_or_none() -> None:
    assert reveal(None) is None
    assert reveal(SecretStr("")) is None  # set but empty: unset
    assert reveal(SecretStr("t0ken")) == "t0ken"
    assert load_settings(gateway_token="").gateway_token is not None
    assert reveal(load_settings(gateway_token="").gateway_token) is None
