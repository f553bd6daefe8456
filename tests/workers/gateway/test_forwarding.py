"""What reaches the replica, and what comes back: forwarding as nginx and Envoy do by default.

Each test reproduces one way the gateway used to forward what a trusted proxy must not:
callers' ``X-Forwarded-*`` believed from any loopback peer, ``Forwarded`` / ``X-Real-IP``
and ``Connection``-named headers passed on, the decoded path sent (``%3F`` became a
query), and an ``Accept-Encoding`` of the gateway's own added. Real HTTP, broker,
worker and process agent; the replica is ``examples.reflect``, which answers with the
request it received. Each checked call is warm (:meth:`Stack.warm` first): with HAProxy
in front, HAProxy forwards it, by the same rules (:mod:`workers.gateway.haproxy.config`).
"""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.workers.gateway.conftest import Stack

SPOOFED = {
    "X-Forwarded-For": "6.6.6.6",
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Host": "evil.example",
    "Forwarded": "for=6.6.6.6;proto=https",
    "X-Real-IP": "6.6.6.6",
}


def _raw(url: str, path: str, headers: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """One GET sent byte for byte (no client defaults); the reflected request."""
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1" and parts.port
    head = [f"GET {path} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in headers or []]
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status, _, rest = data.partition(b"\r\n")
    assert status.split()[1] == b"200", data
    answer: dict[str, Any] = json.loads(rest.partition(b"\r\n\r\n")[2])
    return answer


def test_an_untrusted_peers_forwarding_headers_are_replaced_not_passed_on(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway()  # no trusted proxies: loopback peers are callers like any other
    stack.warm(gw, "reflect")
    seen = httpx.get(f"{gw.url}/function/reflect", headers=SPOOFED, timeout=60).json()["headers"]
    stack.carried(gw, "reflect", 1)
    assert seen["x-forwarded-for"] == "127.0.0.1"  # the peer, as the gateway saw it
    assert seen["x-forwarded-proto"] == "http"
    assert seen["x-forwarded-host"] == urlsplit(gw.url).netloc
    assert "forwarded" not in seen and "x-real-ip" not in seen
    stack.settled()


def test_a_trusted_proxys_forwarding_headers_are_kept_with_the_peer_appended(
    stack: Stack,
) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway(gateway_trusted_proxies="10.0.0.0/8, 127.0.0.1")
    stack.warm(gw, "reflect")
    seen = httpx.get(f"{gw.url}/function/reflect", headers=SPOOFED, timeout=60).json()["headers"]
    stack.carried(gw, "reflect", 1)
    assert seen["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "https"
    assert seen["x-forwarded-host"] == "evil.example"
    assert seen["forwarded"] == "for=6.6.6.6;proto=https"
    assert seen["x-real-ip"] == "6.6.6.6"
    stack.settled()


def test_hop_by_hop_and_connection_named_headers_stop_at_the_gateway(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway()
    stack.warm(gw, "reflect")
    answer = httpx.get(
        f"{gw.url}/function/reflect?header=Connection:+x-replica-hop&header=X-Replica-Hop:+1"
        "&header=X-Kept:+yes",
        headers={
            "Connection": "keep-alive, X-Caller-Hop",
            "X-Caller-Hop": "secret",
            "Keep-Alive": "timeout=5",
            "Proxy-Connection": "keep-alive",
            "X-Passed": "yes",
        },
        timeout=60,
    )
    seen = answer.json()["headers"]
    assert seen["x-passed"] == "yes"
    assert not {"x-caller-hop", "keep-alive", "proxy-connection"} & seen.keys(), seen
    assert seen.get("connection") in (None, "keep-alive")  # the gateway's own hop, if any
    assert answer.headers["x-kept"] == "yes"
    assert "x-replica-hop" not in answer.headers  # named in the replica's Connection:
    # and a warm call's answer (HAProxy carries it): the replica's hop-by-hop headers go
    plain = httpx.get(
        f"{gw.url}/function/reflect?header=Connection:+x-replica-hop&header=X-Replica-Hop:+1"
        "&header=Keep-Alive:+timeout%3D5&header=Proxy-Connection:+keep-alive&header=X-Kept:+yes",
        timeout=60,
    )
    stack.carried(gw, "reflect", 1)
    assert plain.headers["x-kept"] == "yes"
    assert not {"x-replica-hop", "keep-alive", "proxy-connection"} & plain.headers.keys()
    stack.settled()


def test_the_raw_path_reaches_the_replica_byte_for_byte(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway()
    stack.warm(gw, "reflect")
    for path, query in (
        ("/a%3Fadmin=1", ""),
        ("/x%2Fy/z", "q=%2F"),
        ("/a%00b", ""),
        ("/sp%20ace/", "a=1&b"),
    ):
        seen = _raw(gw.url, f"/function/reflect{path}" + (f"?{query}" if query else ""))
        assert (seen["path"], seen["query"]) == (path, query)
    assert _raw(gw.url, "/function/reflect")["path"] == "/"
    assert _raw(gw.url, "/function/reflect?x=1")["query"] == "x=1"
    stack.carried(gw, "reflect", 6)
    stack.settled()


def test_accept_encoding_goes_as_the_caller_sent_it_and_nothing_is_added(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway()
    stack.warm(gw, "reflect")
    bare = _raw(gw.url, "/function/reflect")["headers"]
    assert "accept-encoding" not in bare  # a caller that asked for no encoding gets none
    assert not {"user-agent", "accept", "cookie"} & bare.keys(), bare
    asked = _raw(gw.url, "/function/reflect", [("Accept-Encoding", "br;q=1.0, identity;q=0.5")])
    assert asked["headers"]["accept-encoding"] == "br;q=1.0, identity;q=0.5"
    stack.carried(gw, "reflect", 2)
    stack.settled()
