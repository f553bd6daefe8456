"""Notices of ready replicas over Redis pub/sub: published after a commit, heard by gateways."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import redis

from workers.replicas import notices


def test_a_notice_reaches_a_listener_and_a_lost_redis_is_quiet(redis_url: str) -> None:
    heard: list[str] = []
    stop = threading.Event()

    async def listening() -> None:
        task = asyncio.create_task(notices.listen(redis_url, heard.append))
        while not stop.is_set():
            await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    thread = threading.Thread(target=asyncio.run, args=(listening(),), daemon=True)
    thread.start()
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 10
        while not heard:  # subscribed only after a moment: announce until it hears
            notices.announce(client, ["hello", "world", "hello"])
            assert time.monotonic() < deadline, "no notice was heard"
            time.sleep(0.05)
        assert set(heard) <= {"hello", "world"}
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    # Redis away, or no Redis at all: nothing is raised, the waiters look on their own.
    notices.announce(redis.Redis.from_url("redis://127.0.0.1:1/0"), ["hello"])
    notices.announce(None, ["hello"])


def test_a_listener_in_this_process_is_told_at_once_without_redis() -> None:
    heard: list[str] = []
    closed = asyncio.new_event_loop()
    closed.close()
    stop_gone = notices.listen_here(lambda name: closed.call_soon_threadsafe(print, name))
    stop = notices.listen_here(heard.append)
    try:
        notices.announce(None, ["b", "a", "b"])  # no Redis; one listener's loop is closed
    finally:
        stop()
        stop_gone()
    notices.announce(None, ["c"])  # stopped: not told
    assert heard == ["a", "b"]
