"""Models the tests share: fenced tables (one with a composite key) and a plain one."""

from __future__ import annotations

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sa_fence

SEQUENCE = "sa_fence_token_seq"


class Base(DeclarativeBase):
    pass


sa_fence.fence_schema(Base.metadata, SEQUENCE)


class Job(sa_fence.Fenced, Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    result: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), default="pending")


class Cell(sa_fence.Fenced, Base):
    """Composite primary key, to check keys are named in full."""

    __tablename__ = "cells"

    sheet: Mapped[str] = mapped_column(String(20), primary_key=True)
    pos: Mapped[int] = mapped_column(primary_key=True)
    value: Mapped[str | None] = mapped_column(String(200))


class Audit(Base):
    """Not fenced: written freely."""

    __tablename__ = "audit"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    message: Mapped[str] = mapped_column(String(200))
