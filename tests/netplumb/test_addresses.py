"""Host and port strings: one parser for every shape an address arrives in, IPv6 included."""

from __future__ import annotations

import pytest

from netplumb.addresses import host_of, is_loopback, is_wildcard, join_hostport, split_hostport


@pytest.mark.parametrize(
    ("host", "port", "joined"),
    [
        ("127.0.0.1", 8080, "127.0.0.1:8080"),
        ("node-1.example", 50051, "node-1.example:50051"),
        ("::1", 8080, "[::1]:8080"),  # an IPv6 host is bracketed...
        ("[fe80::2]", 3000, "[fe80::2]:3000"),  # ...once, if it came bracketed
    ],
)
def test_join_hostport_brackets_ipv6_once_and_splits_back(
    host: str, port: int, joined: str
) -> None:
    assert join_hostport(host, port) == joined
    assert split_hostport(joined) == (host.strip("[]"), port)


@pytest.mark.parametrize("bad", ["", "host", "host:", "host:http", "host:65536", "[::1]"])
def test_split_hostport_refuses_anything_but_host_and_port(bad: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        split_hostport(bad)


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("node-1.example", "node-1.example"),
        ("node-1.example:50051", "node-1.example"),
        ("10.0.0.5", "10.0.0.5"),
        ("10.0.0.5:50051", "10.0.0.5"),
        ("::1", "::1"),  # a bare IPv6 address is all host
        ("fe80::2:1", "fe80::2:1"),  # ...even when it ends like a port
        ("[::1]", "::1"),
        ("[fe80::2]:50051", "fe80::2"),
        ("http://lambdo.example:3000", "lambdo.example"),
        ("http://lambdo.example:3000/", "lambdo.example"),
        ("http://[::1]:3000/vms", "::1"),
        ("http://10.0.0.5", "10.0.0.5"),
        ("redis://user:secret@cache.example:6379/0", "cache.example"),
        ("  10.0.0.5:1  ", "10.0.0.5"),
    ],
)
def test_host_of_every_shape(address: str, host: str) -> None:
    assert host_of(address) == host


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST", True),
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("[::1]:8080", True),
        ("http://127.0.0.1:9808", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("localhost.example", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("host", "wildcard"),
    [
        ("", True),
        ("0.0.0.0", True),
        ("::", True),
        ("[::]", True),
        ("*", True),
        ("127.0.0.1", False),
        ("::1", False),
        ("node.example", False),
    ],
)
def test_is_wildcard(host: str, wildcard: bool) -> None:
    assert is_wildcard(host) is wildcard
