"""The ``corral`` command: operators' and scripts' way into the control plane.

Every listing command takes ``--json`` and then prints exactly one JSON document
on stdout. Errors go to stderr as one line (``corral: error: ...``) with exit
status 1; usage errors exit 2. ``spawn``, ``delete`` and ``scale`` print the
operation id, or with ``--wait`` follow it to the end (a progress bar on a
terminal) and exit non-zero if it failed.

Each module of this package registers one group of commands; :data:`GROUPS`
lists them in the order ``corral --help`` shows them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from config.settings import ConfigError, get_settings
from tasks.cli import claims as claim_cmds
from tasks.cli import core, gateway, gpus, maintenance, services
from tasks.cli._output import Command, Handler
from workers.errors import CorralError
from workers.store.migrate import SchemaError

GROUPS: list[Callable[[Any, Command], None]] = [
    core.register,
    claim_cmds.register,
    maintenance.register,
    gpus.register,
    services.register,
    gateway.register,
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every ``corral`` command."""
    parser = argparse.ArgumentParser(
        prog="corral", description="Control plane for serverless microVM fleets."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, handler: Handler, help: str, parent: Any = sub, listing: bool = False
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(name, help=help, description=help)
        p.set_defaults(handler=handler)
        if listing:
            p.add_argument("--json", action="store_true", help="print one JSON document")
        return p

    for register in GROUPS:
        register(sub, command)
    return parser


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
