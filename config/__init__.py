"""corral's configuration: typed settings from the environment and the Celery set-up.

:mod:`config.settings` reads ``CORRAL_*`` environment variables (see
:class:`~config.settings.Settings`); when a ``corral up`` stack runs in the working
directory, its state file supplies the addresses it started (broker, database,
registry) for anything the environment does not set. :mod:`config.celery` turns
settings into Celery configuration: queues, routes, the beat schedule and the
reliability options. :mod:`config.docs` writes ``docs/settings.md`` from the settings;
:mod:`config.processes` is standard library only, for agent processes, and so is
:mod:`config.lazy`, the one lazy import (a name's module imported on first use) that
every floor above uses.

Importing :mod:`config` itself loads nothing: each process imports what it uses.
"""
