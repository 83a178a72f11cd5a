"""Expression properties on fenced and unfenced classes: only real Columns carry the fence.

A mapper's ``columns`` also hold the SQL expressions of expression
properties (``column_property(a + b)`` is a ``Label``, ``query_expression()``
another expression).  They have no ``info`` of their own; one such class
mapped anywhere in the process once made every write through an installed
session fail, whatever class it wrote (issue 18).  These classes are mapped
at import, as an application maps them, so the whole suite runs with them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import ForeignKey, String, select
from sqlalchemy.ext.associationproxy import AssociationProxy, association_proxy
from sqlalchemy.ext.hybrid import hybrid_property
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    column_property,
    composite,
    mapped_column,
    query_expression,
    relationship,
    sessionmaker,
    with_expression,
)

import sa_fence
import sa_fence.testing
from sa_fence.orm import model
from tests.models import SEQUENCE, Audit


class Base(DeclarativeBase):
    pass


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __composite_values__(self) -> tuple[int, int]:
        return self.x, self.y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    def __hash__(self) -> int:
        return hash((self.x, self.y))


class Shape(sa_fence.Fenced, Base):
    """A fenced class with every kind of expression property."""

    __tablename__ = "expr_shapes"

    id: Mapped[int] = mapped_column(primary_key=True)
    a: Mapped[int] = mapped_column(default=0)
    b: Mapped[int] = mapped_column(default=0)
    x: Mapped[int] = mapped_column(default=0)
    y: Mapped[int] = mapped_column(default=0)
    total: Mapped[int] = column_property(a + b)
    scaled: Mapped[int | None] = query_expression()
    corner: Mapped[Point] = composite(Point, "x", "y")
    tags: Mapped[list[Tag]] = relationship(back_populates="shape", cascade="all, delete-orphan")
    tag_names: AssociationProxy[list[str]] = association_proxy(
        "tags", "name", creator=lambda name: Tag(name=name)
    )

    @hybrid_property
    def difference(self) -> int:
        return self.a - self.b


class Tag(Base):
    """An unfenced class with expression properties of its own."""

    __tablename__ = "expr_tags"

    id: Mapped[int] = mapped_column(primary_key=True)
    shape_id: Mapped[int] = mapped_column(ForeignKey("expr_shapes.id"))
    name: Mapped[str] = mapped_column(String(50))
    shape: Mapped[Shape] = relationship(back_populates="tags")
    upper_name: Mapped[str] = column_property(sa.func.upper(name))
    weight: Mapped[int | None] = query_expression()
    shape_total: AssociationProxy[int] = association_proxy("shape", "total")

    @hybrid_property
    def shouted(self) -> str:
        return self.name + "!"


sa_fence.fence_schema(Base.metadata, SEQUENCE)


@pytest.fixture
def expr_engine(engine: sa.Engine) -> Iterator[sa.Engine]:
    Base.metadata.create_all(engine, tables=[Shape.__table__, Tag.__table__])
    yield engine
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE expr_tags, expr_shapes"))


def test_only_a_real_column_can_carry_the_fence() -> None:
    assert model.fence_key_of(sa.inspect(Shape)) == "fence"
    assert model.fence_key_of(sa.inspect(Tag)) is None
    label = sa.inspect(Shape).columns["total"]
    assert not isinstance(label, sa.Column)
    assert not model.carries_fence(label)
    assert not model.carries_fence(sa.inspect(Shape).columns["scaled"])


def test_a_bound_session_writes_a_fenced_class_with_expression_properties(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], expr_engine: sa.Engine
) -> None:
    with fencer.acquire("shape:1", 5) as lease, lease.bind(make_session()) as session:
        shape = Shape(id=1, a=2, b=3, corner=Point(4, 5))
        shape.tag_names.append("red")
        session.add(shape)
        session.commit()
        assert shape.total == 5
        assert shape.difference == -1
        shape.a = 10
        shape.corner = Point(6, 7)
        shape.tag_names.append("blue")
        session.commit()
        assert (shape.total, shape.fence) == (13, lease.token)
        scaled = session.scalars(
            select(Shape).options(with_expression(Shape.scaled, Shape.a * 100))
        ).one()
        assert scaled.scaled == 1000
        assert session.scalars(select(Shape).where(Shape.difference == 7)).one() is shape
        tag = session.scalars(
            select(Tag)
            .where(Tag.shouted == "blue!")
            .options(with_expression(Tag.weight, Tag.id * 0 + 9))
        ).one()
        assert (tag.name, tag.upper_name, tag.weight, tag.shape_total) == ("blue", "BLUE", 9, 13)
        session.delete(shape)
        session.commit()
    with expr_engine.connect() as conn:
        assert conn.scalar(select(sa.func.count()).select_from(Shape.__table__)) == 0


def test_a_stale_holder_is_still_refused_on_a_class_with_expression_properties(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], expr_engine: sa.Engine
) -> None:
    old = fencer.acquire("shape:2", 5)
    with old.bind(make_session()) as session:
        session.add(Shape(id=2, a=1, b=1))
        session.commit()
    stale = old.bind(make_session())
    stale.get_one(Shape, 2).a = 99  # loaded, not flushed yet
    sa_fence.testing.expire(old)  # its TTL runs out; a newer holder writes
    with fencer.acquire("shape:2", 5) as newer, newer.bind(make_session()) as session:
        session.get_one(Shape, 2).a = 50
        session.commit()
    with pytest.raises(sa_fence.StaleTokenError):
        stale.commit()
    stale.close()
    with expr_engine.connect() as conn:
        assert conn.execute(select(Shape.__table__.c.a, Shape.__table__.c.fence)).one() == (
            50,
            newer.token,
        )


def test_with_no_lease_bound_unfenced_classes_write_while_expression_properties_are_mapped(
    make_session: sessionmaker[Session], expr_engine: sa.Engine
) -> None:
    """One expression property anywhere must not break writes of other classes."""
    with make_session() as session:
        session.execute(sa.text("INSERT INTO expr_shapes (id, a, b, x, y) VALUES (3, 1, 2, 0, 0)"))
        session.add(Tag(shape_id=3, name="green"))
        session.commit()
        tag = session.scalars(select(Tag)).one()
        tag.name = "olive"
        session.commit()
        assert tag.upper_name == "OLIVE"
        session.delete(tag)
        session.commit()
        session.get_one(Shape, 3).a = 7
        with pytest.raises(sa_fence.UnfencedWriteError):  # the fenced class still refuses
            session.flush()


def test_without_the_column_check_an_expression_property_breaks_every_write(
    make_session: sessionmaker[Session],
    expr_engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the tests above: read ``info`` of every mapped expression and writes fail."""

    def unguarded(col: Any) -> bool:
        return bool(col.info.get(model.FENCE_INFO_KEY))

    monkeypatch.setattr(model, "carries_fence", unguarded)
    monkeypatch.setattr(model, "_mapper_fences", weakref.WeakKeyDictionary())
    monkeypatch.setattr(model, "_fenced_classes", weakref.WeakKeyDictionary())
    monkeypatch.setattr(model, "_index", model.OrmIndex(-1))
    with make_session() as session:
        session.add(Audit(message="an unfenced class without expression properties"))
        with pytest.raises(AttributeError, match="info"):
            session.flush()
