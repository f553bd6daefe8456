"""Secrets kept out of text: the one redaction every message, error and log line goes through.

Text corral did not write - an agent's gRPC details, a Lambdo host's error body, a
database driver's message - may carry a secret: one corral sent (the call's token, a
function's AWS keys) echoed back, or one that merely looks like a credential. Before
such text is logged, stored (an operation's error, a replica's, a node's last error) or
printed, :func:`redact` replaces, with the one :data:`MASK`:

* each secret it is given, also in its URL-encoded (``%2F``, ``+``) and JSON-escaped
  forms, so an echo inside a query string or a JSON body is caught too;
* credential-shaped text: ``Bearer <token>``, the password of ``scheme://user:password@``
  (also URL-encoded: ``%3A...%40``), the value of ``password=`` / ``token:`` /
  ``aws_secret_access_key=`` style pairs (also with ``%3D`` / ``%3A``), and AWS access
  key ids (``AKIA...``/``ASIA...``).

The same pass makes the text safe to show (:func:`escape_controls`): an operator reads
it in a terminal (``corral nodes list``, a worker's log) or in Flower, where an agent's
``\\x1b[2K\\r`` would erase the line and an OSC sequence set the window's title. Every
control character - C0 and C1, DEL, line and paragraph separators, the bidirectional
overrides - becomes its visible escape (``\\x1b``, ``\\u202e``). Text that is already
escaped has none left, so escaping twice changes nothing.

:func:`redact_params` masks the values of secret-named keys in a mapping (an
operation's parameters); :func:`is_secret_name` is its rule for which names hold a
secret. A secret *setting* needs neither: it is a ``SecretStr`` (:mod:`config.settings`),
masked by pydantic wherever the settings are shown.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, quote_plus

__all__ = [
    "MASK",
    "SECRET_WORDS",
    "escape_controls",
    "is_secret_name",
    "redact",
    "redact_params",
]

MASK = "***"
#: A name holding one of these (case-insensitive) holds a secret.
SECRET_WORDS = (
    "secret",
    "token",
    "password",
    "passwd",
    "api_key",
    "apikey",
    "authorization",
    "aws_access_key",
    "credential",
    "basic_auth",
)
_MIN_SECRET = 4  # shorter "secrets" would mask ordinary words

_NAMES = "|".join(re.escape(w).replace("_", "[_-]?") for w in SECRET_WORDS)
_PATTERNS = [
    # Bearer <token>
    re.compile(r"(?i)(\bbearer(?:\s+|%20|\+))[^\s'\",;&]+"),
    # scheme://user:password@ (also URL-encoded: %3A%2F%2Fuser%3Apassword%40)
    re.compile(r"(://[^/\s:@]*:)[^\s/@]*(@)"),
    re.compile(r"(?i)(%3A%2F%2F[^/\s%@]*%3A)\S*?(%40)"),
    # password=..., "token": "...", aws_secret_access_key%3D...
    re.compile(
        r"(?i)([\w-]*(?:" + _NAMES + r")[\w-]*['\"]?\s*(?:[=:]|%3D|%3A)\s*['\"]?)"
        r"(?!(?i:bearer)\b|\*\*\*)[^\s'\",;&)]+"
    ),
    # AWS access key ids
    re.compile(r"\b((?:AKIA|ASIA))[A-Z0-9]{16}\b"),
]


#: Characters a terminal or a browser acts on rather than shows: C0 and DEL, C1 (``\x9b``
#: is a CSI by itself), line and paragraph separators, bidirectional marks, embeddings,
#: overrides and isolates.
_CONTROLS = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    # (not mutated: 0x100 is no control character, so < and <= 0x100 read the same)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"  # pragma: no mutate


def escape_controls(text: str) -> str:
    """``text`` with every control character shown as its escape (``\\x1b``), once."""
    return _CONTROLS.sub(_visible, text)


def is_secret_name(name: str) -> bool:
    """True if a parameter called ``name`` holds a secret."""
    lowered = name.lower().replace("-", "_")
    return any(word in lowered for word in SECRET_WORDS)


def _forms(secret: str) -> set[str]:
    """The ways ``secret`` may appear in text: as is, URL-encoded, JSON-escaped."""
    return {
        secret,
        # (not mutated: letters added to safe="" are letters quote never encodes anyway)
        quote(secret, safe=""),  # pragma: no mutate
        quote_plus(secret),
        json.dumps(secret)[1:-1],
    }


def _mask(match: re.Match[str]) -> str:
    tail = match.group(2) if match.re.groups > 1 else ""
    return match.group(1) + MASK + tail


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with each of ``secrets`` (in every form) and credential-shaped strings masked,
    and its control characters escaped."""
    forms = {form for s in secrets if s and len(s) >= _MIN_SECRET for form in _forms(s)}
    for form in sorted(forms, key=len, reverse=True):  # the longest first: no partial leftovers
        text = text.replace(form, MASK)
    for pattern in _PATTERNS:
        text = pattern.sub(_mask, text)
    return escape_controls(text)


def redact_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` with the values of secret-named keys masked (nested mappings too)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if is_secret_name(key):
            out[key] = MASK if value else value
        elif isinstance(value, Mapping):
            out[key] = redact_params(value)
        else:
            out[key] = value
    return out
