"""Long-running commands: ``registry``, ``metrics``, ``agent`` (reference agents), ``up``."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from config.settings import Settings
from tasks.cli._output import Command, integer


def cmd_registry(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the registry until SIGINT / SIGTERM."""
    from tasks.api import database
    from workers.registry.service import check_listen, serve_registry

    if not args.insecure:
        check_listen(settings, args.listen)  # refuse before anything else is said
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    database(settings)  # refuse an un-migrated store before listening
    running = serve_registry(settings, args.listen, insecure=args.insecure)
    print(f"registry listening on {args.listen or settings.registry_listen}", flush=True)
    _until_signalled()
    running.stop(2.0)
    return 0


def cmd_metrics(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the control plane's Prometheus metrics until SIGINT / SIGTERM."""
    from tasks.api import database
    from workers.metrics import serve
    from workers.redis_client import redis_client

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    running = serve(database(settings), redis_client(settings.broker_url),
                    args.listen or settings.metrics_listen, token=settings.metrics_token,
                    insecure=args.insecure)
    print(f"metrics at {running.url}", flush=True)
    _until_signalled()
    running.stop()
    return 0


def _until_signalled() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def cmd_agent(args: argparse.Namespace, settings: Settings) -> int:
    """Run a reference agent (fcdaemon, lambdo or gpus)."""
    from agents.__main__ import main as agent_main

    return agent_main([args.kind, *args.rest])


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    """Run the whole stack in the foreground."""
    from stack.up import AlreadyRunning, UpOptions, run
    from workers.errors import CorralError

    state_dir = Path(args.state_dir) if args.state_dir else settings.state_dir
    try:
        return run(UpOptions(state_dir=state_dir, agents=not args.no_agents,
                             worker_concurrency=args.concurrency))
    except AlreadyRunning as exc:
        raise CorralError(str(exc)) from None


def register(sub: Any, command: Command) -> None:
    """Add the long-running commands to the ``corral`` parser."""
    p = command("registry", cmd_registry, "serve the registry (resmngr, mngrinfo) over gRPC")
    p.add_argument("--listen", help="HOST:PORT (default CORRAL_REGISTRY_LISTEN, 127.0.0.1:50052; "
                   "off loopback needs CORRAL_REGISTRY_TOKEN)")
    p.add_argument("--insecure", action="store_true",
                   help="listen off loopback without a token (logs a warning at every start)")
    p = command("metrics", cmd_metrics, "serve the control plane's Prometheus metrics")
    p.add_argument("--listen", help="HOST:PORT (default CORRAL_METRICS_LISTEN, 127.0.0.1:9808)")
    p.add_argument("--insecure", action="store_true",
                   help="allow an address off loopback without CORRAL_METRICS_TOKEN")
    p = command("agent", cmd_agent, "run a reference agent: fcdaemon, lambdo or gpus")
    p.add_argument("kind", choices=["fcdaemon", "lambdo", "gpus"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the agent's own options")
    p = command("up", cmd_up, "run broker, store, registry, worker, beat, Flower and agents")
    p.add_argument("--state-dir", help="where data and logs live (default .corral)")
    p.add_argument("--no-agents", action="store_true", help="run the control plane alone")
    p.add_argument("--concurrency", type=integer, default=2, help="worker processes (default 2)")
