"""Maintenance on demand: ``reap`` and ``reconcile`` (beat runs both on a schedule).

Each asks a worker for one pass and prints the operation id, or with ``--wait``
what the pass did: for ``reap``, what it deleted and why (exit 1 if it was
skipped or a VM could not be released) and which stalled operations it sent
again; for ``reconcile``, the orphans it
destroyed, the rows whose VM vanished, and the spawns it asked for to keep
functions at their min.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from config.settings import Settings
from corral import api
from corral.api import OperationView
from corral.cli._output import emit, table


def _reap_text(view: OperationView) -> str:
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
        lines.append(
            table(
                deleted, ["replica_id", "function", "reason", "detail", "node", "outcome", "error"]
            )
        )
    if report.get("claims_expired"):
        lines.append(f"gave back {report['claims_expired']} expired claim(s)")
    kept = report.get("kept_for_min") or {}
    if kept:
        lines.append("kept for min: " + ", ".join(f"{k}={v}" for k, v in sorted(kept.items())))
    for name, op in sorted((report.get("replacements") or {}).items()):
        lines.append(f"replacing stale replicas of {name}: {op}")
    for op_id, outcome in sorted((report.get("redriven") or {}).items()):
        lines.append(f"operation {op_id} stopped moving: {outcome}")
    if report.get("more"):
        lines.append("note: the batch limit was reached; the next pass continues")
    return "\n".join(lines)


def _reconcile_text(view: OperationView) -> str:
    report = view.get("result") or {}
    if report.get("skipped"):
        return "reconcile pass skipped: another pass holds the lease"
    lines = [
        f"checked {len(report.get('nodes_checked', []))} node(s): "
        f"{len(report.get('orphans_destroyed', []))} orphan VM(s) destroyed, "
        f"{report.get('orphans_waiting', 0)} too young to judge, "
        f"{len(report.get('vanished', []))} replica(s) whose VM vanished marked dead, "
        f"{len(report.get('drained', []))} moved off draining nodes"
    ]
    for vm in report.get("orphans_destroyed", []):
        lines.append(f"  destroyed orphan {vm}")
    for name in report.get("nodes_unlistable", []):
        lines.append(f"  node {name} cannot list its VMs (no ListReplicas / GET /vms): skipped")
    for name, error in sorted((report.get("node_errors") or {}).items()):
        lines.append(f"  node {name}: {error}")
    for name, op in sorted((report.get("spawned") or {}).items()):
        lines.append(f"  {name} below its min: spawn {op}")
    return "\n".join(lines)


def _run(
    args: argparse.Namespace, settings: Settings, op_id: str, text: Callable[[OperationView], str]
) -> int:
    if not args.wait:
        print(json.dumps({"operation": op_id}) if args.json else op_id)
        return 0
    view = api.wait(op_id, timeout=args.timeout, settings=settings)
    emit(args, view, text)
    if view["error"] and not args.json:
        print(f"corral: error: {view['error']}", file=sys.stderr)
    return 0 if view["status"] == "succeeded" else 1


def cmd_reap(args: argparse.Namespace, settings: Settings) -> int:
    """Run one reaper pass now."""
    return _run(args, settings, api.reap(args.idle_timeout, settings=settings), _reap_text)


def cmd_reconcile(args: argparse.Namespace, settings: Settings) -> int:
    """Run one reconcile pass now."""
    return _run(args, settings, api.reconcile(settings=settings), _reconcile_text)
