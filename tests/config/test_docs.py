"""docs/settings.md is written from config/settings.py, and CI fails while they differ."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from config import docs
from config.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_the_settings_reference_matches_the_code() -> None:
    # What CI runs: a setting added, removed or redescribed without rewriting the file fails.
    done = subprocess.run(
        [sys.executable, "-m", "config.docs", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (ROOT / "docs" / "settings.md").read_text() == docs.render()


def test_every_setting_has_a_row_with_its_default() -> None:
    text = docs.render()
    rows = text.splitlines()
    for name, info in Settings.model_fields.items():
        (row,) = [line for line in rows if line.startswith(f"| `CORRAL_{name.upper()}` |")]
        assert docs.default(info) in row
    assert "| `CORRAL_REAP_BATCH` | `100` | integer, 1 to 100,000 |" in text
    assert "| `CORRAL_PLACEMENT` | `loadbalance` | `loadbalance`, `roundrobin`," in text
    assert "| `CORRAL_AGENT_TOKEN` | unset | secret (never shown) |" in text


def test_check_fails_on_a_stale_file_and_writing_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "settings.md"
    target.write_text(docs.render().replace("`600`", "`601`"))
    assert docs.main(["--check", "--output", str(target)]) == 1
    assert "python -m config.docs" in capsys.readouterr().err
    assert "`601`" in target.read_text()  # --check writes nothing
    assert docs.main(["--output", str(target)]) == 0
    assert docs.main(["--check", "--output", str(target)]) == 0


class _Group(BaseModel):
    """A group."""

    described: int = 1
    """Has a string."""
    bare: int = 2


class Knobs(_Group, BaseSettings):
    """Knobs."""

    model_config = SettingsConfigDict(env_prefix="CORRAL_")


class _Documented(BaseModel):
    """Now documented."""

    bare: int = 2
    """Now it has one."""


class Documented(_Documented, BaseSettings):
    """Knobs, documented."""

    model_config = SettingsConfigDict(env_prefix="CORRAL_")


def test_a_setting_without_a_description_is_an_error_naming_it() -> None:
    with pytest.raises(docs.UndocumentedSetting, match="CORRAL_BARE") as caught:
        docs.render(Knobs)
    assert "CORRAL_DESCRIBED" not in str(caught.value)
    text = docs.render(Documented)
    assert "## Now documented\n" in text
    assert "| `CORRAL_BARE` | `2` | integer | Now it has one. |" in text


def test_a_settings_description_is_its_string_and_the_reference_shows_it() -> None:
    # The authoring style: the string below a field, read from its group's source.
    meaning = docs.described(Settings)["reap_batch"]
    assert meaning == "Replicas one reaper pass deletes at most."
    assert f"| {meaning} |" in docs.render()
    assert len(docs.described(Settings)) == len(Settings.model_fields)  # every one has one


class _Bounded(BaseModel):
    port: int = Field(80, ge=1, le=65535)
    ratio: float = Field(0.5, gt=0, le=1)


def test_bounds_are_written_in_words() -> None:
    port, ratio = _Bounded.model_fields["port"], _Bounded.model_fields["ratio"]
    assert docs.accepts("port", port) == "integer, 1 to 65,535"
    assert docs.accepts("ratio", ratio) == "number, > 0, <= 1"
    assert docs.accepts("wait_s", ratio) == "seconds, > 0, <= 1"


def test_rst_roles_become_code_spans() -> None:
    assert docs.markdown("a :class:`~config.settings.ConfigError` and ``x``") == (
        "a `ConfigError` and `x`"
    )
