"""What some tests need from the machine, and whether a missing need skips or fails them.

A few features can only be tested where the machine has something pip cannot install:
PostgreSQL's wheel (pip does install it, but a partial install may lack it), root and
iproute2 for network namespaces (the partition tests), a C compiler (the guest
environment's ``LD_PRELOAD`` case), QEMU and busybox (the qemu driver's real guests),
HAProxy (the gateway's warm data plane). On a developer's machine a test whose need is unmet
skips, saying why. Where the environment requires the need, the test fails instead, so
a CI run cannot pass by skipping what it was meant to show: ``CI=true`` requires every
need (``.ci/run`` installs them all and sets it), ``CORRAL_REQUIRE_<NEED>=1`` requires one
(``CORRAL_REQUIRE_POSTGRES=1`` as before).

A test states a need with ``@needs(NETNS, why)`` (``why``: what is missing, None when
nothing is; ``tests/conftest.py`` acts on the mark before the test runs), or by calling
:func:`unmet` from inside a fixture or test once it finds the need unmet.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

POSTGRES = "POSTGRES"
NETNS = "NETNS"
CC = "CC"
QEMU = "QEMU"
HAPROXY = "HAPROXY"
NEEDS = (POSTGRES, NETNS, CC, QEMU, HAPROXY)
_TRUE = {"1", "true", "yes"}


def _set(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def required_by(need: str) -> str | None:
    """The variable that makes ``need`` required here (None: a missing need skips)."""
    if need not in NEEDS:
        raise ValueError(f"unknown need {need!r} (one of {', '.join(NEEDS)})")
    for name in (f"CORRAL_REQUIRE_{need}", "CI"):
        if _set(name):
            return name
    return None


def unmet(need: str, why: str) -> NoReturn:
    """Skip the test because ``need`` is unmet (``why``), or fail it where it is required."""
    by = required_by(need)
    if by is not None:
        pytest.fail(f"{why}, but {by} is set: this run must test it", pytrace=False)
    pytest.skip(why)


def needs(need: str, why: str | None) -> pytest.MarkDecorator:
    """Mark a test that needs ``need``; ``why`` says what is missing (None: nothing)."""
    return pytest.mark.needs(need, why)


def check(item: pytest.Item) -> None:
    """Act on an item's ``needs`` marks: skip or fail it for the first unmet one."""
    for mark in item.iter_markers("needs"):
        need, why = mark.args
        if why is not None:
            unmet(need, why)
