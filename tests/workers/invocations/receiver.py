"""A callback receiver for the tests: an HTTP server on 127.0.0.2 that records every POST.

127.0.0.2 is loopback, but not the address the tests' agents (the nodes) have, which a
callback may never reach. ``statuses`` are answered in turn (the last one from then on).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """A callback receiver on 127.0.0.2 (loopback, but not the nodes' 127.0.0.1)."""

    def __init__(self, *statuses: int) -> None:
        self.got: list[tuple[dict[str, str], bytes, str]] = []
        self.statuses = list(statuses or (200,))
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.got.append(
                    ({k.lower(): v for k, v in self.headers.items()}, body, self.path)
                )
                status = receiver.statuses[min(len(receiver.got), len(receiver.statuses)) - 1]
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.2", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        """Where it listens."""
        return f"http://127.0.0.2:{self.port}"

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
