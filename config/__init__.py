"""corral's configuration: typed settings from the environment and the Celery set-up.

Settings come from ``CORRAL_*`` environment variables (see :class:`Settings`); when a
``corral up`` stack runs in the working directory, its state file supplies the
addresses it started (broker, database, registry) for anything the environment
does not set. :mod:`config.celery` turns settings into Celery configuration:
queues, routes, the beat schedule and the reliability options.
"""

from config.settings import ConfigError, Settings, get_settings, reset_settings

__all__ = ["ConfigError", "Settings", "get_settings", "reset_settings"]
