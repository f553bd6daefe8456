"""Alembic environment: migrates the URL handed over by :mod:`workers.store.migrate`."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from workers.store.models import Base

config = context.config
url = config.get_main_option("sqlalchemy.url")
assert url, "workers.store.migrate sets sqlalchemy.url"  # noqa: S101 - our own wiring

with create_engine(url, poolclass=pool.NullPool).connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()
