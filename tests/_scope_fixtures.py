"""Fixtures of the lease-scope test modules: a database of their own with the scope schema.

Imported by each module that uses them (module-scoped: each module gets its own
database, dropped at its end).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from tests._fresh_db import fresh_database
from tests.models_scope import TABLES, create_scope_schema


@pytest.fixture(scope="module")
def scope_engine() -> Iterator[sa.Engine]:
    with fresh_database("scope") as engine:
        create_scope_schema(engine)
        yield engine


@pytest.fixture(autouse=True)
def empty_tables(scope_engine: sa.Engine) -> Iterator[None]:
    yield
    with scope_engine.begin() as conn:
        # A test that leaves a transaction open would block TRUNCATE forever.
        conn.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
        conn.execute(sa.text(f"TRUNCATE {', '.join(TABLES)}"))


@pytest.fixture
def fencer(
    scope_engine: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> Iterator[sa_fence.Fencer]:
    fencer = sa_fence.Fencer(redis_client, scope_engine, key_prefix=key_prefix)
    yield fencer
    fencer.close()


@pytest.fixture
def make_session(scope_engine: sa.Engine) -> sessionmaker[Session]:
    return sa_fence.install(sessionmaker(scope_engine))
