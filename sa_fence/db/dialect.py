"""What an engine must be for sa-fence to fence through it (shared by every front end)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from ..errors import FencingConfigError


def check_engine(engine: object) -> Engine:
    """Refuse engines that cannot fence: not PostgreSQL, or no executemany rowcounts."""
    if hasattr(engine, "sync_engine"):  # AsyncEngine (not imported: needs greenlet)
        raise FencingConfigError(
            "Fencer takes a sync sqlalchemy Engine, got an AsyncEngine: for asyncio use "
            "sa_fence.AsyncFencer(redis.asyncio.Redis(...), async_engine)"
        )
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a sqlalchemy Engine, got {type(engine).__name__}")
    check_dialect(engine.dialect)
    return engine


def check_dialect(dialect: Any) -> None:
    if dialect.name != "postgresql":
        raise FencingConfigError(
            f"sa-fence needs PostgreSQL (tokens come from a sequence in the protected "
            f"database); this engine's dialect is {dialect.name!r}"
        )
    if not (dialect.supports_sane_rowcount and dialect.supports_sane_multi_rowcount):
        raise FencingConfigError(
            f"driver {dialect.driver!r} does not report row counts for executemany, so a "
            "stale batched write could not be detected. Use psycopg 3: "
            "'postgresql+psycopg://...' (or 'postgresql+psycopg_async://' for asyncio)"
        )
