"""``corral worker``: a Celery worker under its supervisor, in a module of its own.

The supervisor (:mod:`stack.worker`) stays small and outside the worker: it loads no
Celery, no store and no agent client, only what keeps the worker's hard time limits.
"""

from __future__ import annotations

import argparse

from config.settings import Settings
from stack.worker import supervise


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    """Run ``celery -A workers worker OPTIONS`` under the supervisor until it ends."""
    return supervise(args.options)
