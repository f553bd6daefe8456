"""``corral gateway``: serve functions over HTTP at ``/function/NAME[/PATH]`` (and asynchronous
calls at ``/async-function/NAME[/PATH]``, their answers at ``/calls/ID``).

Listens on ``--listen`` (default ``CORRAL_GATEWAY_LISTEN``, 127.0.0.1:8080). A
non-loopback address needs ``CORRAL_GATEWAY_TOKEN`` (callers then send
``Authorization: Bearer <token>``) or ``--insecure``.

The gateway asks for work through the Celery queue, with a few threads of its own on
which a cold start's spawn is carried out here (:class:`tasks.queues.HereFirst`);
asynchronous calls are sent to ``corral.invocations`` (:data:`tasks.invocations.CALLS`).
"""

from __future__ import annotations

import argparse
import logging

from config.settings import Settings
from corral import api
from tasks.invocations import CALLS
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from workers.gateway import run_gateway


def cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the invocation gateway until SIGINT / SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    api.database(settings)  # refuse an un-migrated store before listening
    run_gateway(
        settings,
        args.listen,
        queue=HereFirst(QUEUE),
        calls=CALLS,
        insecure=args.insecure,
        on_ready=lambda url, plane: print(
            f"gateway listening on {url}\ndata plane: {plane}", flush=True
        ),
    )
    return 0
