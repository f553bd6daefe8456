"""Asynchronous calls: ``corral calls`` lists them, ``show`` one, ``redrive`` dead ones, ``purge``.

``corral calls [--function F] [--status S] [--limit N]`` lists calls newest first;
``calls show ID`` shows one with its stored answer; ``calls redrive ID...`` (or
``--function F``, ``--all``) queues dead calls again, each with a fresh budget of
attempts and age; ``calls purge [--older-than S]`` deletes finished calls. Every one
takes ``--json``.
"""

from __future__ import annotations

import argparse

from config.settings import Settings
from corral import api
from corral.cli._output import emit, kv, table

CALL_COLUMNS = (
    "id",
    "function",
    "status",
    "attempts",
    "answer_status",
    "created_at",
    "finished_at",
    "error",
)


def cmd_calls(args: argparse.Namespace, settings: Settings) -> int:
    """List calls, or show, redrive or purge them."""
    match getattr(args, "calls_cmd", None):
        case "show":
            emit(args, api.call(args.call_id, settings=settings), kv)
        case "redrive":
            redriven = api.redrive_calls(
                args.ids,
                function=args.redrive_function,
                every=args.all,
                settings=settings,
            )
            emit(args, {"redriven": redriven}, lambda r: f"redrove {len(r['redriven'])} calls")
        case "purge":
            purged = api.purge_calls(args.older_than, settings=settings)
            emit(args, {"purged": purged}, lambda r: f"purged {r['purged']} finished calls")
        case _:
            rows = api.calls(args.function, status=args.status, limit=args.limit, settings=settings)
            emit(args, rows, lambda r: table(r, CALL_COLUMNS))
    return 0
