"""``python -m bench``: every benchmark in turn (spawn, claims and reap, placement, gateway,
asynchronous calls, the warm path's routes under churn, CLI start-up)."""

from __future__ import annotations

import sys

from bench import claims_reap, gateway, invocations, placement, spawn, startup, warmroutes


def main() -> int:
    """Run the benchmarks; non-zero if any of them failed to run or missed its aim."""
    status = 0
    for name, module in (
        ("spawn", spawn),
        ("claims_reap", claims_reap),
        ("placement", placement),
        ("gateway", gateway),
        ("invocations", invocations),
        ("warmroutes", warmroutes),
        ("startup", startup),
    ):
        print(f"\n=== python -m bench.{name}", flush=True)
        status |= int(module.main([]) or 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
