"""A replica whose answers are hostile: the gateway tests run it as a function's image.

A tenant's code answers whatever it likes; this one answers what the gateway must
survive, chosen by the request's path (``?mib=N`` sizes the attack, ``?size=N`` a chunk):

* ``/bomb`` - a 200 head with N MiB of ``a:b`` header lines that never ends;
* ``/long`` - a 200 head with one header whose value is N MiB long;
* ``/trailers`` - a chunked ``ok``, then N MiB of trailer lines;
* ``/interim`` - N MiB of ``103 Early Hints`` heads before a final 200;
* ``/chunks`` - N MiB of body in chunks of ``size`` bytes;
* ``/drip`` - a head one header line every 0.2 s, forever;
* ``/trickle`` - a 200 head, then a chunk of its body every 0.2 s, forever;
* ``/upgrade`` - a ``101 Switching Protocols``;
* ``/hangup?flag=PATH`` - the connection closed without a byte of answer, by the first
  replica to make file PATH; ``ok`` from any other (a call sent again elsewhere);
* ``/slow`` - ``ok`` after half a second;
* ``/extra`` - an answer, then in the same write the start of a forged one (status line
  and ``X-Forged: yes``), whose end the next request on that connection gets;
* anything else - ``ok`` (``Content-Length``), kept alive.

Raw sockets, one thread per connection; the attack ends when the gateway hangs up::

    PORT=8080 python -m tests.workers.gateway.hostile
"""

from __future__ import annotations

import os
import socket
import socketserver
import sys
import time
from urllib.parse import parse_qs, urlsplit

MiB = 1024 * 1024
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
FORGED_START = b"HTTP/1.1 200 OK\r\nX-Forged: yes\r\n"
FORGED_END = b"Content-Length: 6\r\n\r\nforged"


def _repeat(sock: socket.socket, unit: bytes, total: int) -> None:
    """Send ``unit`` over and over, ``total`` bytes in all, a MiB at a time."""
    block = unit * max(1, MiB // len(unit))
    sent = 0
    while sent < total:
        sock.sendall(block)
        sent += len(block)


def _chunks(sock: socket.socket, size: int, total: int) -> None:
    """A chunked body of ``total`` bytes in chunks of ``size``, then its end."""
    chunk = f"{size:x}\r\n".encode() + b"c" * size + b"\r\n"
    _repeat(sock, chunk, total // size * len(chunk))
    sock.sendall(b"0\r\n\r\n")


class Handler(socketserver.BaseRequestHandler):
    """Reads request heads (no bodies: GETs) and answers each as its path says."""

    def handle(self) -> None:
        """Serve the connection until either side closes it."""
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pending, forged = b"", False
        try:
            while True:
                while b"\r\n\r\n" not in pending:
                    data = sock.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                target = head.split(b" ", 2)[1].decode("latin-1")
                if forged:  # the rest of the answer begun after the last one
                    forged = False
                    sock.sendall(FORGED_END)
                    continue
                forged = self.answer(sock, target)
        except OSError:
            return  # the gateway hung up: the attack is over

    def answer(self, sock: socket.socket, target: str) -> bool:
        """Answer one request; True when a forged answer was begun."""
        parts = urlsplit(target)
        asked = parse_qs(parts.query)
        mib = int(asked.get("mib", ["1"])[0])
        size = int(asked.get("size", ["2"])[0])
        path = parts.path
        if path == "/bomb":
            sock.sendall(b"HTTP/1.1 200 OK\r\n")
            _repeat(sock, b"a:b\r\n", mib * MiB)
            sock.sendall(b"\r\n")
        elif path == "/long":
            sock.sendall(b"HTTP/1.1 200 OK\r\nX-Long: ")
            _repeat(sock, b"a", mib * MiB)
            sock.sendall(b"\r\n\r\n")
        elif path == "/trailers":
            sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n")
            _repeat(sock, b"t:x\r\n", mib * MiB)
            sock.sendall(b"\r\n")
        elif path == "/interim":
            _repeat(sock, b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", mib * MiB)
            sock.sendall(OK)
        elif path == "/chunks":
            sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            _chunks(sock, size, mib * MiB)
        elif path == "/drip":
            sock.sendall(b"HTTP/1.1 200 OK\r\n")
            while True:
                sock.sendall(b"x-drip: 1\r\n")
                time.sleep(0.2)
        elif path == "/trickle":
            sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                sock.sendall(b"1\r\nx\r\n")
                time.sleep(0.2)
        elif path == "/upgrade":
            sock.sendall(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\n\r\n\x81\x05hello"
            )
        elif path == "/extra":
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst" + FORGED_START)
            return True
        else:
            self.unreliable(sock, path, asked)
        return False

    def unreliable(self, sock: socket.socket, path: str, asked: dict[str, list[str]]) -> None:
        """``/hangup`` and ``/slow``; anything else: ``ok``."""
        if path == "/hangup":
            try:
                os.close(os.open(asked["flag"][0], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                sock.sendall(OK)
            else:
                sock.shutdown(socket.SHUT_RDWR)  # the next read ends the connection
            return
        if path == "/slow":
            time.sleep(0.5)
        sock.sendall(OK)


class Server(socketserver.ThreadingTCPServer):
    """Threads that die with the process; the address reusable at once."""

    daemon_threads = True
    allow_reuse_address = True


def main() -> int:
    """Serve on ``$HOST:$PORT`` until killed."""
    host = os.environ.get("HOST") or "127.0.0.1"
    port = int(os.environ.get("PORT") or 8080)
    with Server((host, port), Handler) as server:
        print(f"listening on {host}:{server.server_address[1]}", file=sys.stderr, flush=True)
        server.serve_forever(poll_interval=0.2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
