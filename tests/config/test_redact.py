"""Secrets kept out of text (config/redact.py): each form of a secret, each credential shape,
control characters, and the parameters of an operation.

The tests through the system (an agent or a Lambdo host echoing a secret into what is
stored, logged and printed) are in tests/workers/test_secrets.py and test_terminal_text.py.
"""

from __future__ import annotations

import json
from urllib.parse import quote, quote_plus

import pytest

from config.redact import MASK, SECRET_WORDS, escape_controls, is_secret_name, redact, redact_params

HOSTILE = "\x1b[2K\r\x1b[32mHEALTHY-LOOKING TEXT\x1b[0m\x1b]0;title\x07"
SECRET = 'wJal/rXUt+nFEMI"K7MD\\ENG=bPx é'  # slash, plus, quote, backslash, equals, space, é


@pytest.mark.parametrize(
    ("form", "how"),
    [
        (SECRET, "as is"),
        (quote(SECRET, safe=""), "URL-encoded"),
        (quote_plus(SECRET), "URL-encoded, spaces as +"),
        (json.dumps(SECRET)[1:-1], "JSON-escaped"),
    ],
)
def test_a_secret_is_masked_in_every_form(form: str, how: str) -> None:
    assert form != SECRET or how == "as is"  # each form differs from the secret itself
    text = f"the host said: no such image ({form}) - try again"
    assert redact(text, [SECRET]) == f"the host said: no such image ({MASK}) - try again", how


def test_a_secret_echoed_inside_a_json_body_is_masked() -> None:
    body = json.dumps({"detail": f"rejected {SECRET}", "code": 7})
    shown = redact(body, [SECRET])
    assert json.loads(shown) == {"detail": f"rejected {MASK}", "code": 7}


def test_the_longest_form_is_masked_first_so_nothing_of_it_is_left() -> None:
    # "abcd" is also the start of the longer secret: masking it first would leave "efgh"
    assert redact("key abcdefgh and abcd", ["abcd", "abcdefgh"]) == f"key {MASK} and {MASK}"


def test_the_longest_form_is_masked_first_whatever_its_letters() -> None:
    # sorted by their letters the short one comes first, and would leave "abcd...xx"
    assert redact("key abcdzz12xx", ["zz12", "abcdzz12xx"]) == f"key {MASK}"


def test_short_or_missing_secrets_mask_nothing() -> None:
    assert redact("a cat sat on the mat", ["cat", "", None]) == "a cat sat on the mat"
    assert redact("a cats tail", ["cats"]) == f"a {MASK} tail"  # four characters do


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("Authorization: Bearer abc.def-ghi", f"Authorization: Bearer {MASK}"),
        ("bearer%20abc.def then more", f"bearer%20{MASK} then more"),
        ("BEARER+abc,next", f"BEARER+{MASK},next"),
        ("postgresql://corral:hunter22@db:5432/x", f"postgresql://corral:{MASK}@db:5432/x"),
        ("redis://:pw@broker/0", f"redis://:{MASK}@broker/0"),
        ("url=postgresql%3A%2F%2Fu%3Ahunter22%40db", f"url=postgresql%3A%2F%2Fu%3A{MASK}%40db"),
        ("password=hunter22&user=u", f"password={MASK}&user=u"),
        ('{"token": "t0k3n", "n": 1}', f'{{"token": "{MASK}", "n": 1}}'),
        ("aws_secret_access_key%3Dxyz123 more", f"aws_secret_access_key%3D{MASK} more"),
        ("Api-Key: zzz9; next", f"Api-Key: {MASK}; next"),
        ("x-auth-token:'q1w2' (sent)", f"x-auth-token:'{MASK}' (sent)"),
        ("id AKIAIOSFODNN7EXAMPLE used", f"id AKIA{MASK} used"),
        ("id ASIAIOSFODNN7EXAMPLE used", f"id ASIA{MASK} used"),
    ],
)
def test_credential_shaped_text_is_masked(text: str, shown: str) -> None:
    assert redact(text) == shown


@pytest.mark.parametrize(
    "text",
    [
        "password: Bearer",  # the pair's value is the bearer rule's, not a secret itself
        f"token={MASK} already masked",
        "AKIAIOSFODNN7EXAMPL is too short, XAKIAIOSFODNN7EXAMPLE is inside a word",
        "mailto:someone@example.org and http://host/path@v2",
        "the secretary sent no tokens",
    ],
)
def test_text_that_only_looks_near_a_credential_is_left_alone(text: str) -> None:
    assert redact(text) == text


def test_redacting_twice_changes_nothing() -> None:
    once = redact(f"password=hunter22 Bearer abc {SECRET} {HOSTILE}", [SECRET])
    assert redact(once, [SECRET]) == once


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (HOSTILE, "\\x1b[2K\\x0d\\x1b[32mHEALTHY-LOOKING TEXT\\x1b[0m\\x1b]0;title\\x07"),
        ("8-bit CSI \x9b2J, DEL \x7f, NUL \x00", "8-bit CSI \\x9b2J, DEL \\x7f, NUL \\x00"),
        ("bidi \u202eoverride\u2069, line\u2028sep", "bidi \\u202eoverride\\u2069, line\\u2028sep"),
        ("marks \u200f\u200e\u061c", "marks \\u200f\\u200e\\u061c"),
        ("two\nlines\tand a tab", "two\\x0alines\\x09and a tab"),
        ("plain text, é and 雪 stay", "plain text, é and 雪 stay"),
        ("\x1f\x20\x7e\x80\xa0", "\\x1f ~\\x80\xa0"),  # the edges of each range
        ("\u2027\u202a\u202f\u2065\u2066\u206a", "\u2027\\u202a\u202f\u2065\\u2066\u206a"),
    ],
)
def test_control_characters_are_escaped_once(raw: str, shown: str) -> None:
    assert escape_controls(raw) == shown
    assert escape_controls(shown) == shown  # escaping again changes nothing
    assert redact(raw) == shown  # the one pass text from the network goes through


@pytest.mark.parametrize(
    "name",
    ["AWS_SECRET_ACCESS_KEY", "agent-token", "Password", "x_api_key", "Authorization",
     "aws_access_key_id", "db_credentials", "BASIC_AUTH", "apikey", "passwd",
     "X-Api-Key", "aws-access-key-id", "Basic-Auth"],  # a dash reads as an underscore
)  # fmt: skip
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["image", "kernel", "min_replicas", "author", "pass", "key"])
def test_ordinary_names(name: str) -> None:
    assert not is_secret_name(name)


def test_every_secret_word_names_a_secret() -> None:
    for word in SECRET_WORDS:
        assert is_secret_name(word.upper()) and is_secret_name(f"my-{word}-1")


def test_params_mask_secret_named_values_at_any_depth() -> None:
    params = {
        "function": "hello",
        "count": 3,
        "aws_secret_access_key": "s3cr3t",
        "agent_token": "",
        "password": None,
        "env": {"API_KEY": "k", "PATH": "/bin", "nested": {"db_password": "p"}},
    }
    assert redact_params(params) == {
        "function": "hello",
        "count": 3,
        "aws_secret_access_key": MASK,
        "agent_token": "",  # nothing to hide: empty stays empty
        "password": None,
        "env": {"API_KEY": MASK, "PATH": "/bin", "nested": {"db_password": MASK}},
    }
    assert params["aws_secret_access_key"] == "s3cr3t"  # a copy: the original is untouched
