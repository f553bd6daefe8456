"""The gateway's two data planes in tests: the Python gateway alone, and HAProxy in front of it.

A test of the gateway runs on both (``CORRAL_GATEWAY_DATAPLANE``: ``python`` and
``haproxy``; :mod:`workers.gateway.haproxy`). HAProxy is a system package (Debian's
``haproxy``, 2.6 or later): where it is missing the HAProxy side is skipped, and said
so, or fails where HAProxy is required (:mod:`tests.requirements`: ``CI=true`` or
``CORRAL_REQUIRE_HAPROXY=1``).
"""

from __future__ import annotations

from functools import cache

import pytest

from tests.requirements import HAPROXY, unmet
from workers.gateway.haproxy.process import Unavailable, find

DATAPLANES = ("python", "haproxy")
PAIRS = (("sqlite", "haproxy"), ("postgres", "python"))  # (store, data plane) of each run
PLANE_PER_STORE = pytest.mark.parametrize(
    ("store_url", "dataplane"),
    PAIRS,
    indirect=["store_url"],
    ids=[f"{store}-{plane}" for store, plane in PAIRS],
)
"""Each data plane once and each store once: SQLite, the default store, behind HAProxy, the
default data plane where it is installed, and PostgreSQL behind the Python gateway.

The store's part is the same on both data planes (claims, cold starts, retiring) and the
data plane's the same on both stores, so the two runs cover what the four would. The
``dataplane`` argument is the name; a test passes it through :func:`need`.
"""


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
        unmet(HAPROXY, f"the HAProxy data plane: {why} (apt-get install haproxy)")
    return dataplane
