"""Fencing tokens from a PostgreSQL sequence in the protected database.

Tokens come from a sequence (``CACHE 1``, ``NO CYCLE``, ``bigint``) in the
same database as the fenced rows, so token and rows share one WAL and one
failover fate (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import BigInteger, Connection, Engine, MetaData, Sequence, text
from sqlalchemy.exc import DBAPIError

from . import _failures
from . import _protocol as proto
from ._fitness import register_problems, sequence_problem
from ._guard import DEFAULT_SEQUENCE as DEFAULT_SEQUENCE  # re-exported: the package's one default
from ._register import (
    DATABASE_ID_SQL,
    DEFAULT_GRANT_LOCK_TIMEOUT_MS,
    Register,
    pinned_register,
    register_table,
    scope_trigger_problem,
    split_name,
)
from .errors import FencingConfigError, LeaseBackendError, LeaseLostError

log = logging.getLogger(__name__)  # a child of "sa_fence"


#: Held token connections inherited through fork(): kept referenced, never
#: closed (closing would end the parent's session on the shared socket).
_FORKED_AWAY: list[Any] = []

#: How many times one grant's statement is sent when the connection it was
#: sent on turns out lost (a server restart or crash, a failover, an idle
#: timeout): after a restart the engine's pool still holds connections from
#: before it (without ``pool_pre_ping``), and the first one fails.  The pool
#: is then invalidated, as SQLAlchemy does on a disconnect, so the next try
#: runs on a fresh connection.  Resending is always safe: a token drawn whose
#: answer was lost is never used, which leaves only a gap in the sequence.
DRAW_ATTEMPTS = 2


def fence_sequence(
    metadata: MetaData | None = None,
    name: str = DEFAULT_SEQUENCE,
    *,
    schema: str | None = None,
) -> Sequence:
    """The token sequence as a SQLAlchemy schema object, declared correctly.

    ``metadata.create_all(engine)`` (or ``fence_sequence().create(conn)``)
    then emits ``CREATE SEQUENCE ... AS BIGINT INCREMENT BY 1 START WITH 1
    CACHE 1 NO CYCLE``.  With a ``metadata``, the lease register
    (``sa_fence_leases``, whose token default draws from this sequence) and
    its commit check function are added too, so ``create_all()`` gives the
    whole working schema.  ``CACHE 1`` is required: with a cache every backend
    pre-allocates a block of values and ``nextval`` stops following real time
    across connections.  Never drop or ``RESTART`` this sequence in a live
    database: tokens would start again below the fences already on the rows.
    """
    if schema is None and "." in name:
        schema, name = split_name(name)
    sequence = Sequence(
        name,
        start=1,
        increment=1,
        cache=1,
        cycle=False,
        data_type=BigInteger,
        metadata=metadata,
        schema=schema,
    )
    if metadata is not None:
        register_table(metadata, sequence)
    return sequence


def setup_problem(conn: Connection, sequence: str) -> str | None:
    """What keeps ``sequence`` and its register from granting leases, with the fix; or None.

    The first broken rule of :mod:`sa_fence._fitness` (the rules ``sa-fence
    check`` reports, and the grant statement enforces), then the scope
    trigger.  Reads the sequence and the register by their schema-qualified
    names (:func:`~sa_fence._register.pinned_register`): a temporary table or
    a table of another schema earlier on the search_path changes nothing of
    what it finds.  Messages show the names as the user gave them.
    """
    shown = Register(sequence)
    register = pinned_register(conn, sequence)
    _, problem = sequence_problem(conn, shown, register)
    if problem is None:
        problems = register_problems(conn, shown, register)
        problem = problems[0] if problems else None
    if problem is not None:
        return problem.sentence()
    return scope_trigger_problem(conn, register)


def behind_pooler(conn: Connection) -> bool:
    """Whether ``conn`` reaches PostgreSQL through a connection pooler.

    A pooler answers the start-up itself, so the backend process id the
    connection was given (the pooler's) is not the server's
    ``pg_backend_pid()``.  False when the driver does not say (not psycopg).
    """
    dbapi_conn = conn.connection.driver_connection
    client_pid = getattr(getattr(dbapi_conn, "info", None), "backend_pid", None)
    if client_pid is None:
        return False
    return bool(conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != client_pid)


def pooler_problem(conn: Connection) -> str | None:
    """What keeps a transaction pooler in front of the database from working, or None.

    psycopg prepares a statement it has run five times; a pooler that hands
    each transaction to any server connection (PgBouncer ``pool_mode =
    transaction`` before 1.21, or with ``max_prepared_statements = 0``) then
    runs it where it was never prepared, or where another client prepared
    another statement under the same name.  A pooler shows itself by the
    backend process id: the one the connection was given at start-up (the
    pooler's own) is not the server's ``pg_backend_pid()``.  Session pooling
    and PgBouncer >= 1.21 with ``max_prepared_statements`` would work, but
    cannot be told apart from here, so the fix is asked for in every case: it
    costs one statement parse per call and works behind any pooler.
    """
    dbapi_conn = conn.connection.driver_connection
    if getattr(dbapi_conn, "prepare_threshold", None) is None:
        return None  # not psycopg, or it never prepares
    if not behind_pooler(conn):
        return None  # connected to the server itself
    return (
        "the engine connects through a connection pooler (PgBouncer?): its connections "
        "do not reach the server they started with. psycopg prepares statements it runs "
        "often, and a pooler that pools by transaction (PgBouncer pool_mode = "
        "transaction before 1.21, or with max_prepared_statements = 0) mixes them up "
        "between clients ('prepared statement \"_pg3_0\" already exists'). Create the "
        "engine with connect_args={'prepare_threshold': None} (see "
        f"{_failures.POOLER_DOC})."
    )


def token_error(
    name: str,
    exc: BaseException,
    lock_timeout_ms: int,
    *,
    operation: str = "token",
    sequence: str = DEFAULT_SEQUENCE,
) -> LeaseBackendError | FencingConfigError:
    """The error for a failed token draw (``operation="token"``) or set-up check
    (``"check"``), told apart by :func:`sa_fence._failures.classify_postgres`:
    a set-up mistake (login refused, no such database, no register or check
    function, no rights, a transaction pooler mixing prepared statements) is a
    FencingConfigError with the fix; an outage, a standby (failover) or a
    wait for the register row is a LeaseBackendError saying what is known.
    Raise it ``from None``: ``.cause`` keeps the driver's exception."""
    orig = getattr(exc, "orig", None)
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate == "55P03":  # lock_not_available
        return LeaseBackendError(
            backend="postgresql",
            operation=operation,
            name=name,
            cause=exc,
            detail=(
                f"waited {lock_timeout_ms} ms for the lease register row of {name!r}, held "
                "by a transaction committing under an older lease of this name (its commit "
                "check holds the row until its COMMIT ends). Nothing was granted; try again. "
                "If this repeats, a holder's connection is stuck mid-commit."
            ),
        )
    kind, problem = _failures.classify_postgres(sqlstate, str(orig if orig is not None else exc))
    cause = _failures.cause_text(exc)
    if kind == _failures.SETUP and problem is not None:
        register = Register(sequence)
        fix = _failures.postgres_setup_fix(
            problem,
            sequence=register.sequence_sql,
            register=register.table_sql,
            function=register.function_sql,
        )
        return FencingConfigError(
            f"{operation} of lease {name!r} failed: PostgreSQL refused the set-up ({cause}). {fix}",
            cause=exc,
        )
    # A token draw is resent only when its connection was lost (see
    # TokenSource.should_redraw, which notes the sends).  Whether it committed
    # is unknown only when a connection was lost after the statement was
    # sent: not after an error reply, nor when the connection could not be made.
    sends = getattr(exc, "sa_fence_sends", 1)
    maybe_ran = getattr(exc, "sa_fence_maybe_ran", None)
    if maybe_ran is None:
        maybe_ran = sqlstate is None and "connection failed" not in cause.lower()
    unknown = operation == "token" and kind == _failures.OUTAGE and maybe_ran
    failure = _failures.Failure(kind, unknown, cause)
    return LeaseBackendError(
        backend="postgresql",
        operation=operation,
        name=name,
        cause=exc,
        detail=_failures.outage_detail("PostgreSQL", failure, max(1, sends)),
    )


def not_forward_error(name: str, sequence: str, drawn: int, held: int | None) -> FencingConfigError:
    """A grant refused because its drawn token does not move the register forward."""
    held_text = "a token at least as large" if held is None else f"token {held}"
    return FencingConfigError(
        f"lease {name!r} was not granted: the token sequence {sequence!r} is behind the "
        f"lease register: it drew token {drawn}, but the register already holds "
        f"{held_text} for this name. The sequence was set back (setval, a restore from "
        "backup, a promoted replica), so it would hand out tokens already held: the "
        f"drawn token was thrown away and nothing was granted. Stop the workers and run "
        f"`sa-fence repair-sequence --url ... --sequence {sequence}` (it moves the "
        "sequence past every fence and every registered token)."
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
    """Draws tokens and advances the lease register through the protected database's engine.

    One statement per grant (:mod:`sa_fence._register`): the token comes from
    the register's own sequence, checked fit in that same statement, and the
    register row of the lease name is advanced to it and committed.  The
    token is durable when the grant returns; the register advance is too,
    unless the statement found the token's WAL record already flushed and
    committed without waiting for the flush (:attr:`skip_flush`): then it is
    durable at the next WAL flush, at the latest the holder's first commit.
    """

    engine: Engine
    sequence: str
    #: Bound (ms) on a grant's wait for a committing holder's share lock on
    #: the register row; the wait ends in LeaseBackendError naming it.
    lock_timeout_ms: int = DEFAULT_GRANT_LOCK_TIMEOUT_MS
    #: Let a grant commit without waiting for the WAL flush when the WAL record
    #: that makes its token durable is already flushed (the grant statement
    #: decides; docs/guarantees.md, "A PostgreSQL crash").  False: every grant's
    #: commit waits for the flush, as before.
    skip_flush: bool = True
    _checked: bool = False
    # The connection tokens are drawn on when no other thread is drawing one
    # (see _next_token_psycopg); None until first used.
    _held: Any = field(default=None, init=False, repr=False)
    _held_pid: int = field(default=0, init=False, repr=False)
    _held_since: float = field(default=0.0, init=False, repr=False)
    _held_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    #: Sends of one grant's statement when its connection is lost (DRAW_ATTEMPTS).
    draw_attempts: int = field(default=DRAW_ATTEMPTS, init=False, repr=False)

    #: Whether the latest grant's commit waited for the WAL flush (None: no grant yet).
    last_flushed: bool | None = field(default=None, init=False, repr=False)

    #: (system identifier, database name) of the register's database, once checked
    database_id: tuple[Any, ...] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        #: where the register and its check function live (read at every commit)
        self.register = Register(self.sequence)

    @property
    def checked(self) -> bool:
        """Whether :meth:`check` has passed (a fencer runs it before its first token)."""
        return self._checked

    def check(self) -> None:
        """Verify the sequence, the register and the connection settings.

        Raises :class:`FencingConfigError` naming what is wrong and how to fix it.
        """
        with self.engine.connect() as conn:
            problem = setup_problem(conn, self.sequence) or pooler_problem(conn)
            sync = conn.execute(text("SELECT current_setting('synchronous_commit')")).scalar_one()
            self.database_id = tuple(conn.execute(text(DATABASE_ID_SQL)).one())
            register = pinned_register(conn, self.sequence)
            conn.rollback()
        if problem is not None:
            raise FencingConfigError(problem)
        if sync == "off":
            raise _sync_commit_error(sync)
        # From here on every statement names the register and the sequence by
        # the schema found now, never through a connection's search_path.
        self.register = register
        self._checked = True

    def params(self, name: str) -> dict[str, Any]:
        register = self.register
        return {
            "name": name,
            "sequence": register.sequence_sql,
            "register": register.table_sql,
            "lock_timeout": f"{self.lock_timeout_ms}ms",
            "skip_flush": self.skip_flush,
        }

    def next_token(self, name: str, *, pooled: bool = False) -> int:
        """Draw a token for lease ``name`` and register it, in its own committed transaction
        (``pooled``: always through a pooled ``Connection``, as for an AsyncEngine)."""
        params = self.params(name)
        # Engines with statement listeners (logging, tracing, tests) keep the
        # SQLAlchemy path, so that those listeners still see the grant statement.
        if (
            not pooled
            and self.engine.dialect.driver == "psycopg"
            and not getattr(self.engine, "_has_events", True)
        ):
            row = self._next_token_psycopg(params)
        else:
            row = self._next_token_sqlalchemy(params)
        return self.granted(row, name)

    def _next_token_sqlalchemy(self, params: dict[str, Any]) -> Any:
        """The grant statement through a pooled ``Connection`` in autocommit.

        A lost connection (``connection_invalidated``: SQLAlchemy has then
        also invalidated the pool's older connections) is retried once on a
        fresh one (see :data:`DRAW_ATTEMPTS`).
        """
        attempt = 1
        while True:
            try:
                with self.engine.connect() as conn:  # closed even if setting autocommit fails
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                    return conn.execute(self.register.grant_text(), params).one_or_none()
            except DBAPIError as exc:
                if not self.should_redraw(exc, attempt, params["name"]):
                    raise
                attempt += 1

    def should_redraw(
        self, exc: DBAPIError, attempt: int, name: str, *, sent_before: int = 0
    ) -> bool:
        """After failed draw number ``attempt``: send the grant again?  Only when
        its connection was lost (SQLAlchemy's ``connection_invalidated``), and
        at most :attr:`draw_attempts` times in all.  When not, ``exc`` is noted
        for :func:`token_error` with how many times the statement was sent in
        all (``sent_before``: sent on the held connection first, and lost) and
        whether one of those sends may have run (its connection was lost)."""
        if not exc.connection_invalidated or attempt >= self.draw_attempts:
            # the attempts before were sent and lost; this one was sent unless
            # its connection could not be made (no statement then)
            sent = exc.statement is not None
            note: Any = exc
            note.sa_fence_sends = sent_before + attempt - 1 + sent
            note.sa_fence_maybe_ran = bool(
                sent_before or attempt > 1 or (sent and exc.connection_invalidated)
            )
            return False
        log.info(
            "the token draw for lease %r lost its connection (%s); drawing again on a fresh one",
            name,
            (str(exc.orig or exc).strip().splitlines() or [type(exc).__name__])[0],
        )
        return True

    def granted(self, row: Any, name: str) -> int:
        """The token from the grant statement's row; FencingConfigError if it drew none."""
        if row is None:
            # The sequence is unfit or not the register's: find out which (failure path).
            with self.engine.connect() as conn:
                problem = setup_problem(conn, self.sequence)
            raise FencingConfigError(
                f"lease {name!r} was not granted: "
                + (problem or f"the token sequence {self.sequence!r} cannot issue tokens")
            )
        token, sync, drawn, held, flushed = row
        #: whether the latest grant's commit waited for the WAL flush (for tests)
        self.last_flushed = bool(flushed)
        if sync == "off":
            raise _sync_commit_error(sync)
        if token is None:
            # ``held`` is of the statement's snapshot, taken before its draw.  At
            # least the drawn token there: the sequence is behind the register.
            # Less (or no row): the row the upsert met was committed after the
            # snapshot, with a token drawn after ours, by a newer grant of the
            # name, so this acquire's Redis lease had expired in between.
            if held is None or held < drawn:
                raise LeaseLostError(proto.overtaken_grant_message(name, int(drawn)))
            raise not_forward_error(name, self.sequence, int(drawn), held)
        return int(token)

    def withdraw(self, name: str, token: int) -> None:
        """Put the register back to the token before ``token`` if it still holds ``token``.

        For a grant whose lease turned out lost before its token was
        confirmed: the token was never used, and a holder granted in between
        must not stay fenced out.  Best effort (the failure path).
        """
        try:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(self.register.withdraw_sql(), {"name": name, "token": token})
        except Exception:
            log.warning(
                "could not withdraw the unused token %d of lease %r from the register; the "
                "lease's current holder's commits are refused until the name is granted again",
                token,
                name,
                exc_info=True,
            )

    def _next_token_psycopg(self, params: dict[str, Any]) -> Any:
        """The same statement on one psycopg connection the pool made and let go.

        It stays in autocommit for the grant alone, sparing SQLAlchemy's
        per-checkout work (about 3x the round trip, docs/benchmarks.md).  A
        thread that finds it busy, or a call after it failed, uses a pooled
        connection instead (:data:`DRAW_ATTEMPTS`).  Errors are SQLAlchemy's
        ``DBAPIError``; a connection that failed is never used again.
        """
        held_sent = 0
        if self._held_lock.acquire(blocking=False):
            try:
                held = self._held_connection()
                try:
                    held_sent = 1
                    return self._draw(held, params)
                except Exception as exc:
                    if not (held.closed or held.broken):
                        # the server refused the statement (a lock timeout, no
                        # rights, no register): the connection is fine
                        if isinstance(exc, self.engine.dialect.loaded_dbapi.Error):
                            raise self._wrap(exc, params, invalidated=False) from exc
                        raise
                    # a lost connection (server restart, idle timeout): the
                    # pool's path below (pre-ping, invalidation) decides
                    self._drop_held()
                except BaseException:
                    self._drop_held()
                    raise
            finally:
                self._held_lock.release()
        attempt = 1
        while True:
            try:
                return self._draw_pooled(params)
            except DBAPIError as exc:
                if not self.should_redraw(exc, attempt, params["name"], sent_before=held_sent):
                    raise
                attempt += 1

    def _draw_pooled(self, params: dict[str, Any]) -> Any:
        """One grant statement on a pooled connection, put in autocommit for it."""
        dialect = self.engine.dialect
        try:
            raw = self.engine.raw_connection()
        except dialect.loaded_dbapi.Error as exc:  # Engine.connect() wraps this too
            raise self._wrap(exc, None, invalidated=False) from exc
        dbapi_conn: Any = raw.driver_connection
        try:
            autocommit = dbapi_conn.autocommit  # restored: the engine may set either
            dbapi_conn.autocommit = True
            drawn = self._draw(dbapi_conn, params)
            dbapi_conn.autocommit = autocommit
        except BaseException as exc:
            lost = bool(dbapi_conn.closed or dbapi_conn.broken)
            if lost:
                # As SQLAlchemy does on a disconnect: this connection and every
                # one the pool made before it are recycled at their next
                # checkout, so the retry (and the application's next checkout)
                # gets a fresh one.
                self.engine.pool._invalidate(raw, exc)
            else:
                raw.invalidate(exc)  # also returns it to the pool, closed
            if isinstance(exc, dialect.loaded_dbapi.Error):
                # connection_invalidated as SQLAlchemy sets it: "lost, not refused"
                raise self._wrap(exc, params, invalidated=lost) from exc
            raise
        raw.close()
        return drawn

    def _draw(self, dbapi_conn: Any, params: dict[str, Any]) -> Any:
        with dbapi_conn.cursor() as cursor:
            cursor.execute(self.register.grant_sql(), params)
            return cursor.fetchone()

    def _wrap(self, exc: BaseException, params: dict[str, Any] | None, *, invalidated: bool) -> Any:
        dialect = self.engine.dialect
        return DBAPIError.instance(
            self.register.grant_sql() if params else None,
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
