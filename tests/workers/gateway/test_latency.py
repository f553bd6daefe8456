"""A warm call is not held back by Nagle's algorithm and delayed ACKs, through the gateway or not.

A server that writes one answer in several small sends with Nagle on makes every
request after the first on a kept-alive connection wait for the client's delayed ACK:
about 40 ms each on Linux. The reference functions answer in one send with
``TCP_NODELAY``, and so do the gateway's sockets; these calls show it.
"""

from __future__ import annotations

import statistics
import time

from testkit import httpcalls
from tests.workers.gateway.conftest import Stack

CALLS = 50
STALL_MS = 40.0  # the delayed-ACK timer a stalled call waits out
ROUNDS = 3  # a stall is every call, every round; a busy machine's stray wait is one call
# Stray waits a round may have: a busy machine's, 40-56 ms, one a round at load 27; two
# suites side by side have made 3-10 of 50, each round. A stall is all of them.
STRAYS = CALLS // 5


def _keepalive_calls(url: str, n: int) -> list[float]:
    """``n`` sequential GETs of ``url`` on one kept-alive connection; each one's milliseconds."""
    times: list[float] = []
    with httpcalls.client(timeout=10) as client:
        assert client.get(url).status_code == 200  # the connection is made here
        for _ in range(n):
            started = time.perf_counter()
            answer = client.get(url)
            times.append((time.perf_counter() - started) * 1000)
            assert answer.status_code == 200 and answer.text == "hello from corral\n"
    return times


def test_fifty_keepalive_calls_through_the_gateway_and_direct_never_stall(stack: Stack) -> None:
    stack.deploy("hello", max=1)
    gw = stack.gateway(gateway_keep_s=30.0)
    assert httpcalls.get(f"{gw.url}/function/hello", timeout=60).status_code == 200  # warm
    (replica,) = stack.replicas("hello")
    assert replica.address

    for where, url in (("direct", replica.address), ("gateway", f"{gw.url}/function/hello")):
        rounds = []
        for _ in range(ROUNDS):  # a round with (nearly) every call well under the stall
            times = _keepalive_calls(url, CALLS)
            slow = sum(t >= STALL_MS * 0.75 for t in times)
            rounds.append((statistics.median(times), max(times), slow))
            if slow <= STRAYS:
                break
        else:
            raise AssertionError(f"{where}: (p50, max ms, slow calls) of each round: {rounds}")
        # stalled, every call waits the timer out; a machine at load 27 has made direct's
        # median 5 ms, never 20
        assert statistics.median(times) < STALL_MS / 2, (where, statistics.median(times))
