"""The ``corral`` command: operators' and scripts' way into the control plane.

Every listing command takes ``--json`` and then prints exactly one JSON document
on stdout. Errors go to stderr as one line (``corral: error: ...``) with exit
status 1; usage errors exit 2. ``spawn``, ``delete`` and ``scale`` print the
operation id, or with ``--wait`` follow it to the end (a progress bar on a
terminal) and exit non-zero if it failed.

:mod:`tasks.cli.parser` declares every command and names its handler; the
handlers live in one module per group (``core``, ``claims``, ``maintenance``,
``gpus``, ``services``, ``agent``, ``gateway``) and call :mod:`tasks.api` for everything they
show or change. A handler's module is imported only when its command runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from config.settings import ConfigError, get_settings
from tasks.cli.parser import build_parser
from workers.errors import CorralError, SchemaError

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``corral`` command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        settings = get_settings()
        return int(args.handler(args, settings))
    except (ConfigError, SchemaError, CorralError, TimeoutError) as exc:
        print(f"corral: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("corral: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
