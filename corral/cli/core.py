"""Core commands: ``db``, ``nodes``, ``functions``, ``spawn``, ``delete``, ``scale``,
``replicas`` and ``ops``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from config.settings import Settings
from corral import api
from corral.cli._output import emit, kv, table, wait_and_report
from workers.base.errors import InputError
from workers.functions import FunctionSpec, parse_pairs, spec_from, spec_from_toml

# -- db ----------------------------------------------------------------------------------------


def cmd_db_upgrade(args: argparse.Namespace, settings: Settings) -> int:
    """Migrate the database to the newest schema."""
    done = api.upgrade_db(settings=settings)
    if done["before"] == done["after"]:
        print(f"{done['database']}: already at revision {done['after']}")
    else:
        print(f"{done['database']}: migrated {done['before'] or 'empty'} -> {done['after']}")
    return 0


def cmd_db_check(args: argparse.Namespace, settings: Settings) -> int:
    """Recount node, function and GPU counters from the replica rows (exit 1 on drift)."""
    found = api.check_db(fix=args.fix, settings=settings)
    drifts, checked = found.drifts, found.checked
    if args.json:
        emit(
            args,
            {
                "checked": checked,
                "drift": [d.as_dict() for d in drifts],
                "fixed": bool(drifts) and args.fix,
            },
            kv,
        )
    elif not drifts:
        print(
            f"counters agree with the replica rows ({checked['nodes']} nodes, "
            f"{checked['functions']} functions, {checked['gpus']} GPUs)"
        )
    else:
        for d in drifts:
            print(d.message)
        print(
            f"fixed {len(drifts)} counter(s)"
            if args.fix
            else f"{len(drifts)} counter(s) disagree; `corral db check --fix` sets them to the "
            "rows' values"
        )
    return 0 if not drifts or args.fix else 1


# -- nodes -------------------------------------------------------------------------------------

NODE_COLUMNS = [
    "name",
    "kind",
    "address",
    "live",
    "capacity",
    "healthy",
    "draining",
    "quarantined",
    "repointed",
    "last_error",
]


def cmd_nodes_add(args: argparse.Namespace, settings: Settings) -> int:
    """Add (or update) a node."""
    saved = api.add_node(
        args.address,
        name=args.name,
        kind=args.kind,
        capacity=args.capacity,
        replica_networks=args.replica_network,
        settings=settings,
    )
    emit(
        args,
        saved.view,
        lambda v: (
            f"{'added' if saved.created else 'updated'} node {v['name']} at {v['address']}"
            + (f" (resolved from {v['resolved_from']})" if "resolved_from" in v else "")
            + f" ({v['kind']}, capacity {v['capacity']})"
        ),
    )
    return 0


def cmd_nodes_list(args: argparse.Namespace, settings: Settings) -> int:
    """List nodes."""
    emit(args, api.nodes(settings=settings), lambda r: table(r, NODE_COLUMNS))
    return 0


# what ``nodes remove`` and ``gpus remove`` take away, by command group: (noun, API call)
REMOVALS: dict[str, tuple[str, Callable[..., None]]] = {
    "nodes": ("node", api.remove_node),
    "gpus": ("GPU", api.remove_gpu),
}


def cmd_remove(args: argparse.Namespace, settings: Settings) -> int:
    """Remove a node or a GPU that nothing uses."""
    noun, remove = REMOVALS[args.command]
    remove(args.key, settings=settings)
    print(f"removed {noun} {args.key}")
    return 0


def cmd_nodes_drain(args: argparse.Namespace, settings: Settings) -> int:
    """Stop placing replicas on a node."""
    api.drain_node(args.name, undo=args.undo, settings=settings)
    print(f"node {args.name} {'accepts replicas again' if args.undo else 'is draining'}")
    return 0


# -- functions ---------------------------------------------------------------------------------

FUNCTION_COLUMNS = ["name", "backend", "image", "min", "max", "target", "live", "build_version"]
# deploy's options, by the spec field each one fills
DEPLOY_OPTIONS = (
    "image",
    "backend",
    "kernel",
    "initrd",
    "kernel_args",
    "vm_type",
    "cpu",
    "mem",
    "min",
    "max",
    "rootfs",
    "idle_timeout",
    "readiness",
    "exec_envs",
    "gpu_mem",
    "placement",
    "autoscale",
    "scale_to_zero_after",
    "keep_alive",
    "call_attempts",
    "call_max_age",
)


def cmd_functions_deploy(args: argparse.Namespace, settings: Settings) -> int:
    """Create or update a function."""
    saved = api.deploy(_spec(args), settings=settings)
    emit(
        args,
        saved.view,
        lambda v: (
            f"{'deployed' if saved.created else 'updated'} function "
            f"{v['name']} (build {v['build_version']}, {v['backend']}, min {v['min']}, "
            f"max {v['max']})"
        ),
    )
    return 0


def _spec(args: argparse.Namespace) -> FunctionSpec:
    """The function ``deploy`` asks for: from ``--file``, or from NAME and the options."""
    if args.file:
        if args.name:
            raise InputError("give either NAME with options or --file, not both")
        return spec_from_toml(Path(args.file))
    if not args.name:
        raise InputError("a function NAME (or --file FILE) is required")
    fields: dict[str, Any] = {
        "name": args.name,
        **{option: getattr(args, option) for option in DEPLOY_OPTIONS},
        "labels": parse_pairs(args.label, "label"),
        "env": parse_pairs(args.env, "env"),
        "ports": args.port,
        **_aws_keys(args),
    }
    return spec_from(**{k: v for k, v in fields.items() if v is not None})


def _aws_keys(args: argparse.Namespace) -> dict[str, str | None]:
    """The function's AWS keys from a file, the environment or (discouraged) argv."""
    key_id, secret = args.aws_access_key_id, args.aws_secret_access_key
    if secret is not None:
        print(
            "corral: warning: --aws-secret-access-key shows the key to anyone who can run "
            "ps; prefer --aws-secret-access-key-file or --aws-keys-from-env",
            file=sys.stderr,
        )
    if args.aws_secret_access_key_file:
        secret = _read_secret(args.aws_secret_access_key_file)
    if args.aws_keys_from_env:
        key_id = key_id or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = secret or os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not key_id or not secret:
            raise InputError("--aws-keys-from-env: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    return {"aws_access_key_id": key_id, "aws_secret_access_key": secret}


def _read_secret(path: str) -> str:
    """The secret access key in ``--aws-secret-access-key-file``."""
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise InputError(f"cannot read --aws-secret-access-key-file: {exc.strerror}") from None
    if not secret:
        raise InputError("--aws-secret-access-key-file is empty")
    return secret


def cmd_functions_list(args: argparse.Namespace, settings: Settings) -> int:
    """List functions."""
    emit(args, api.functions(settings=settings), lambda r: table(r, FUNCTION_COLUMNS))
    return 0


def cmd_functions_show(args: argparse.Namespace, settings: Settings) -> int:
    """Show one function."""
    emit(args, api.function(args.name, secrets=args.show_secrets, settings=settings), kv)
    return 0


def cmd_functions_remove(args: argparse.Namespace, settings: Settings) -> int:
    """Remove a function (with --force, delete its replicas first)."""
    deleted = api.remove_function(
        args.name, force=args.force, timeout=args.timeout, settings=settings
    )
    print(f"removed function {args.name}" + (f" and {deleted} replica(s)" if deleted else ""))
    return 0


# -- operations --------------------------------------------------------------------------------

REPLICA_COLUMNS = ["id", "function", "node", "status", "vmid", "address", "error"]
OPERATION_COLUMNS = ["id", "kind", "status", "total", "done", "failed", "created_at", "error"]


def cmd_spawn(args: argparse.Namespace, settings: Settings) -> int:
    """Add replicas."""
    return wait_and_report(args, settings, api.spawn(args.name, args.n, settings=settings))


def cmd_delete(args: argparse.Namespace, settings: Settings) -> int:
    """Delete one replica."""
    return wait_and_report(args, settings, api.delete(args.replica_id, settings=settings))


def cmd_scale(args: argparse.Namespace, settings: Settings) -> int:
    """Set a function's replica target."""
    return wait_and_report(args, settings, api.scale(args.name, args.target, settings=settings))


def cmd_replicas(args: argparse.Namespace, settings: Settings) -> int:
    """List replicas (or show one)."""
    if getattr(args, "rep_cmd", None) == "show":
        emit(args, api.replica(args.replica_id, settings=settings), kv)
        return 0
    rows = api.replicas(args.function, all=args.all, settings=settings)
    emit(args, rows, lambda r: table(r, REPLICA_COLUMNS))
    return 0


def cmd_ops(args: argparse.Namespace, settings: Settings) -> int:
    """List operations (or show one)."""
    if args.op_id:
        emit(args, api.operation(args.op_id, settings=settings), kv)
        return 0
    emit(args, api.operations(args.limit, settings=settings), lambda r: table(r, OPERATION_COLUMNS))
    return 0
