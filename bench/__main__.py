"""``python -m bench``: run every benchmark in turn (spawn, claims and reap, placement)."""

from __future__ import annotations

import sys

from bench import claims_reap, placement, spawn


def main() -> int:
    """Run the three benchmarks; non-zero if any of them failed to run."""
    status = 0
    for name, module in (("spawn", spawn), ("claims_reap", claims_reap),
                         ("placement", placement)):
        print(f"\n=== python -m bench.{name}", flush=True)
        status |= int(module.main([]) or 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
