"""Host and port strings: one parser for every shape an address arrives in, IPv6 included."""

from __future__ import annotations

import pytest

from netplumb.addresses import (
    HTTP_PORTS,
    UrlAddress,
    host_of,
    ip_literal,
    ip_of,
    is_loopback,
    is_wildcard,
    join_hostport,
    parse_hostport,
    parse_url,
    split_hostport,
)


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


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("10.0.0.5", ("10.0.0.5", 50051)),  # no port: the caller's default
        ("10.0.0.5:7000", ("10.0.0.5", 7000)),
        ("node-1.example", ("node-1.example", 50051)),
        ("gpu_7:1", ("gpu_7", 1)),
        ("  node-1:65535 ", ("node-1", 65535)),  # typed with spaces: trimmed
        ("[::1]", ("::1", 50051)),  # IPv6 in brackets, with or without a port
        ("[fe80::2]:7000", ("fe80::2", 7000)),
        ("[::ffff:10.0.0.5]:7000", ("::ffff:10.0.0.5", 7000)),
    ],
)
def test_parse_hostport_takes_what_an_operator_types(address: str, parsed: tuple[str, int]) -> None:
    assert parse_hostport(address, 50051, "agent address") == parsed
    assert parse_hostport(join_hostport(*parsed)) == parsed  # written back, read the same


@pytest.mark.parametrize(
    "bad",
    ["", "   ", "a b", "host:", "host:port", "host:0", "host:65536", "host:99999", "h:1:2",
     "[zz::1]:1", "[::1", "::1]:1", "[10.0.0.5]:1", "[1.2.3.4:5]:1", "http://h:1", "h/x"],
)  # fmt: skip
def test_parse_hostport_refuses_anything_else_naming_what_and_the_shape(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^invalid agent address .*: expected HOST\[:PORT\]"):
        parse_hostport(bad, 50051, "agent address")


def test_parse_hostport_without_a_default_needs_the_port() -> None:
    with pytest.raises(ValueError, match=r"invalid address 'h': expected HOST:PORT$"):
        parse_hostport("h")
    assert parse_hostport("h:1") == ("h", 1)


@pytest.mark.parametrize("bare_v6", ["::1", "fe80::2:7000"])
def test_an_unbracketed_ipv6_address_is_refused_with_the_way_to_write_it(bare_v6: str) -> None:
    with pytest.raises(ValueError, match=r"an IPv6 host in brackets: \[::1\]:50051"):
        parse_hostport(bare_v6, 50051, "agent address")


def test_parse_hostport_refuses_what_is_not_text() -> None:
    with pytest.raises(ValueError, match="invalid GPU server address None"):
        parse_hostport(None, 50053, "GPU server address")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid Lambdo host address None"):
        parse_url(None, HTTP_PORTS, "Lambdo host address")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("http://10.0.0.5:3000", UrlAddress("http", "10.0.0.5", 3000)),
        ("http://10.0.0.5", UrlAddress("http", "10.0.0.5", 80)),  # the scheme's port
        ("https://lambdo.example/", UrlAddress("https", "lambdo.example", 443)),
        ("https://[::1]:3000", UrlAddress("https", "::1", 3000)),
        ("HTTP://Node-1:3000", UrlAddress("http", "node-1", 3000)),
    ],
)
def test_parse_url_bare(url: str, parsed: UrlAddress) -> None:
    assert parse_url(url, HTTP_PORTS, "Lambdo host address", bare=True) == parsed


def test_parse_url_writes_its_host_and_port_back_bracketed() -> None:
    assert parse_url("http://[fe80::2]:8080/x", HTTP_PORTS).hostport == "[fe80::2]:8080"
    assert parse_url("http://10.0.0.5/x", HTTP_PORTS).hostport == "10.0.0.5:80"


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("redis://:secret@127.0.0.1:6390/0", UrlAddress("redis", "127.0.0.1", 6390)),
        ("redis://cache", UrlAddress("redis", "cache", 6379)),
        ("postgresql+psycopg://u:p@db_1/corral", UrlAddress("postgresql", "db_1", 5432)),
        ("postgresql://u@[::1]:5433/corral?x=1", UrlAddress("postgresql", "::1", 5433)),
    ],
)
def test_parse_url_with_credentials_driver_and_path(url: str, parsed: UrlAddress) -> None:
    ports = {"redis": 6379, "postgresql": 5432}
    assert parse_url(url, ports, "store URL") == parsed


@pytest.mark.parametrize(
    "bad",
    ["", "10.0.0.5:3000", "//10.0.0.5:3000", "ftp://h:1", "http://", "http://h:0", "http://h:99999",
     "http://h:x", "http://a b:1", "http://[zz]:1", "http://h/path", "http://h/?q", "http://h/#f",
     "http://[1.2.3.4:5]:1", "http://u:p@h:1"],
)  # fmt: skip
def test_parse_url_bare_refuses_anything_else_naming_what_and_the_schemes(bad: str) -> None:
    with pytest.raises(
        ValueError, match=r"^invalid Lambdo host address .*: expected http\|https://HOST\[:PORT\]$"
    ):
        parse_url(bad, HTTP_PORTS, "Lambdo host address", bare=True)


@pytest.mark.parametrize(
    ("address", "ip"),
    [
        ("10.0.0.5", "10.0.0.5"),
        ("10.0.0.5:50051", "10.0.0.5"),
        ("[fe80::2]:50051", "fe80::2"),
        ("http://[::1]:3000/x", "::1"),
        ("::ffff:10.0.0.5", "10.0.0.5"),  # IPv4-mapped: its IPv4 address
        ("[::ffff:10.0.0.5]:1", "10.0.0.5"),
        ("node-1.example", None),  # a name is never looked up
        ("localhost:1", None),
        ("", None),
    ],
)
def test_ip_of_any_shape_and_never_a_name(address: str, ip: str | None) -> None:
    assert ip_literal(address) == ip
    got = ip_of(address)
    assert (None if got is None else str(got)) == ip
