"""Fixtures and helpers for the asyncio tests (tests/lease/test_async*.py).

Each test gets its own event loop (pytest-asyncio), async Redis client and
AsyncEngine, closed at the end; the fixtures fail the test if it left a
connection checked out or a renewal task running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

import sa_fence
from sa_fence.lease import aio
from sa_fence.lease import protocol as proto
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE


def renewal_tasks() -> list[asyncio.Task[Any]]:
    return [
        t
        for t in asyncio.all_tasks()
        if t.get_name().startswith(aio.RENEWAL_TASK_NAME) and not t.done()
    ]


async def no_renewal_tasks_left() -> list[asyncio.Task[Any]]:
    for _ in range(10):  # a cancelled task ends on its next step
        if not renewal_tasks():
            break
        await asyncio.sleep(0)
    return renewal_tasks()


@pytest_asyncio.fixture
async def async_engine(database_url: sa.URL, engine: sa.Engine) -> AsyncIterator[AsyncEngine]:
    """The test database through psycopg's async driver (tables made by ``engine``)."""
    eng = create_async_engine(database_url.set(drivername="postgresql+psycopg_async"))
    try:
        yield eng
        assert eng.sync_engine.pool.checkedout() == 0, "a connection was left checked out"
    finally:
        await eng.dispose()


@pytest_asyncio.fixture
async def aredis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        yield client
    finally:
        await client.aclose()


@pytest_asyncio.fixture
async def afencer(
    aredis: aioredis.Redis, async_engine: AsyncEngine, key_prefix: str
) -> AsyncIterator[sa_fence.AsyncFencer]:
    fencer = sa_fence.AsyncFencer(aredis, async_engine, sequence=SEQUENCE, key_prefix=key_prefix)
    yield fencer
    assert await no_renewal_tasks_left() == [], "a renewal task outlived the test"
    if fencer._background:
        await asyncio.wait(fencer._background)
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert others == [], f"tasks left running: {others}"


@pytest.fixture
def make_async_session(async_engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return sa_fence.install(async_sessionmaker(async_engine, expire_on_commit=False))


def row(engine: sa.Engine, job_id: int) -> tuple[Any, ...] | None:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT result, fence FROM jobs WHERE id = :id"), {"id": job_id}
        ).one_or_none()
    return None if found is None else tuple(found)


def expire(client: redis.Redis, lease: sa_fence.AsyncLease) -> bool:
    """End the lease in Redis now (owner-checked), leaving the object believing it holds it."""
    return bool(client.eval(proto.RELEASE_SCRIPT, 1, lease.key, lease._value))


def keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*"))
