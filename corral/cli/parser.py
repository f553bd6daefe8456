"""What the ``corral`` command line accepts: every command, its arguments and its handler.

A handler is named, not imported: ``"core:cmd_spawn"`` is ``cmd_spawn`` in
:mod:`corral.cli.core`, imported only when that command runs (:class:`Deferred`). The
handler modules load the settings, the store and the producer API: a ``corral --help``
or a usage error needs none of that, and this module imports only argparse.

Given the command line, :func:`build_parser` builds in full only the parser of the
command it names; every other command gets its name and help, which is all
``corral --help`` and an "invalid choice" error show (:class:`_Unbuilt` takes and
drops its arguments). Building every command's arguments was most of ``--help``'s time.
Commands appear in ``corral --help`` in the order the ``_add_*`` steps below add them.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence

from workers.base.kinds import NODE_KINDS, NodeKind

# typing is for mypy only here: importing it is a twentieth of what `corral --help` costs.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from config.settings import Settings

Handler = Callable[[argparse.Namespace, "Settings"], int]
#: a command that runs another program with its own settings (an agent, the worker's
#: supervisor) takes none: the settings are not loaded for it (pydantic: some 0.15 s)
BareHandler = Callable[[argparse.Namespace], int]


def integer(text: str) -> int:
    """An argparse type: an integer, with a clear message otherwise."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


class Deferred:
    """A command's handler, ``"MODULE:FUNCTION"`` in :mod:`corral.cli`, imported when called
    (:func:`config.lazy.attribute`), and given the settings unless it takes none."""

    def __init__(self, name: str, *, settings: bool = True) -> None:
        self.name = name
        self.settings = settings

    def __call__(self, args: argparse.Namespace) -> int:
        """Import the handler's module, load the settings if it takes them, and run it."""
        from config import lazy  # here: `corral --help` and a usage error run no handler

        if not self.settings:
            bare: BareHandler = lazy.attribute(f"corral.cli.{self.name}")
            return bare(args)
        from config.settings import get_settings

        run: Handler = lazy.attribute(f"corral.cli.{self.name}")
        return run(args, get_settings())


@functools.cache
def _columns() -> int:
    """The width argparse wraps help at: ``COLUMNS``, else the terminal's, else 80; less 2."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):  # no stdout, or not a terminal
            columns = 0
    return (columns or 80) - 2


class Formatter(argparse.HelpFormatter):
    """argparse's help formatter, the terminal's width asked once.

    argparse makes a formatter for every argument it adds (to check its ``nargs``), and
    each one asks the terminal for its size through :mod:`shutil` (whose import alone
    costs ``corral --help`` a twentieth of its time): :func:`_columns` asks once, as
    ``shutil.get_terminal_size`` would.
    """

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        super().__init__(prog, indent_increment, max_help_position, width or _columns())


class Commands:
    """Adds commands to one parser level: each with its handler's name and, if a listing, --json.

    With ``only`` set, a top-level command of another name gets its name and help and no
    parser of its own arguments (an :class:`_Unbuilt` stands in for it).
    """

    def __init__(self, sub: Any, only: str | None = None) -> None:
        self.sub = sub
        self.only = only

    def _skip(self, name: str) -> bool:
        return self.only is not None and name != self.only

    def add(  # noqa: PLR0913 - options by name
        self,
        name: str,
        handler: str,
        help: str,
        *,
        listing: bool = False,
        wraps: bool = False,
        settings: bool = True,
    ) -> argparse.ArgumentParser:
        """A new command ``name`` run by ``handler``.

        ``wraps``: the command passes every argument (``-h`` too) on to the program it wraps.
        ``settings=False``: the handler takes none (:data:`BareHandler`), and none are loaded.
        """
        if self._skip(name):
            self.sub.add_parser(name, help=help, formatter_class=Formatter)
            unbuilt: argparse.ArgumentParser = _unbuilt()
            return unbuilt
        p: argparse.ArgumentParser = self.sub.add_parser(
            name,
            help=help,
            description=help,
            formatter_class=Formatter,
            # no option of its own: "-c 4" is the wrapped program's, not an unknown one
            **({"prefix_chars": "+", "add_help": False} if wraps else {}),
        )
        p.set_defaults(handler=Deferred(handler, settings=settings))
        if listing:
            p.add_argument("--json", action="store_true", help="print one JSON document")
        return p

    def group(self, name: str, help: str, dest: str) -> Commands:
        """A command with sub-commands (``corral nodes list``...)."""
        if self._skip(name):
            self.sub.add_parser(name, help=help, formatter_class=Formatter)
            unbuilt: Commands = _unbuilt()
            return unbuilt
        parser = self.sub.add_parser(name, help=help, formatter_class=Formatter)
        return Commands(parser.add_subparsers(dest=dest, required=True))


class _Unbuilt:
    """The parser of a command not on this command line: takes its arguments and drops them."""

    def __getattr__(self, name: str) -> Callable[..., _Unbuilt]:
        return self._drop

    def _drop(self, *args: Any, **kwargs: Any) -> _Unbuilt:
        return self


def _unbuilt() -> Any:
    """An :class:`_Unbuilt`, standing in for a parser or a level of commands."""
    return _Unbuilt()


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of every ``corral`` command; given ``argv``, only its command in full."""
    parser = argparse.ArgumentParser(
        prog="corral",
        description="Control plane for serverless microVM fleets.",
        formatter_class=Formatter,
    )
    named = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    top = Commands(
        parser.add_subparsers(dest="command", required=True, metavar="COMMAND"), only=named
    )
    for add in (
        _add_db,
        _add_nodes,
        _add_functions,
        _add_operations,
        _add_inspection,
        _add_claims,
        _add_calls,
        _add_maintenance,
        _add_gpus,
        _add_hogs,
        _add_services,
        _add_gateway,
    ):
        add(top)
    return parser


def _add_db(top: Commands) -> None:
    db = top.group("db", "database schema", "db_cmd")
    db.add("upgrade", "core:cmd_db_upgrade", "migrate the database to the newest schema")
    p = db.add(
        "check",
        "core:cmd_db_check",
        "recount node, function and GPU counters from the replica rows",
        listing=True,
    )
    p.add_argument("--fix", action="store_true", help="set drifted counters to the rows' values")


def _add_nodes(top: Commands) -> None:
    nodes = top.group("nodes", "node agents and Lambdo hosts", "nodes_cmd")
    p = nodes.add("add", "core:cmd_nodes_add", "add or update a node", listing=True)
    p.add_argument(
        "address",
        help="HOST:PORT of an fcdaemon agent, or http://HOST:PORT of Lambdo (a host name is "
        "resolved once, now: the node is stored at the IP)",
    )
    p.add_argument("--name")
    p.add_argument("--kind", choices=NODE_KINDS, default=NodeKind.FCDAEMON.value)
    p.add_argument("--capacity", type=integer, help="most live replicas on this node")
    p.add_argument(
        "--replica-network",
        action="append",
        metavar="CIDR",
        help="a network its replicas' addresses may be in (repeatable; default: the "
        "node's own host, for fcdaemon also CORRAL_REPLICA_NETWORKS)",
    )
    nodes.add("list", "core:cmd_nodes_list", "list nodes", listing=True)
    p = nodes.add("remove", "core:cmd_remove", "remove a node that runs no replicas")
    p.add_argument("key", metavar="name")
    p = nodes.add("drain", "core:cmd_nodes_drain", "stop placing replicas on a node")
    p.add_argument("name")
    p.add_argument("--undo", action="store_true", help="accept replicas again")


def _add_functions(top: Commands) -> None:
    fns = top.group("functions", "deployable functions", "fn_cmd")
    _deploy_options(
        fns.add("deploy", "core:cmd_functions_deploy", "create or update a function", listing=True)
    )
    fns.add("list", "core:cmd_functions_list", "list functions", listing=True)
    p = fns.add("show", "core:cmd_functions_show", "show a function", listing=True)
    p.add_argument("name")
    p.add_argument(
        "--show-secrets",
        action="store_true",
        help="show env values and --env= kernel arguments in clear (masked by default)",
    )
    p = fns.add("remove", "core:cmd_functions_remove", "remove a function")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="delete its replicas first")
    p.add_argument("--timeout", type=float, default=120.0)


def _deploy_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?")
    p.add_argument("--file", help="a TOML file describing the function")
    p.add_argument("--image", help="the image to run (a lambdo function defaults to its --rootfs)")
    p.add_argument("--backend", choices=NODE_KINDS)
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
    p.add_argument(
        "--call-attempts",
        type=integer,
        metavar="N",
        help="attempts of one asynchronous call (default CORRAL_CALLS_MAX_ATTEMPTS)",
    )
    p.add_argument(
        "--call-max-age",
        type=float,
        metavar="S",
        help="no attempt of an asynchronous call starts later than S seconds after it was "
        "accepted (default CORRAL_CALLS_MAX_AGE_S)",
    )
    p.add_argument(
        "--autoscale",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let the autoscaler set the replica target from gateway demand",
    )
    p.add_argument(
        "--scale-to-zero-after",
        type=float,
        metavar="S",
        help="with --autoscale: go to zero after S seconds without requests "
        "(0: never, the default)",
    )
    p.add_argument(
        "--keep-alive",
        choices=["fixed", "adaptive"],
        help="how long idle replicas stay: fixed (--idle-timeout, the default) or "
        "adaptive (pre-warm and keep-alive windows learnt from the function's "
        "idle times)",
    )
    p.add_argument("--aws-access-key-id")
    aws = p.add_mutually_exclusive_group()
    aws.add_argument("--aws-secret-access-key", help="discouraged: argv is visible in ps")
    aws.add_argument(
        "--aws-secret-access-key-file",
        metavar="PATH",
        help="read the secret access key from this file",
    )
    p.add_argument(
        "--aws-keys-from-env",
        action="store_true",
        help="take AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from the environment",
    )


def _waiting(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", action="store_true", help="wait for the outcome")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def _add_operations(top: Commands) -> None:
    p = top.add("spawn", "core:cmd_spawn", "add replicas of a function")
    p.add_argument("name")
    p.add_argument("-n", type=integer, default=1, help="how many (default 1)")
    _waiting(p)
    p = top.add("delete", "core:cmd_delete", "delete a replica")
    p.add_argument("replica_id")
    _waiting(p)
    p = top.add("scale", "core:cmd_scale", "set a function's replica target")
    p.add_argument("name")
    p.add_argument("target", type=integer)
    _waiting(p)


def _add_inspection(top: Commands) -> None:
    p = top.add("replicas", "core:cmd_replicas", "list replicas", listing=True)
    p.add_argument("--function")
    p.add_argument("--all", action="store_true", help="include dead and deleted replicas")
    rep = p.add_subparsers(dest="rep_cmd", required=False)
    q = rep.add_parser("show", help="show one replica", formatter_class=Formatter)
    q.add_argument("replica_id")
    q.add_argument("--json", action="store_true")

    p = top.add("ops", "core:cmd_ops", "list operations (or show one)", listing=True)
    p.add_argument("op_id", nargs="?")
    p.add_argument("--limit", type=integer, default=50)


def _add_claims(top: Commands) -> None:
    p = top.add(
        "claim",
        "claims:cmd_claim",
        "take one execution environment of an idle replica",
        listing=True,
    )
    p.add_argument("name")
    p.add_argument(
        "--cold-start-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="with nothing idle, wait up to S seconds for a new replica",
    )
    p.add_argument(
        "--ttl",
        type=float,
        default=None,
        metavar="S",
        help="the claim expires after S seconds (default CORRAL_CLAIM_TTL_S)",
    )
    p = top.add(
        "release", "claims:cmd_release", "give a claimed execution environment back", listing=True
    )
    p.add_argument("claim_id")


def _add_calls(top: Commands) -> None:
    p = top.add(
        "calls",
        "calls:cmd_calls",
        "list asynchronous calls (or show, redrive or purge them)",
        listing=True,
    )
    p.add_argument("--function", help="only this function's calls")
    p.add_argument("--status", choices=["queued", "running", "retrying", "succeeded", "dead"])
    p.add_argument("--limit", type=integer, default=50)
    sub = p.add_subparsers(dest="calls_cmd", required=False)
    q = sub.add_parser("show", help="show one call and its answer", formatter_class=Formatter)
    q.add_argument("call_id")
    q.add_argument("--json", action="store_true", help="print one JSON document")
    q = sub.add_parser(
        "redrive", help="queue dead calls again (a fresh budget)", formatter_class=Formatter
    )
    q.add_argument("ids", nargs="*", metavar="CALL_ID")
    q.add_argument("--function", dest="redrive_function", help="every dead call of a function")
    q.add_argument("--all", action="store_true", help="every dead call")
    q.add_argument("--json", action="store_true", help="print one JSON document")
    q = sub.add_parser("purge", help="delete finished calls", formatter_class=Formatter)
    q.add_argument(
        "--older-than",
        type=float,
        metavar="S",
        help="finished at least S seconds ago (default CORRAL_CALLS_KEEP_S)",
    )
    q.add_argument("--json", action="store_true", help="print one JSON document")


def _add_maintenance(top: Commands) -> None:
    p = top.add(
        "reap", "maintenance:cmd_reap", "delete idle, stale and stuck replicas now", listing=True
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        metavar="S",
        help="reap replicas idle at least S seconds (instead of each function's)",
    )
    p.add_argument("--wait", action="store_true", help="wait for the pass and report it")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    p = top.add(
        "reconcile",
        "maintenance:cmd_reconcile",
        "compare rows with what agents run, fix both, restore mins",
        listing=True,
    )
    p.add_argument("--wait", action="store_true", help="wait for the pass and report it")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")


def _add_gpus(top: Commands) -> None:
    gpus = top.group("gpus", "GPU servers and their GPUs", "gpus_cmd")
    p = gpus.add(
        "add", "gpus:cmd_gpus_add", "record (or refresh) a GPU server's GPUs", listing=True
    )
    p.add_argument("address", help="HOST[:PORT] of the AvA manager's GPUResc (port 50053)")
    p.add_argument(
        "--manager",
        help="HOST[:PORT] guests reach the AvA manager at (default HOST:CORRAL_GPU_MANAGER_PORT)",
    )
    gpus.add("list", "gpus:cmd_gpus_list", "list GPUs: memory and slots in use", listing=True)
    p = gpus.add("remove", "core:cmd_remove", "forget a GPU no replica uses")
    p.add_argument("key", metavar="uuid")


def _add_hogs(top: Commands) -> None:
    hogs = top.group("hogs", "CPU-hog processes on node agents", "hog_action")
    for action, text in (
        ("start", "start N busy-loop processes on each node"),
        ("stop", "stop up to N busy-loop processes on each node"),
    ):
        p = hogs.add(action, "gpus:cmd_hogs", text)
        p.add_argument("n", type=integer, metavar="N")
        p.add_argument("--node", help="only this node (default: every healthy agent)")
        p.add_argument("--wait", action="store_true", help="wait and report each node")
        p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait")
        p.add_argument("--json", action="store_true", help="print one JSON document")


def _add_services(top: Commands) -> None:
    p = top.add(
        "registry", "services:cmd_registry", "serve the registry (resmngr, mngrinfo) over gRPC"
    )
    p.add_argument(
        "--listen",
        help="HOST:PORT (default CORRAL_REGISTRY_LISTEN, 127.0.0.1:50052; "
        "off loopback needs CORRAL_REGISTRY_TOKEN)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="listen off loopback without a token (logs a warning at every start)",
    )
    p = top.add("metrics", "services:cmd_metrics", "serve the control plane's Prometheus metrics")
    p.add_argument("--listen", help="HOST:PORT (default CORRAL_METRICS_LISTEN, 127.0.0.1:9808)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow an address off loopback without CORRAL_METRICS_TOKEN",
    )
    p = top.add(
        "worker",
        "worker:cmd_worker",
        "run `celery -A workers worker` under a supervisor that enforces hard time limits",
        wraps=True,
        settings=False,  # the worker loads them; its supervisor needs none
    )
    p.add_argument("options", nargs=argparse.REMAINDER, help="the Celery worker's own options")
    p = top.add(
        "agent",
        "agent:cmd_agent",
        "run a reference agent: fcdaemon, lambdo or gpus",
        settings=False,  # an agent is configured by its own options and variables
    )
    p.add_argument("kind", choices=["fcdaemon", "lambdo", "gpus"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the agent's own options")
    p = top.add(
        "up", "services:cmd_up", "run broker, store, registry, worker, beat, Flower and agents"
    )
    p.add_argument("--state-dir", help="where data and logs live (default .corral)")
    p.add_argument("--no-agents", action="store_true", help="run the control plane alone")
    p.add_argument(
        "--driver",
        choices=["process", "qemu"],
        default="process",
        help="the fcdaemon agent's replicas: processes (default) or QEMU microVMs",
    )
    p.add_argument(
        "--concurrency",
        type=integer,
        default=None,
        help="tasks the worker runs at once (default CORRAL_WORKER_CONCURRENCY, 8)",
    )


def _add_gateway(top: Commands) -> None:
    p = top.add(
        "gateway",
        "gateway:cmd_gateway",
        "serve functions over HTTP at /function/NAME[/PATH] (and /async-function/NAME)",
    )
    p.add_argument("--listen", help="HOST:PORT (default CORRAL_GATEWAY_LISTEN, 127.0.0.1:8080)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback address without CORRAL_GATEWAY_TOKEN",
    )
