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

from config.settings import Settings
from corral import api
from corral.api import ReleaseView
from corral.cli._output import emit


def cmd_claim(args: argparse.Namespace, settings: Settings) -> int:
    """Take one execution environment of an Idle replica."""
    got = api.claim(
        args.name, cold_start_timeout=args.cold_start_timeout, ttl=args.ttl, settings=settings
    )
    emit(args, got, lambda g: f"{g['claim_id']} {g['address'] or ''}".rstrip())
    return 0


def _released(v: ReleaseView) -> str:
    if not v["released"]:
        return str(v["detail"])
    return (
        f"released {v['claim_id']}: replica {v['replica_id']} {v['status']} "
        f"({v['envs_in_use']} of {v['envs_total']} environments in use)"
    )


def cmd_release(args: argparse.Namespace, settings: Settings) -> int:
    """Give a claimed execution environment back."""
    emit(args, api.release(args.claim_id, settings=settings), _released)
    return 0
