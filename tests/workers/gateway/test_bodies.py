"""Request bodies (workers/gateway/bodies.py): read whole, bounded per request, in all and in
time; what a body holds of the budget is given back when its request ends.

:class:`Bodies` is driven directly with an ASGI ``receive`` of the test's own; the bounds
through a real gateway, against callers that hold them, are in test_bounds.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from workers.gateway.asgi import RETRY_AFTER_S, Answer, ClientGone
from workers.gateway.bodies import Bodies
from workers.gateway.headers import Trusted

Receive = Callable[[], Awaitable[dict[str, Any]]]


def _scope(**headers: str) -> dict[str, Any]:
    return {"headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def _pieces(*chunks: bytes) -> Receive:
    """A receive that hands out ``chunks`` as one body, then waits for good."""
    queue = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive


def test_a_body_is_read_whole_and_holds_its_bytes_until_its_request_ends() -> None:
    async def run() -> None:
        bodies = Bodies(max_body=100, budget=100, read_timeout_s=5)
        async with bodies.read(_scope(content_length="11"), _pieces(b"hello", b" world")) as body:
            assert body == b"hello world" and bodies.held == 11
        assert bodies.held == 0

    asyncio.run(run())


def test_a_chunked_body_takes_the_budget_as_it_arrives_a_byte_at_a_time() -> None:
    async def run() -> None:
        bodies = Bodies(max_body=100, budget=100, read_timeout_s=5)
        pieces = [bytes([c]) for c in b"abcde"]
        async with bodies.read(_scope(transfer_encoding="chunked"), _pieces(*pieces)) as body:
            assert body == b"abcde" and bodies.held == 5
        assert bodies.held == 0

    asyncio.run(run())


def test_a_body_that_fills_the_budget_exactly_fits_and_one_byte_more_is_refused() -> None:
    async def run() -> None:
        bodies = Bodies(max_body=100, budget=10, read_timeout_s=5)
        async with bodies.read(_scope(content_length="6"), _pieces(b"x" * 6)):
            async with bodies.read(_scope(content_length="4"), _pieces(b"y" * 4)) as second:
                assert second == b"yyyy" and bodies.held == 10  # exactly the budget
            with pytest.raises(Answer) as refused:
                async with bodies.read(_scope(content_length="5"), _pieces(b"z" * 5)):
                    pass
            assert bodies.held == 6  # the refused body took nothing
        assert bodies.held == 0
        answer = refused.value
        assert (answer.status, answer.message) == (
            503,
            "the gateway holds as many request bodies as it may: try again",
        )
        assert answer.headers == {"retry-after": str(RETRY_AFTER_S), "connection": "close"}

    asyncio.run(run())


def test_a_body_over_the_limit_is_413_announced_or_counted() -> None:
    async def never() -> dict[str, Any]:
        raise AssertionError("an announced body over the limit is refused before it is read")

    async def run() -> None:
        bodies = Bodies(max_body=5, budget=100, read_timeout_s=5)
        for scope, receive in (
            (_scope(content_length="6"), never),
            (_scope(transfer_encoding="chunked"), _pieces(b"xxx", b"xxx")),
        ):
            with pytest.raises(Answer) as over:
                async with bodies.read(scope, receive):
                    pass
            answer = over.value
            assert (answer.status, answer.message) == (413, "request body over 5 bytes")
            assert answer.headers == {"connection": "close"}
            assert bodies.held == 0

    asyncio.run(run())


def test_a_body_that_stops_arriving_is_408_and_gives_its_bytes_back() -> None:
    async def stalls() -> None:
        bodies = Bodies(max_body=100, budget=100, read_timeout_s=0.05)

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        with pytest.raises(Answer) as slow:
            async with bodies.read(_scope(content_length="10"), receive):
                pass
        assert (slow.value.status, slow.value.message) == (
            408,
            "request body not received within 0.05s",
        )
        assert slow.value.headers == {"connection": "close"}  # the rest is never read
        assert bodies.held == 0

    asyncio.run(stalls())


def test_a_caller_that_goes_away_mid_body_gives_its_bytes_back() -> None:
    async def run() -> None:
        bodies = Bodies(max_body=100, budget=100, read_timeout_s=5)
        sent: list[dict[str, Any]] = [
            {"type": "http.request", "body": b"abc", "more_body": True},
            {"type": "http.disconnect"},
        ]

        async def receive() -> dict[str, Any]:
            return sent.pop(0)

        with pytest.raises(ClientGone):
            async with bodies.read(_scope(content_length="10"), receive):
                pass
        assert bodies.held == 0

    asyncio.run(run())


def test_no_body_announced_reads_the_one_message_and_holds_nothing() -> None:
    async def run() -> None:
        bodies = Bodies(max_body=100, budget=0, read_timeout_s=5)
        async with bodies.read(_scope(), _pieces(b"")) as body:
            assert body == b"" and bodies.held == 0

    asyncio.run(run())


def test_a_peers_bodies_hold_at_most_its_share_and_give_it_back_once() -> None:
    async def run() -> None:
        bodies = Bodies(max_body=100, budget=100, read_timeout_s=5, per_peer=10)

        def of(peer: str, size: int) -> tuple[dict[str, Any], Receive]:
            scope = _scope(content_length=str(size)) | {"client": (peer, 40000)}
            return scope, _pieces(b"x" * size)

        first = bodies.read(*of("10.0.0.1", 1))
        async with first:
            with pytest.raises(Answer) as refused:
                async with bodies.read(*of("10.0.0.1", 10)):
                    pass
            async with bodies.read(*of("10.0.0.2", 5)):  # another peer has its own share
                assert bodies.peers == {"10.0.0.1": 1, "10.0.0.2": 5} and bodies.held == 6
            assert bodies.peers == {"10.0.0.1": 1} and bodies.held == 1
            async with bodies.read(*of("10.0.0.1", 9)):  # the rest of the peer's share
                assert bodies.peers == {"10.0.0.1": 10}
            assert bodies.peers == {"10.0.0.1": 1}  # the byte its other body holds is kept
        assert (bodies.peers, bodies.held, first.held) == ({}, 0, 0)
        first.release()  # given back once: releasing again changes nothing
        assert (bodies.peers, bodies.held) == ({}, 0)
        async with bodies.read(*of("10.0.0.1", 10)):  # the whole share is the peer's again
            assert bodies.peers == {"10.0.0.1": 10}
        answer = refused.value
        assert (answer.status, answer.message) == (
            503,
            "the gateway holds as many request bodies of this caller as it may: try again",
        )

    asyncio.run(run())


def test_a_body_behind_the_minimum_rate_after_its_grace_is_408_and_closes() -> None:
    async def run() -> None:
        # no grace: the first piece is already due (a second more per min_rate bytes read)
        bodies = Bodies(max_body=100, budget=100, read_timeout_s=5, min_rate=1000, grace_s=0)
        with pytest.raises(Answer) as slow:
            async with bodies.read(_scope(content_length="10"), _pieces(b"x" * 10)):
                pass
        answer = slow.value
        assert (answer.status, answer.message, answer.headers) == (
            408,
            "request body slower than 1000 bytes a second",
            {"connection": "close"},
        )
        assert bodies.held == 0

    asyncio.run(run())


def test_a_body_that_arrives_within_a_short_read_timeout_is_read() -> None:
    async def run() -> None:
        # every piece is there at once: no wait, whatever the timeout (under a second here)
        bodies = Bodies(max_body=100, budget=100, read_timeout_s=0.5)
        async with bodies.read(_scope(content_length="6"), _pieces(b"abc", b"def")) as body:
            assert body == b"abcdef"

    asyncio.run(run())


def test_with_no_body_allowed_an_empty_chunked_body_is_still_read() -> None:
    async def run() -> None:
        bodies = Bodies(max_body=0, budget=100, read_timeout_s=5)
        async with bodies.read(_scope(transfer_encoding="chunked"), _pieces(b"")) as body:
            assert body == b"" and bodies.held == 0

    asyncio.run(run())


def test_with_no_body_announced_the_one_message_is_what_is_read() -> None:
    async def read(message: dict[str, Any]) -> bytes:
        async def receive() -> dict[str, Any]:
            return message

        async with Bodies(max_body=100, budget=0, read_timeout_s=5).read(_scope(), receive) as b:
            return b

    assert asyncio.run(read({"type": "http.request"})) == b""  # no body key: none
    assert asyncio.run(read({"type": "http.request", "body": b"hi"})) == b"hi"
    with pytest.raises(ClientGone):
        asyncio.run(read({"type": "http.disconnect"}))


def test_a_trusted_proxys_bodies_and_a_peerless_ones_are_bounded_by_the_total() -> None:
    async def run() -> None:
        bodies = Bodies(
            max_body=100, budget=100, read_timeout_s=5, per_peer=4, trusted=Trusted("10.0.0.9/32")
        )
        proxy = _scope(content_length="10") | {"client": ("10.0.0.9", 40000)}
        # pieces without a body key (an empty piece) are read as empty
        pieces = [{"type": "http.request", "body": b"x" * 10, "more_body": True},
                  {"type": "http.request", "more_body": False}]  # fmt: skip

        async def receive() -> dict[str, Any]:
            return pieces.pop(0)

        async with bodies.read(proxy, receive) as body:  # over the share: a proxy has none
            assert (body, bodies.held, bodies.peers) == (b"x" * 10, 10, {})
            async with bodies.read(_scope(content_length="3"), _pieces(b"abc")):  # no client
                assert bodies.peers == {"": 3}
        assert (bodies.held, bodies.peers) == (0, {})
        assert (bodies.min_rate, bodies.grace_s) == (4096, 10.0)  # the defaults: Apache's

    asyncio.run(run())


def test_a_piece_without_more_body_is_the_last() -> None:
    async def run() -> None:
        bodies = Bodies(max_body=100, budget=100, read_timeout_s=5)
        said: list[dict[str, Any]] = [
            {"type": "http.request", "body": b"ab", "more_body": True},
            {"type": "http.request", "body": b"c"},
        ]
        pieces = iter(said)

        async def receive() -> dict[str, Any]:
            return next(pieces)  # a third read would raise StopIteration

        async with bodies.read(_scope(transfer_encoding="chunked"), receive) as body:
            assert body == b"abc" and bodies.held == 3

    asyncio.run(run())
