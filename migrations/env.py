"""Alembic environment for sa-fence's schema: the demo's fenced tables.

``import sa_fence.alembic`` registers ``op.create_fence_sequence``,
``op.add_fence_column``, ``op.create_fence_guard`` (and their reverses) and
the autogenerate comparator that notices fenced models whose table is not.

The connection comes from ``config.attributes["connection"]`` when a
program runs the migrations (``sa-fence demo``, the tests), else from the
``SA_FENCE_DATABASE_URL`` environment variable or ``sqlalchemy.url``.
"""

from __future__ import annotations

import logging.config
import os

import sqlalchemy as sa
from alembic import context

import sa_fence.alembic  # noqa: F401  (registers the sa-fence operations)
from sa_fence.cli.demo_models import DemoBase

config = context.config
target_metadata = DemoBase.metadata

if config.config_file_name is not None and config.attributes.get("connection") is None:
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = os.environ.get("SA_FENCE_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit(
            "migrations/env.py: no database URL. Set SA_FENCE_DATABASE_URL, e.g. "
            "postgresql+psycopg://postgres@127.0.0.1:5432/mydb"
        )
    return url


def _configure(**kw: object) -> None:
    context.configure(target_metadata=target_metadata, compare_server_default=True, **kw)


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = sa.create_engine(_url(), poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
