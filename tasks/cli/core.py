"""Core commands: ``db``, ``nodes``, ``functions``, ``spawn``, ``delete``, ``scale``,
``replicas`` and ``ops``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from config.settings import Settings
from tasks.cli._output import Command, emit, integer, kv, table, wait_and_report

# -- db ----------------------------------------------------------------------------------------


def cmd_db_upgrade(args: argparse.Namespace, settings: Settings) -> int:
    """Migrate the database to the newest schema."""
    from workers.store.db import get_database
    from workers.store.migrate import safe_url, upgrade

    before, after = upgrade(get_database(settings.database_url))
    where = safe_url(settings.database_url)
    if before == after:
        print(f"{where}: already at revision {after}")
    else:
        print(f"{where}: migrated {before or 'empty'} -> {after}")
    return 0


def cmd_db_check(args: argparse.Namespace, settings: Settings) -> int:
    """Recount node, function and GPU counters from the replica rows (exit 1 on drift)."""
    from tasks.api import database
    from workers.maintenance.audit import audit

    with database(settings).transaction() as s:
        found = audit(s, fix=args.fix)
    drifts, checked = found.drifts, found.checked
    if args.json:
        emit(args, {"checked": checked, "drift": [d.as_dict() for d in drifts],
                    "fixed": bool(drifts) and args.fix}, kv)
    elif not drifts:
        print(f"counters agree with the replica rows ({checked['nodes']} nodes, "
              f"{checked['functions']} functions, {checked['gpus']} GPUs)")
    else:
        for d in drifts:
            print(d.message)
        print(f"fixed {len(drifts)} counter(s)" if args.fix else
              f"{len(drifts)} counter(s) disagree; `corral db check --fix` sets them to the "
              "rows' values")
    return 0 if not drifts or args.fix else 1


# -- nodes -------------------------------------------------------------------------------------


def cmd_nodes_add(args: argparse.Namespace, settings: Settings) -> int:
    """Add (or update) a node."""
    from tasks.api import database
    from workers.fleet.nodes import node_view, upsert_node

    with database(settings).transaction() as s:
        node, created = upsert_node(
            s, args.address, name=args.name, kind=args.kind, capacity=args.capacity,
            default_capacity=settings.node_capacity,
        )
        view = node_view(node)
    emit(args, view, lambda v: f"{'added' if created else 'updated'} node {v['name']} "
          f"({v['kind']} at {v['address']}, capacity {v['capacity']})")
    return 0


def cmd_nodes_list(args: argparse.Namespace, settings: Settings) -> int:
    """List nodes."""
    from sqlalchemy import select

    from tasks.api import database
    from workers.fleet.nodes import node_view
    from workers.store.models import Node

    with database(settings).read() as s:
        rows = [node_view(n) for n in s.scalars(select(Node).order_by(Node.name))]
    emit(args, rows, lambda r: table(
        r, ["name", "kind", "address", "live", "capacity", "healthy", "draining", "quarantined",
            "last_error"]))
    return 0


def cmd_nodes_remove(args: argparse.Namespace, settings: Settings) -> int:
    """Remove a node that runs nothing."""
    from tasks.api import database
    from workers.fleet.nodes import remove_node

    with database(settings).transaction() as s:
        remove_node(s, args.name)
    print(f"removed node {args.name}")
    return 0


def cmd_nodes_drain(args: argparse.Namespace, settings: Settings) -> int:
    """Stop placing replicas on a node."""
    from tasks.api import database
    from workers.fleet.nodes import get_node

    with database(settings).transaction() as s:
        node = get_node(s, args.name)
        node.draining = not args.undo
    print(f"node {args.name} {'accepts replicas again' if args.undo else 'is draining'}")
    return 0


# -- functions ---------------------------------------------------------------------------------


def cmd_functions_deploy(args: argparse.Namespace, settings: Settings) -> int:
    """Create or update a function."""
    from tasks.api import database
    from workers.errors import InputError
    from workers.functions import deploy, function_view, parse_pairs, spec_from, spec_from_toml

    if args.file:
        if args.name:
            raise InputError("give either NAME with options or --file, not both")
        spec = spec_from_toml(Path(args.file))
    else:
        if not args.name:
            raise InputError("a function NAME (or --file FILE) is required")
        fields = {
            "name": args.name,
            "image": args.image,
            "backend": args.backend,
            "kernel": args.kernel,
            "initrd": args.initrd,
            "kernel_args": args.kernel_args,
            "vm_type": args.vm_type,
            "cpu": args.cpu,
            "mem": args.mem,
            "min": args.min,
            "max": args.max,
            "labels": parse_pairs(args.label, "label"),
            "env": parse_pairs(args.env, "env"),
            "rootfs": args.rootfs,
            "ports": args.port,
            "idle_timeout": args.idle_timeout,
            "readiness": args.readiness,
            "exec_envs": args.exec_envs,
            "gpu_mem": args.gpu_mem,
            "placement": args.placement,
            "autoscale": args.autoscale,
            "scale_to_zero_after": args.scale_to_zero_after,
            **_aws_keys(args),
        }
        spec = spec_from(**{k: v for k, v in fields.items() if v is not None})
    with database(settings).transaction() as s:
        fn, created = deploy(s, spec, settings)
        view = function_view(fn)
    emit(args, view, lambda v: f"{'deployed' if created else 'updated'} function {v['name']} "
          f"(build {v['build_version']}, {v['backend']}, min {v['min']}, max {v['max']})")
    return 0


def _aws_keys(args: argparse.Namespace) -> dict[str, str | None]:
    """The function's AWS keys from a file, the environment or (discouraged) argv."""
    from workers.errors import InputError

    key_id, secret = args.aws_access_key_id, args.aws_secret_access_key
    if secret is not None:
        print("corral: warning: --aws-secret-access-key shows the key to anyone who can run "
              "ps; prefer --aws-secret-access-key-file or --aws-keys-from-env", file=sys.stderr)
    if args.aws_secret_access_key_file:
        try:
            secret = Path(args.aws_secret_access_key_file).read_text().strip()
        except OSError as exc:
            raise InputError(f"cannot read --aws-secret-access-key-file: {exc.strerror}") from None
        if not secret:
            raise InputError("--aws-secret-access-key-file is empty")
    if args.aws_keys_from_env:
        key_id = key_id or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = secret or os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not key_id or not secret:
            raise InputError(
                "--aws-keys-from-env: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    return {"aws_access_key_id": key_id, "aws_secret_access_key": secret}


def _function_counts(s: Any) -> dict[str, dict[str, int]]:
    from sqlalchemy import func, select

    from workers.store.models import LIVE_STATES, Replica, ReplicaState

    counts: dict[str, dict[str, int]] = {}
    rows = s.execute(
        select(Replica.function_id, Replica.status, func.count())
        .where(Replica.status.in_(LIVE_STATES))
        .group_by(Replica.function_id, Replica.status)
    )
    for fid, status, n in rows:
        counts.setdefault(fid, {})[ReplicaState(status).label] = n
    return counts


def cmd_functions_list(args: argparse.Namespace, settings: Settings) -> int:
    """List functions."""
    from sqlalchemy import select

    from tasks.api import database
    from workers.functions import function_view
    from workers.store.models import Function

    with database(settings).read() as s:
        counts = _function_counts(s)
        rows = [
            function_view(f, counts.get(f.id, {}))
            for f in s.scalars(select(Function).order_by(Function.name))
        ]
    for row in rows:
        row["live"] = sum(row["replicas"].values())
    emit(args, rows, lambda r: table(
        r, ["name", "backend", "image", "min", "max", "target", "live", "build_version"]))
    return 0


def cmd_functions_show(args: argparse.Namespace, settings: Settings) -> int:
    """Show one function."""
    from tasks.api import database
    from workers.functions import function_view, get_function

    with database(settings).read() as s:
        fn = get_function(s, args.name)
        view = function_view(fn, _function_counts(s).get(fn.id, {}))
    emit(args, view, kv)
    return 0


def cmd_functions_remove(args: argparse.Namespace, settings: Settings) -> int:
    """Remove a function (with --force, delete its replicas first)."""
    from sqlalchemy import select

    from tasks import api
    from workers.errors import InputError
    from workers.functions import get_function
    from workers.store.models import LIVE_STATES, Replica

    db = api.database(settings)
    with db.read() as s:
        fn = get_function(s, args.name)
        live = list(s.scalars(select(Replica.id).where(
            Replica.function_id == fn.id, Replica.status.in_(LIVE_STATES))))
    if live and not args.force:
        raise InputError(
            f"function {args.name!r} has {len(live)} replica(s); delete them or use --force"
        )
    ops = [api.delete(rid, settings=settings) for rid in live]
    for op_id in ops:
        view = api.wait(op_id, timeout=args.timeout, settings=settings)
        if view["status"] != "succeeded":
            raise InputError(f"could not delete a replica of {args.name}: {view['error']}")
    with db.transaction() as s:
        fn = get_function(s, args.name, lock=True)
        still = s.scalar(select(Replica.id).where(
            Replica.function_id == fn.id, Replica.status.in_(LIVE_STATES)).limit(1))
        if still:
            raise InputError(f"function {args.name!r} gained a replica meanwhile; try again")
        s.delete(fn)
    print(f"removed function {args.name}" + (f" and {len(live)} replica(s)" if live else ""))
    return 0


# -- operations --------------------------------------------------------------------------------


def cmd_spawn(args: argparse.Namespace, settings: Settings) -> int:
    """Add replicas."""
    from tasks import api

    return wait_and_report(args, settings, api.spawn(args.name, args.n, settings=settings))


def cmd_delete(args: argparse.Namespace, settings: Settings) -> int:
    """Delete one replica."""
    from tasks import api

    return wait_and_report(args, settings, api.delete(args.replica_id, settings=settings))


def cmd_scale(args: argparse.Namespace, settings: Settings) -> int:
    """Set a function's replica target."""
    from tasks import api

    return wait_and_report(args, settings, api.scale(args.name, args.target, settings=settings))


def cmd_replicas(args: argparse.Namespace, settings: Settings) -> int:
    """List replicas (or show one)."""
    from sqlalchemy import select

    from tasks.api import check_id, database
    from workers.errors import NotFound
    from workers.functions import get_function
    from workers.replicas.views import replica_view
    from workers.store.models import LIVE_STATES, Replica

    with database(settings).read() as s:
        if getattr(args, "rep_cmd", None) == "show":
            replica = s.get(Replica, check_id(args.replica_id, "replica"))
            if replica is None:
                raise NotFound(f"unknown replica {args.replica_id!r}")
            emit(args, replica_view(replica), kv)
            return 0
        query = select(Replica).order_by(Replica.created_at)
        if args.function:
            query = query.where(Replica.function_id == get_function(s, args.function).id)
        if not args.all:
            query = query.where(Replica.status.in_(LIVE_STATES))
        rows = [replica_view(r) for r in s.scalars(query)]
    emit(args, rows, lambda r: table(
        r, ["id", "function", "node", "status", "vmid", "address", "error"]))
    return 0


def cmd_ops(args: argparse.Namespace, settings: Settings) -> int:
    """List operations (or show one)."""
    from tasks.api import database
    from workers.operations import get_operation, list_operations, operation_view

    with database(settings).read() as s:
        if args.op_id:
            emit(args, operation_view(get_operation(s, args.op_id)), kv)
            return 0
        rows = [operation_view(o) for o in list_operations(s, args.limit)]
    emit(args, rows, lambda r: table(
        r, ["id", "kind", "status", "total", "done", "failed", "created_at", "error"]))
    return 0


def register(sub: Any, command: Command) -> None:
    """Add the core commands to the ``corral`` parser."""
    db = sub.add_parser("db", help="database schema").add_subparsers(dest="db_cmd", required=True)
    command("upgrade", cmd_db_upgrade, "migrate the database to the newest schema", db)
    p = command("check", cmd_db_check,
                "recount node, function and GPU counters from the replica rows", db,
                listing=True)
    p.add_argument("--fix", action="store_true", help="set drifted counters to the rows' values")

    nodes = sub.add_parser("nodes", help="node agents and Lambdo hosts").add_subparsers(
        dest="nodes_cmd", required=True)
    p = command("add", cmd_nodes_add, "add or update a node", nodes, listing=True)
    p.add_argument("address", help="HOST:PORT of an fcdaemon agent, or http://HOST:PORT of Lambdo")
    p.add_argument("--name")
    p.add_argument("--kind", choices=["fcdaemon", "lambdo"], default="fcdaemon")
    p.add_argument("--capacity", type=integer, help="most live replicas on this node")
    command("list", cmd_nodes_list, "list nodes", nodes, listing=True)
    p = command("remove", cmd_nodes_remove, "remove a node that runs no replicas", nodes)
    p.add_argument("name")
    p = command("drain", cmd_nodes_drain, "stop placing replicas on a node", nodes)
    p.add_argument("name")
    p.add_argument("--undo", action="store_true", help="accept replicas again")

    fns = sub.add_parser("functions", help="deployable functions").add_subparsers(
        dest="fn_cmd", required=True)
    p = command("deploy", cmd_functions_deploy, "create or update a function", fns, listing=True)
    p.add_argument("name", nargs="?")
    p.add_argument("--file", help="a TOML file describing the function")
    p.add_argument("--image", help="the image to run (a lambdo function defaults to its --rootfs)")
    p.add_argument("--backend", choices=["fcdaemon", "lambdo"])
    p.add_argument("--kernel")
    p.add_argument("--initrd")
    p.add_argument("--kernel-args")
    p.add_argument("--vm-type", choices=["osv", "linux"])
    p.add_argument("--cpu", type=integer)
    p.add_argument("--mem", type=integer, help="memory in MiB")
    p.add_argument("--min", type=integer)
    p.add_argument("--max", type=integer)
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument("--env", action="append", metavar="K=V")
    p.add_argument("--rootfs", help="Lambdo rootfs location (URL)")
    p.add_argument("--port", type=integer, action="append", help="guest port (default 8080)")
    p.add_argument("--idle-timeout", type=float, help="seconds idle before the reaper deletes")
    p.add_argument("--readiness", choices=["agent", "guest"])
    p.add_argument("--exec-envs", type=integer, help="concurrent requests per replica")
    p.add_argument("--gpu-mem", type=integer, help="GPU memory per replica in MB")
    p.add_argument("--placement")
    p.add_argument("--autoscale", action=argparse.BooleanOptionalAction, default=None,
                   help="let the autoscaler set the replica target from gateway demand")
    p.add_argument("--scale-to-zero-after", type=float, metavar="S",
                   help="with --autoscale: go to zero after S seconds without requests "
                        "(0: never, the default)")
    p.add_argument("--aws-access-key-id")
    aws = p.add_mutually_exclusive_group()
    aws.add_argument("--aws-secret-access-key", help="discouraged: argv is visible in ps")
    aws.add_argument("--aws-secret-access-key-file", metavar="PATH",
                     help="read the secret access key from this file")
    p.add_argument("--aws-keys-from-env", action="store_true",
                   help="take AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from the environment")
    command("list", cmd_functions_list, "list functions", fns, listing=True)
    p = command("show", cmd_functions_show, "show a function", fns, listing=True)
    p.add_argument("name")
    p = command("remove", cmd_functions_remove, "remove a function", fns)
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="delete its replicas first")
    p.add_argument("--timeout", type=float, default=120.0)

    def waiting(p: argparse.ArgumentParser) -> None:
        p.add_argument("--wait", action="store_true", help="wait for the outcome")
        p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
        p.add_argument("--json", action="store_true", help="print one JSON document")

    p = command("spawn", cmd_spawn, "add replicas of a function")
    p.add_argument("name")
    p.add_argument("-n", type=integer, default=1, help="how many (default 1)")
    waiting(p)
    p = command("delete", cmd_delete, "delete a replica")
    p.add_argument("replica_id")
    waiting(p)
    p = command("scale", cmd_scale, "set a function's replica target")
    p.add_argument("name")
    p.add_argument("target", type=integer)
    waiting(p)

    p = command("replicas", cmd_replicas, "list replicas", listing=True)
    p.add_argument("--function")
    p.add_argument("--all", action="store_true", help="include dead and deleted replicas")
    rep = p.add_subparsers(dest="rep_cmd", required=False)
    q = rep.add_parser("show", help="show one replica")
    q.add_argument("replica_id")
    q.add_argument("--json", action="store_true")

    p = command("ops", cmd_ops, "list operations (or show one)", listing=True)
    p.add_argument("op_id", nargs="?")
    p.add_argument("--limit", type=integer, default=50)

