"""The gateway's HTTP/1.1 client against a loopback server that answers as a test scripts it.

One test per limit of :class:`workers.gateway.http1.Limits` and the read-ahead budget,
each at its edge where it has one (what fits passes, one more is refused), and the
smaller rules: trailers dropped, a 101 refused without a traceback, bytes after a
complete answer never reaching the next request, keep-alive otherwise.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

import pytest

from workers.gateway import http1

Script = Callable[[asyncio.StreamWriter, int], Awaitable[None]]
GET = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Server:
    """A loopback server: each request head read, ``script(writer, n)`` answers request n."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests = 0
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def address(self) -> str:
        """The server's ``http://`` address."""
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                self.requests += 1
                await self.script(writer, self.requests)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def run(scenario: Coroutine[Any, Any, None]) -> None:
    """Run a scenario on a loop that fails the test on any exception it did not handle."""

    async def guarded() -> None:
        unhandled: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unhandled.append(ctx))
        await scenario
        await asyncio.sleep(0.05)  # what the closed connections' callbacks do, done
        assert not unhandled, f"exceptions the loop did not expect: {unhandled}"

    asyncio.run(guarded())


async def body_of(exchange: http1.Exchange) -> bytes:
    """The whole body of an answer."""
    out = b""
    while (chunk := await exchange.chunk()) is not None:
        out += chunk
    return out


async def fetch(pool: http1.Pool) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One GET: status, headers, body."""
    exchange = await pool.send(GET, b"", head_only=False)
    await exchange.head()
    body = await body_of(exchange)
    exchange.abandon()
    return exchange.status, exchange.headers, body


async def refused(pool: http1.Pool) -> http1.Rejected:
    """One GET whose answer must be refused; the refusal."""
    exchange = await pool.send(GET, b"", head_only=False)

    async def whole() -> None:
        await exchange.head()
        await body_of(exchange)

    with pytest.raises(http1.Rejected) as caught:
        await whole()
    exchange.abandon()
    assert not pool.idle, "a refused answer's connection must not be kept"
    return caught.value


def writes(*answers: bytes) -> Script:
    """Answer request n with ``answers[n - 1]`` (the last one for every later request)."""

    async def script(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(answers[min(n, len(answers)) - 1])

    return script


LIMITS = http1.Limits(head_bytes=4096, head_lines=10, head_timeout_s=0.5, read_ahead=64 * 1024)


def answer_of(size: int, body: bytes) -> bytes:
    """A 200 answer whose head is exactly ``size`` bytes (one filler header)."""
    start = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Fill: " % len(body)
    return start + b"f" * (size - len(start) - 4) + b"\r\n\r\n" + body


@pytest.mark.parametrize("split", [False, True])
def test_a_head_of_the_limit_passes_and_one_byte_more_is_refused(split: bool) -> None:
    async def scenario() -> None:
        async def script(writer: asyncio.StreamWriter, n: int) -> None:
            answer = answer_of(4096 + (n - 1), b"ok")  # the body in the same write
            if split:  # in pieces of 100: counted as they arrive, not once a header is whole
                for at in range(0, len(answer), 100):
                    writer.write(answer[at : at + 100])
                    await writer.drain()
                    await asyncio.sleep(0)
            else:
                writer.write(answer)

        async with Server(script) as server:
            pool = http1.Pool(server.address, 5.0, LIMITS)
            assert (await fetch(pool))[2] == b"ok"  # exactly 4096 bytes of head
            assert (await refused(pool)).reason == "head_bytes"

    run(scenario())


def test_header_lines_past_the_limit_are_refused() -> None:
    def lines(n: int) -> bytes:
        return b"HTTP/1.1 200 OK\r\n" + b"a:b\r\n" * (n - 1) + b"Content-Length: 0\r\n\r\n"

    async def scenario() -> None:
        async with Server(writes(lines(10), lines(11))) as server:
            pool = http1.Pool(server.address, 5.0, LIMITS)
            status, headers, _ = await fetch(pool)
            assert status == 200 and len(headers) == 10
            assert (await refused(pool)).reason == "head_lines"

    run(scenario())


def test_interim_heads_count_against_the_head_and_are_dropped() -> None:
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>\r\n\r\n"  # 49 bytes, one line

    async def scenario() -> None:
        async with Server(writes(hints * 2 + OK, hints * 100 + OK)) as server:
            pool = http1.Pool(server.address, 5.0, LIMITS)
            status, headers, body = await fetch(pool)
            assert (status, body) == (200, b"ok") and headers == [(b"Content-Length", b"2")]
            assert (await refused(pool)).reason in ("head_bytes", "head_lines")

    run(scenario())


def test_a_head_that_drips_is_refused_at_its_deadline_not_before_its_first_byte() -> None:
    async def script(writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:  # a slow function: nothing for twice the head's deadline, then its answer
            await asyncio.sleep(1.0)
            writer.write(OK)
            return
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(50):
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"x-drip: 1\r\n")

    async def scenario() -> None:
        async with Server(script) as server:
            pool = http1.Pool(server.address, 5.0, LIMITS)
            assert (await fetch(pool))[2] == b"ok"
            loop = asyncio.get_running_loop()
            started = loop.time()
            rejected = await refused(pool)
            assert (rejected.reason, rejected.status) == ("head_timeout", 504)
            assert 0.4 < loop.time() - started < 2.0

    run(scenario())


def test_trailers_are_dropped_and_bounded() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
    small = chunked + b"X-Trailer: 1\r\n\r\n"

    async def script(writer: asyncio.StreamWriter, n: int) -> None:
        if n <= 2:
            writer.write(small)
            return
        writer.write(chunked)
        await writer.drain()
        for _ in range(100):  # 100 x 1 KiB of trailer lines, in writes of their own
            await asyncio.sleep(0.001)
            writer.write(b"t:x\r\n" * 205)
            await writer.drain()
        writer.write(b"\r\n")

    async def scenario() -> None:
        async with Server(script) as server:
            pool = http1.Pool(server.address, 5.0, LIMITS)
            for _ in range(2):  # and the connection is reused after one
                status, headers, body = await fetch(pool)
                assert (status, body) == (200, b"ok")
                assert all(name != b"X-Trailer" for name, _ in headers)
            assert server.connections == 1
            assert (await refused(pool)).reason == "trailers"

    run(scenario())


def test_a_101_is_refused_cleanly() -> None:
    upgrade = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )

    async def scenario() -> None:
        async with Server(writes(upgrade + b"\x81\x05hello", OK)) as server:
            pool = http1.Pool(server.address, 5.0, LIMITS)
            assert (await refused(pool)).reason == "upgrade"
            assert (await fetch(pool))[2] == b"ok"  # a new connection

    run(scenario())  # and nothing reached the loop's exception handler


def test_bytes_after_a_complete_answer_never_reach_the_next_request() -> None:
    forged = b"HTTP/1.1 200 OK\r\nX-Forged: yes\r\n"
    rest = b"Content-Length: 6\r\n\r\nforged"

    async def script(writer: asyncio.StreamWriter, n: int) -> None:
        # the first answer, then a forged head begun; on the same connection, its end
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst" + forged if n == 1 else rest
        )

    async def scenario() -> None:
        async with Server(script) as server:
            pool = http1.Pool(server.address, 5.0, LIMITS)
            assert (await fetch(pool))[2] == b"first"
            await asyncio.sleep(0.05)
            assert not pool.idle  # closed, not kept

    run(scenario())


def test_an_answer_and_a_head_after_it_in_one_write_close_the_connection() -> None:
    async def scenario() -> None:
        after = OK + b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged"
        async with Server(writes(after, OK)) as server:
            pool = http1.Pool(server.address, 5.0, LIMITS)
            assert (await fetch(pool))[2] == b"ok"
            assert (await fetch(pool))[2] == b"ok"
            assert server.connections == 2

    run(scenario())


def test_a_head_answer_and_a_204_keep_the_connection() -> None:
    async def scenario() -> None:
        no_body = b"HTTP/1.1 204 No Content\r\n\r\n"
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"  # a HEAD's: no body
        async with Server(writes(no_body, head, OK)) as server:
            pool = http1.Pool(server.address, 5.0, LIMITS)
            assert (await fetch(pool))[0] == 204
            exchange = await pool.send(GET, b"", head_only=True)
            await exchange.head()
            assert exchange.complete and await exchange.chunk() is None
            assert (await fetch(pool))[2] == b"ok"
            assert server.connections == 1

    run(scenario())


def chunked(size: int, total: int) -> bytes:
    """A chunked answer of ``total`` bytes in chunks of ``size``."""
    piece = f"{size:x}\r\n".encode() + b"c" * size + b"\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + piece * (total // size) + b"0\r\n\r\n"


async def held_by(exchange: http1.Exchange, budget: http1.Budget, until: float) -> int:
    """What the budget holds once it has stopped growing (the connection paused)."""
    last = -1
    conn = cast(http1.Connection, exchange.conn)
    while budget.held != last or not conn._paused:
        last = budget.held
        await asyncio.sleep(0.05)
        assert asyncio.get_running_loop().time() < until, "the read-ahead never paused"
    return budget.held


def test_two_byte_chunks_are_charged_by_memory_and_stop_at_the_read_ahead() -> None:
    async def scenario() -> None:
        async with Server(writes(chunked(2, 4 * 1024 * 1024))) as server:
            budget = http1.Budget()
            pool = http1.Pool(server.address, 5.0, LIMITS, budget)
            gc.collect()
            tracemalloc.start()
            try:
                exchange = await pool.send(GET, b"", head_only=False)
                await exchange.head()
                held = await held_by(exchange, budget, asyncio.get_running_loop().time() + 10)
                # what the client keeps, allocated from its module (not the test server's)
                mine = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(True, http1.__file__)]
                )
                used = sum(stat.size for stat in mine.statistics("filename"))
            finally:
                tracemalloc.stop()
            # paused within a read (256 KiB of wire: 75 KiB of body) of the read-ahead
            assert LIMITS.read_ahead < held < LIMITS.read_ahead + 200 * 1024
            assert used < held, f"{used} bytes in memory, {held} charged"  # charged: memory
            assert len(await body_of(exchange)) == 4 * 1024 * 1024  # and it all comes through
            assert budget.held == 0
            exchange.abandon()

    run(scenario())


def test_tiny_chunks_are_fed_a_turns_worth_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    turns = [0]  # pieces of body handed over in each turn of the loop

    def counted(self: http1.Connection, body: bytes) -> None:
        turns[-1] += 1
        original(self, body)

    original = http1.Connection.on_body
    monkeypatch.setattr(http1.Connection, "on_body", counted)

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0)
            turns.append(0)

    async def scenario() -> None:
        async with Server(writes(chunked(2, 1024 * 1024), OK)) as server:
            pool = http1.Pool(server.address, 5.0)
            tick = asyncio.ensure_future(ticker())
            assert len((await fetch(pool))[2]) == 1024 * 1024
            tick.cancel()
            conn = pool.idle[0]
            assert conn._feed_size < 4 * 1024  # learnt: about a turn's pieces of 7 bytes
            assert (await fetch(pool))[2] == b"ok"

    run(scenario())
    busy = sorted(n for n in turns if n)
    # the first feeds (the head's room, then FEED_FIRST) are larger; then a turn's worth
    assert busy[len(busy) * 9 // 10] <= 2 * http1.PIECES_A_TURN, busy[-20:]


def test_the_budget_pauses_callers_that_do_not_wait_and_serves_one_that_does() -> None:
    async def scenario() -> None:
        async with Server(writes(chunked(1000, 1024 * 1024))) as server:
            budget = http1.Budget(128 * 1024)  # under one answer's own read-ahead
            limits = http1.Limits(read_ahead=1024 * 1024)
            pool = http1.Pool(server.address, 5.0, limits, budget)
            idle = []
            for _ in range(4):  # callers that never read: paused once the budget is full
                exchange = await pool.send(GET, b"", head_only=False)
                await exchange.head()
                idle.append(exchange)
            until = asyncio.get_running_loop().time() + 10
            for exchange in idle:
                await held_by(exchange, budget, until)
            assert budget.held < budget.limit + 4 * 300 * 1024  # each at most a read past it
            reader = await pool.send(GET, b"", head_only=False)
            await reader.head()
            assert len(await body_of(reader)) == 1048 * 1000  # its caller waits: it reads
            for exchange in idle:
                exchange.abandon()  # what they held goes back
            reader.abandon()
            assert budget.held == 0

    run(scenario())
