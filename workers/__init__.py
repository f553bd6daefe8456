"""What executes tasks: the Celery app, the store, placement, agent clients, the registry.

``celery -A workers worker|beat|flower`` loads :data:`app` from here.
"""

from workers.app import app

__all__ = ["app"]
