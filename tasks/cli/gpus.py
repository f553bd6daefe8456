"""GPU and interference commands: ``gpus add|list|remove`` and ``hogs start|stop``.

``gpus add HOST[:PORT]`` asks a GPU server's AvA manager for its GPUs
(``gpuresc.GPUResc``, port 50053 by default) and records them with their memory,
worker slots and worker ports; ``gpus list`` shows what replicas hold of each.
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
from tasks.cli._output import Command, emit, integer, table

GPU_COLUMNS = ["server", "uuid", "memory", "slots", "ports", "mngr_addr"]


def _rows(views: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
    from tasks.api import database
    from workers.fleet.gpus import add_gpu_server, gpu_view, server_address

    gpus = add_gpu_server(database(settings), settings, args.address, mngr_addr=args.manager)
    views = [gpu_view(g) for g in gpus]
    server = server_address(args.address)
    emit(args, views, lambda v: f"GPU server {server}: {len(v)} GPU(s)\n"
         + table(_rows(v), GPU_COLUMNS))
    return 0


def cmd_gpus_list(args: argparse.Namespace, settings: Settings) -> int:
    """List recorded GPUs with memory and slots in use."""
    from tasks.api import database
    from workers.fleet.gpus import gpu_view, list_gpus

    with database(settings).read() as s:
        views = [gpu_view(g) for g in list_gpus(s)]
    emit(args, views, lambda v: table(_rows(v), GPU_COLUMNS))
    return 0


def cmd_gpus_remove(args: argparse.Namespace, settings: Settings) -> int:
    """Forget a GPU no live replica uses."""
    from tasks.api import database
    from workers.fleet.gpus import remove_gpu

    with database(settings).transaction() as s:
        remove_gpu(s, args.uuid)
    print(f"removed GPU {args.uuid}")
    return 0


def cmd_hogs(args: argparse.Namespace, settings: Settings) -> int:
    """Start or stop CPU hogs; with ``--wait`` report each node's outcome."""
    from tasks import api

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


def register(sub: Any, command: Command) -> None:
    """Add the ``gpus`` and ``hogs`` commands to the ``corral`` parser."""
    gpus = sub.add_parser("gpus", help="GPU servers and their GPUs").add_subparsers(
        dest="gpus_cmd", required=True)
    p = command("add", cmd_gpus_add, "record (or refresh) a GPU server's GPUs", gpus,
                listing=True)
    p.add_argument("address", help="HOST[:PORT] of the AvA manager's GPUResc (port 50053)")
    p.add_argument("--manager", help="HOST[:PORT] guests reach the AvA manager at "
                   "(default HOST:CORRAL_GPU_MANAGER_PORT)")
    command("list", cmd_gpus_list, "list GPUs: memory and slots in use", gpus, listing=True)
    p = command("remove", cmd_gpus_remove, "forget a GPU no replica uses", gpus)
    p.add_argument("uuid")

    hogs = sub.add_parser("hogs", help="CPU-hog processes on node agents").add_subparsers(
        dest="hog_action", required=True)
    for action, text in (("start", "start N busy-loop processes on each node"),
                         ("stop", "stop up to N busy-loop processes on each node")):
        p = command(action, cmd_hogs, text, hogs)
        p.add_argument("n", type=integer, metavar="N")
        p.add_argument("--node", help="only this node (default: every healthy agent)")
        p.add_argument("--wait", action="store_true", help="wait and report each node")
        p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait")
        p.add_argument("--json", action="store_true", help="print one JSON document")
