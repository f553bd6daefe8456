"""Host and port helpers every server and client shares."""

from __future__ import annotations

import pytest

from agents.runtime import join_hostport, split_hostport


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
    back_host, back_port = split_hostport(joined)
    assert (back_host.strip("[]"), back_port) == (host.strip("[]"), port)
