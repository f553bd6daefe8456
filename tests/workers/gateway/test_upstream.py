"""The upstream side (workers/gateway/upstream.py): one request forwarded to a claimed replica,
its answer relayed one chunk behind, the environment handed back before the answer ends.

The replica here is a real HTTP server on loopback (asyncio streams) that answers what
each test needs; :class:`Upstreams` is driven directly, as the gateway drives it. The
whole gateway against hostile replicas is in test_hostile_answers.py and test_errors.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import pytest

from config.settings import get_settings
from workers.gateway.asgi import Answer, Message
from workers.gateway.upstream import (
    BrokenOff,
    ReplicaFailed,
    Upstreams,
    target_of,
)
from workers.replicas.claims import Claimed

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 11\r\n\r\nhello world"


def _scope(path: str = "/function/hello/a/b", query: bytes = b"") -> dict[str, Any]:
    return {
        "type": "http",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "query_string": query,
        "headers": [(b"host", b"gw")],
        "client": ("127.0.0.1", 40000),
    }


def _claimed(address: str | None) -> Claimed:
    return Claimed("c1", "r1", address, "vm1", "hello", datetime(2030, 1, 1))


class Caller:
    """What the gateway's caller was sent, and when the environment went back, in order."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def send(self, message: Message) -> None:
        self.events.append(message)

    def done(self) -> None:
        self.events.append("done")

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.events if isinstance(m, dict))


async def _forward(
    answer: Handler, scope: dict[str, Any] | None = None, **settings: Any
) -> tuple[Caller, BaseException | None, list[bytes]]:
    """Forward one request to a replica that answers with ``answer``; what the caller got,
    what ``forward`` raised, and the request heads the replica read."""
    heads: list[bytes] = []

    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        await answer(reader, writer)
        writer.close()

    server = await asyncio.start_server(replica, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstreams = Upstreams(get_settings().model_copy(update=settings), None)
    caller, raised = Caller(), None
    try:
        await upstreams.forward(
            scope or _scope(), _claimed(f"http://127.0.0.1:{port}"), b"", caller.send, caller.done
        )
    except (Answer, BrokenOff, ReplicaFailed) as exc:
        raised = exc
    finally:
        await upstreams.close()
        server.close()
    return caller, raised, heads


def _answers(data: bytes) -> Handler:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()

    return answer


@pytest.mark.parametrize(
    ("scope", "target"),
    [
        ({"path": "/function/hello", "raw_path": b"/function/hello"}, b"/"),
        ({"path": "/function/hello/", "raw_path": b"/function/hello/"}, b"/"),
        ({"path": "/function/hello/a/b", "raw_path": b"/function/hello/a%2Fb"}, b"/a%2Fb"),
        ({"path": "/function/hello/x", "query_string": b"q=%3F&r=1"}, b"/x?q=%3F&r=1"),
        ({"path": "/function/hello/ä b"}, b"/%C3%A4%20b"),  # no raw path: quoted
    ],
)
def test_the_target_is_the_raw_path_after_the_function_and_its_query(
    scope: dict[str, Any], target: bytes
) -> None:
    assert target_of(scope) == target


def test_an_answer_is_relayed_and_the_environment_goes_back_before_its_end() -> None:
    caller, raised, heads = asyncio.run(_forward(_answers(OK), _scope(query=b"x=1")))
    assert raised is None
    start, *_ = [e for e in caller.events if e != "done"]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/plain") in start["headers"]
    assert caller.body == b"hello world"
    assert caller.events.count("done") == 1
    assert caller.events.index("done") < len(caller.events) - 1  # the last chunk comes after
    assert caller.events[-1]["more_body"] is False
    assert heads[0].startswith(b"GET /a/b?x=1 HTTP/1.1\r\n")


def test_a_path_that_is_not_plain_ascii_is_refused_and_the_environment_goes_back() -> None:
    scope = _scope() | {"raw_path": b"/function/hello/\xff"}
    caller, raised, heads = asyncio.run(_forward(_answers(OK), scope))
    assert isinstance(raised, Answer) and raised.status == 400
    assert caller.events == ["done"] and heads == []  # nothing was sent


def test_an_answer_that_is_not_http_fails_the_replica() -> None:
    caller, raised, _ = asyncio.run(_forward(_answers(b"SSH-2.0-OpenSSH\r\n\r\n")))
    assert isinstance(raised, ReplicaFailed) and "not HTTP/1.1" in str(raised)
    assert caller.events == []  # no head: the claim is the caller's to retire


def test_no_complete_answer_in_time_is_a_504() -> None:
    async def never(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        await reader.read()  # until the gateway gives up and closes

    caller, raised, _ = asyncio.run(_forward(never, gateway_timeout_s=0.2))
    assert isinstance(raised, Answer) and raised.status == 504
    assert "no complete answer within 0.2s" in str(raised) and caller.events == ["done"]


def test_an_answer_broken_after_its_status_line_is_broken_off() -> None:
    half = b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"x" * 70000
    caller, raised, _ = asyncio.run(_forward(_answers(half), gateway_read_ahead=1024))
    assert isinstance(raised, BrokenOff) and "broke off its answer" in str(raised)
    assert caller.events[0]["status"] == 200 and caller.events.count("done") == 1


def test_a_replica_that_breaks_the_exchange_before_answering_has_failed() -> None:
    async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    caller, raised, _ = asyncio.run(_forward(hang_up))
    assert isinstance(raised, ReplicaFailed)
    assert caller.events == []  # the claim is the caller's to retire with the replica


def test_a_replica_without_an_address_or_that_refuses_connections_has_failed() -> None:
    async def forward(address: str | None) -> tuple[Caller, BaseException]:
        upstreams = Upstreams(get_settings(), None)
        caller = Caller()
        try:
            await upstreams.forward(_scope(), _claimed(address), b"", caller.send, caller.done)
        except ReplicaFailed as exc:
            return caller, exc
        finally:
            await upstreams.close()
        raise AssertionError("forwarded")

    caller, raised = asyncio.run(forward(None))
    assert str(raised) == "the replica has no address" and caller.events == []
    caller, raised = asyncio.run(forward("http://127.0.0.1:1"))  # refused for the whole grace
    assert caller.events == []


def test_pools_unused_and_unwanted_are_swept() -> None:
    async def run() -> list[str]:
        upstreams = Upstreams(get_settings(), None)
        for address in ("http://127.0.0.1:1", "http://127.0.0.1:2"):
            upstreams._pool(address).last_used = 0.0  # unused since long ago
        upstreams.sweep({"http://127.0.0.1:2"})
        kept = list(upstreams._pools)
        await upstreams.close()
        assert upstreams._pools == {}
        return kept

    assert asyncio.run(run()) == ["http://127.0.0.1:2"]
