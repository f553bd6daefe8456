"""The listening rule: nothing listens off loopback without a token, and the refusal says why."""

from __future__ import annotations

import logging

import pytest

from netplumb.listening import Server, listen_address, listen_refusal, refuse_to_listen


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_token(host: str) -> None:
    assert listen_refusal("corral thing", host, None, "CORRAL_THING_TOKEN") is None


@pytest.mark.parametrize(
    ("host", "shown"),
    [("0.0.0.0", "0.0.0.0"), ("", "0.0.0.0"), ("[::]", "::"), ("10.0.0.5", "10.0.0.5")],
)
def test_off_loopback_without_a_token_is_refused_naming_the_variable(host: str, shown: str) -> None:
    reason = listen_refusal("corral thing", host, None, "CORRAL_THING_TOKEN")
    assert reason == (
        f"corral thing refuses to listen on {shown} without a token: set "
        "CORRAL_THING_TOKEN (or listen on 127.0.0.1, or pass --insecure to "
        "accept the risk)"
    )
    assert listen_refusal("corral thing", host, "s3cret", "CORRAL_THING_TOKEN") is None


def test_insecure_allows_it_with_a_warning_each_time(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="corral.security")
    for _ in range(2):
        assert (
            listen_refusal("corral thing", "10.0.0.5", None, "CORRAL_THING_TOKEN", insecure=True)
            is None
        )
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2
    assert "listens on 10.0.0.5 WITHOUT a token" in warned[0]
    assert "CORRAL_THING_TOKEN" in warned[0]


def test_listen_address_checks_the_shape_then_the_rule() -> None:
    thing = Server("corral thing", "CORRAL_THING_LISTEN", "CORRAL_THING_TOKEN")
    assert listen_address(thing, "[::1]:9000", None) == ("::1", 9000)
    with pytest.raises(ValueError, match=r"^CORRAL_THING_LISTEN: expected HOST:PORT"):
        listen_address(thing, "nowhere", None)
    with pytest.raises(ValueError, match=r"refuses to listen on 10\.0\.0\.5 .*CORRAL_THING_TOKEN"):
        listen_address(thing, "10.0.0.5:9000", None)
    assert listen_address(thing, "10.0.0.5:9000", "s3cret") == ("10.0.0.5", 9000)


def test_a_command_line_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert refuse_to_listen("corral-agent", "0.0.0.0", None, "CORRAL_AGENT_TOKEN", False)
    err = capsys.readouterr().err
    assert err.startswith("corral-agent: error: corral-agent refuses to listen on 0.0.0.0")
    assert len(err.strip().splitlines()) == 1
    assert not refuse_to_listen("corral-agent", "0.0.0.0", "t", "CORRAL_AGENT_TOKEN", False)
