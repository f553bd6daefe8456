"""GPU and interference commands: ``gpus add|list`` and ``hogs start|stop``.

``gpus add HOST[:PORT]`` asks a GPU server's AvA manager for its GPUs
(``gpuresc.GPUResc``, port 50053 by default) and records them with their memory,
worker slots and worker ports; ``gpus list`` shows what replicas hold of each
(``gpus remove`` shares :func:`corral.cli.core.cmd_remove` with ``nodes remove``).
``hogs start N`` / ``hogs stop N`` queue a request for CPU-hog processes on one
node (``--node``) or every healthy agent, and with ``--wait`` report per node
what happened.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from config.settings import Settings
from corral import api
from corral.api import GpuView
from corral.cli._output import emit, table

GPU_COLUMNS = ["server", "uuid", "memory", "slots", "ports", "mngr_addr"]


def _rows(views: list[GpuView]) -> list[dict[str, Any]]:
    return [
        {
            **v,
            "memory": f"{v['mem_used_mb']}/{v['mem_total_mb']} MB",
            "slots": f"{v['slots_used']}/{v['slots_total']}",
        }
        for v in views
    ]


def cmd_gpus_add(args: argparse.Namespace, settings: Settings) -> int:
    """Record (or refresh) the GPUs of a GPU server."""
    views = api.add_gpus(args.address, manager=args.manager, settings=settings)
    server = views[0]["server"] if views else args.address
    emit(
        args,
        views,
        lambda v: f"GPU server {server}: {len(v)} GPU(s)\n" + table(_rows(v), GPU_COLUMNS),
    )
    return 0


def cmd_gpus_list(args: argparse.Namespace, settings: Settings) -> int:
    """List recorded GPUs with memory and slots in use."""
    emit(args, api.gpus(settings=settings), lambda v: table(_rows(v), GPU_COLUMNS))
    return 0


def cmd_hogs(args: argparse.Namespace, settings: Settings) -> int:
    """Start or stop CPU hogs; with ``--wait`` report each node's outcome."""
    op_id = api.hogs(args.hog_action, args.n, args.node, settings=settings)
    if not args.wait:
        print(json.dumps({"operation": op_id}) if args.json else op_id)
        return 0
    view = api.wait(op_id, timeout=args.timeout, settings=settings)
    nodes = (view.get("result") or {}).get("nodes", {})
    if args.json:
        print(json.dumps(view, indent=2, sort_keys=True, default=str))
    else:
        rows = [
            {"node": name, "outcome": o.get("state"), "error": o.get("error")}
            for name, o in sorted(nodes.items())
        ]
        verb = "started" if args.hog_action == "start" else "stopped (up to)"
        print(f"hogs {args.hog_action} {args.n}: operation {op_id} {view['status']}")
        print(table(rows, ["node", "outcome", "error"]))
        ok = sum(1 for r in rows if r["outcome"] == "ok")
        print(f"{verb} {args.n} hog(s) on each of {ok} node(s)")
        if view["error"]:
            print(f"corral: error: {view['error']}", file=sys.stderr)
    return 0 if view["status"] == "succeeded" else 1
