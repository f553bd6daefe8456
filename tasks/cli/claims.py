"""Claim commands: ``claim`` and ``release``.

``claim NAME`` takes one execution environment of an Idle replica and prints the
replica id and the address to send the request to; ``--cold-start-timeout S``
waits up to S seconds for a new replica when none is Idle. ``release ID`` gives
it back.
"""

from __future__ import annotations

import argparse
from typing import Any

from config.settings import Settings
from tasks.cli._output import Command, emit


def cmd_claim(args: argparse.Namespace, settings: Settings) -> int:
    """Take one execution environment of an Idle replica."""
    from tasks import api

    got = api.claim(args.name, cold_start_timeout=args.cold_start_timeout, settings=settings)
    emit(args, got, lambda g: f"{g['replica_id']} {g['address'] or ''}".rstrip())
    return 0


def cmd_release(args: argparse.Namespace, settings: Settings) -> int:
    """Give a claimed execution environment back."""
    from tasks import api

    view = api.release(args.replica_id, settings=settings)
    emit(args, view, lambda v: f"released {v['replica_id']}: {v['status']} "
         f"({v['envs_in_use']} of {v['envs_total']} environments in use)")
    return 0


def register(sub: Any, command: Command) -> None:
    """Add the claim commands to the ``corral`` parser."""
    p = command("claim", cmd_claim, "take one execution environment of an idle replica",
                listing=True)
    p.add_argument("name")
    p.add_argument("--cold-start-timeout", type=float, default=0.0, metavar="S",
                   help="with nothing idle, wait up to S seconds for a new replica")
    p = command("release", cmd_release, "give a claimed execution environment back",
                listing=True)
    p.add_argument("replica_id")
