"""The gateway's two data planes in tests: the Python gateway alone, and HAProxy in front of it.

A test of the gateway runs on both (``CORRAL_GATEWAY_DATAPLANE``: ``python`` and
``haproxy``; :mod:`workers.gateway.haproxy`). HAProxy is a system package (Debian's
``haproxy``, 2.6 or later): where it is missing the HAProxy side is skipped, and said
so, unless ``CORRAL_REQUIRE_HAPROXY=1`` (``.ci/run`` installs HAProxy and sets it) or
``CI=true`` is set, in which case it fails, as ``CORRAL_REQUIRE_POSTGRES`` does for
PostgreSQL.
"""

from __future__ import annotations

import os
from functools import cache

import pytest

from workers.gateway.haproxy.process import Unavailable, find

DATAPLANES = ("python", "haproxy")
REQUIRE_ENV = "CORRAL_REQUIRE_HAPROXY"


@cache
def _missing() -> str | None:
    """Why HAProxy cannot be used here (None: it can)."""
    try:
        find("haproxy")
    except Unavailable as exc:
        return str(exc)
    return None


def need(dataplane: str) -> str:
    """``dataplane``, once it can run here: skips (or fails, when required) without HAProxy."""
    if dataplane == "haproxy" and (why := _missing()) is not None:
        required = os.environ.get(REQUIRE_ENV, "").strip().lower() in {"1", "true", "yes"}
        if required or os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"HAProxy is needed: {why}, but {REQUIRE_ENV} or CI is set", pytrace=False)
        pytest.skip(f"the HAProxy data plane: {why} (apt-get install haproxy)")
    return dataplane
