"""Long-running commands: ``registry``, ``metrics``, ``up``."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from config.settings import Settings, reveal
from corral.api import database
from netplumb.signals import until_signalled, wait_for
from stack.up import AlreadyRunning, UpOptions, run
from workers.base.errors import CorralError
from workers.base.redis_client import redis_client
from workers.observability.exporter import serve
from workers.registry.service import check_listen, serve_registry


def cmd_registry(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the registry until SIGINT / SIGTERM."""
    if not args.insecure:
        check_listen(settings, args.listen)  # refuse before anything else is said
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    database(settings)  # refuse an un-migrated store before listening
    from tasks.maintenance import QUEUE  # Celery and the tasks: for this command only

    try:
        running = serve_registry(settings, args.listen, queue=QUEUE, insecure=args.insecure)
    except OSError as exc:  # the port is taken, or the address is not this host's
        raise CorralError(f"registry {exc}") from None
    print(f"registry listening on {running.listening}", flush=True)
    _until_signalled()
    running.stop(2.0)
    return 0


def cmd_metrics(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the control plane's Prometheus metrics until SIGINT / SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    listen = args.listen or settings.metrics_listen
    try:
        running = serve(
            database(settings),
            redis_client(settings.broker_url),
            listen,
            token=reveal(settings.metrics_token),
            insecure=args.insecure,
        )
    except OSError as exc:  # the port is taken, or the address is not this host's
        raise CorralError(f"metrics cannot listen on {listen}: {exc.strerror or exc}") from None
    print(f"metrics listening on {running.url}", flush=True)
    _until_signalled()
    running.stop()
    return 0


def _until_signalled() -> None:
    """Block until SIGINT or SIGTERM."""
    with until_signalled() as stop:
        wait_for(stop)


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    """Run the whole stack in the foreground."""
    state_dir = Path(args.state_dir) if args.state_dir else settings.state_dir
    try:
        return run(
            UpOptions(
                state_dir=state_dir,
                agents=not args.no_agents,
                worker_concurrency=args.concurrency,
                driver=args.driver,
            )
        )
    except AlreadyRunning as exc:
        raise CorralError(str(exc)) from None
