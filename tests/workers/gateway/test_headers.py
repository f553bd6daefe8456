"""The header rules (workers/gateway/headers.py): what reaches the replica, and what comes
back, as nginx and Envoy forward by default.

The first tests go through the whole gateway. Each reproduces one way the gateway used
to forward what a trusted proxy must not: callers' ``X-Forwarded-*`` believed from any
loopback peer, ``Forwarded`` / ``X-Real-IP`` and ``Connection``-named headers passed on,
the decoded path sent (``%3F`` became a query), and an ``Accept-Encoding`` of the
gateway's own added. Real HTTP, broker,
worker and process agent; the replica is ``examples.reflect``, which answers with the
request it received. The rest call the rules themselves (:func:`request_head`,
:func:`response_headers`, :class:`Trusted`) on the cases a caller cannot easily send.
"""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlsplit

from testkit import httpcalls
from tests.workers.gateway.conftest import Stack
from workers.gateway.headers import (
    Trusted,
    connection_named,
    request_head,
    response_headers,
    scoped_cookie,
)

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
    seen = httpcalls.get(f"{gw.url}/function/reflect", headers=SPOOFED, timeout=60).json()[
        "headers"
    ]
    stack.carried(gw, "reflect", 1)
    assert seen["x-forwarded-for"] == "127.0.0.1"  # the peer, as the gateway saw it
    assert seen["x-forwarded-proto"] == "http"
    assert seen["x-forwarded-host"] == urlsplit(gw.url).netloc
    assert "forwarded" not in seen and "x-real-ip" not in seen
    stack.finish()


def test_a_trusted_proxys_forwarding_headers_are_kept_with_the_peer_appended(
    stack: Stack,
) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway(gateway_trusted_proxies="10.0.0.0/8, 127.0.0.1")
    stack.warm(gw, "reflect")
    seen = httpcalls.get(f"{gw.url}/function/reflect", headers=SPOOFED, timeout=60).json()[
        "headers"
    ]
    stack.carried(gw, "reflect", 1)
    assert seen["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "https"
    assert seen["x-forwarded-host"] == "evil.example"
    assert seen["forwarded"] == "for=6.6.6.6;proto=https"
    assert seen["x-real-ip"] == "6.6.6.6"
    stack.finish()


def test_hop_by_hop_and_connection_named_headers_stop_at_the_gateway(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway()
    stack.warm(gw, "reflect")
    answer = httpcalls.get(
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
    stack.routed(gw, "reflect")  # the call above took the environment back from HAProxy
    plain = httpcalls.get(
        f"{gw.url}/function/reflect?header=Connection:+x-replica-hop&header=X-Replica-Hop:+1"
        "&header=Keep-Alive:+timeout%3D5&header=Proxy-Connection:+keep-alive&header=X-Kept:+yes",
        timeout=60,
    )
    stack.carried(gw, "reflect", 1)
    assert plain.headers["x-kept"] == "yes"
    assert not {"x-replica-hop", "keep-alive", "proxy-connection"} & plain.headers.keys()
    stack.finish()


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
    stack.finish()


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
    stack.finish()


# -- the rules themselves --------------------------------------------------------------------


def _scope(headers: list[tuple[bytes, bytes]], peer: str | None = "10.1.2.3") -> dict[str, Any]:
    return {
        "method": "POST",
        "scheme": "https",
        "client": (peer, 50000) if peer else None,
        "headers": headers,
    }


def _head(scope: dict[str, Any], body: bytes = b"", **kw: Any) -> list[bytes]:
    options: dict[str, Any] = {"token": None, "trusted": Trusted(""), **kw}
    head = request_head(scope, b"/p%2Fq?x=1", b"10.9.9.9:8080", body, **options)
    assert head.endswith(b"\r\n\r\n")
    return head[:-4].split(b"\r\n")


def test_the_head_is_the_raw_target_then_the_replicas_host_then_the_rest_in_order() -> None:
    lines = _head(_scope([(b"Host", b"gw.example"), (b"X-B", b"2"), (b"X-A", b"1")]))
    assert lines == [
        b"POST /p%2Fq?x=1 HTTP/1.1",
        b"host: 10.9.9.9:8080",
        b"X-B: 2",
        b"X-A: 1",
        b"x-forwarded-for: 10.1.2.3",
        b"x-forwarded-proto: https",
        b"x-forwarded-host: gw.example",
    ]


def test_authorization_stays_with_a_gateway_that_has_a_token() -> None:
    scope = _scope([(b"Authorization", b"Bearer gw-token")])
    assert b"Authorization: Bearer gw-token" not in _head(scope, token=b"gw-token")
    assert b"Authorization: Bearer gw-token" in _head(scope)  # no token: the replica's


def test_content_length_is_the_body_forwarded() -> None:
    chunked = _scope([(b"Transfer-Encoding", b"chunked"), (b"Expect", b"100-continue")])
    assert _head(chunked, b"hello")[-1] == b"content-length: 5"
    assert b"content-length: 0" in _head(_scope([(b"Content-Length", b"0")]))
    assert not [x for x in _head(_scope([])) if x.startswith(b"content-length")]
    assert not [x for x in _head(chunked, b"x") if x.lower().startswith((b"transfer", b"expect"))]


def test_a_trusted_proxys_headers_are_believed_and_anyone_elses_are_not() -> None:
    sent = [
        (b"X-Forwarded-For", b"1.1.1.1"),
        (b"X-Forwarded-For", b"2.2.2.2"),
        (b"X-Forwarded-Proto", b"http"),
        (b"X-Forwarded-Host", b"shop.example"),
        (b"Forwarded", b"for=1.1.1.1"),
        (b"X-Real-IP", b"1.1.1.1"),
    ]
    trusted = _head(_scope(sent), trusted=Trusted("10.0.0.0/8"))
    assert b"x-forwarded-for: 1.1.1.1, 2.2.2.2, 10.1.2.3" in trusted
    assert b"x-forwarded-proto: http" in trusted and b"x-forwarded-host: shop.example" in trusted
    assert b"Forwarded: for=1.1.1.1" in trusted and b"X-Real-IP: 1.1.1.1" in trusted
    untrusted = _head(_scope(sent), trusted=Trusted("192.168.0.0/16"))
    claims = (b"x-forwarded", b"forwarded", b"x-real")
    assert [x for x in untrusted if x.lower().startswith(claims)] == [
        b"x-forwarded-for: 10.1.2.3",
        b"x-forwarded-proto: https",
    ]


def test_without_a_peer_address_nothing_is_claimed_for_it() -> None:
    lines = _head(
        _scope([(b"X-Forwarded-For", b"6.6.6.6")], peer=None), trusted=Trusted("0.0.0.0/0")
    )
    assert not [x for x in lines if x.startswith(b"x-forwarded-for")]


def test_the_trusted_set_reads_addresses_and_remembers_a_bounded_number() -> None:
    trusted = Trusted("127.0.0.0/8, ::1/128")
    assert "127.0.0.1" in trusted and "::1" in trusted
    assert "10.0.0.1" not in trusted and "/run/gw.sock" not in trusted and "" not in trusted
    for i in range(5000):
        assert f"10.{i // 250}.{i % 250}.1" not in trusted
    assert len(trusted._seen) == 4096  # a flood of peers does not grow it for good
    assert "127.0.0.1" in trusted  # still answered, remembered or not


def test_connection_names_every_header_it_lists() -> None:
    raw = [(b"connection", b"Keep-Alive, X-Secret"), (b"Connection", b" close ,,"), (b"X", b"y")]
    assert connection_named(raw) == {b"keep-alive", b"x-secret", b"close"}


def test_the_replicas_hop_by_hop_headers_stop_at_the_gateway() -> None:
    raw = [
        (b"Content-Type", b"text/plain"),
        (b"Connection", b"X-Internal"),
        (b"X-Internal", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Set-Cookie", b"a=1"),
        (b"Set-Cookie", b"b=2"),
    ]
    assert response_headers(raw, "fn") == [
        (b"Content-Type", b"text/plain"),
        (b"Set-Cookie", b"a=1; Path=/function/fn"),
        (b"Set-Cookie", b"b=2; Path=/function/fn"),
    ]
    # nothing named: hop-by-hop only
    assert response_headers(raw[:1] + raw[3:4], "fn") == raw[:1]


def test_a_replicas_cookies_are_scoped_to_its_function(stack: Stack) -> None:
    """One origin serves every function: a cookie one sets for ``/`` must not reach another."""
    stack.deploy("reflect", image="examples.reflect")
    stack.deploy("other", image="examples.reflect")
    gw = stack.gateway()
    with httpcalls.client(timeout=60) as browser:  # a cookie jar that applies Path and Domain
        set_cookies = [
            "session=alice; Path=/; HttpOnly",
            "theme=dark",  # no Path: a browser would take /function's
            "deep=1; Path=/app; Domain=127.0.0.1",
        ]
        first = browser.get(
            f"{gw.url}/function/reflect", params=[("set-cookie", c) for c in set_cookies]
        )
        assert first.headers.get_list("set-cookie") == [
            "session=alice; HttpOnly; Path=/function/reflect",
            "theme=dark; Path=/function/reflect",
            "deep=1; Path=/function/reflect/app",
        ]
        other = browser.get(f"{gw.url}/function/other").json()["headers"]
        assert "cookie" not in other  # another function on the same gateway: none of them
        mine = browser.get(f"{gw.url}/function/reflect/app/x").json()["headers"]
        assert sorted(mine["cookie"].split("; ")) == ["deep=1", "session=alice", "theme=dark"]
        assert browser.get(f"{gw.url}/function/reflect").json()["headers"]["cookie"] in (
            "session=alice; theme=dark",
            "theme=dark; session=alice",
        )
    stack.finish()


def test_a_warm_replicas_cookies_are_scoped_to_its_function(stack: Stack) -> None:
    """The same scoping on a warm call: with HAProxy, one it carries itself."""
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway()
    stack.warm(gw, "reflect")
    given = [
        "session=alice; Path=/; HttpOnly",
        "theme=dark",
        "deep=1; Path=/app; Domain=127.0.0.1",
        "odd=1;path=nothing; secure",
    ]
    answer = httpcalls.get(
        f"{gw.url}/function/reflect", params=[("set-cookie", c) for c in given], timeout=60
    )
    stack.carried(gw, "reflect", 1)  # with HAProxy: this call was warm
    assert answer.headers.get_list("set-cookie") == [
        scoped_cookie(c.encode(), "reflect").decode() for c in given
    ]
    assert (
        answer.headers.get_list("set-cookie")[0]
        == "session=alice; HttpOnly; Path=/function/reflect"
    )
    stack.finish()
