"""Claim and reaper commands: ``claim``, ``release`` and ``reap``.

``claim NAME`` takes one execution environment of an Idle replica and prints the
replica id and the address to send the request to; ``--cold-start-timeout S``
waits up to S seconds for a new replica when none is Idle. ``release ID`` gives
it back. ``reap`` asks for one reaper pass and prints its operation id, or with
``--wait`` what the pass deleted and why (exit 1 if it was skipped or a VM could
not be released).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from config.settings import Settings
from tasks.cli._output import Command, emit, table


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


def _reap_text(view: dict[str, Any]) -> str:
    report = view.get("result") or {}
    if report.get("skipped"):
        return f"reap pass skipped: another pass holds the lease ({report.get('held_by')})"
    counts = report.get("counts", {})
    deleted = report.get("deleted", [])
    lines = [
        f"reap pass deleted {len(deleted)} replica(s): "
        + ", ".join(f"{counts.get(r, 0)} {r}" for r in ("idle", "stale", "stuck"))
    ]
    if deleted:
        lines.append(table(deleted, ["replica_id", "function", "reason", "detail", "node",
                                     "outcome", "error"]))
    kept = report.get("kept_for_min") or {}
    if kept:
        lines.append("kept for min: " + ", ".join(f"{k}={v}" for k, v in sorted(kept.items())))
    for name, op in sorted((report.get("replacements") or {}).items()):
        lines.append(f"replacing stale replicas of {name}: {op}")
    if report.get("more"):
        lines.append("note: the batch limit was reached; the next pass continues")
    return "\n".join(lines)


def cmd_reap(args: argparse.Namespace, settings: Settings) -> int:
    """Run one reaper pass now."""
    import sys

    from tasks import api

    op_id = api.reap(args.idle_timeout, settings=settings)
    if not args.wait:
        print(json.dumps({"operation": op_id}) if args.json else op_id)
        return 0
    view = api.wait(op_id, timeout=args.timeout, settings=settings)
    emit(args, view, _reap_text)
    if view["error"] and not args.json:
        print(f"corral: error: {view['error']}", file=sys.stderr)
    return 0 if view["status"] == "succeeded" else 1


def register(sub: Any, command: Command) -> None:
    """Add the claim and reaper commands to the ``corral`` parser."""
    p = command("claim", cmd_claim, "take one execution environment of an idle replica",
                listing=True)
    p.add_argument("name")
    p.add_argument("--cold-start-timeout", type=float, default=0.0, metavar="S",
                   help="with nothing idle, wait up to S seconds for a new replica")
    p = command("release", cmd_release, "give a claimed execution environment back",
                listing=True)
    p.add_argument("replica_id")
    p = command("reap", cmd_reap, "delete idle, stale and stuck replicas now", listing=True)
    p.add_argument("--idle-timeout", type=float, metavar="S",
                   help="reap replicas idle at least S seconds (instead of each function's)")
    p.add_argument("--wait", action="store_true", help="wait for the pass and report it")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
