"""A fresh PostgreSQL database per test (for migrations, guards and checks).

Migrations and guard triggers change the schema, so these tests do not use
the run's shared database: each gets its own, dropped afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import sqlalchemy as sa

from tests.conftest import PG_SERVER, RUN_ID, _admin_dsn


@contextmanager
def fresh_database(label: str) -> Iterator[sa.Engine]:
    name = f"sa_fence_test_{RUN_ID}_{label}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    engine = sa.create_engine(sa.make_url(PG_SERVER).set(database=name))
    try:
        yield engine
    finally:
        engine.dispose()
        with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def url_of(engine: sa.Engine) -> str:
    return engine.url.render_as_string(hide_password=False)
