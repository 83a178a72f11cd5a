"""Fencing tokens from a PostgreSQL sequence in the protected database.

Tokens come from a sequence (``CACHE 1``, ``NO CYCLE``, ``bigint``) in the
same database as the fenced rows, so token and rows share one WAL and one
failover fate (DESIGN.md, I4/I4b).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import BigInteger, Engine, MetaData, Sequence, text
from sqlalchemy.exc import DBAPIError

from .errors import FencingConfigError

DEFAULT_SEQUENCE = "sa_fence_token_seq"

#: Held token connections inherited through fork(): kept referenced, never
#: closed (closing would end the parent's session on the shared socket).
_FORKED_AWAY: list[Any] = []


def fence_sequence(
    metadata: MetaData | None = None,
    name: str = DEFAULT_SEQUENCE,
    *,
    schema: str | None = None,
) -> Sequence:
    """The token sequence as a SQLAlchemy schema object, declared correctly.

    ``metadata.create_all(engine)`` (or ``fence_sequence().create(conn)``)
    then emits ``CREATE SEQUENCE ... AS BIGINT INCREMENT BY 1 START WITH 1
    CACHE 1 NO CYCLE``.  ``CACHE 1`` is required: with a cache every backend
    pre-allocates a block of values and ``nextval`` stops following real time
    across connections.  Never drop or ``RESTART`` this sequence in a live
    database: tokens would start again below the fences already on the rows.
    """
    return Sequence(
        name,
        start=1,
        increment=1,
        cache=1,
        cycle=False,
        data_type=BigInteger,
        metadata=metadata,
        schema=schema,
    )


#: The sequence's settings that decide whether it can issue fencing tokens.
SEQUENCE_SQL = text(
    """
    SELECT format_type(s.seqtypid, NULL) AS data_type,
           s.seqcache, s.seqcycle, s.seqincrement, s.seqstart
      FROM pg_catalog.pg_sequence s
     WHERE s.seqrelid = to_regclass(:name)
    """
)

# One round trip, autocommit: txid_current() gives the statement's implicit
# transaction an xid, so its commit is WAL-flushed (with synchronous_commit
# on) and covers the sequence's WAL record: a crash cannot hand this number
# out again (DESIGN.md I4b).  Without an xid, a transaction that only calls
# nextval commits without flushing WAL.
_TOKEN_SQL = text(
    "SELECT nextval(CAST(:name AS regclass)), txid_current(), current_setting('synchronous_commit')"
)
_TOKEN_SQL_PYFORMAT = (
    "SELECT nextval(CAST(%(name)s AS regclass)), txid_current(), "
    "current_setting('synchronous_commit')"
)


def sequence_problems(row: Any) -> list[str]:
    """Why a sequence (a row of ``pg_sequence``: data_type, seqcache,
    seqcycle, seqincrement) cannot issue fencing tokens; empty when it can."""
    problems = []
    if row.data_type != "bigint":
        problems.append(f"its type is {row.data_type} (need bigint: AS bigint)")
    if row.seqcache != 1:
        problems.append(
            f"it has CACHE {row.seqcache} (need CACHE 1: cached values are not "
            "ordered in time across connections)"
        )
    if row.seqcycle:
        problems.append("it is CYCLE (need NO CYCLE: a wrapped token looks ancient)")
    if row.seqincrement <= 0:
        problems.append(f"it has INCREMENT {row.seqincrement} (need a positive increment)")
    return problems


def _fix_hint(name: str) -> str:
    return (
        f"Create it with sa_fence.fence_sequence(metadata, {name!r}) and "
        f"metadata.create_all(), or in SQL: CREATE SEQUENCE {name} AS bigint "
        "CACHE 1 NO CYCLE;"
    )


def _sync_commit_error(value: str) -> FencingConfigError:
    return FencingConfigError(
        f"synchronous_commit is {value!r} on the token connection: a token could be "
        "handed out twice after a crash. Set it to 'on' (ALTER DATABASE <db> SET "
        "synchronous_commit = on, or remove the override from the engine's "
        "connect_args / postgresql.conf)."
    )


@dataclass
class TokenSource:
    """Draws tokens from the sequence through the protected database's engine."""

    engine: Engine
    sequence: str
    _checked: bool = False
    # The connection tokens are drawn on when no other thread is drawing one
    # (see _next_token_psycopg); None until first used.
    _held: Any = field(default=None, init=False, repr=False)
    _held_pid: int = field(default=0, init=False, repr=False)
    _held_since: float = field(default=0.0, init=False, repr=False)
    _held_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def check(self) -> None:
        """Verify the sequence and the connection settings; raise FencingConfigError."""
        name = self.sequence
        with self.engine.connect() as conn:
            row = conn.execute(SEQUENCE_SQL, {"name": name}).one_or_none()
            sync = conn.execute(text("SELECT current_setting('synchronous_commit')")).scalar_one()
            conn.rollback()
        if row is None:
            raise FencingConfigError(
                f"token sequence {name!r} does not exist in {self.engine.url.database!r}. "
                + _fix_hint(name)
            )
        problems = sequence_problems(row)
        if problems:
            raise FencingConfigError(
                f"token sequence {name!r} cannot issue fencing tokens: "
                + "; ".join(problems)
                + f". Fix it with: ALTER SEQUENCE {name} AS bigint CACHE 1 NO CYCLE "
                "INCREMENT BY 1;"
            )
        if sync == "off":
            raise _sync_commit_error(sync)
        self._checked = True

    def ensure_checked(self) -> None:
        if not self._checked:
            self.check()

    def next_token(self) -> int:
        """Take the next token in its own committed transaction."""
        # Engines with statement listeners (logging, tracing, tests) keep the
        # SQLAlchemy path, so that those listeners still see the token statement.
        if self.engine.dialect.driver == "psycopg" and not getattr(
            self.engine, "_has_events", True
        ):
            token, sync = self._next_token_psycopg()
        else:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                token, _xid, sync = conn.execute(_TOKEN_SQL, {"name": self.sequence}).one()
        if sync == "off":
            raise _sync_commit_error(sync)
        return int(token)

    def _next_token_psycopg(self) -> tuple[int, str]:
        """The same statement on a psycopg connection of the engine's, driven directly.

        Performance fix (docs/benchmarks.md): through a pooled SQLAlchemy
        ``Connection`` with ``isolation_level="AUTOCOMMIT"`` a token cost
        ~225 us of Python (execution options, isolation level set and reset,
        result wrapping, checkout and reset-on-return) around a ~80 us round
        trip.  Now one connection, made by the engine's pool (so its connect
        events and arguments apply) and then detached from it, stays in
        autocommit for the token statement alone; the pool keeps its full
        size.  A thread that finds it busy, and a call after it failed, uses
        a pooled connection the same way instead.  Only for engines without
        connection event listeners (see next_token).  Errors are raised as
        SQLAlchemy's ``DBAPIError``, as before; a connection that failed is
        never used again.
        """
        if self._held_lock.acquire(blocking=False):
            try:
                held = self._held_connection()
                try:
                    return self._draw(held)
                except Exception:
                    # a lost connection (server restart, idle timeout): the
                    # pool's path below (pre-ping, invalidation) decides
                    self._drop_held()
                except BaseException:
                    self._drop_held()
                    raise
            finally:
                self._held_lock.release()
        dialect = self.engine.dialect
        try:
            raw = self.engine.raw_connection()
        except dialect.loaded_dbapi.Error as exc:  # Engine.connect() wraps this too
            raise self._wrap(exc, None, invalidated=False) from exc
        try:
            dbapi_conn: Any = raw.driver_connection
            autocommit = dbapi_conn.autocommit  # restored: the engine may set either
            dbapi_conn.autocommit = True
            drawn = self._draw(dbapi_conn)
            dbapi_conn.autocommit = autocommit
        except BaseException as exc:
            raw.invalidate(exc)  # also returns it to the pool, closed
            if isinstance(exc, dialect.loaded_dbapi.Error):
                raise self._wrap(exc, _TOKEN_SQL_PYFORMAT, invalidated=True) from exc
            raise
        raw.close()
        return drawn

    def _draw(self, dbapi_conn: Any) -> tuple[int, str]:
        with dbapi_conn.cursor() as cursor:
            cursor.execute(_TOKEN_SQL_PYFORMAT, {"name": self.sequence})
            token, _xid, sync = cursor.fetchone()
        return int(token), str(sync)

    def _wrap(self, exc: BaseException, statement: str | None, *, invalidated: bool) -> Any:
        dialect = self.engine.dialect
        params = {"name": self.sequence} if statement else None
        return DBAPIError.instance(
            statement,
            params,
            exc,
            dialect.loaded_dbapi.Error,
            connection_invalidated=invalidated,
            dialect=dialect,
        )

    def _held_connection(self) -> Any:
        """The held connection, made on first use and again after a failure."""
        held = self._held
        if held is not None and (
            self._held_pid != os.getpid()  # forked: the parent's socket, never touch it
            or held.closed
            or self._expired()
        ):
            if self._held_pid == os.getpid():
                self._drop_held()
            else:
                _FORKED_AWAY.append(held)  # closing it would close the parent's session
                self._held = None
            held = None
        if held is None:
            dbapi_error = self.engine.dialect.loaded_dbapi.Error
            try:
                raw = self.engine.raw_connection()
            except dbapi_error as exc:
                raise self._wrap(exc, None, invalidated=False) from exc
            held = cast("Any", raw.driver_connection)
            raw.detach()  # no longer the pool's: its slot is free again
            held.autocommit = True
            self._held, self._held_pid, self._held_since = held, os.getpid(), time.monotonic()
        return held

    def _expired(self) -> bool:
        recycle = getattr(self.engine.pool, "_recycle", -1)
        return recycle > -1 and time.monotonic() - self._held_since > recycle

    def _drop_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            with contextlib.suppress(Exception):  # already broken: nothing to give back
                held.close()

    def close(self) -> None:
        """Close the held token connection (the next token opens a new one)."""
        with self._held_lock:
            if self._held_pid == os.getpid():
                self._drop_held()
