"""Settings: typed, named in every error, and found from a running stack."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from config.settings import ConfigError, load_settings, reset_settings
from tasks.cli import main


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
