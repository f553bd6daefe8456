"""HAProxy's configuration and runtime API as corral writes and speaks them, against HAProxy.

No store, broker or replica: a configuration written from settings is checked by
``haproxy -c``, and an HAProxy started on it answers the runtime commands the router
sends (dynamic servers, the map, counters) as :mod:`workers.gateway.haproxy.runtime`
reads them.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from config.settings import Settings, load_settings
from tests.dataplanes import need
from workers.gateway.haproxy import config
from workers.gateway.haproxy.layout import Layout
from workers.gateway.haproxy.process import Process, find
from workers.gateway.haproxy.runtime import Commands, Runtime

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "token, trusted proxies, larger answer heads": {
        "gateway_token": SecretStr("s3cret"),
        "gateway_trusted_proxies": "10.0.0.0/8, 127.0.0.1",
        "gateway_answer_head_max": 128 * 1024,
    },
    "a warm queue, small bodies, short timeouts": {
        "gateway_warm_queue": 4,
        "gateway_max_body": 1000,
        "gateway_timeout_s": 0.5,
        "gateway_read_timeout_s": 0.25,
    },
}


_made: list[Layout] = []


@pytest.fixture(autouse=True)
def _layouts_removed() -> Iterator[None]:
    """Each layout a test wrote is removed after it (under /tmp when tmp_path is too long)."""
    yield
    while _made:
        _made.pop().remove()


def _written(tmp_path: Path, **update: Any) -> tuple[Layout, socket.socket, Settings]:
    settings = load_settings().model_copy(
        update={"gateway_warm_functions": 3, "state_dir": tmp_path, **update}
    )
    layout = Layout.make(tmp_path)
    _made.append(layout)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    config.write(settings, layout)
    return layout, sock, settings


@pytest.mark.parametrize("update", VARIANTS.values(), ids=VARIANTS.keys())
def test_the_configuration_is_one_haproxy_takes(tmp_path: Path, update: dict[str, Any]) -> None:
    need("haproxy")
    layout, sock, _ = _written(tmp_path, **update)
    with sock:
        done = subprocess.run(
            [find("haproxy").path, "-c", "-f", str(layout.config)],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=sock.fileno(),  # as Process passes it: config.LISTEN_FD
        )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stdout + done.stderr  # (rules in the order they run)
    text = layout.config.read_text()
    assert "s3cret" not in text  # the token is compared as its digest
    for path in (layout.dir, layout.config, layout.functions):
        assert path.stat().st_mode & 0o077 == 0, path  # private to the gateway's user


def test_a_head_that_may_not_be_warm_is_told_by_its_header_names() -> None:
    odd = re.compile(config.ODD_NAMES)
    for names in ("host,user-agent,accept", "host,x-te,x-trailers,content-length"):
        assert not odd.search(names), names
    for names in (
        "host,transfer-encoding",
        "host,upgrade,connection",
        "expect,host",
        "host,te",
        "host,trailer",
        "host,proxy-authorization",
        "host,authorization,accept,authorization",
        "host,x-forwarded-for,x-forwarded-for",
        "host,content-length,content-length",
        "host,a,host",
    ):
        assert odd.search(names), names


@pytest.fixture
def haproxy(tmp_path: Path) -> Iterator[Layout]:
    """An HAProxy on corral's configuration (no gateway behind it)."""
    need("haproxy")
    layout, sock, _ = _written(tmp_path)
    process = Process(find("haproxy"), layout, sock)
    process.start()
    try:
        yield layout
    finally:
        process.kill()
        sock.close()


def test_haproxy_takes_the_gateways_socket_whatever_its_number_in_the_gateway(
    tmp_path: Path,
) -> None:
    # cis677: a gateway in a process holding some 460 descriptors passed its socket as
    # fd@464, above HAProxy's socket limit (about twice its maxconn: 2 x 64 + 64 there), and
    # HAProxy would not start ("not enough free sockets"). It is HAProxy's stdin now.
    need("haproxy")
    layout, sock, settings = _written(tmp_path, gateway_max_connections=64)
    high = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 4096) - 1
    assert high > 4 * (2 * settings.gateway_max_connections + 64), "the limit is too low here"
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(high)  # free: the socket is put there, not over another descriptor
    os.dup2(sock.fileno(), high, inheritable=False)
    with sock, socket.socket(fileno=high) as far:
        process = Process(find("haproxy"), layout, far)
        process.start()
        try:
            with socket.create_connection(far.getsockname(), timeout=10) as caller:
                caller.sendall(b"GET /function/none HTTP/1.1\r\nHost: gw\r\n\r\n")
                assert caller.recv(64).startswith(b"HTTP/1.1 ")  # HAProxy answers on the port
        finally:
            process.kill()


def test_the_routers_commands_are_answered_and_told_apart(haproxy: Layout) -> None:
    commands = Commands(haproxy.admin)
    server = "127.0.0.1:9"
    answers = commands.ask(
        f"add server b1/{server} {server} maxconn 2 pool-max-conn 64 pool-purge-delay 5s"
        " check observe layer4 error-limit 1 on-error mark-down",
        f"set server b1/{server} state ready",
        f"add map {haproxy.functions} hello b1",
        f"set maxconn server b1/{server} 3",
        f"set server b1/{server} state maint",
        f"del server b1/{server}",  # (its answer ends without the usual blank line)
        f"del server b1/{server}",
        f"del map {haproxy.functions} hello",
    )
    assert answers == [
        "New server registered.",
        "",
        "",
        "",
        "",
        "Server deleted.",
        "No such server.",
        "",
    ]
    commands.close()


def test_counters_and_streams_are_read(haproxy: Layout) -> None:
    async def read() -> None:
        runtime = Runtime(haproxy.admin)
        server = "127.0.0.1:9"
        await runtime.run(
            f"add server b0/{server} {server} maxconn 4", f"set server b0/{server} state ready"
        )
        rows = {row.server: row for row in await runtime.stat(["b0"])}
        assert set(rows) == {config.backup("b0"), server, "BACKEND"}
        assert rows[server].sessions == rows[server].total == 0
        assert rows[server].status == "no check"
        assert await runtime.sessions() == []  # only the runtime's own stream, no backend
        runtime.close()

    asyncio.run(read())


@pytest.mark.parametrize(
    ("grace", "rate", "read"),
    [(10.0, 4096, 15.0), (1.0, 1000, 60.0), (0.0, 4096, 15.0), (20, 1, 15)],
)
def test_haproxy_waits_for_a_warm_body_no_less_than_the_minimum_rate_allows(
    grace: float, rate: int, read: float
) -> None:
    """A body HAProxy answers 408 for is one the gateway's rate rule refuses too."""
    settings = load_settings().model_copy(
        update={
            "gateway_body_grace_s": grace,
            "gateway_body_min_rate": rate,
            "gateway_read_timeout_s": read,
        }
    )
    waits = config.body_waits(settings, 96 * 1024)
    least = 0
    for size, wait in waits:
        assert least < size <= 96 * 1024 and wait <= read
        assert size <= rate * max(grace, wait)  # at the minimum rate it is whole by then
        assert wait <= 2 * max(
            grace, size / rate, 0.001
        )  # and refused within twice the rule's time
        least = size
    if grace > read:
        assert waits == []  # no body is warm: the activator alone may wait past the read timeout
