"""Recording the SQL an engine sends (for tests that pin what reaches the server)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa


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
