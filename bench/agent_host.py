"""The benchmark's node agents, in a process of their own (as real agents are).

Run by :mod:`bench.spawn`: ``python -m bench.agent_host --fast 2 --slow 10
--create-s 0.5 --served 32``. Starts that many reference fcdaemon agents on
loopback (memory driver; the slow ones wait ``--create-s`` per create and serve
``--served`` calls at once), prints one JSON line ``{"fast": [addresses],
"slow": [addresses]}``, then answers each ``count`` line on stdin with the VMs
each group runs (``{"fast": n, "slow": n}``). It stops when stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from agents.drivers import MemoryDriver, VMSpec
from agents.fcdaemon import serve_fcdaemon


def slow_driver(seconds: float) -> Any:
    """A :class:`agents.drivers.MemoryDriver` whose ``start`` takes ``seconds`` first."""

    class _Slow(MemoryDriver):
        def start(self, spec: VMSpec) -> Any:
            time.sleep(seconds)
            return super().start(spec)

    return _Slow()


def main(argv: list[str] | None = None) -> int:
    """Serve the agents until stdin closes."""
    parser = argparse.ArgumentParser(prog="python -m bench.agent_host")
    parser.add_argument("--fast", type=int, default=2)
    parser.add_argument("--slow", type=int, default=10)
    parser.add_argument("--create-s", type=float, default=0.5)
    parser.add_argument("--served", type=int, default=32)
    args = parser.parse_args(argv)
    fast = [serve_fcdaemon("127.0.0.1:0") for _ in range(args.fast)]
    slow = [
        serve_fcdaemon("127.0.0.1:0", driver=slow_driver(args.create_s), max_workers=args.served)
        for _ in range(args.slow)
    ]
    try:
        print(
            json.dumps({"fast": [a.address for a in fast], "slow": [a.address for a in slow]}),
            flush=True,
        )
        for line in sys.stdin:
            if line.strip() == "count":
                print(
                    json.dumps(
                        {
                            "fast": sum(len(a.driver.list()) for a in fast),
                            "slow": sum(len(a.driver.list()) for a in slow),
                        }
                    ),
                    flush=True,
                )
    finally:
        for agent in fast + slow:
            agent.stop(grace=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
