"""A function that answers, as JSON, the request it received: method, path, query, headers, body.

For checking what a proxy in front of it forwards (the gateway tests use it). The
answer carries a ``X-Reflect-Vmid`` header with the replica's ``$VMID`` so a caller
can tell replicas apart; ``?set-cookie=NAME=VALUE`` (repeatable) adds a ``Set-Cookie``
header, ``?header=NAME:VALUE`` (repeatable) any header, and ``?pad=N`` makes the answer
N bytes longer (a ``pad`` field; at most ``MAX_PAD``)::

    PORT=8080 python -m examples.reflect
"""

from __future__ import annotations

import json
import os
from urllib.parse import parse_qs, urlsplit

from examples._http import QuietHandler, run

__all__ = ["MAX_PAD", "ReflectHandler", "main"]

#: Most padding bytes an answer gets, so a typo cannot make a replica build gigabytes.
MAX_PAD = 256 * 1024 * 1024


class ReflectHandler(QuietHandler):
    """Answers every method with a JSON description of the request."""

    def _reflect(self) -> None:
        parts = urlsplit(self.path)
        body = self.read_body()
        vmid = os.environ.get("VMID", "")
        asked = parse_qs(parts.query)
        pad = asked.get("pad", ["0"])[-1]
        if not pad.isdigit() or int(pad) > MAX_PAD:
            self.send_body(400, f"pad must be a byte count in 0..{MAX_PAD}\n".encode())
            return
        answer = {
            "method": self.command,
            "path": parts.path,
            "query": parts.query,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body.decode("utf-8", "replace"),
            "vmid": vmid,
        }
        if int(pad):
            answer["pad"] = "x" * int(pad)
        data = json.dumps(answer, sort_keys=True).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Reflect-Vmid", vmid)
        for cookie in asked.get("set-cookie", []):  # ?set-cookie=name=value
            self.send_header("Set-Cookie", cookie)
        for line in asked.get("header", []):  # ?header=name:value
            name, _, value = line.partition(":")
            self.send_header(name.strip(), value.strip())
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _reflect


def main() -> int:
    """Serve until SIGTERM."""
    return run(ReflectHandler)


if __name__ == "__main__":
    raise SystemExit(main())
