"""The gateway's two data planes in tests: the Python gateway alone, and HAProxy in front of it.

A test of the gateway runs on both (``CORRAL_GATEWAY_DATAPLANE``: ``python`` and
``haproxy``; :mod:`workers.gateway.haproxy`). HAProxy is a system package (Debian's
``haproxy``, 2.6 or later): where it is missing the HAProxy side is skipped, and said
so, or fails where HAProxy is required (:mod:`tests.requirements`: ``CI=true`` or
``CORRAL_REQUIRE_HAPROXY=1``).
"""

from __future__ import annotations

from functools import cache

from tests.requirements import HAPROXY, unmet
from workers.gateway.haproxy.process import Unavailable, find

DATAPLANES = ("python", "haproxy")


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
