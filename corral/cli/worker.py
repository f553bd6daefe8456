"""``corral worker``: a Celery worker under its supervisor, in a module of its own.

The supervisor (:mod:`stack.worker`) stays small and outside the worker: it loads no
Celery, no store, no agent client and no settings (the worker loads them, and says which
one is bad), only what keeps the worker's hard time limits.
"""

from __future__ import annotations

import argparse

from stack.worker import supervise


def cmd_worker(args: argparse.Namespace) -> int:
    """Run ``celery -A workers worker OPTIONS`` under the supervisor until it ends."""
    return supervise(args.options)
