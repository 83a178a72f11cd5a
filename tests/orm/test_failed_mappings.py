"""A mapping that failed elsewhere in the process: sa-fence's flush works as plain SQLAlchemy's.

A declarative class whose mapping raised stays in its registry, with no mapper, while anything
references it (a kept traceback is enough), and a registry with a relationship to a missing
class never configures; plain SQLAlchemy still flushes every other registry's objects.  A
fenced class in either state refuses writes instead: its tables would go unfenced.
"""

from __future__ import annotations

import gc
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    relationship,
    sessionmaker,
)

import sa_fence
from sa_fence.orm import model
from tests.models import Audit, Job


class NotAColumnType:
    """No SQLAlchemy type: a ``Mapped[NotAColumnType]`` attribute fails the class's mapping."""


@pytest.fixture
def job_id() -> int:
    return 700_000 + uuid.uuid4().int % 100_000


@pytest.fixture
def registries() -> Iterator[list[Any]]:
    """Bases whose registries the test disposes of, and whose failed classes it lets go."""
    bases: list[Any] = []
    yield bases
    for base in bases:
        base.registry.dispose()
    gc.collect()


def assert_flushes_work(
    engine: sa.Engine, make_session: sessionmaker[Session], fencer: sa_fence.Fencer, job_id: int
) -> None:
    """An unrelated, unfenced write commits with and without sa-fence; a fenced one commits
    under a lease with its token, and is refused without one."""
    for maker in (sessionmaker(engine), make_session):
        with maker() as session:
            session.add(Audit(message="unrelated"))
            session.commit()
    with fencer.acquire(f"job:{job_id}", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Job(id=job_id, result="fenced"))
        session.commit()
        assert session.get_one(Job, job_id).fence == lease.token
    with make_session() as session:
        session.get_one(Job, job_id).result = "no lease"
        with pytest.raises(sa_fence.UnfencedWriteError):
            session.flush()


def test_flushes_work_while_a_class_whose_mapping_failed_is_still_referenced(
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    fencer: sa_fence.Fencer,
    job_id: int,
    registries: list[Any],
) -> None:
    class Elsewhere(DeclarativeBase):
        pass

    registries.append(Elsewhere)
    with pytest.raises(sa.exc.ArgumentError, match="NotAColumnType") as failed:

        class Broken(Elsewhere):
            __tablename__ = "fm_broken"
            id: Mapped[int] = mapped_column(primary_key=True)
            odd: Mapped[NotAColumnType]

    assert failed.value.__traceback__ is not None  # keeps the class, so its registry holds it
    with pytest.raises(sa.orm.exc.UnmappedClassError):
        Elsewhere.registry.mappers  # noqa: B018  (what sa-fence read)
    assert_flushes_work(engine, make_session, fencer, job_id)


def test_flushes_work_while_another_registry_cannot_be_configured(
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    fencer: sa_fence.Fencer,
    job_id: int,
    registries: list[Any],
) -> None:
    class Elsewhere(DeclarativeBase):
        pass

    registries.append(Elsewhere)

    class Dangling(Elsewhere):
        __tablename__ = "fm_dangling"
        id: Mapped[int] = mapped_column(primary_key=True)
        missing = relationship("NoSuchClass")

    with pytest.raises(sa.exc.InvalidRequestError, match="NoSuchClass"):
        Elsewhere.registry.configure()
    assert_flushes_work(engine, make_session, fencer, job_id)


def test_an_unconfigurable_classs_table_between_it_and_a_fenced_class_still_needs_a_lease(
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    fencer: sa_fence.Fencer,
    job_id: int,
    registries: list[Any],
) -> None:
    """Its relationships cannot be read: a table whose foreign keys reach it and a fenced class
    is taken for their ``secondary``, whose rows need a lease as when it is configured."""

    class Elsewhere(DeclarativeBase):
        pass

    registries.append(Elsewhere)
    links = sa.Table(
        "fm_tagger_jobs",
        Elsewhere.metadata,
        sa.Column("tagger_id", sa.ForeignKey("fm_taggers.id"), primary_key=True),
        sa.Column("job_id", sa.ForeignKey(Job.__table__.c.id), primary_key=True),
    )

    class Tagger(Elsewhere):
        __tablename__ = "fm_taggers"
        id: Mapped[int] = mapped_column(primary_key=True)
        jobs = relationship(Job, secondary=links)
        missing = relationship("NoSuchClass")

    assert links in model.orm_index().association_tables
    with make_session() as session, pytest.raises(sa_fence.UnfencedWriteError):
        session.execute(sa.insert(links).values(tagger_id=1, job_id=job_id))
    assert_flushes_work(engine, make_session, fencer, job_id)


def test_a_fenced_class_whose_mapping_failed_refuses_writes_rather_than_leave_its_table_unfenced(
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    fencer: sa_fence.Fencer,
    job_id: int,
    registries: list[Any],
) -> None:
    """A joined subclass's own table has no fence column: mapped, its writes bump the parent's
    fence; its mapping failed, they would be sent unfenced, so nothing is written."""

    class Elsewhere(DeclarativeBase):
        pass

    registries.append(Elsewhere)

    class Parent(sa_fence.Fenced, Elsewhere):
        __tablename__ = "fm_parents"
        id: Mapped[int] = mapped_column(primary_key=True)

    with pytest.raises(sa.exc.NoForeignKeysError) as failed:

        class Child(Parent):  # no foreign key to fm_parents: no inheritance condition
            __tablename__ = "fm_children"
            id: Mapped[int] = mapped_column(primary_key=True)

    child_table = Elsewhere.metadata.tables["fm_children"]
    assert model.fence_column_of(child_table) is None
    with make_session() as session, pytest.raises(sa_fence.FencingConfigError) as refused:
        session.execute(sa.insert(child_table).values(id=1))
    assert "Child is a fenced class, but its mapping failed" in str(refused.value)
    assert "'fm_children'" in str(refused.value)
    with make_session() as session:
        session.add(Audit(message="refused too"))
        with pytest.raises(sa_fence.FencingConfigError):
            session.flush()
    del failed, refused  # (their tracebacks hold Child)
    gc.collect()  # nothing references Child now: its registry lets it go
    assert "Child" not in [cls.__name__ for cls in model.unmapped_classes()]
    assert_flushes_work(engine, make_session, fencer, job_id)


def test_a_fenced_class_that_cannot_be_configured_refuses_writes(
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    fencer: sa_fence.Fencer,
    job_id: int,
) -> None:
    class Elsewhere(DeclarativeBase):
        pass

    class Dangling(sa_fence.Fenced, Elsewhere):
        __tablename__ = "fm_fenced_dangling"
        id: Mapped[int] = mapped_column(primary_key=True)
        missing = relationship("NoSuchClass")

    try:
        with make_session() as session:
            session.add(Audit(message="refused"))
            with pytest.raises(sa_fence.FencingConfigError) as refused:
                session.flush()
        assert "Dangling is a fenced class, but SQLAlchemy cannot configure" in str(refused.value)
        assert "NoSuchClass" in str(refused.value)
    finally:
        Elsewhere.registry.dispose()
    assert_flushes_work(engine, make_session, fencer, job_id)
