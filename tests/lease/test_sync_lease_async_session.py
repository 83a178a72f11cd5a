"""A sync ``Lease`` bound to an ``AsyncSession`` is fenced as an ``AsyncLease`` is (issue 49).

Binding needs no I/O of the lease's own: the flush hook is the AsyncSession's
sync session's, the checks it makes of the lease are local
(``check(for_write=True)``), and the COMMIT is checked by PostgreSQL against
the register whatever front end drew the token.  A sync lease's renewal runs on
the Fencer's thread, beside the event loop.  So it is accepted, on evidence
(these tests, on real servers); what differs is that the sync Fencer's own calls
(acquire, extend, release) block the event loop while they run, which
docs/asyncio.md says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

import sa_fence
from sa_fence.testing import expire
from tests.models import SEQUENCE, Job


@pytest.fixture
def sync_fencer(
    redis_client: redis.Redis, engine: sa.Engine, key_prefix: str
) -> Iterator[sa_fence.Fencer]:
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    yield fencer
    fencer.close()


def fences(engine: sa.Engine) -> dict[int, tuple[str | None, int | None]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, result, fence FROM jobs")).all()
    return {row.id: (row.result, row.fence) for row in rows}


async def test_a_sync_lease_fences_an_async_sessions_writes_and_its_stale_commit_is_refused(
    sync_fencer: sa_fence.Fencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
) -> None:
    a = sync_fencer.acquire("job:1", 30)
    async with make_async_session() as session:
        assert a.bind(session) is session
        session.add(Job(id=1, result="A"))
        await session.commit()
    assert fences(engine) == {1: ("A", a.token)}  # the row carries the sync lease's token

    async with make_async_session() as session:
        a.bind(session)
        session.add(Job(id=5, result="A, late"))  # (not row 1: B's update would wait for it)
        await session.flush()
        assert expire(a)  # A pauses past its TTL; B is granted and commits
        b = sync_fencer.acquire("job:1", 30)
        async with make_async_session() as other:
            b.bind(other)
            (await other.get(Job, 1)).result = "B"  # type: ignore[union-attr]
            await other.commit()
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            await session.commit()
    assert (refused.value.statement, refused.value.newest_token) == ("COMMIT", b.token)
    assert fences(engine) == {1: ("B", b.token)}  # nothing of A's late transaction (row 5)
    b.release()

    async with make_async_session() as session:  # the row fence refuses the stale token too
        a.bind(session)
        (await session.get(Job, 1)).result = "A again"  # type: ignore[union-attr]
        with pytest.raises(sa_fence.StaleTokenError):
            await session.commit()
    assert fences(engine) == {1: ("B", b.token)}


async def test_a_sync_lease_lost_or_renewed_behaves_in_an_async_session_as_in_a_sync_one(
    sync_fencer: sa_fence.Fencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
) -> None:
    # fail_fast: past its local validity the flush refuses it, before anything is sent
    short = sync_fencer.acquire("job:2", 0.2, fail_fast=True)
    await asyncio.sleep(0.3)
    async with make_async_session() as session:
        short.bind(session)
        session.add(Job(id=2, result="too late"))
        with pytest.raises(sa_fence.LeaseLostError):
            await session.flush()
    assert 2 not in fences(engine)

    # renewed on the Fencer's thread while the loop awaits: still valid, commits
    renewed = sync_fencer.acquire("job:3", 0.6, renew=True)
    await asyncio.sleep(1.5)  # 2.5 TTLs: only renewals keep it
    assert not renewed.lost
    async with make_async_session() as session:
        renewed.bind(session)
        session.add(Job(id=3, result="renewed"))
        await session.commit()
    assert fences(engine)[3] == ("renewed", renewed.token)
    renewed.release()

    # released: refused at bind, as for an AsyncLease
    async with make_async_session() as session:
        with pytest.raises(sa_fence.LeaseLostError):
            renewed.bind(session)


async def test_binding_a_sync_lease_mid_transaction_is_refused_as_an_async_lease_is(
    sync_fencer: sa_fence.Fencer, make_async_session: async_sessionmaker[AsyncSession]
) -> None:
    with sync_fencer.acquire("job:4", 30) as lease:
        async with make_async_session() as session:
            await session.execute(sa.text("SELECT 1"))
            with pytest.raises(sa_fence.FencingConfigError, match=r"run_sync\(lambda s"):
                lease.bind(session)
            await session.run_sync(lambda s: lease.bind(s))
            session.add(Job(id=4, result="bound inside"))
            await session.commit()
