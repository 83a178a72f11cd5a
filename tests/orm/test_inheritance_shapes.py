"""Joined-table inheritance shapes beyond tests/models_scope.py's, on the real server.

The fence may sit on the base table of a hierarchy (``Doc``, three joined
levels deep), on a composite key whose subclass columns have other names
(``Pair``), or on a joined subclass of an unfenced base (``Dog`` under
``Animal``, whose table other classes share).  Whichever table of a fenced
object a write touches, the row's fence is compared and advanced: in the flush
and in the ORM's bulk UPDATE by primary key, and for Core writes of a table
that only fenced subclasses own.  Each shape here has a guard of its own in
``sa_fence.orm.model.orm_index`` and the statement hook; these tests fail when it
is removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import sqlalchemy as sa
from sqlalchemy import ForeignKey, ForeignKeyConstraint, String, delete, update
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.ext.horizontal_shard import ShardedSession, set_shard_id
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    declared_attr,
    mapped_column,
    relationship,
    sessionmaker,
)
from sqlalchemy.orm.attributes import flag_modified

import sa_fence
from sa_fence.testing import expire
from tests import _scope_fixtures
from tests._fresh_db import fresh_database


class ShapesBase(DeclarativeBase):
    pass


sa_fence.fence_schema(ShapesBase.metadata, "sa_fence_token_seq")


class Animal(ShapesBase):
    """Not fenced: cats are not; dogs are, with the fence on their own table."""

    __tablename__ = "animals"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(50))
    kind: Mapped[str] = mapped_column(String(20))
    kennel_id: Mapped[int | None] = mapped_column(ForeignKey("kennels.id"))
    __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "animal"}  # noqa: RUF012


class Dog(sa_fence.Fenced, Animal):
    __tablename__ = "dogs"
    id: Mapped[int] = mapped_column(ForeignKey("animals.id"), primary_key=True)
    bark: Mapped[str] = mapped_column(String(50), default="")
    __mapper_args__ = {"polymorphic_identity": "dog"}  # noqa: RUF012


class Cat(Animal):
    __tablename__ = "cats"
    id: Mapped[int] = mapped_column(ForeignKey("animals.id"), primary_key=True)
    __mapper_args__ = {"polymorphic_identity": "cat"}  # noqa: RUF012


class Kennel(ShapesBase):
    """Not fenced.  Its collection sets a foreign key in animals, the table the fenced Dog
    shares with the unfenced Cat, with no change to the Dog itself (no backref)."""

    __tablename__ = "kennels"
    id: Mapped[int] = mapped_column(primary_key=True)
    animals: Mapped[list[Animal]] = relationship()


class Doc(sa_fence.Fenced, ShapesBase):
    __tablename__ = "docs"
    id: Mapped[int] = mapped_column(primary_key=True)
    title: Mapped[str] = mapped_column(String(50))
    kind: Mapped[str] = mapped_column(String(20))
    __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "doc"}  # noqa: RUF012


class Report(Doc):
    __tablename__ = "reports"
    id: Mapped[int] = mapped_column(ForeignKey("docs.id"), primary_key=True)
    summary: Mapped[str] = mapped_column(String(50), default="")
    folder_id: Mapped[int | None] = mapped_column(ForeignKey("folders.id"))
    pin_folder_id: Mapped[int | None] = mapped_column(ForeignKey("folders.id"))
    owner_folder_id: Mapped[int | None] = mapped_column(ForeignKey("folders.id"))
    __mapper_args__ = {"polymorphic_identity": "report"}  # noqa: RUF012


class Folder(ShapesBase):
    """Not fenced.  Its collections set foreign keys in reports (a joined table of the fenced
    Doc) with no change to the Report objects themselves: no backref; ``pinned`` writes them
    in the flush's post-update pass."""

    __tablename__ = "folders"
    id: Mapped[int] = mapped_column(primary_key=True)
    reports: Mapped[list[Report]] = relationship(foreign_keys=[Report.folder_id])
    pinned: Mapped[list[Report]] = relationship(
        foreign_keys=[Report.pin_folder_id], post_update=True
    )
    owned: Mapped[list[Report]] = relationship(
        foreign_keys=[Report.owner_folder_id], cascade="all, delete-orphan"
    )


class Audit(Report):
    """Three joined levels: audits.id is equated with docs.id only through reports.id."""

    __tablename__ = "audits"
    id: Mapped[int] = mapped_column(ForeignKey("reports.id"), primary_key=True)
    finding: Mapped[str] = mapped_column(String(50), default="")
    __mapper_args__ = {"polymorphic_identity": "audit"}  # noqa: RUF012


class Memo(Doc):
    """Its table's key is not the fence table's: the inheritance condition equates another
    column with docs.id, so a row of memos cannot be matched to its fence by key."""

    __tablename__ = "memos"
    memo_id: Mapped[int] = mapped_column(primary_key=True)
    doc_id: Mapped[int] = mapped_column(ForeignKey("docs.id"))
    body: Mapped[str] = mapped_column(String(50), default="")
    __mapper_args__ = {  # noqa: RUF012
        "polymorphic_identity": "memo",
        "inherit_condition": doc_id == Doc.id,
    }


class Pair(sa_fence.Fenced, ShapesBase):
    __tablename__ = "pairs"
    a: Mapped[int] = mapped_column(primary_key=True)
    b: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(20))
    __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "pair"}  # noqa: RUF012


class SubPair(Pair):
    """A composite key whose columns have other names, in another order."""

    __tablename__ = "subpairs"
    b2: Mapped[int] = mapped_column(primary_key=True)
    a2: Mapped[int] = mapped_column(primary_key=True)
    note: Mapped[str] = mapped_column(String(50), default="")
    __table_args__ = (ForeignKeyConstraint(["a2", "b2"], ["pairs.a", "pairs.b"]),)
    __mapper_args__ = {"polymorphic_identity": "sub"}  # noqa: RUF012


class Staff(sa_fence.Fenced, ShapesBase):
    __tablename__ = "staff"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(50))


class Boss(Staff):
    """Concrete table inheritance: its own table, which needs a fence column of its own."""

    __tablename__ = "bosses"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(50))
    budget: Mapped[int] = mapped_column(default=0)
    fence = sa_fence.fence_column()
    __mapper_args__ = {"concrete": True}  # noqa: RUF012


class Versioned(sa_fence.Fenced, ShapesBase):
    """Not an inheritance shape: a mapper whose UPDATE carries a version condition too."""

    __tablename__ = "versioned"
    id: Mapped[int] = mapped_column(primary_key=True)
    value: Mapped[str] = mapped_column(String(50))
    version: Mapped[int] = mapped_column(default=1)
    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012


class Swapped(sa_fence.Fenced, ShapesBase):
    """Not an inheritance shape: a mapper whose identity lists the key in another order."""

    __tablename__ = "swapped"
    a: Mapped[int] = mapped_column(primary_key=True)
    b: Mapped[int] = mapped_column(primary_key=True)
    value: Mapped[str] = mapped_column(String(50))

    @declared_attr.directive
    def __mapper_args__(cls) -> dict[str, Any]:
        return {"primary_key": [cls.__table__.c.b, cls.__table__.c.a]}


class Stamped(sa_fence.Fenced, ShapesBase):
    """Not an inheritance shape: a mapper that reads server values back in its UPDATE."""

    __tablename__ = "stamped"
    id: Mapped[int] = mapped_column(primary_key=True)
    value: Mapped[str] = mapped_column(String(50))
    stamp: Mapped[int] = mapped_column(default=0, onupdate=sa.text("stamped.stamp + 1"))
    __mapper_args__ = {"eager_defaults": True}  # noqa: RUF012


class Ticket(sa_fence.Fenced, ShapesBase):
    __tablename__ = "tickets"
    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(20))
    __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "ticket"}  # noqa: RUF012


class RenamedTicket(Ticket):
    """A joined subclass that maps the fence under another attribute name."""

    __tablename__ = "renamed_tickets"
    id: Mapped[int] = mapped_column(ForeignKey("tickets.id"), primary_key=True)
    note: Mapped[str] = mapped_column(String(50), default="")
    __mapper_args__ = {  # noqa: RUF012
        "polymorphic_identity": "renamed",
        "exclude_properties": ["fence"],
        "properties": {"seen_fence": Ticket.__table__.c.fence},
    }


subpairs = SubPair.__table__


@pytest.fixture(scope="module")
def scope_engine() -> Iterator[sa.Engine]:
    """A database of this module's own, with the shapes above (named as the lease-scope
    fixtures expect it)."""
    with fresh_database("shapes") as engine:
        ShapesBase.metadata.create_all(engine)
        yield engine


fencer = _scope_fixtures.fencer
make_session = _scope_fixtures.make_session


@pytest.fixture(autouse=True)
def _empty_tables(scope_engine: sa.Engine) -> Iterator[None]:
    yield
    with scope_engine.begin() as conn:
        conn.execute(
            sa.text(
                "TRUNCATE animals, docs, pairs, versioned, folders, kennels, staff, bosses, "
                "swapped, stamped, tickets CASCADE"
            )
        )


def rows(engine: sa.Engine) -> dict[str, tuple[Any, ...]]:
    """Each object's row, fence included, as the database holds it."""
    queries = {
        "dog": "SELECT name, bark, fence FROM animals JOIN dogs USING (id)",
        "audit": "SELECT title, summary, finding, fence FROM docs JOIN reports USING (id) "
        "JOIN audits USING (id)",
        "pair": "SELECT note, fence FROM pairs JOIN subpairs ON (a2, b2) = (a, b)",
    }
    with engine.connect() as conn:
        return {key: tuple(conn.execute(sa.text(sql)).one()) for key, sql in queries.items()}


#: One write of each shape, by which table it touches, as change(session, value).
WRITES: dict[str, tuple[str, Callable[[Session, str], Any]]] = {
    "unfenced base column, flush": ("dog", lambda s, v: setattr(s.get(Dog, 1), "name", v)),
    "unfenced base column, orm bulk by key": (
        "dog",
        lambda s, v: s.execute(update(Dog), [{"id": 1, "name": v}]),
    ),
    "third level, flush": ("audit", lambda s, v: setattr(s.get(Audit, 1), "finding", v)),
    "third level, orm bulk by key": (
        "audit",
        lambda s, v: s.execute(update(Audit), [{"id": 1, "finding": v}]),
    ),
    "second level of three, orm bulk by key": (
        "audit",
        lambda s, v: s.execute(update(Audit), [{"id": 1, "summary": v}]),
    ),
    "composite key, flush": ("pair", lambda s, v: setattr(s.get(SubPair, (1, 2)), "note", v)),
    "composite key, core executemany": (
        "pair",
        lambda s, v: s.execute(
            subpairs.update()
            .where(subpairs.c.a2 == sa.bindparam("x"), subpairs.c.b2 == sa.bindparam("y"))
            .values(note=sa.bindparam("v")),
            [{"x": 1, "y": 2, "v": v}],
        ),
    ),
}


def seed(fencer: sa_fence.Fencer, make_session: sessionmaker[Session]) -> None:
    with fencer.acquire("seed", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add_all(
            [
                Dog(id=1, name="initial", bark="initial"),
                Cat(id=2, name="cat"),
                Audit(id=1, title="initial", summary="initial", finding="initial"),
                SubPair(a=1, b=2, note="initial"),
                Swapped(a=1, b=2, value="initial"),
                Versioned(id=1, value="initial"),
                Stamped(id=1, value="initial"),
            ]
        )
        session.commit()


def written_by_b_after_as_grant(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], change: Callable[[Session], Any]
) -> tuple[sa_fence.Lease, sa_fence.Lease]:
    """A's lease, then B's (another name), which makes ``change`` and commits: each row it
    wrote carries a fence newer than A's token.  B is released; A is held."""
    a = fencer.acquire("a", 5)
    with fencer.acquire("b", 5) as b, make_session() as session:
        b.bind(session)
        change(session)
        session.commit()
    return a, b


def _write_every_object(session: Session) -> None:
    session.get(Dog, 1).bark = "B"
    session.get(Audit, 1).title = "B"
    session.get(SubPair, (1, 2)).note = "B"


def stale_and_newer(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> tuple[sa_fence.Lease, sa_fence.Lease]:
    """The seeded objects, every one written by B after A's grant."""
    seed(fencer, make_session)
    return written_by_b_after_as_grant(fencer, make_session, _write_every_object)


def refused_flush(
    a: sa_fence.Lease, make_session: sessionmaker[Session], change: Callable[[Session], Any]
) -> sa_fence.StaleTokenError:
    """A's bound session makes ``change`` and flushes: the StaleTokenError that refuses either
    (an ORM bulk UPDATE is refused as it is sent, a change to an object at the flush)."""

    def change_and_flush(session: Session) -> None:
        change(session)
        session.flush()

    with make_session() as session:
        a.bind(session)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            change_and_flush(session)
    return refused.value


def sent_by(session: Session) -> list[str]:
    """The SQL ``session``'s connection sends from now on (the list grows as it does)."""
    sent: list[str] = []
    sa.event.listen(
        session.connection(),
        "before_cursor_execute",
        lambda conn, cursor, statement, *_: sent.append(statement),
    )
    return sent


def refused_and_unchanged(
    a: sa_fence.Lease,
    b: sa_fence.Lease,
    make_session: sessionmaker[Session],
    change: Callable[[Session], Any],
    table: str,
    read: Callable[[], Any],
) -> None:
    """A's flush of ``change`` is refused by the fence of ``table`` that B wrote, and what
    ``read`` reads is as it was; A is released."""
    before = read()
    refused = refused_flush(a, make_session, change)
    assert refused.table == table
    assert refused.current_fences == (b.token,)
    assert read() == before
    a.release()


@pytest.mark.parametrize("write", list(WRITES))
def test_a_stale_write_to_any_table_of_a_fenced_object_is_refused_by_its_fence(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    write: str,
) -> None:
    """A holder of another name wrote every object after A's grant: A's write is refused
    whichever table it touches, and the rows keep B's values and fence."""
    a, b = stale_and_newer(fencer, make_session)
    before = rows(scope_engine)
    _, change = WRITES[write]
    refused = refused_flush(a, make_session, lambda session: change(session, "A"))
    assert refused.token == a.token
    assert refused.current_fences == (b.token,)
    assert rows(scope_engine) == before
    a.release()


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_to_any_table_of_a_fenced_object_advances_its_fence(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    write: str,
) -> None:
    seed(fencer, make_session)
    shape, change = WRITES[write]
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        change(session, "mine")
        session.commit()
    row = rows(scope_engine)[shape]
    assert "mine" in row
    assert row[-1] == lease.token


def test_an_unfenced_sibling_sharing_the_base_table_is_written_as_without_sa_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """Cat shares `animals` with the fenced Dog: its writes need no lease and send no fence."""
    seed(fencer, make_session)
    with make_session() as session:
        session.get(Cat, 2).name = "flushed"
        session.commit()
        session.execute(update(Cat), [{"id": 2, "name": "in bulk"}])
        session.execute(sa.update(Animal.__table__).where(Animal.id == 2).values(name="core"))
        session.commit()
    with scope_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT name FROM animals WHERE id = 2")).scalar() == "core"


async def test_a_stale_orm_bulk_write_through_an_async_session_is_refused_by_the_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """AsyncSession runs the same statement hook (through SQLAlchemy's greenlet bridge)."""
    a, b = stale_and_newer(fencer, make_session)
    before = rows(scope_engine)
    engine = create_async_engine(scope_engine.url.set(drivername="postgresql+psycopg_async"))
    try:
        make_async = sa_fence.install(async_sessionmaker(engine))
        for statement, params in [(update(Dog), {"name": "A"}), (update(Audit), {"finding": "A"})]:
            async with make_async() as session:
                a.bind(session)
                with pytest.raises(sa_fence.StaleTokenError) as refused:
                    await session.execute(statement, [{"id": 1, **params}])
            assert refused.value.current_fences == (b.token,)
    finally:
        await engine.dispose()
    assert rows(scope_engine) == before
    a.release()


def test_a_table_whose_key_is_not_the_fence_tables_is_refused_outside_a_flush(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """Which fence row a memos row belongs to is not in its key: a keyed write of it outside a
    flush is refused, saying why; the flush (which compares docs.fence itself) works."""
    memos = Memo.__table__
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Memo(id=9, memo_id=7, title="memo", body="initial"))
        session.commit()
        with pytest.raises(sa_fence.FencingConfigError) as refused:
            session.execute(
                memos.update().where(memos.c.memo_id == sa.bindparam("k")).values(body="core"),
                [{"k": 7}],
            )
        session.rollback()
        session.get(Memo, 9).body = "flushed"
        session.commit()
    assert "'memos'" in str(refused.value)
    assert "inheritance condition equate the keys" in str(refused.value)
    with scope_engine.connect() as conn:
        found = conn.execute(sa.text("SELECT body, fence FROM memos JOIN docs ON doc_id = id"))
        assert found.one() == ("flushed", lease.token)


def test_a_version_mismatch_is_sqlalchemys_stale_data_error_not_a_stale_token(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """The UPDATE's version condition skipped the row, not its fence (which holds this very
    token): SQLAlchemy's own error, which names the row count, not a StaleTokenError."""
    with fencer.acquire("a", 5) as lease, make_session() as first, make_session() as second:
        lease.bind(first)
        lease.bind(second)
        first.add(Versioned(id=1, value="initial"))
        first.commit()
        loaded = first.get(Versioned, 1)
        second.get(Versioned, 1).value = "second"
        second.commit()
        loaded.value = "first"
        with pytest.raises(sa.orm.exc.StaleDataError) as refused:
            first.flush()
    assert not isinstance(refused.value, sa_fence.StaleTokenError)
    with scope_engine.connect() as conn:
        row = conn.execute(sa.text("SELECT value, version, fence FROM versioned")).one()
    assert tuple(row) == ("second", 2, lease.token)


#: A report moved into or out of a folder's collection: the unit of work writes reports
#: (through the foreign key it sets, or in its post-update pass) for a Report that was not
#: changed itself.  (A report removed from a post-update collection is not written at all.)
MOVES = {
    "removed from a collection": ("reports", "remove"),
    "added to a collection": ("reports", "append"),
    "added, post-update": ("pinned", "append"),
}


def seed_folder(fencer: sa_fence.Fencer, make_session: sessionmaker[Session], move: str) -> None:
    relation, how = MOVES[move]
    with fencer.acquire("seed", 5) as lease, make_session() as session:
        lease.bind(session)
        folder, report = Folder(id=1), Report(id=5, title="initial", summary="initial")
        if how == "remove":
            getattr(folder, relation).append(report)
        session.add_all([folder, report])
        session.commit()


def move_report(session: Session, move: str) -> None:
    relation, how = MOVES[move]
    folder, report = session.get(Folder, 1), session.get(Report, 5)
    getattr(getattr(folder, relation), how)(report)
    assert report not in session.dirty  # the flush writes its row all the same


def report_row(engine: sa.Engine) -> tuple[Any, ...]:
    sql = "SELECT summary, folder_id, pin_folder_id, fence FROM docs JOIN reports USING (id)"
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text(sql)).one())


@pytest.mark.parametrize("move", list(MOVES))
def test_a_stale_flush_writing_a_joined_table_of_an_unchanged_object_is_refused_by_its_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine, move: str
) -> None:
    """The flush compares the fence of the objects it was asked to change; a row of reports it
    writes for another object's relationship is compared and advanced first, as outside a
    flush."""
    seed_folder(fencer, make_session, move)
    a, b = written_by_b_after_as_grant(
        fencer, make_session, lambda s: setattr(s.get(Report, 5), "summary", "B")
    )
    refused_and_unchanged(
        a, b, make_session, lambda s: move_report(s, move), "docs", lambda: report_row(scope_engine)
    )


@pytest.mark.parametrize("move", list(MOVES))
def test_a_flush_writing_a_joined_table_of_an_unchanged_object_advances_its_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine, move: str
) -> None:
    seed_folder(fencer, make_session, move)
    relation, how = MOVES[move]
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        sent = sent_by(session)
        move_report(session, move)
        session.commit()
    assert len([s for s in sent if s.startswith("UPDATE docs")]) == 1, sent  # compared once
    summary, folder_id, pin_folder_id, fence = report_row(scope_engine)
    moved = folder_id if relation == "reports" else pin_folder_id
    assert (summary, moved, fence) == ("initial", 1 if how == "append" else None, lease.token)


def move_animals(session: Session, how: str) -> None:
    """The Cat and the Dog appended to or removed from kennel 1, neither changed itself."""
    kennel = session.get(Kennel, 1)
    for animal in (session.get(Cat, 2), session.get(Dog, 1)):
        getattr(kennel.animals, how)(animal)


@pytest.mark.parametrize("how", ["append", "remove"])
def test_a_stale_flush_writing_the_shared_base_table_of_an_unchanged_dog_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine, how: str
) -> None:
    """animals is shared with the unfenced Cat: the flush's UPDATE of it for a Dog it did not
    flag finds the Dog in the identity map and compares dogs.fence first; the Cat's row in the
    same statement is written as without sa-fence."""
    seed(fencer, make_session)
    with fencer.acquire("seed", 5) as lease, make_session() as session:
        lease.bind(session)
        kennel = Kennel(id=1)
        if how == "remove":
            kennel.animals.extend([session.get(Dog, 1), session.get(Cat, 2)])
        session.add(kennel)
        session.commit()
    a, b = written_by_b_after_as_grant(
        fencer, make_session, lambda s: setattr(s.get(Dog, 1), "bark", "B")
    )
    refused_and_unchanged(
        a, b, make_session, lambda s: move_animals(s, how), "dogs", lambda: rows(scope_engine)
    )


def test_a_stale_flush_writing_the_shared_base_row_of_a_dog_loaded_with_an_identity_token(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """The Dog is found among the flush's states when the identity map holds it under an
    identity token (it was missed, and the stale flush committed)."""
    seed(fencer, make_session)
    a, b = written_by_b_after_as_grant(
        fencer, make_session, lambda s: setattr(s.get(Dog, 1), "bark", "B")
    )

    def move(session: Session) -> None:
        kennel = Kennel(id=1)
        session.add(kennel)
        kennel.animals.append(session.get(Dog, 1, identity_token="shard"))

    refused_and_unchanged(a, b, make_session, move, "dogs", lambda: rows(scope_engine))


def test_a_flush_writing_the_shared_base_table_advances_only_the_dogs_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed(fencer, make_session)
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        kennel = Kennel(id=1)
        kennel.animals.extend([session.get(Dog, 1), session.get(Cat, 2)])
        session.add(kennel)
        session.commit()
    with scope_engine.connect() as conn:
        found = conn.execute(sa.text("SELECT kind, kennel_id FROM animals ORDER BY id")).all()
    assert [tuple(row) for row in found] == [("dog", 1), ("cat", 1)]
    assert rows(scope_engine)["dog"][-1] == lease.token


def test_a_flush_of_a_changed_dog_sends_one_write_of_dogs(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """The flush flagged the changed Dog's fence itself: its UPDATE of animals sends no fenced
    UPDATE of dogs besides the flush's own."""
    seed(fencer, make_session)
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        session.get(Dog, 1).name = "mine"
        sent = sent_by(session)
        session.commit()
    assert len([s for s in sent if s.startswith("UPDATE dogs")]) == 1, sent


def test_without_a_lease_a_flush_writing_the_shared_base_table_for_a_dog_is_refused(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer, scope_engine: sa.Engine
) -> None:
    """As for a flush of a changed Dog: the unbound session may not write its rows, a Cat's
    are written as without sa-fence, and unfenced() lets the Dog's through."""
    seed(fencer, make_session)
    with make_session() as session:
        kennel = Kennel(id=1, animals=[session.get(Cat, 2)])
        session.add(kennel)
        session.commit()
        kennel.animals.append(session.get(Dog, 1))
        with pytest.raises(sa_fence.UnfencedWriteError):
            session.flush()
        session.rollback()
        with sa_fence.unfenced(session):
            session.get(Kennel, 1).animals.append(session.get(Dog, 1))
            session.commit()
    with scope_engine.connect() as conn:
        found = conn.execute(sa.text("SELECT kind, kennel_id FROM animals ORDER BY id")).all()
    assert [tuple(row) for row in found] == [("dog", 1), ("cat", 1)]


def test_the_current_holder_deletes_a_dog_and_its_shared_base_row(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """The flush deletes dogs (compared) before animals: the DELETE of the shared table's row
    is not preceded by a fenced UPDATE of the dogs row already gone."""
    seed(fencer, make_session)
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        session.delete(session.get(Dog, 1))
        session.commit()
    with scope_engine.connect() as conn:
        kinds = conn.execute(sa.text("SELECT kind FROM animals")).scalars().all()
    assert kinds == ["cat"]


def test_a_concrete_subclass_with_a_fence_of_its_own_is_fenced_on_its_table(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    with fencer.acquire("seed", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Boss(id=1, name="initial"))
        session.commit()
    a, b = written_by_b_after_as_grant(
        fencer, make_session, lambda s: setattr(s.get(Boss, 1), "budget", 2)
    )
    refused = refused_flush(
        a, make_session, lambda session: setattr(session.get(Boss, 1), "budget", 3)
    )
    assert refused.table == "bosses"
    with scope_engine.connect() as conn:
        row = conn.execute(sa.text("SELECT budget, fence FROM bosses")).one()
    assert tuple(row) == (2, b.token)
    a.release()


def test_a_concrete_subclass_of_a_fenced_class_without_a_fence_is_refused_when_mapped() -> None:
    """The mixin's column is the parent's: without a fence of its own, the subclass's table
    would be written with no fencing at all."""

    class Base(DeclarativeBase):
        pass

    class Employee(sa_fence.Fenced, Base):
        __tablename__ = "employees"
        id: Mapped[int] = mapped_column(primary_key=True)

    class Manager(Employee):
        __tablename__ = "managers"
        id: Mapped[int] = mapped_column(primary_key=True)
        __mapper_args__ = {"concrete": True}  # noqa: RUF012

    try:
        with pytest.raises(sa_fence.FencingConfigError) as refused:
            Base.registry.configure()
    finally:
        Base.registry.dispose()  # a failed mapper would fail every later configure_mappers()
    assert "Manager" in str(refused.value)
    assert "'managers' has no fence column" in str(refused.value)
    assert "fence = sa_fence.fence_column()" in str(refused.value)
    sa.orm.configure_mappers()  # the other registries configure as before


async def test_a_stale_async_flush_writing_joined_tables_of_unchanged_objects_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """AsyncSession flushes through the same hook: the rows it writes for a Report and a Dog
    it was not asked to change are compared first (``reports`` under ``docs``, and the shared
    ``animals`` matched through the identity map)."""
    seed(fencer, make_session)
    seed_folder(fencer, make_session, "added to a collection")
    with fencer.acquire("seed", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Kennel(id=1))
        session.commit()
    a, b = written_by_b_after_as_grant(fencer, make_session, _write_report_and_dog)
    engine = create_async_engine(scope_engine.url.set(drivername="postgresql+psycopg_async"))
    try:
        make_async = sa_fence.install(async_sessionmaker(engine))
        for move, table in [(_add_report, "docs"), (_add_dog, "dogs")]:
            async with make_async() as session:
                a.bind(session)
                await session.run_sync(move)
                with pytest.raises(sa_fence.StaleTokenError) as refused:
                    await session.flush()
            assert (refused.value.table, refused.value.current_fences) == (table, (b.token,))
    finally:
        await engine.dispose()
    sql = "SELECT r.folder_id, a.kennel_id, d.fence, g.fence FROM reports r, docs d, animals a, "
    sql += "dogs g WHERE r.id = 5 AND d.id = 5 AND a.id = 1 AND g.id = 1"
    with scope_engine.connect() as conn:
        assert tuple(conn.execute(sa.text(sql)).one()) == (None, None, b.token, b.token)
    a.release()


def _write_report_and_dog(session: Session) -> None:
    session.get(Report, 5).summary = "B"
    session.get(Dog, 1).bark = "B"


def _add_report(session: Session) -> None:
    move_report(session, "added to a collection")


def _add_dog(session: Session) -> None:
    kennel = session.get(Kennel, 1)  # held: a collection event needs its parent alive
    kennel.animals.append(session.get(Dog, 1))


@pytest.mark.parametrize("stale", [True, False], ids=["stale holder", "current holder"])
def test_a_cascade_delete_of_a_joined_subclass_compares_its_base_rows_fence(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    stale: bool,
) -> None:
    """Deleting a Folder deletes the Reports it owns (an ORM cascade): their docs rows are
    deleted with the fence compared, as for session.delete()."""
    with fencer.acquire("seed", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Folder(id=1, owned=[Report(id=5, title="initial", summary="initial")]))
        session.commit()
    a, b = written_by_b_after_as_grant(
        fencer, make_session, lambda s: setattr(s.get(Report, 5), "summary", "B")
    )
    holder = a if stale else fencer.acquire("c", 5)
    if stale:
        refused = refused_flush(holder, make_session, lambda s: s.delete(s.get(Folder, 1)))
        assert (refused.table, refused.current_fences) == ("docs", (b.token,))
    else:
        with make_session() as session:
            holder.bind(session)
            session.delete(session.get(Folder, 1))
            session.commit()
    with scope_engine.connect() as conn:
        left = conn.execute(sa.text("SELECT count(*) FROM reports WHERE id = 5")).scalar()
    assert left == (1 if stale else 0)
    a.release()
    if not stale:
        holder.release()


#: One change of each shape's object, returning the object: the fence on a joined subclass's
#: table, on the base of three levels, on a composite key, in a mapper whose identity lists the
#: key in another order than the table, beside a version condition, with server values read
#: back in the UPDATE (``eager_defaults``).
CHANGED: dict[str, Callable[[Session], Any]] = {
    "fence on a subclass's table": lambda s: _changed(s.get(Dog, 1), name="mine"),
    "third level": lambda s: _changed(s.get(Audit, 1), finding="mine"),
    "composite key": lambda s: _changed(s.get(SubPair, (1, 2)), note="mine"),
    "identity in another order": lambda s: _changed(s.get(Swapped, (2, 1)), value="mine"),
    "version condition": lambda s: _changed(s.get(Versioned, 1), value="mine"),
    "identity token": lambda s: _changed(s.get(Dog, 1, identity_token="shard"), bark="mine"),
    "eager defaults": lambda s: _changed(s.get(Stamped, 1), value="mine"),
}


def _changed(obj: Any, **values: str) -> Any:
    for name, value in values.items():
        setattr(obj, name, value)
    return obj


@pytest.mark.parametrize("shape", list(CHANGED))
def test_a_flushed_object_shows_its_rows_token_without_reading_it_back(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    shape: str,
) -> None:
    """The flush writes the fence as a bare parameter, which the ORM neither expires nor reads
    back: sa-fence sets each written object's fence to the token itself, so reading it sends no
    query and shows the row's value (not the old fence)."""
    seed(fencer, make_session)
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        obj = CHANGED[shape](session)
        session.flush()
        sent = sent_by(session)
        assert obj.fence == lease.token
        assert sent == []
        session.commit()
    table = sa.inspect(obj).mapper.columns["fence"].table.name
    with scope_engine.connect() as conn:
        fences = conn.execute(sa.text(f"SELECT fence FROM {table}")).scalars().all()
    assert fences == [lease.token]


def test_an_object_the_flush_did_not_write_keeps_its_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """Only the objects whose rows the UPDATE wrote are shown the token, not every object the
    flush looked at (one set to the value it had is dirty, and written by no statement)."""
    seed(fencer, make_session)
    with make_session() as session:
        seeded = session.get(SubPair, (1, 2)).fence
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        untouched, changed = session.get(SubPair, (1, 2)), session.get(Dog, 1)
        untouched.note = untouched.note
        changed.bark = "mine"
        assert untouched in session.dirty
        session.flush()
        assert (changed.fence, untouched.fence) == (lease.token, seeded)


def test_a_hierarchy_naming_its_fence_twice_has_the_fence_read_back(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """The hook shows a written object its token under the fence's one attribute name; where a
    subclass names it otherwise, the flush writes the fence as before, and the ORM expires it:
    each object still reads its row's token."""
    with fencer.acquire("seed", 5) as seeded, make_session() as session:
        seeded.bind(session)
        session.add_all([Ticket(id=1), RenamedTicket(id=2, note="initial")])
        session.commit()
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        ticket, renamed = session.get(Ticket, 1), session.get(RenamedTicket, 2)
        assert (ticket.fence, renamed.seen_fence) == (seeded.token, seeded.token)
        ticket.kind, renamed.note = "ticket", "mine"
        flag_modified(ticket, "kind")
        session.flush()
        assert (ticket.fence, renamed.seen_fence) == (lease.token, lease.token)


def test_a_savepoint_rolled_back_after_the_flush_reads_the_old_fence_again(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """The token shown to a flushed object is undone with the savepoint, as the row is."""
    seed(fencer, make_session)
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        dog = session.get(Dog, 1)
        seeded = dog.fence
        savepoint = session.begin_nested()
        dog.bark = "mine"
        session.flush()
        assert dog.fence == lease.token
        savepoint.rollback()
        assert (dog.bark, dog.fence) == ("initial", seeded)


def test_an_eager_defaults_flush_reads_its_server_values_in_the_one_update_it_sends(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """A mapper with ``eager_defaults`` reads the UPDATE's server-side values back with
    RETURNING: the fenced UPDATE keeps that RETURNING, and showing the token adds no SELECT."""
    seed(fencer, make_session)
    with fencer.acquire("a", 5) as lease, make_session() as session:
        lease.bind(session)
        stamped = session.get(Stamped, 1)
        stamped.value = "mine"
        sent = sent_by(session)
        session.flush()
        assert [s.split()[0] for s in sent] == ["UPDATE"]
        assert "RETURNING stamped.stamp" in sent[0]
        flushed = list(sent)
        assert (stamped.stamp, stamped.fence) == (1, lease.token)
        assert sent == flushed


async def test_an_async_flush_shows_the_token_without_an_await(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """In an AsyncSession a flushed object's fence reads without ``awaitable_attrs``: it holds
    the token, not an expired attribute whose load would need the event loop."""
    seed(fencer, make_session)
    engine = create_async_engine(scope_engine.url.set(drivername="postgresql+psycopg_async"))
    try:
        make_async = sa_fence.install(async_sessionmaker(engine))
        with fencer.acquire("a", 5) as lease:
            async with make_async() as session:
                lease.bind(session)
                dog = await session.get(Dog, 1)
                assert dog is not None
                dog.bark = "mine"
                await session.flush()
                assert dog.fence == lease.token  # an expired attribute raises MissingGreenlet
                await session.commit()
    finally:
        await engine.dispose()
    with scope_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT fence FROM dogs")).scalar_one() == lease.token


@pytest.fixture(params=["schemas"])
def sharded(
    request: pytest.FixtureRequest, scope_engine: sa.Engine
) -> Iterator[sessionmaker[Session]]:
    """A ShardedSession over two shards, schemas of the module's database (the same tables, the
    same primary keys; its objects carry the shard as their identity token); with the param
    "databases", shard B's schema is in a database of its own, outside lease scope."""
    with contextlib.ExitStack() as stack:
        across = request.param == "databases"
        hosts = {"shard_a": scope_engine, "shard_b": scope_engine}
        if across:
            hosts["shard_b"] = stack.enter_context(fresh_database("shard_b"))
        for shard, host in hosts.items():
            with host.begin() as conn:
                conn.execute(sa.text(f"CREATE SCHEMA {shard}"))
            stack.callback(_drop_schema, host, shard)
        engines = {s: e.execution_options(schema_translate_map={None: s}) for s, e in hosts.items()}
        for engine in engines.values():
            ShapesBase.metadata.create_all(engine)
        yield sa_fence.install(
            sessionmaker(
                class_=ShardedSession,
                shards=engines,
                shard_chooser=lambda mapper, obj, clause=None: obj.shard,
                identity_chooser=lambda *args, **kwargs: list(SHARDS),
                execute_chooser=lambda context: list(SHARDS),
            )
        )


def _drop_schema(engine: sa.Engine, schema: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))


SHARDS = ("shard_a", "shard_b")


def in_shard(session: Session, cls: type[Any], key: Any, shard: str) -> Any:
    obj = session.get(cls, key, identity_token=shard)
    obj.shard = shard  # where shard_chooser sends it
    return obj


def seed_shards(fencer: sa_fence.Fencer, sharded: sessionmaker[Session], *objs: Any) -> None:
    with fencer.acquire("seed", 5) as lease, sharded() as session:
        lease.bind(session)
        session.add_all(objs)
        session.commit()


def sharded_obj(obj: Any, shard: str) -> Any:
    obj.shard = shard
    return obj


def refused_if_stale_in_shards(
    fencer: sa_fence.Fencer,
    sharded: sessionmaker[Session],
    engine: sa.Engine,
    stale: bool,
    *,
    newer: Callable[[Session], Any],
    change: Callable[[Session], Any],
    table: str,
    moved: str,
) -> None:
    """A commits ``change`` (moving one object into a collection of its shard), refused by the
    fence of ``table`` when B, of another name and granted after A, first wrote ``newer``.
    ``moved`` reads the moved object's foreign key and fence: unchanged when refused, else
    moved and fenced with A's token."""
    a = fencer.acquire("a", 30)
    b = fencer.acquire("b", 30) if stale else None
    if b is not None:
        with sharded() as session:
            b.bind(session)
            newer(session)
            session.commit()
    with sharded() as session:
        a.bind(session)
        change(session)
        if b is not None:
            with pytest.raises(sa_fence.StaleTokenError) as refused:
                session.commit()
            assert (refused.value.table, refused.value.current_fences) == (table, (b.token,))
        else:
            session.commit()
    with engine.connect() as conn:
        row = tuple(conn.execute(sa.text(moved)).one())
    assert row == ((None, b.token) if b is not None else (1, a.token))


@pytest.mark.parametrize("sharded", ["schemas", "databases"], indirect=True)
@pytest.mark.parametrize("dog_last", [True, False], ids=["dog moved last", "dog moved first"])
@pytest.mark.parametrize("stale", [True, False], ids=["stale holder", "current holder"])
def test_a_shared_base_row_is_compared_by_the_object_in_its_own_shard(
    fencer: sa_fence.Fencer,
    sharded: sessionmaker[Session],
    scope_engine: sa.Engine,
    dog_last: bool,
    stale: bool,
) -> None:
    """Shard A holds Dog 1, shard B Cat 1: one primary key under two identity tokens (shard B
    in the same database or in another, outside lease scope: the row fence alone). Moving
    both into a kennel writes ``animals`` row 1 in each shard; each statement's row is matched
    with the object the flush sends through that statement's connection. The Dog's is compared
    with dogs.fence (a stale holder refused), the Cat's is not (a current holder commits; it was
    taken for the Dog, the Dog for the Cat: a stale write went through, or a missing dogs row
    in shard B refused the current holder)."""
    seed_shards(
        fencer,
        sharded,
        sharded_obj(Dog(id=1, name="dog", bark="initial"), "shard_a"),
        sharded_obj(Cat(id=1, name="cat"), "shard_b"),
        *(sharded_obj(Kennel(id=1), shard) for shard in SHARDS),
    )

    def move(session: Session) -> None:
        dog, cat = in_shard(session, Dog, 1, "shard_a"), in_shard(session, Cat, 1, "shard_b")
        moves = [
            (in_shard(session, Kennel, 1, s), animal)
            for s, animal in zip(SHARDS, (dog, cat), strict=True)
        ]
        for kennel, _ in moves:
            assert kennel.animals == []  # loaded now: no autoflush between the moves
        for kennel, animal in reversed(moves) if dog_last else moves:
            kennel.animals.append(animal)

    refused_if_stale_in_shards(
        fencer,
        sharded,
        scope_engine,
        stale,
        newer=lambda s: setattr(in_shard(s, Dog, 1, "shard_a"), "bark", "B"),
        change=move,
        table="dogs",
        moved="SELECT a.kennel_id, d.fence FROM shard_a.animals a JOIN shard_a.dogs d USING (id)",
    )


@pytest.mark.parametrize("changed_shard", SHARDS)
def test_a_flushed_object_is_shown_the_token_in_its_own_shard_only(
    fencer: sa_fence.Fencer, sharded: sessionmaker[Session], changed_shard: str
) -> None:
    """Dog 2 in both shards, both in the flush, only one changed: it shows the token, the
    other (set to the value it had: dirty, and written by no statement) keeps the fence it was
    loaded with."""
    seed_shards(
        fencer, sharded, *(sharded_obj(Dog(id=2, name="dog", bark="initial"), s) for s in SHARDS)
    )
    with fencer.acquire("a", 5) as lease, sharded() as session:
        lease.bind(session)
        dogs = {shard: in_shard(session, Dog, 2, shard) for shard in SHARDS}
        changed = dogs.pop(changed_shard)
        (untouched,) = dogs.values()
        seeded = untouched.fence
        untouched.bark, changed.bark = untouched.bark, "mine"
        assert untouched in session.dirty
        session.flush()
        assert (changed.fence, untouched.fence) == (lease.token, seeded)


@pytest.mark.parametrize("stale", [True, False], ids=["stale holder", "current holder"])
def test_a_joined_row_is_compared_unless_its_own_shards_object_was_flagged(
    fencer: sa_fence.Fencer,
    sharded: sessionmaker[Session],
    scope_engine: sa.Engine,
    stale: bool,
) -> None:
    """Report 5 in both shards: shard A's changed (the flush flags its fence and compares its
    docs row itself), shard B's added to a folder (its reports row written, its fence not
    flagged). Shard B's row is compared first: the flagged Report of shard A does not stand
    for it."""
    seed_shards(
        fencer,
        sharded,
        *(sharded_obj(Report(id=5, title="initial", summary="initial"), s) for s in SHARDS),
        sharded_obj(Folder(id=1), "shard_b"),
    )

    def change_and_move(session: Session) -> None:
        folder = in_shard(session, Folder, 1, "shard_b")
        moved = in_shard(session, Report, 5, "shard_b")
        changed = in_shard(session, Report, 5, "shard_a")
        assert folder.reports == []  # all loaded now: no autoflush between the changes
        changed.summary = "A"
        folder.reports.append(moved)

    refused_if_stale_in_shards(
        fencer,
        sharded,
        scope_engine,
        stale,
        newer=lambda s: setattr(in_shard(s, Report, 5, "shard_b"), "summary", "B"),
        change=change_and_move,
        table="docs",
        moved="SELECT r.folder_id, d.fence FROM shard_b.reports r JOIN shard_b.docs d USING (id)",
    )


def test_a_stale_holders_writes_in_every_shard_of_the_registers_database_are_refused_at_commit(
    fencer: sa_fence.Fencer, sharded: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """Lease scope in a ShardedSession: each shard's connection is armed, so A's transaction,
    whose name was granted to B since, commits in no shard (both tables here are unfenced:
    only lease scope refuses)."""
    a = fencer.acquire("job", 5)
    with sharded() as session:
        a.bind(session)
        assert expire(a)
        b = fencer.acquire("job", 5)
        session.add_all(
            [sharded_obj(Kennel(id=7), "shard_a"), sharded_obj(Folder(id=7), "shard_b")]
        )
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            session.commit()
    assert (refused.value.statement, refused.value.newest_token) == ("COMMIT", b.token)
    sql = "SELECT (SELECT count(*) FROM shard_a.kennels) + (SELECT count(*) FROM shard_b.folders)"
    with scope_engine.connect() as conn:
        assert conn.execute(sa.text(sql)).scalar_one() == 0
    b.release()


DOCS, REPORTS = ShapesBase.metadata.tables["docs"], ShapesBase.metadata.tables["reports"]


def docs_in(sharded: sessionmaker[Session], shard: str) -> dict[int, dict[str, Any]]:
    """Each Doc's row in ``shard`` by id, as that shard's database holds it."""
    query = (
        sa.select(DOCS.c.id, DOCS.c.title, REPORTS.c.summary, DOCS.c.fence)
        .outerjoin_from(DOCS, REPORTS)
        .order_by(DOCS.c.id)
    )
    with sharded() as session:
        rows = session.connection(bind_arguments={"shard_id": shard}).execute(query)
        return {row.id: row._asdict() for row in rows}


def seed_docs_in_shards(fencer: sa_fence.Fencer, sharded: sessionmaker[Session]) -> None:
    """Doc 2 and Report 3 in each shard: the same primary keys, the seed's fence."""
    seed_shards(
        fencer,
        sharded,
        *(
            sharded_obj(doc, shard)
            for shard in SHARDS
            for doc in (Doc(id=2, title="seed"), Report(id=3, title="seed", summary="seed"))
        ),
    )


def docs_written_by_b_in(
    fencer: sa_fence.Fencer,
    sharded: sessionmaker[Session],
    shard: str,
    *,
    after_a_ended: bool = False,
) -> tuple[sa_fence.Lease, sa_fence.Lease]:
    """The seeded docs; then A's lease, then B's, which writes Doc 2 and Report 3 in ``shard``
    only: their fence there is newer than A's token, the other shard's older.  B's lease is of
    another name (A is stale to those rows only), or, ``after_a_ended``, of A's own name once
    A's lease ended in Redis (A is stale at COMMIT too).  B is released; A believes it holds."""
    seed_docs_in_shards(fencer, sharded)
    a = fencer.acquire("a", 30)
    if after_a_ended:
        assert expire(a)
    with fencer.acquire("a" if after_a_ended else "b", 30) as b, sharded() as session:
        b.bind(session)
        in_shard(session, Doc, 2, shard).title = "B"
        in_shard(session, Report, 3, shard).summary = "B"
        session.commit()
    return a, b


class ShardWrite(NamedTuple):
    """A bulk or Core write of one row in one shard."""

    doc: int  # the id of the Doc whose row it writes
    column: str | None  # the column it sets; None: it deletes the row
    send: Callable[[Session, str, str], Any]  # send(session, shard, value) -> its result


def written(
    before: dict[int, dict[str, Any]], write: ShardWrite, value: str, token: int
) -> dict[int, dict[str, Any]]:
    """A shard's rows as ``before``, once ``write`` went through there under ``token``."""
    if write.column is None:
        return {doc: row for doc, row in before.items() if doc != write.doc}
    return {**before, write.doc: {**before[write.doc], write.column: value, "fence": token}}


def _on(session: Session, shard: str) -> sa.Connection:
    return session.connection(bind_arguments={"shard_id": shard})


#: Writes whose WHERE clause pins the primary key to a bind: a row skipped as newer is refused.
KEYED_SHARD_WRITES = {
    "orm update pinned by a bind": ShardWrite(
        2,
        "title",
        lambda s, shard, v: s.execute(
            update(Doc).where(Doc.id == sa.bindparam("key")).values(title=v),
            {"key": 2},
            bind_arguments={"shard_id": shard},
        ),
    ),
    "orm update of a joined table pinned by a bind": ShardWrite(
        3,
        "summary",
        lambda s, shard, v: s.execute(
            update(Report).where(Report.id == sa.bindparam("key")).values(summary=v),
            {"key": 3},
            bind_arguments={"shard_id": shard},
        ),
    ),
    "orm delete pinned by a bind, shard by option": ShardWrite(
        2,
        None,
        lambda s, shard, v: s.execute(
            delete(Doc).where(Doc.id == sa.bindparam("key")).options(set_shard_id(shard)),
            {"key": 2},
        ),
    ),
    "core update on the shard's connection": ShardWrite(
        2,
        "title",
        lambda s, shard, v: _on(s, shard).execute(
            DOCS.update().where(DOCS.c.id == sa.bindparam("key")).values(title=sa.bindparam("v")),
            [{"key": 2, "v": v}],
        ),
    ),
    "core update of a joined table on the shard's connection": ShardWrite(
        3,
        "summary",
        lambda s, shard, v: _on(s, shard).execute(
            REPORTS.update()
            .where(REPORTS.c.id == sa.bindparam("key"))
            .values(summary=sa.bindparam("v")),
            [{"key": 3, "v": v}],
        ),
    ),
    "core delete through the session": ShardWrite(
        2,
        None,
        lambda s, shard, v: s.execute(
            DOCS.delete().where(DOCS.c.id == sa.bindparam("key")),
            [{"key": 2}],
            bind_arguments={"shard_id": shard},
        ),
    ),
}

#: Writes by criteria (the key compared with a value): a row skipped as newer is skipped.
CRITERIA_SHARD_WRITES = {
    "orm update by criteria": ShardWrite(
        2,
        "title",
        lambda s, shard, v: s.execute(
            update(Doc).where(Doc.id == 2).values(title=v), bind_arguments={"shard_id": shard}
        ),
    ),
    "orm delete by criteria, shard by identity token": ShardWrite(
        2,
        None,
        lambda s, shard, v: s.execute(
            delete(Doc).where(Doc.id == 2), execution_options={"identity_token": shard}
        ),
    ),
    "core update by criteria on the shard's connection": ShardWrite(
        2,
        "title",
        lambda s, shard, v: _on(s, shard).execute(
            DOCS.update().where(DOCS.c.id == 2).values(title=v)
        ),
    ),
}


@pytest.mark.parametrize("sharded", ["schemas", "databases"], indirect=True)
@pytest.mark.parametrize("write", list(KEYED_SHARD_WRITES))
def test_a_stale_keyed_write_in_one_shard_is_refused_and_goes_through_in_the_other(
    fencer: sa_fence.Fencer, sharded: sessionmaker[Session], write: str
) -> None:
    """Doc 2 and Report 3 in both shards, written in shard A by B (another name) after A's
    grant. A's bulk or Core write pinning the key to a bind is refused by the row fence as it is
    sent to shard A (its fence compared on shard A's connection), and shard A's row keeps B's
    values; the same write to shard B, whose row is older than A's token, goes through and
    commits (shard B in the register's database or in another: A's name was not granted since,
    so lease scope refuses neither), writing A's token there and nothing in shard A."""
    a, b = docs_written_by_b_in(fencer, sharded, "shard_a")
    before = {shard: docs_in(sharded, shard) for shard in SHARDS}
    shard_write = KEYED_SHARD_WRITES[write]
    with sharded() as session:
        a.bind(session)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            shard_write.send(session, "shard_a", "A")
    deletes = shard_write.column is None
    assert (refused.value.statement, refused.value.table) == (
        "DELETE" if deletes else "UPDATE",
        "docs",
    )
    assert refused.value.primary_keys == ((shard_write.doc,),)
    assert refused.value.current_fences == (b.token,)
    assert docs_in(sharded, "shard_a") == before["shard_a"]
    with sharded() as session:
        a.bind(session)
        assert shard_write.send(session, "shard_b", "A").rowcount == 1
        session.commit()
    assert docs_in(sharded, "shard_a") == before["shard_a"]
    assert docs_in(sharded, "shard_b") == written(before["shard_b"], shard_write, "A", a.token)
    a.release()


@pytest.mark.parametrize("sharded", ["schemas", "databases"], indirect=True)
@pytest.mark.parametrize("write", list(CRITERIA_SHARD_WRITES))
def test_a_stale_criteria_write_in_one_shard_skips_the_newer_row_and_writes_the_others(
    fencer: sa_fence.Fencer, sharded: sessionmaker[Session], write: str
) -> None:
    """As above, by criteria: in shard A the row B wrote is skipped, silently (docs/statements.md),
    and so is its object in A's session (sa-fence's synchronize_session="fetch": "evaluate"
    would give it the values of a write that did not happen, or mark it deleted), which the
    write to shard B does not touch either; in shard B, in the same transaction, the older row
    is written, and the transaction commits."""
    a, _ = docs_written_by_b_in(fencer, sharded, "shard_a")
    before = {shard: docs_in(sharded, shard) for shard in SHARDS}
    shard_write = CRITERIA_SHARD_WRITES[write]
    with sharded() as session:
        a.bind(session)
        newer = in_shard(session, Doc, 2, "shard_a")
        older = in_shard(session, Doc, 2, "shard_b")
        assert (newer.title, older.title) == ("B", "seed")
        assert shard_write.send(session, "shard_a", "A").rowcount == 0
        assert (newer.title, sa.inspect(newer).was_deleted) == ("B", False)
        assert shard_write.send(session, "shard_b", "A").rowcount == 1
        assert (newer.title, sa.inspect(newer).was_deleted) == ("B", False)
        session.commit()
    assert docs_in(sharded, "shard_a") == before["shard_a"]
    assert docs_in(sharded, "shard_b") == written(before["shard_b"], shard_write, "A", a.token)
    a.release()


@pytest.mark.parametrize("shard", SHARDS)
@pytest.mark.parametrize("write", list(KEYED_SHARD_WRITES | CRITERIA_SHARD_WRITES))
def test_a_current_holders_write_to_one_shard_carries_its_token_there_and_nowhere_else(
    fencer: sa_fence.Fencer, sharded: sessionmaker[Session], shard: str, write: str
) -> None:
    """The same key in both shards: the current holder's write to one shard writes its value
    and its token as the row's fence there (or deletes the row); the other shard's row keeps
    its values and fence. (A shard in another database: the tests above, whose write to shard
    B goes through.)"""
    seed_docs_in_shards(fencer, sharded)
    before = {s: docs_in(sharded, s) for s in SHARDS}
    shard_write = (KEYED_SHARD_WRITES | CRITERIA_SHARD_WRITES)[write]
    with fencer.acquire("a", 5) as lease, sharded() as session:
        lease.bind(session)
        assert shard_write.send(session, shard, "mine").rowcount == 1
        session.commit()
    (other,) = set(SHARDS) - {shard}
    assert docs_in(sharded, shard) == written(before[shard], shard_write, "mine", lease.token)
    assert docs_in(sharded, other) == before[other]


@pytest.mark.parametrize("sharded", ["schemas", "databases"], indirect=True)
def test_a_keyed_write_sent_to_every_shard_is_refused_by_the_shard_whose_row_is_newer(
    fencer: sa_fence.Fencer, sharded: sessionmaker[Session]
) -> None:
    """An ORM statement given no shard runs in each shard in turn (``execution_options=
    {"shard_id": ...}`` names none: ShardedSession reads ``shard_id`` from the bind arguments):
    shard A's older row is written, shard B's, which B wrote, refuses it; the session commits
    nothing, in either shard."""
    a, b = docs_written_by_b_in(fencer, sharded, "shard_b")
    before = {shard: docs_in(sharded, shard) for shard in SHARDS}
    statement = update(Doc).where(Doc.id == sa.bindparam("key")).values(title="A")
    with sharded() as session:
        a.bind(session)
        updates: list[str] = []
        for shard in SHARDS:
            sa.event.listen(
                _on(session, shard),
                "before_cursor_execute",
                lambda conn, cursor, sql, *_: updates.append(sql.split(" SET")[0]),
            )
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            session.execute(statement, {"key": 2}, execution_options={"shard_id": "shard_a"})
        assert [sql for sql in updates if sql.startswith("UPDATE")] == [
            "UPDATE shard_a.docs",
            "UPDATE shard_b.docs",
        ]
        with pytest.raises(sa_fence.FenceError):
            session.commit()
    assert (refused.value.primary_keys, refused.value.current_fences) == (((2,),), (b.token,))
    assert {shard: docs_in(sharded, shard) for shard in SHARDS} == before
    a.release()


@pytest.mark.parametrize("sharded", ["schemas", "databases"], indirect=True)
def test_a_stale_holders_write_is_refused_at_the_statement_by_the_row_fence_and_at_commit_by_scope(
    fencer: sa_fence.Fencer, sharded: sessionmaker[Session]
) -> None:
    """A's lease ended and its name was granted to B, which wrote shard A's Doc 2. A's keyed
    UPDATE of shard A is refused as it is sent, by the row fence (``table`` and
    ``primary_keys`` set); the same UPDATE of shard B, whose row is older than A's token, is
    not, and is refused at COMMIT by lease scope (``statement == "COMMIT"``, no table) when
    shard B is a schema of the register's database. In a database of its own, shard B has its
    row fence only (docs/guarantees.md, "Other databases"): A's write commits there."""
    a, b = docs_written_by_b_in(fencer, sharded, "shard_a", after_a_ended=True)
    before = {shard: docs_in(sharded, shard) for shard in SHARDS}
    shard_write = KEYED_SHARD_WRITES["orm update pinned by a bind"]
    with sharded() as session:
        a.bind(session)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            shard_write.send(session, "shard_a", "A")
    assert (refused.value.statement, refused.value.table) == ("UPDATE", "docs")
    assert (refused.value.primary_keys, refused.value.current_fences) == (((2,),), (b.token,))
    in_scope = sharded.kw["shards"]["shard_b"].url == fencer.engine.url  # the register's database
    with sharded() as session:
        a.bind(session)
        assert shard_write.send(session, "shard_b", "A").rowcount == 1
        if in_scope:
            with pytest.raises(sa_fence.StaleTokenError) as at_commit:
                session.commit()
            assert (at_commit.value.statement, at_commit.value.table) == ("COMMIT", None)
            assert at_commit.value.newest_token == b.token
        else:
            session.commit()
    assert docs_in(sharded, "shard_a") == before["shard_a"]
    expected = (
        before["shard_b"] if in_scope else written(before["shard_b"], shard_write, "A", a.token)
    )
    assert docs_in(sharded, "shard_b") == expected


def test_an_orm_bulk_update_by_primary_key_is_refused_by_sqlalchemy_in_a_sharded_session(
    fencer: sa_fence.Fencer, sharded: sessionmaker[Session]
) -> None:
    """Not sa-fence's: SQLAlchemy's bulk UPDATE by primary key does not support a session that
    routes objects to connections (``update(Doc), [{"id": ...}]``), so in a ShardedSession the
    keyed writes above stand for it. Should SQLAlchemy support it, this fails: test its row
    fence in the shards then."""
    seed_docs_in_shards(fencer, sharded)
    before = {shard: docs_in(sharded, shard) for shard in SHARDS}
    with fencer.acquire("a", 5) as lease, sharded() as session:
        lease.bind(session)
        with pytest.raises(NotImplementedError, match="sharding not supported in bulk_update"):
            session.execute(
                update(Doc), [{"id": 2, "title": "A"}], bind_arguments={"shard_id": "shard_a"}
            )
    assert {shard: docs_in(sharded, shard) for shard in SHARDS} == before
