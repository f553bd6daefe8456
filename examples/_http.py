"""Shared plumbing of the examples: run a request handler on ``$HOST:$PORT`` until SIGTERM.

Answers go out in one send, with ``TCP_NODELAY`` on the socket. The standard library's
handler writes the status line, the headers and the body in separate small sends; with
Nagle's algorithm on, the last of them waits for the client's delayed ACK (about
40 ms on Linux) on every request of a kept-alive connection after the first. Here the
socket writer is buffered and flushed once per request (``handle_one_request`` flushes
after the handler returns), and Nagle is off for whatever is larger than the buffer.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType

__all__ = ["QuietHandler", "run"]

#: Bytes an answer may reach before part of it is sent ahead of the handler's return.
WRITE_BUFFER = 64 * 1024


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 handler that answers in one send and logs only when ``$VERBOSE`` is set."""

    protocol_version = "HTTP/1.1"
    server_version = "corral-example/1"
    disable_nagle_algorithm = True  # TCP_NODELAY on every connection
    wbufsize = WRITE_BUFFER  # one buffered writer, flushed once per request

    def log_message(self, format: str, *args: object) -> None:
        """Log to stderr only in verbose mode (replicas are many and chatty)."""
        if os.environ.get("VERBOSE"):
            super().log_message(format, *args)

    def handle_expect_100(self) -> bool:
        """Send ``100 Continue`` at once: the client waits for it before sending the body."""
        accepted = super().handle_expect_100()
        self.wfile.flush()
        return accepted

    def send_body(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        """Send a complete response with a Content-Length."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def read_body(self) -> bytes:
        """Read the request body announced by Content-Length (empty without one)."""
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""


def run(handler: type[BaseHTTPRequestHandler]) -> int:
    """Serve ``handler`` on ``$HOST:$PORT`` until SIGTERM or SIGINT; return an exit code."""
    host = os.environ.get("HOST") or "127.0.0.1"
    port = int(os.environ.get("PORT") or 8080)
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer((host, port), handler)

    def _stop(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"listening on {host}:{server.server_address[1]}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0
