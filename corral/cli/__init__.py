"""The ``corral`` command: operators' and scripts' way into the control plane.

Every listing command takes ``--json`` and then prints exactly one JSON document
on stdout. Errors go to stderr as one line (``corral: error: ...``) with exit
status 1; usage errors exit 2. ``spawn``, ``delete`` and ``scale`` print the
operation id, or with ``--wait`` follow it to the end (a progress bar on a
terminal) and exit non-zero if it failed.

:mod:`corral.cli.parser` declares every command and names its handler; the
handlers live in one module per group (``core``, ``claims``, ``maintenance``,
``gpus``, ``services``, ``agent``, ``gateway``) and call :mod:`corral.api` for everything they
show or change. A handler's module is imported only when its command runs, and the
settings (pydantic) only once the command line has parsed, and only for a command that
takes them: ``corral --help`` and a usage error load argparse and nothing else of note,
``corral worker`` (a supervisor) and ``corral agent`` no settings.
``tests/corral/cli/test_startup.py`` checks what each command imports.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from corral.cli.parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``corral`` command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.handler(args))  # the settings loaded if it takes them: see above
    except KeyboardInterrupt:
        print("corral: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # imported here: a command that ends well never loads what it did not need
        from config.settings import ConfigError
        from workers.base.errors import CorralError, SchemaError

        if not isinstance(exc, (ConfigError, SchemaError, CorralError, TimeoutError)):
            raise
        print(f"corral: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
