"""A fence assigned by hand is refused at flush, before any SQL (issue 19, item 9).

The fence is written by sa-fence from the bound lease's token; a value the
caller gives would re-open a row to stale holders (a low one) or lock every
later holder out (a high one).  The statement hook always dropped such a
value, silently; now the flush refuses an assignment on a loaded or a new
object with :class:`sa_fence.FencingConfigError`.  ``Session.merge()`` of a
detached object does not copy the fence it loaded (the common case keeps
working); a fence assigned on the detached object is refused like any other
assignment.  Bulk mappings that carry the fence as data keep having it
dropped (tests/scope/test_lease_scope.py, docs/statements.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import (
    ColumnProperty,
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    sessionmaker,
)

import sa_fence
from sa_fence.orm import flush as _flush
from sa_fence.orm import model
from sa_fence.orm import statements as _statements
from tests._sql import recorded_statements, seed
from tests.models import Job


def row(engine: sa.Engine, job_id: int) -> tuple[Any, ...] | None:
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT result, fence FROM jobs WHERE id = :i"), {"i": job_id})
        first = found.first()
        return None if first is None else tuple(first)


@pytest.fixture
def statements(engine: sa.Engine) -> Iterator[list[str]]:
    with recorded_statements(engine) as sent:
        yield sent


def writes(statements: list[str]) -> list[str]:
    return [s for s in statements if s.lstrip().startswith(("INSERT", "UPDATE", "DELETE"))]


REFUSED = r"Job\.fence was assigned .*Never set Job\.fence.*Nothing was sent"


@pytest.mark.parametrize("given", [10**12, 0, None])
def test_assigning_a_loaded_objects_fence_is_refused_at_flush_and_nothing_is_sent(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    statements: list[str],
    given: int | None,
) -> None:
    token = seed(fencer, make_session, Job(id=1, result="initial"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        job = session.get(Job, 1)
        assert job is not None
        job.result = "changed"
        job.fence = given
        statements.clear()
        with pytest.raises(sa_fence.FencingConfigError, match=REFUSED) as refused:
            session.commit()
        assert "Job (1,)" in str(refused.value)
        assert writes(statements) == []
        with pytest.raises(sa_fence.FenceError, match="rollback"):
            session.commit()  # refused until rolled back, as any fencing error
        session.rollback()
    assert row(engine, 1) == ("initial", token)


def test_a_new_object_given_a_fence_is_refused_and_no_insert_is_sent(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    statements: list[str],
) -> None:
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Job(id=1, result="new", fence=2**63 - 1))
        statements.clear()
        with pytest.raises(sa_fence.FencingConfigError, match=r"on a new Job"):
            session.flush()
        assert writes(statements) == []
        session.rollback()
    assert row(engine, 1) is None


def test_the_unfenced_opt_out_refuses_an_assigned_fence_too(
    make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with make_session() as session, sa_fence.unfenced(session):
        session.add(Job(id=1, result="admin", fence=5))
        with pytest.raises(sa_fence.FencingConfigError, match=REFUSED):
            session.commit()
    assert row(engine, 1) is None


def test_setting_the_fence_to_the_value_it_has_is_no_assignment(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """Code that copies every attribute back (forms, serializers) keeps working."""
    seed(fencer, make_session, Job(id=1, result="initial"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        job = session.get(Job, 1)
        assert job is not None
        job.fence = job.fence
        job.result = "copied back"
        session.commit()
    assert row(engine, 1) == ("copied back", lease.token)


def test_without_the_check_an_assigned_fence_is_silently_dropped(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pair of the refusals above: the flush-time check is what refuses; without it
    the statement hook drops the value and the caller never learns."""
    monkeypatch.setattr(_flush, "_refuse_assigned_fences", lambda session: None)
    seed(fencer, make_session, Job(id=1, result="initial"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        job = session.get(Job, 1)
        assert job is not None
        job.fence = 10**12
        job.result = "changed"
        session.add(Job(id=2, result="new", fence=2**63 - 1))
        session.commit()
    assert row(engine, 1) == ("changed", lease.token)
    assert row(engine, 2) == ("new", lease.token)


async def test_an_async_session_refuses_an_assigned_fence(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
) -> None:
    async with afencer.acquire("job:1", 30) as lease, make_async_session() as session:
        lease.bind(session)
        session.add(Job(id=1, result="initial"))
        await session.commit()
        job = await session.get(Job, 1)
        assert job is not None
        job.fence = 10**12
        with pytest.raises(sa_fence.FencingConfigError, match=REFUSED):
            await session.commit()
        await session.rollback()
        session.add(Job(id=2, fence=3))
        with pytest.raises(sa_fence.FencingConfigError, match="on a new Job"):
            await session.flush()
        await session.rollback()
    assert row(engine, 1) == ("initial", lease.token)
    assert row(engine, 2) is None


# ------------------------------------------------------------------ merge()


class ItemBase(DeclarativeBase):
    pass


class Item(ItemBase):
    """Fenced with fence_column(), not the Fenced mixin."""

    __tablename__ = "fence_assignment_items"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str | None] = mapped_column(sa.String(50))
    fence = sa_fence.fence_column()


@pytest.fixture
def items(engine: sa.Engine) -> Iterator[None]:
    ItemBase.metadata.create_all(engine)
    yield
    ItemBase.metadata.drop_all(engine)


def newer_fence_on_the_row(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], cls: Any
) -> tuple[Any, int]:
    """A detached copy of row 1, then a write that leaves the row a newer fence."""
    seed(fencer, make_session, cls(id=1))
    with make_session() as reader:
        detached: Any = reader.get(cls, 1)
    with fencer.acquire("between", 5) as between, make_session() as session:
        between.bind(session)
        obj = session.get(cls, 1)
        session.delete(obj)
        session.flush()
        session.add(cls(id=1))  # same row, written again under a newer token
        session.commit()
    assert detached.fence < between.token
    return detached, between.token


@pytest.mark.parametrize("cls", [Job, Item], ids=["Fenced-mixin", "fence_column"])
def test_merging_a_detached_object_with_an_older_fence_writes_with_the_token(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    items: None,
    cls: Any,
) -> None:
    """merge() copies loaded state; the fence it loaded is not a value to write, so it
    is not copied and the merged object is not refused."""
    detached, _ = newer_fence_on_the_row(fencer, make_session, cls)
    attr = "result" if cls is Job else "name"
    setattr(detached, attr, "merged")
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        merged = session.merge(detached)
        session.commit()
        assert merged.fence == lease.token
        assert getattr(session.get(cls, 1), attr) == "merged"


def test_merging_a_detached_object_whose_fence_was_assigned_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    detached, newer = newer_fence_on_the_row(fencer, make_session, Job)
    detached.fence = 10**12
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.merge(detached)
        with pytest.raises(sa_fence.FencingConfigError, match=REFUSED):
            session.commit()
    assert row(engine, 1) == (None, newer)


def test_merging_a_new_detached_copy_inserts_with_the_token(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """The row the detached object was loaded from is gone: merge() makes a new
    object without the loaded fence, and the INSERT carries the token."""
    seed(fencer, make_session, Job(id=1, result="initial"))
    with make_session() as reader:
        detached = reader.get(Job, 1)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM jobs"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.merge(detached)
        session.commit()
    assert row(engine, 1) == ("initial", lease.token)


def test_without_the_fence_property_merge_copies_the_loaded_fence_and_is_refused(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pair of the merge tests: without the property that leaves a loaded fence
    behind, merge() copies it as an assignment and the common case breaks."""
    monkeypatch.setattr(model._FenceProperty, "merge", ColumnProperty.merge)
    detached, _ = newer_fence_on_the_row(fencer, make_session, Job)
    detached.result = "merged"
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.merge(detached)
        with pytest.raises(sa_fence.FencingConfigError, match=REFUSED):
            session.commit()


async def test_an_async_session_merges_a_detached_object_with_an_older_fence(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
) -> None:
    async with afencer.acquire("seed", 30) as seeded, make_async_session() as session:
        seeded.bind(session)
        session.add(Job(id=1, result="initial"))
        await session.commit()
    async with make_async_session() as reader:
        detached = await reader.get(Job, 1)
    assert detached is not None
    async with afencer.acquire("job:1", 30) as lease:
        async with make_async_session() as session:
            lease.bind(session)
            (await session.get(Job, 1)).result = "between"  # type: ignore[union-attr]
            await session.commit()  # the row's fence is now newer than the copy's
        detached.result = "merged"
        async with make_async_session() as session:
            lease.bind(session)
            await session.merge(detached)
            await session.commit()
    assert row(engine, 1) == ("merged", lease.token)


def test_bulk_save_objects_skips_the_flush_so_a_fence_it_carries_is_dropped_as_data(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """As documented in docs/statements.md: the bulk methods carry the fence as data."""
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.bulk_save_objects([Job(id=1, result="bulk", fence=2**63 - 1)])
        session.commit()
    assert row(engine, 1) == ("bulk", lease.token)


#: Bulk mappings of ``unfenced()`` writes that carry the fence as data.
UNFENCED_BULK = {"insert": sa.insert(Job), "update by primary key": sa.update(Job)}


@pytest.mark.parametrize("write", UNFENCED_BULK.values(), ids=UNFENCED_BULK.keys())
@pytest.mark.parametrize("dropped", [True, False], ids=["dropped", "guard-removed"])
def test_the_unfenced_opt_out_drops_a_fence_carried_by_bulk_mappings(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    write: sa.Insert | sa.Update,
    dropped: bool,
) -> None:
    """Bulk mappings skip the flush's refusal; inside ``unfenced()`` the statement hook
    drops their fence as it does under a lease, so an admin script cannot lock every later
    holder out with a high fence.  Without the drop it lands (the pair's other half)."""
    if not dropped:
        monkeypatch.setattr(_statements, "_without", lambda params, key: params)
    if isinstance(write, sa.Update):
        seed(fencer, make_session, Job(id=1, result="initial"))
    before = row(engine, 1)
    with make_session() as session, sa_fence.unfenced(session):
        session.execute(write, [{"id": 1, "result": "admin", "fence": 2**63 - 1}])
        session.commit()
    kept = before[1] if before is not None else 0  # the seed's token, or the column default
    assert row(engine, 1) == ("admin", kept if dropped else 2**63 - 1)
