"""The names corral gives functions and nodes: DNS labels, checked the same way for both.

A name goes into URLs (``/function/NAME``), host names and log lines, so it is a DNS
label: 1-63 lowercase letters, digits and ``-``, starting and ending with a letter or
digit. :func:`check_name` refuses anything else with a clear :class:`InputError`,
showing the name as typed (escaped when it is not printable, shortened when long).
"""

from __future__ import annotations

import re

from workers.base.errors import InputError

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def check_name(name: str, what: str = "function") -> str:
    """``name`` if it is a valid DNS-label name, else a clear :class:`InputError`."""
    if not isinstance(name, str) or not name.isprintable() or not NAME_RE.match(name):
        shown = name if isinstance(name, str) and name.isprintable() else repr(name)
        if isinstance(shown, str) and len(shown) > 70:
            shown = shown[:67] + "..."
        raise InputError(
            f"invalid {what} name {shown!r}: use 1-63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return name
