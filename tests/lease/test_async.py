"""The asyncio front end on real servers: AsyncFencer, AsyncLease, AsyncSession.

Every test runs on its own event loop with its own async Redis client and
AsyncEngine (both closed at the end), and checks that no task it started
outlives it.
"""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
import logging
import threading
import time
import types
import typing
from typing import Any

import psycopg
import pytest
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
from sa_fence.orm import flush, statements
from tests._async_fixtures import expire, keys, no_renewal_tasks_left, row
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE, Job

TTL = 0.5


# ------------------------------------------------------------------- parity


def _public_methods(cls: type) -> dict[str, inspect.Signature]:
    found = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name != "__init__":
            continue
        if callable(member):
            found[name] = inspect.signature(member)
    return found


def _shape(sig: inspect.Signature) -> list[tuple[str, Any, Any]]:
    """Parameter names, kinds and defaults: what a caller sees (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize(
    ("sync_cls", "async_cls"),
    [(sa_fence.Fencer, sa_fence.AsyncFencer), (sa_fence.Lease, sa_fence.AsyncLease)],
)
def test_the_sync_and_async_classes_have_the_same_methods_and_parameters(
    sync_cls: type, async_cls: type
) -> None:
    sync_methods = _public_methods(sync_cls)
    async_methods = _public_methods(async_cls)
    assert sorted(sync_methods) == sorted(async_methods)
    for name, sig in sync_methods.items():
        assert _shape(sig) == _shape(async_methods[name]), name
    sync_props = {n for n, v in vars(sync_cls).items() if isinstance(v, property)}
    async_props = {n for n, v in inspect.getmembers(async_cls) if isinstance(v, property)}
    assert sync_props <= async_props


def test_what_does_io_is_a_coroutine_on_the_async_side_and_nothing_else_is() -> None:
    """Every method that does I/O is a coroutine function, but ``acquire``, which returns a
    coroutine that is also an async context manager (``Acquiring``)."""
    for cls, io in [
        (sa_fence.AsyncFencer, {"check", "close", "prune"}),
        (sa_fence.AsyncLease, {"extend", "release"}),
    ]:
        for name, member in inspect.getmembers(cls):
            if not name.startswith("_") and inspect.isfunction(member) and name != "acquire":
                assert inspect.iscoroutinefunction(member) == (name in io), name
    acquiring = typing.get_type_hints(sa_fence.AsyncFencer.acquire)["return"]
    assert issubclass(acquiring, collections.abc.Coroutine)
    assert hasattr(acquiring, "__aenter__")
    assert hasattr(acquiring, "__aexit__")


# --------------------------------------------------------- configuration


async def test_async_fencer_refuses_sync_clients_and_engines_with_a_fix(
    redis_client: redis.Redis, engine: sa.Engine, aredis: aioredis.Redis
) -> None:
    with pytest.raises(TypeError, match=r"for a sync client use sa_fence\.Fencer"):
        sa_fence.AsyncFencer(redis_client, engine)  # type: ignore[arg-type]
    with pytest.raises(
        sa_fence.FencingConfigError, match=r"for a sync Engine use sa_fence\.Fencer"
    ):
        sa_fence.AsyncFencer(aredis, engine)  # type: ignore[arg-type]


async def test_asyncpg_is_refused_because_it_reports_no_executemany_row_counts(
    aredis: aioredis.Redis, database_url: sa.URL
) -> None:
    # asyncpg itself need not be installed: the dialect's capabilities decide,
    # and nothing here connects.
    asyncpg_engine = create_async_engine(
        database_url.set(drivername="postgresql+asyncpg"),
        module=types.SimpleNamespace(paramstyle="numeric_dollar"),
    )
    try:
        with pytest.raises(sa_fence.FencingConfigError, match="does not report row counts"):
            sa_fence.AsyncFencer(aredis, asyncpg_engine)
        with pytest.raises(sa_fence.FencingConfigError, match="does not report row counts"):
            sa_fence.install(async_sessionmaker(asyncpg_engine))
    finally:
        await asyncpg_engine.dispose()


async def test_bad_arguments_are_refused_before_anything_is_written(
    afencer: sa_fence.AsyncFencer, redis_client: redis.Redis, key_prefix: str
) -> None:
    with pytest.raises(ValueError, match="ttl must be a finite number"):
        await afencer.acquire("job:1", -1)
    with pytest.raises(ValueError, match="has no effect without blocking=True"):
        await afencer.acquire("job:1", 5, timeout=3)
    with pytest.raises(TypeError, match="renew must be True or False"):
        await afencer.acquire("job:1", 5, renew="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease name must be 1 to 1024"):
        await afencer.acquire("", 5)
    assert keys(redis_client, key_prefix) == []


async def test_install_leaves_the_users_async_engine_untouched(
    async_engine: AsyncEngine,
) -> None:
    maker = async_sessionmaker(async_engine)
    sa_fence.install(maker)
    assert maker.kw["bind"] is async_engine  # no private view is bound (issue 18)
    assert not sa.event.contains(
        async_engine.sync_engine, "before_execute", statements._before_execute
    )
    assert maker.kw["sync_session_class"] is not sa.orm.Session
    sa_fence.uninstall(maker)
    assert maker.kw["bind"] is async_engine
    assert maker.kw["sync_session_class"] is sa.orm.Session
    async with maker() as session:
        assert not flush.is_installed(session.sync_session)


async def test_install_refuses_an_async_session_class_and_bind_needs_the_hook(
    async_engine: AsyncEngine, afencer: sa_fence.AsyncFencer
) -> None:
    with pytest.raises(TypeError, match="Install on your async_sessionmaker"):
        sa_fence.install(AsyncSession)
    async with afencer.acquire("job:40", 30) as lease, AsyncSession(async_engine) as session:
        with pytest.raises(sa_fence.FencingConfigError, match="does not have the sa-fence"):
            lease.bind(session)


# --------------------------------------------------- the fenced AsyncSession


async def test_an_async_session_write_carries_the_lease_token(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    async with afencer.acquire("job:1", 30) as lease, make_async_session() as session:
        assert lease.bind(session) is session
        session.add(Job(id=1, result="async"))
        await session.commit()
    assert row(engine, 1) == ("async", lease.token)
    assert lease.released
    assert keys(redis_client, key_prefix) == []


async def test_an_async_session_without_a_lease_may_not_write_fenced_rows(
    make_async_session: async_sessionmaker[AsyncSession], engine: sa.Engine
) -> None:
    async with make_async_session() as session:
        session.add(Job(id=2, result="no lease"))
        with pytest.raises(sa_fence.UnfencedWriteError):
            await session.commit()
    assert row(engine, 2) is None


#: Driver SQL as a str, as bytes and as a psycopg sql object.
DRIVER_SQL: dict[str, Any] = {
    "exec_driver_sql": str,
    "exec_driver_sql(bytes)": str.encode,
    "exec_driver_sql(psycopg sql)": psycopg.sql.SQL,
}


@pytest.mark.parametrize("sql", ["COMMIT AND CHAIN", "COMMIT; BEGIN"])
@pytest.mark.parametrize("send", ["text", *DRIVER_SQL])
async def test_an_async_session_refuses_sql_that_ends_the_transaction_and_goes_on(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
    send: str,
    sql: str,
) -> None:
    """What follows the end would run unarmed: refused before it is sent, on the
    asyncio path too (AsyncConnection runs the sync Connection's method in a greenlet)."""
    async with afencer.acquire("job:chain", 30) as lease, make_async_session() as session:
        lease.bind(session)
        session.add(Job(id=3, result="chained"))
        await session.flush()
        conn = await session.connection()
        sent = (
            conn.execute(sa.text(sql))
            if send == "text"
            else conn.exec_driver_sql(DRIVER_SQL[send](sql))
        )
        with pytest.raises(sa_fence.FencingConfigError, match="Nothing was sent"):
            await sent
        await session.rollback()
    assert row(engine, 3) is None  # had the COMMIT been sent, the row would be there


async def test_the_seed_scenario_with_tasks_the_stale_task_is_refused(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
) -> None:
    """Task A takes the lease and stalls past its TTL; task B takes over and
    commits; A's late commit is refused and the row keeps B's result."""
    async with afencer.acquire("job:3", 30) as setup, make_async_session() as session:
        setup.bind(session)
        session.add(Job(id=3, result="initial"))
        await session.commit()

    a_loaded = asyncio.Event()
    b_committed = asyncio.Event()

    async def worker_a() -> str:
        lease = await afencer.acquire("job:3", TTL)
        async with make_async_session() as session:
            lease.bind(session)
            (await session.get(Job, 3)).result = "written by A"  # type: ignore[union-attr]
            a_loaded.set()
            await b_committed.wait()  # A "pauses" past its TTL meanwhile
            try:
                await session.commit()
            except sa_fence.StaleTokenError as exc:
                await session.rollback()
                assert await lease.release() is False
                return f"refused: token {exc.token} < fence {exc.current_fences[0]}"
        return "committed"

    async def worker_b() -> int:
        await a_loaded.wait()
        await asyncio.sleep(2 * TTL)  # A's lease expires
        async with afencer.acquire("job:3", 30) as lease, make_async_session() as session:
            lease.bind(session)
            (await session.get(Job, 3)).result = "written by B"  # type: ignore[union-attr]
            await session.commit()
        b_committed.set()
        return lease.token

    outcome_a, token_b = await asyncio.gather(worker_a(), worker_b())
    assert outcome_a.startswith("refused")
    assert row(engine, 3) == ("written by B", token_b)


async def test_orm_bulk_update_through_an_async_session_is_fenced(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
) -> None:
    old = await afencer.acquire("job:4", 30)
    async with afencer.acquire("job:4b", 30) as newer, make_async_session() as session:
        newer.bind(session)
        session.add(Job(id=4, result="newer"))
        await session.commit()
    async with make_async_session() as session:
        old.bind(session)
        with pytest.raises(sa_fence.StaleTokenError):
            await session.execute(sa.update(Job), [{"id": 4, "result": "stale bulk"}])
        await session.rollback()
    await old.release()
    assert row(engine, 4) == ("newer", newer.token)


async def test_a_single_async_session_installed_alone_is_fenced(
    afencer: sa_fence.AsyncFencer, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    async with AsyncSession(async_engine) as session:
        assert sa_fence.install(session) is session
        async with afencer.acquire("job:5", 30) as lease:
            lease.bind(session)
            session.add(Job(id=5, result="one session"))
            await session.commit()
    assert row(engine, 5) == ("one session", lease.token)


# ------------------------------------------------------- renewal and loss


# (A renewed lease outliving its TTL, and its pair: tests/lease/test_renew.py, both front ends.)


async def test_a_lost_renewed_lease_tells_once_and_its_session_refuses_to_flush(
    afencer: sa_fence.AsyncFencer,
    redis_client: redis.Redis,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
) -> None:
    told: list[sa_fence.AsyncLease] = []
    lost = asyncio.Event()

    def on_lost(lease: sa_fence.AsyncLease) -> None:
        told.append(lease)
        lost.set()

    lease = await afencer.acquire("job:8", TTL, renew=True, on_lost=on_lost)
    async with make_async_session() as session:
        lease.bind(session)
        session.add(Job(id=8, result="A"))
        expire(redis_client, lease)
        await asyncio.wait_for(lost.wait(), 4 * TTL)
        with pytest.raises(sa_fence.LeaseLostError, match="no longer ours"):
            await session.commit()
        await session.rollback()
    assert told == [lease]
    assert await no_renewal_tasks_left() == []
    assert await lease.release() is False
    assert row(engine, 8) is None


async def test_a_renewed_lease_dropped_without_release_stops_being_renewed(
    afencer: sa_fence.AsyncFencer, redis_client: redis.Redis
) -> None:
    import gc

    key = (await afencer.acquire("job:9", TTL, renew=True)).key
    gc.collect()
    await asyncio.sleep(3 * TTL)
    assert redis_client.get(key) is None
    assert await no_renewal_tasks_left() == []


async def test_a_renewed_lease_checked_in_a_thread_tells_its_loss_there_and_stops_renewal(
    afencer: sa_fence.AsyncFencer, caplog: pytest.LogCaptureFixture
) -> None:
    """``lease.check()`` between steps of work run off the loop (asyncio.to_thread): with the
    renewal overdue (the loop is blocked here, as in a paused process) it raises
    LeaseLostError, ``on_lost`` runs once, on that thread, and the renewal task is cancelled
    through the loop.  (It raised RuntimeError, and on_lost never ran.)"""
    told: list[int | None] = []
    lease = await afencer.acquire(
        "job:10", TTL, renew=True, on_lost=lambda _: told.append(threading.get_ident())
    )
    found: list[BaseException] = []

    def long_step() -> None:
        time.sleep(2 * TTL)  # no renewal meanwhile: the loop is blocked in join() below
        try:
            lease.check()
        except BaseException as exc:
            found.append(exc)

    worker = threading.Thread(target=long_step)
    with caplog.at_level(logging.ERROR, logger="sa_fence"):
        worker.start()
        worker.join()  # blocks the event loop on purpose
    assert caplog.records == []  # (stopping the renewal from that thread failed, logged)
    assert [type(e) for e in found] == [sa_fence.LeaseLostError]
    assert "could not be renewed in time" in str(found[0])
    assert told == [worker.ident]
    assert lease.lost
    assert await no_renewal_tasks_left() == []
    assert await lease.release() is False
    assert told == [worker.ident]  # once


def test_a_renewed_lease_read_after_its_event_loop_closed_tells_its_loss(
    database_url: sa.URL, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Its loop is gone, so is its renewal: ``lease.lost`` is True, on_lost runs, nothing
    raises (it raised RuntimeError, and on_lost never ran)."""
    told: list[sa_fence.AsyncLease] = []

    async def acquire() -> sa_fence.AsyncLease:
        url = database_url.set(drivername="postgresql+psycopg_async")
        eng, client = create_async_engine(url), aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        try:
            fencer = sa_fence.AsyncFencer(client, eng, sequence=SEQUENCE, key_prefix=key_prefix)
            return await fencer.acquire("job:11", TTL, renew=True, on_lost=told.append)
        finally:
            await client.aclose()
            await eng.dispose()

    lease = asyncio.run(acquire())
    try:
        time.sleep(2 * TTL)
        assert lease.lost
        assert told == [lease]
        with pytest.raises(sa_fence.LeaseLostError, match="could not be renewed in time"):
            lease.check()
        assert told == [lease]
    finally:
        redis_client.delete(lease.key)


async def test_async_fencer_close_waits_for_background_cleanups(
    afencer: sa_fence.AsyncFencer,
) -> None:
    lease = await afencer.acquire("job:close", 5)
    await lease.release()
    await afencer.close()
    assert not afencer._background
