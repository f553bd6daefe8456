"""``python -m bench``: run every benchmark in turn (spawn, claims and reap, placement, gateway)."""

from __future__ import annotations

import sys

from bench import claims_reap, gateway, placement, spawn


def main() -> int:
    """Run the four benchmarks; non-zero if any of them failed to run."""
    status = 0
    for name, module in (("spawn", spawn), ("claims_reap", claims_reap),
                         ("placement", placement), ("gateway", gateway)):
        print(f"\n=== python -m bench.{name}", flush=True)
        status |= int(module.main([]) or 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
