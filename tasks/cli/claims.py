"""Claim commands: ``claim`` and ``release``.

``claim NAME`` lends one execution environment of an Idle replica and prints the
claim id and the address to send the request to; ``--cold-start-timeout S``
waits up to S seconds for a new replica when none is Idle, ``--ttl S`` sets when
the claim expires (default ``CORRAL_CLAIM_TTL_S``; the reaper then gives it back).
``release CLAIM_ID`` gives back exactly that environment; releasing a claim that is
no longer held changes nothing and says so.
"""

from __future__ import annotations

import argparse
from typing import Any

from config.settings import Settings
from tasks.cli._output import Command, emit


def cmd_claim(args: argparse.Namespace, settings: Settings) -> int:
    """Take one execution environment of an Idle replica."""
    from tasks import api

    got = api.claim(args.name, cold_start_timeout=args.cold_start_timeout, ttl=args.ttl,
                    settings=settings)
    emit(args, got, lambda g: f"{g['claim_id']} {g['address'] or ''}".rstrip())
    return 0


def _released(v: dict[str, Any]) -> str:
    if not v["released"]:
        return str(v["detail"])
    return (f"released {v['claim_id']}: replica {v['replica_id']} {v['status']} "
            f"({v['envs_in_use']} of {v['envs_total']} environments in use)")


def cmd_release(args: argparse.Namespace, settings: Settings) -> int:
    """Give a claimed execution environment back."""
    from tasks import api

    emit(args, api.release(args.claim_id, settings=settings), _released)
    return 0


def register(sub: Any, command: Command) -> None:
    """Add the claim commands to the ``corral`` parser."""
    p = command("claim", cmd_claim, "take one execution environment of an idle replica",
                listing=True)
    p.add_argument("name")
    p.add_argument("--cold-start-timeout", type=float, default=0.0, metavar="S",
                   help="with nothing idle, wait up to S seconds for a new replica")
    p.add_argument("--ttl", type=float, default=None, metavar="S",
                   help="the claim expires after S seconds (default CORRAL_CLAIM_TTL_S)")
    p = command("release", cmd_release, "give a claimed execution environment back",
                listing=True)
    p.add_argument("claim_id")
