"""PostgreSQL's own foreign key actions into fenced rows, with the guard on the child table.

A parent that is not fenced, deleted or re-keyed by a bound session, carries the write into
its fenced children with no statement of sa-fence's: the guard compares each cascaded row
with the token the transaction presented. A bound session presents it before writing such a
parent (the model declares the action), so the current holder's cascade goes through and a
stale holder's is refused as stale; without that it presented none, and the guard refused
both alike. Real PostgreSQL and Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship

import sa_fence
from sa_fence.orm import session_state
from tests._fresh_db import fresh_database


class Base(DeclarativeBase):
    pass


sa_fence.fence_schema(Base.metadata)


class Folder(Base):
    """Not fenced; its rows' deletes and key changes reach the fenced notes below."""

    __tablename__ = "folders"

    id: Mapped[int] = mapped_column(primary_key=True)
    notes: Mapped[list[Note]] = relationship(passive_deletes=True, passive_updates=True)


class Shelf(Base):
    """Two levels up: deleting a shelf deletes its folders, and so their notes."""

    __tablename__ = "shelves"

    id: Mapped[int] = mapped_column(primary_key=True)


class Note(sa_fence.Fenced, Base):
    __tablename__ = "notes"

    id: Mapped[int] = mapped_column(primary_key=True)
    folder_id: Mapped[int | None] = mapped_column(
        ForeignKey("folders.id", ondelete="CASCADE", onupdate="CASCADE")
    )
    text: Mapped[str] = mapped_column(String(50))


Folder.__table__.append_column(
    sa.Column("shelf_id", sa.Integer, ForeignKey("shelves.id", ondelete="CASCADE"))
)


@pytest.fixture(scope="module")
def db() -> Iterator[sa.Engine]:
    with fresh_database("cascades") as engine:
        Base.metadata.create_all(engine)
        sa_fence.create_fence_guard(engine, Note.__table__)
        yield engine


@pytest.fixture
def fencer(db: sa.Engine, redis_client: redis.Redis, key_prefix: str) -> sa_fence.Fencer:
    return sa_fence.Fencer(redis_client, db, key_prefix=key_prefix)


@pytest.fixture(autouse=True)
def _rows(db: sa.Engine, fencer: sa_fence.Fencer) -> None:
    """Shelf 1 > folder 1 > note 1, the note written by a holder of lease "first"."""
    with db.begin() as conn:
        conn.execute(sa.text("TRUNCATE shelves, folders, notes"))
        conn.execute(sa.insert(Shelf.__table__).values(id=1))
        conn.execute(sa.insert(Folder.__table__).values(id=1, shelf_id=1))
    with fencer.acquire("first", 30) as lease, Session(db) as session:
        sa_fence.install(session)
        lease.bind(session)
        session.add(Note(id=1, folder_id=1, text="written"))
        session.commit()


def notes(db: sa.Engine) -> list[Any]:
    with db.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT id, folder_id, fence FROM notes"))]


def flushed(session: Session, write: Any) -> None:
    write(session)
    session.flush()  # (the ORM delete is sent here)


WRITES = {
    "orm delete": lambda s: s.delete(s.get(Folder, 1)),
    "core delete": lambda s: s.execute(sa.delete(Folder).where(Folder.id == 1)),
    "key change": lambda s: s.execute(sa.update(Folder).where(Folder.id == 1).values(id=2)),
    "two levels up": lambda s: s.execute(sa.delete(Shelf).where(Shelf.id == 1)),
}


def test_the_model_tells_which_unfenced_tables_cascade_into_fenced_rows() -> None:
    index = sa_fence.orm.model.orm_index()
    assert {Folder.__table__, Shelf.__table__} <= index.cascading
    assert Note.__table__ not in index.cascading


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_the_current_holders_cascade_into_guarded_fenced_rows_commits(
    db: sa.Engine, fencer: sa_fence.Fencer, write: Any
) -> None:
    with fencer.acquire("later", 30) as lease, Session(db) as session:
        sa_fence.install(session)
        lease.bind(session)
        write(session)
        session.commit()
    assert notes(db) in ([], [(1, 2, lease.token)])  # deleted, or re-keyed under its token


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_a_stale_holders_cascade_is_refused_as_stale_and_changes_nothing(
    db: sa.Engine, fencer: sa_fence.Fencer, write: Any
) -> None:
    stale = fencer.acquire("older", 30)
    with fencer.acquire("newer", 30) as newer, Session(db) as session:  # wrote note 1 after
        sa_fence.install(session)
        newer.bind(session)
        session.get_one(Note, 1).text = "rewritten"
        session.commit()
    with Session(db) as session:
        sa_fence.install(session)
        stale.bind(session)
        with pytest.raises(sa_fence.StaleTokenError, match="table 'notes'"):
            flushed(session, write)
        session.rollback()
    stale.release()
    assert notes(db) == [(1, 1, newer.token)]


def test_without_presenting_the_token_the_guard_refuses_the_current_holders_cascade(
    db: sa.Engine, fencer: sa_fence.Fencer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_state.SessionState, "present_for_raw_sql", lambda self, conn: None)
    with fencer.acquire("later", 30) as lease, Session(db) as session:
        sa_fence.install(session)
        lease.bind(session)
        with pytest.raises(sa_fence.UnfencedWriteError, match="presents no token"):
            WRITES["core delete"](session)
        session.rollback()
    assert notes(db) != []


async def test_an_async_sessions_cascade_is_fenced_as_a_sync_ones(
    db: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Through the greenlet, the same step: the current holder's cascade commits."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    adb = create_async_engine(db.url.set(drivername="postgresql+psycopg_async"))
    try:
        fencer = sa_fence.Fencer(redis_client, db, key_prefix=key_prefix)
        with fencer.acquire("later", 30) as lease:
            async with AsyncSession(adb) as session:
                sa_fence.install(session)
                lease.bind(session)
                await session.execute(sa.delete(Folder).where(Folder.id == 1))
                await session.commit()
        assert notes(db) == []
    finally:
        await adb.dispose()
