"""Shared fixtures: real services (tests.services) plus a migrated store and the Celery app."""

from __future__ import annotations

pytest_plugins = ["tests.services", "tests.fixtures", "tests.celery_workers"]
