"""The chaos harness's tables: rows to update, items to insert, an unfenced audit."""

from __future__ import annotations

from sqlalchemy import BigInteger, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sa_fence

SEQUENCE = "chaos_token_seq"


class Base(DeclarativeBase):
    pass


sa_fence.fence_schema(Base.metadata, SEQUENCE)


class Row(sa_fence.Fenced, Base):
    """Read-modify-write target: one lease name per row (``row:<id>``)."""

    __tablename__ = "chaos_rows"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, default=0)


class Item(sa_fence.Fenced, Base):
    """A fenced INSERT in every unit of work (the row fence cannot refuse it)."""

    __tablename__ = "chaos_items"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    row_id: Mapped[int] = mapped_column(Integer)
    uow: Mapped[str] = mapped_column(String(40), unique=True)


class Audit(Base):
    """Not fenced: one line per unit of work, saying what it did and under which lease."""

    __tablename__ = "chaos_audit"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    uow: Mapped[str] = mapped_column(String(40), unique=True)
    kind: Mapped[str] = mapped_column(String(10))
    worker: Mapped[int] = mapped_column(Integer)
    op: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(40))
    token: Mapped[int] = mapped_column(BigInteger)
    row_id: Mapped[int] = mapped_column(Integer)
    read_value: Mapped[int | None] = mapped_column(BigInteger)
    new_value: Mapped[int | None] = mapped_column(BigInteger)


TABLES = ("chaos_rows", "chaos_items", "chaos_audit", "sa_fence_leases")
