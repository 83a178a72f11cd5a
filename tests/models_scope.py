"""Models for the lease-scope tests (tests/scope/test_lease_scope.py), in their own database.

Everything the row fence alone could not see (issue 9): a joined-inheritance
subclass table without a fence column, a many-to-many association table, a
foreign key the database cascades on delete, an unfenced table, and a legacy
table whose fence column allows NULL.  Created by ``create_scope_schema`` in a
fresh database; tests/models.py and the run's shared database stay untouched.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import Column, ForeignKey, String, Table
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

import sa_fence

SEQUENCE = "sa_fence_token_seq"
#: The rows of sa_fence_scope the current transaction wrote (its arms): their xmin is its id.
OWN_ARMS = (
    "sa_fence_scope WHERE xmin::text::bigint = pg_current_xact_id()::text::bigint % 4294967296"
)


class ScopeBase(DeclarativeBase):
    pass


sa_fence.fence_schema(ScopeBase.metadata, SEQUENCE)


job_tags = Table(
    "job_tags",
    ScopeBase.metadata,
    Column("job_id", ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("tag_id", ForeignKey("tags.id", ondelete="CASCADE"), primary_key=True),
)


class Tag(ScopeBase):
    """Not fenced itself; its association rows with a fenced Job are."""

    __tablename__ = "tags"

    id: Mapped[int] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(String(50))


class Job(sa_fence.Fenced, ScopeBase):
    """The fenced base of a joined-inheritance hierarchy."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    result: Mapped[str | None] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(20), server_default="job")
    tags: Mapped[list[Tag]] = relationship(secondary=job_tags, order_by=Tag.id)

    __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "job"}  # noqa: RUF012


class SpecialJob(Job):
    """Its own table, no fence column of its own: the base row's fence covers it."""

    __tablename__ = "special_jobs"

    id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    detail: Mapped[str | None] = mapped_column(String(200))

    __mapper_args__ = {"polymorphic_identity": "special"}  # noqa: RUF012


class UrgentJob(SpecialJob):
    """Single-table inheritance under the joined subclass: it writes special_jobs too."""

    __mapper_args__ = {"polymorphic_identity": "urgent"}  # noqa: RUF012


class Parent(sa_fence.Fenced, ScopeBase):
    __tablename__ = "parents"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str | None] = mapped_column(String(50))
    # passive_deletes: deleting a parent leaves its children to the database
    children: Mapped[list[Child]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True, order_by="Child.id"
    )


class Child(sa_fence.Fenced, ScopeBase):
    """Deleted by the database (ON DELETE CASCADE) when its parent row goes."""

    __tablename__ = "children"

    id: Mapped[int] = mapped_column(primary_key=True)
    parent_id: Mapped[int] = mapped_column(ForeignKey("parents.id", ondelete="CASCADE"))
    value: Mapped[str | None] = mapped_column(String(200))


class Outbox(ScopeBase):
    """Not fenced: a stale holder's INSERT here is caught by lease scope alone."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(primary_key=True)
    message: Mapped[str] = mapped_column(String(200))


class Legacy(ScopeBase):
    """A table adopted from before sa-fence: ``fence`` allows NULL (see create_scope_schema)."""

    __tablename__ = "legacy"

    id: Mapped[int] = mapped_column(primary_key=True)
    value: Mapped[str | None] = mapped_column(String(200))
    fence = sa_fence.fence_column()


TABLES = ("jobs", "special_jobs", "tags", "job_tags", "parents", "children", "outbox", "legacy")


def create_scope_schema(engine: sa.Engine) -> None:
    """The token sequence, the lease register (and its check function), then the tables."""
    ScopeBase.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE legacy ALTER COLUMN fence DROP NOT NULL"))
        conn.execute(sa.text("ALTER TABLE legacy ALTER COLUMN fence DROP DEFAULT"))
