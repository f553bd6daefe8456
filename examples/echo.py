"""A function that echoes the request body back, optionally after a delay.

The delay (seconds, fractional allowed) comes from the query ``?delay=`` or else from
the environment variable ``ECHO_DELAY``; it lets tests hold a replica busy. ``GET``
answers an empty body, delayed only by an explicit ``?delay=`` - never by
``ECHO_DELAY`` - so the agent's readiness probe (``GET /``) is answered at once::

    PORT=8080 ECHO_DELAY=0.5 python -m examples.echo
"""

from __future__ import annotations

import os
import time
from urllib.parse import parse_qs, urlsplit

from examples._http import QuietHandler, run

__all__ = ["MAX_DELAY", "EchoHandler", "main"]

#: Longest delay honoured, so a typo cannot park a request for hours.
MAX_DELAY = 300.0


class EchoHandler(QuietHandler):
    """Echoes the body with the request's Content-Type."""

    def _delay(self, use_env: bool) -> float | None:
        query = parse_qs(urlsplit(self.path).query)
        if "delay" in query:
            raw = query["delay"][-1]
        else:
            raw = os.environ.get("ECHO_DELAY", "0") if use_env else "0"
        try:
            delay = float(raw or 0)
        except ValueError:
            return None
        if not 0 <= delay <= MAX_DELAY:
            return None
        return delay

    def _echo(self, body: bytes, use_env: bool = True) -> None:
        delay = self._delay(use_env)
        if delay is None:
            self.send_body(400, f"delay must be a number of seconds in 0..{MAX_DELAY:g}\n".encode())
            return
        if delay:
            time.sleep(delay)
        ctype = self.headers.get("Content-Type") or "application/octet-stream"
        self.send_body(200, body, ctype)

    def do_GET(self) -> None:
        """Answer an empty body (after ``?delay=`` only)."""
        self._echo(b"", use_env=False)

    def do_POST(self) -> None:
        """Echo the body after the delay."""
        self._echo(self.read_body())

    def do_PUT(self) -> None:
        """Echo the body after the delay."""
        self._echo(self.read_body())


def main() -> int:
    """Serve until SIGTERM."""
    return run(EchoHandler)


if __name__ == "__main__":
    raise SystemExit(main())
