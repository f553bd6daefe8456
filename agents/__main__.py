"""``python -m agents {fcdaemon,lambdo,gpus} ...``: run one reference agent.

``corral agent <kind> ...`` dispatches here too (:func:`main` takes the argv after
``agent``).
"""

from __future__ import annotations

import sys

__all__ = ["AGENTS", "main"]

AGENTS = ("fcdaemon", "lambdo", "gpus")


def main(argv: list[str] | None = None) -> int:
    """Run the agent named by ``argv[0]`` with the remaining arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in AGENTS:
        print(f"usage: corral agent {{{','.join(AGENTS)}}} [options]", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    kind, rest = args[0], args[1:]
    if kind == "fcdaemon":
        from agents.fcdaemon import main as run
    elif kind == "lambdo":
        from agents.lambdo import main as run
    else:
        from agents.gpus import main as run
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
