"""``python -m workers.command worker|beat [OPTIONS]``: Celery's own commands on corral's app.

``celery -A workers worker`` first builds Celery's whole command line: every subcommand, and
every plugin an installed package registers under ``celery.commands`` - Flower's, which
loads Tornado and Prometheus's client, and the ``shell`` and ``amqp`` commands, which load
prompt_toolkit - before it finds the app. That is some 0.2-0.4 CPU-seconds of imports in
each worker and beat process that none of them uses, paid again at every restart (a
worker killed at a hard limit is started again by its supervisor, :mod:`stack.worker`).

This runs the same click commands (:mod:`celery.bin.worker`, :mod:`celery.bin.beat`) on
the app of :mod:`workers.celery`, set up the way Celery's umbrella command sets them up:
the same options and defaults, the same ``CELERY_WORKER_*`` / ``CELERY_BEAT_*``
environment variables, the app's own user options. ``celery -A workers worker`` still
works and does the same; this is only the shorter way there.

One thing more: the garbage collector is paused while the process imports what it runs -
the app, the tasks, Celery's machinery, some 1,100 modules whose objects all live as long
as the process, and which the collections during the imports walked again and again
(0.2 of 1.8 CPU-seconds) - and once that is done, before a prefork pool forks, every
object it holds is moved out of the collector's reach (:func:`gc.freeze`) and collection
resumes. Without the freeze each full collection walks them all again, and so does the
last one at exit: some 0.3 s of a warm shutdown went to it.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from config import lazy

if TYPE_CHECKING:
    import click

USAGE = "usage: python -m workers.command worker|beat [OPTIONS]"


#: Celery's click command of each name, each module imported only for its command
COMMANDS = {"worker": "celery.bin.worker:worker", "beat": "celery.bin.beat:beat"}


def _freeze(**_: Any) -> None:
    """Leave what the process has loaded so far out of every garbage collection; collect on."""
    gc.freeze()
    gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``worker`` or ``beat`` with ``argv``'s options on the app; exits with its status.

    As on Celery's own command line, a bad option is a usage error (status 2); a bad
    setting is one line naming it (status 1).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    name = args[0]
    gc.disable()  # until the process has loaded what it runs (_freeze)
    command: click.Command = lazy.attribute(COMMANDS[name])
    from celery import signals
    from celery.bin.base import CLIContext

    from config.settings import ConfigError

    try:
        from workers.celery import app  # the app is built from the settings
    except ConfigError as exc:  # one line, as the corral command says it
        print(f"corral {name}: error: {exc}", file=sys.stderr)
        return 1

    signals.worker_init.connect(_freeze, weak=False)
    signals.beat_init.connect(_freeze, weak=False)
    command.params.extend(app.user_options.get(name, []))
    command.main(  # click's standalone mode: exits with the command's status
        args=args[1:],
        prog_name=f"celery -A workers {name}",
        obj=CLIContext(app=app, no_color=None, workdir=None, quiet=False),
        # what Celery's umbrella command gives its subcommands (auto_envvar_prefix
        # "CELERY", and click adds the subcommand's name)
        auto_envvar_prefix=f"CELERY_{name.upper()}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
