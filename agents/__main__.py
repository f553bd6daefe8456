"""``python -m agents {fcdaemon,lambdo,gpus} ...``: run one reference agent.

``corral agent <kind> ...`` dispatches here too (:func:`main` takes the argv after
``agent``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from agents import fcdaemon, gpus, lambdo

__all__ = ["AGENTS", "main"]

_MAINS: dict[str, Callable[[list[str]], int]] = {
    "fcdaemon": fcdaemon.main,
    "lambdo": lambdo.main,
    "gpus": gpus.main,
}
AGENTS = tuple(_MAINS)


def main(argv: list[str] | None = None) -> int:
    """Run the agent named by ``argv[0]`` with the remaining arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in AGENTS:
        print(f"usage: corral agent {{{','.join(AGENTS)}}} [options]", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    return _MAINS[args[0]](args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
