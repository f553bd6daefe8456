"""Flower as ``corral up`` runs it: basic auth always, no cross-site requests, known hosts only.

Flower drives the workers (rate limits, revokes, shutdowns) from its pages and its
API, so a web page the operator visits must not drive it. Flower's own command serves
anyone when no user is set (and with ``FLOWER_UNAUTHENTICATED_API`` lets any origin read
and post), so ``corral up`` runs Flower through this module instead:

* it refuses to start without ``FLOWER_BASIC_AUTH`` (``user:password``, from the
  environment: ``corral up`` passes the stack's) and drops
  ``FLOWER_UNAUTHENTICATED_API``; Flower then sends no ``Access-Control-Allow-Origin``;
* cross-site requests that change something fail: Flower's XSRF check (on with basic
  auth: a ``Sec-Fetch-Site`` other than same-origin, or an ``Origin`` that is not the
  host, is 403) and tornado's ``cross_origin_protection`` besides;
* a request whose ``Host`` is not one this Flower is reached at (``127.0.0.1:PORT``,
  ``localhost:PORT``, ``[::1]:PORT``) is refused 403 before any handler runs, so a
  DNS name re-pointed at 127.0.0.1 (DNS rebinding) gets nothing.

It takes Flower's own options (``--port``, ``--address``...) and runs the app
``celery -A workers flower`` would.

Command line: ``python -m stack.flower --port=5555 --address=127.0.0.1``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
from typing import Any

import tornado.web
from flower import command
from flower.app import Flower
from tornado import httputil
from tornado.options import options

from workers.celery import app

__all__ = ["HostChecked", "allowed_hosts", "main"]

log = logging.getLogger("stack.flower")


def allowed_hosts(port: int) -> frozenset[str]:
    """The ``Host`` values a loopback Flower on ``port`` is reached at."""
    return frozenset(f"{host}:{port}" for host in ("127.0.0.1", "localhost", "[::1]"))


class HostChecked(Flower):  # type: ignore[misc] # Flower is untyped
    """Flower answering only requests whose ``Host`` is one of ``hosts``."""

    def __init__(self, hosts: frozenset[str], **kwargs: Any) -> None:
        """Flower's app (``kwargs``: its options and tornado settings) behind the host check."""
        super().__init__(**kwargs)
        self.hosts = hosts

    def find_handler(self, request: httputil.HTTPServerRequest, **kwargs: Any) -> Any:
        """Route the request, or refuse it (403) when its ``Host`` is not allowed."""
        if request.host.lower() not in self.hosts:
            log.warning("refused a request for host %r", request.host[:100])
            refuse = {"status_code": 403}
            return self.get_handler_delegate(request, tornado.web.ErrorHandler, refuse)
        return super().find_handler(request, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """Run Flower with the checks above until SIGTERM; 2 without basic auth."""
    argv = sys.argv[1:] if argv is None else argv
    if not os.environ.get("FLOWER_BASIC_AUTH"):
        print("stack.flower: error: FLOWER_BASIC_AUTH (user:password) must be set", file=sys.stderr)
        return 2
    os.environ.pop("FLOWER_UNAUTHENTICATED_API", None)
    command.apply_env_options()
    command.apply_options(sys.argv[0], argv)
    command.extract_settings()
    command.setup_logging()
    settings = {**command.settings, "xsrf_cookies": True, "cross_origin_protection": True}
    flower = HostChecked(allowed_hosts(options.port), capp=app, options=options, **settings)
    atexit.register(flower.stop)
    signal.signal(signal.SIGTERM, command.sigterm_handler)
    port = flower.start_http_server()
    command.print_banner(app, False, port)
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        flower.start()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
