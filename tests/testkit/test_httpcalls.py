"""testkit.httpcalls: httpx's one-off calls, one verifying TLS context per process."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from testkit import httpcalls


class _Echo(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._answer(b"")

    def do_POST(self) -> None:
        self._answer(self.rfile.read(int(self.headers["Content-Length"])))

    def do_DELETE(self) -> None:
        self._answer(b"gone")

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) + len(self.command)))
        self.end_headers()
        self.wfile.write(self.command.encode() + body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_each_call_reaches_the_server_with_its_method_and_body(url: str) -> None:
    assert httpcalls.get(url, timeout=5).text == "GET"
    assert httpcalls.post(url, content=b"abc", timeout=5).text == "POSTabc"
    assert httpcalls.delete(url, timeout=5).text == "DELETEgone"
    assert httpcalls.request("GET", url, timeout=5, verify=False).text == "GET"  # its own verify
    with httpcalls.stream("POST", url, content=b"x", timeout=5) as answer:
        assert answer.read() == b"POSTx"


def test_the_tls_context_is_made_once_and_verifies_as_httpxs_default() -> None:
    context = httpcalls._tls()
    assert httpcalls._tls() is context
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] > 0  # the machine's CAs, loaded
