"""Test helpers: recording the SQL an engine sends, and seeding fenced rows."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence


@contextmanager
def recorded_statements(engine: sa.Engine) -> Iterator[list[str]]:
    """Every SQL statement ``engine`` sends inside the block, in order."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


def seed(fencer: sa_fence.Fencer, make_session: sessionmaker[Session], *objs: Any) -> int:
    """Write ``objs`` under a lease of their own; returns its token."""
    with fencer.acquire("seed", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add_all(objs)
        session.commit()
        return lease.token


#: A fenced table partitioned on two levels (parted_b is itself partitioned), no guard yet.
PARTITIONED_TABLES = (
    "CREATE TABLE parted (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0) "
    "PARTITION BY RANGE (id)",
    "CREATE TABLE parted_a PARTITION OF parted FOR VALUES FROM (0) TO (100)",
    "CREATE TABLE parted_b PARTITION OF parted FOR VALUES FROM (100) TO (200) "
    "PARTITION BY RANGE (id)",
    "CREATE TABLE parted_b1 PARTITION OF parted_b FOR VALUES FROM (100) TO (200)",
)
