"""Fencing tokens from a PostgreSQL sequence in the protected database.

Tokens come from a sequence (``CACHE 1``, ``NO CYCLE``, ``bigint``) in the same database as the
fenced rows, so token and rows share one WAL and one failover fate (docs/reliability.md).
:class:`TokenSource` draws them through the lease register's grant statement
(:mod:`sa_fence.db.register`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

from sqlalchemy import BigInteger, Connection, Engine, MetaData, Sequence, text
from sqlalchemy.exc import DBAPIError

from .. import _failures
from ..errors import FencingConfigError, LeaseBackendError, LeaseLostError
from . import blockers
from .fitness import SEQUENCE_CLAUSES, SEQUENCE_RULES, register_problems, sequence_problem
from .guard import DEFAULT_SEQUENCE as DEFAULT_SEQUENCE  # re-exported: the package's one default
from .guard import check_name
from .register import (
    DATABASE_ID_SQL,
    DEFAULT_GRANT_LOCK_TIMEOUT_MS,
    Register,
    check_one_register,
    pinned_register,
    register_table,
    scope_trigger_problem,
    split_name,
)

log = logging.getLogger(__name__)  # a child of "sa_fence"

#: Held token connections inherited through fork(): kept referenced, never
#: closed (closing would end the parent's session on the shared socket).
_FORKED_AWAY: list[Any] = []


#: What a declared ``Sequence`` says of each rule of :data:`.fitness.SEQUENCE_RULES` it can:
#: whether it holds (an option left unset holds: PostgreSQL's default then fits), and the
#: ``Sequence()`` argument that makes it hold.  ``is_logged`` cannot be declared (SQLAlchemy
#: has no UNLOGGED sequence), so it is left to the grant and ``sa-fence check``.
_DECLARED: dict[str, tuple[Callable[[Sequence], bool], str]] = {
    "is_bigint": (
        lambda s: s.data_type is None or isinstance(s.data_type, BigInteger),
        "data_type=BigInteger",
    ),
    "is_cache_1": (lambda s: s.cache is None or s.cache == 1, "cache=1"),
    "is_no_cycle": (lambda s: not s.cycle, "cycle=False"),
    "is_increasing": (lambda s: s.increment is None or s.increment > 0, "increment=1"),
}


def declared_problems(sequence: Sequence) -> list[tuple[str, str]]:
    """Why a declared ``Sequence`` could not issue tokens, as far as its declaration says
    (the rules of :data:`.fitness.SEQUENCE_RULES`, in their words), each with the argument
    that fixes it; empty when it could."""
    values = {
        "data_type": "bigint" if sequence.data_type is None else str(sequence.data_type),
        "seqcache": sequence.cache,
        "seqincrement": sequence.increment,
    }
    return [
        (rule.problem.format(**values), _DECLARED[rule.key][1])
        for rule in SEQUENCE_RULES
        if rule.key in _DECLARED and not _DECLARED[rule.key][0](sequence)
    ]


def _refuse_declared(metadata: MetaData | None, name: object, schema: str | None) -> None:
    """Refuse, before anything is declared, a token sequence already declared unfit: a
    ``Sequence`` passed for ``name``, or one of that name ``metadata`` holds (which
    ``fence_schema`` would replace there, while a column or ``create()`` may still use it)."""
    if isinstance(name, Sequence):
        problems = declared_problems(name)
        why = f": {'; '.join(p for p, _ in problems)}" if problems else ""
        where = f", schema={name.schema!r}" if name.schema else ""
        raise ValueError(
            f"fence_schema() declares the token sequence itself, with every clause it needs "
            f"({SEQUENCE_CLAUSES}); it was given {name!r}{why}. Pass the sequence's name "
            f"instead: sa_fence.fence_schema(metadata, {name.name!r}{where}), and declare no "
            "Sequence of that name of your own. Nothing was declared."
        )
    if metadata is None or not isinstance(name, str):
        return
    if schema is None and "." in name:
        schema, name = split_name(name)
    schema = schema or metadata.schema  # (a Sequence takes its MetaData's schema, as a Table)
    known = metadata._sequences.get(f"{schema}.{name}" if schema else name)
    problems = [] if known is None else declared_problems(known)
    if problems:
        raise ValueError(
            f"this metadata already declares the token sequence {known!r}, and it could not "
            f"issue tokens: {'; '.join(p for p, _ in problems)}. Remove that Sequence of your "
            f"own (fence_schema() declares the token sequence itself), or declare it with "
            f"{', '.join(fix for _, fix in problems)}; a grant would refuse it at the first "
            "acquire. Nothing was declared."
        )


def fence_schema(
    metadata: MetaData | None = None, name: str = DEFAULT_SEQUENCE, *, schema: str | None = None
) -> Sequence:
    """Declare the schema fencing needs in ``metadata``: the token sequence, the lease
    register (``sa_fence_leases``, whose token default draws from the sequence), the lease
    scope table (``sa_fence_scope``) and their functions, so ``create_all()`` gives the whole
    working schema.  Returns the sequence; without a ``metadata``, the sequence alone
    (``fence_schema().create(conn)``).

    The sequence is created as ``CREATE SEQUENCE ... AS BIGINT INCREMENT BY 1 START WITH 1
    CACHE 1 NO CYCLE``.
    ``CACHE 1`` is required: with a cache every backend pre-allocates a block of values and
    ``nextval`` stops following real time across connections.  Never drop or ``RESTART`` this
    sequence in a live database: tokens would start again below the fences already on the rows.

    Pass the sequence's name, not a ``Sequence``.  A ``Sequence`` of that name already in
    ``metadata`` declared unfit (``cache=20``, ``cycle=True``, a type other than bigint, a
    negative increment) is refused here with ``ValueError``, naming the fix, rather than at
    the first acquire; a ``Sequence`` passed for ``name`` is refused the same way.
    """
    if not (metadata is None or isinstance(metadata, MetaData)):
        hint = " (did you mean Base.metadata?)" if hasattr(metadata, "metadata") else ""
        raise TypeError(f"metadata must be a sqlalchemy MetaData, got {metadata!r}{hint}")
    _refuse_declared(metadata, name, schema)
    check_name("sequence", name)
    if schema is not None:
        check_name("schema", schema)
    if schema is None and "." in name:
        schema, name = split_name(name)
    if metadata is not None:
        check_one_register(metadata, name, schema)
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
    """What keeps ``sequence`` and its register from granting leases, with the fix; or None:
    the first broken rule of :mod:`sa_fence.db.fitness`, then the scope trigger, read by the
    pinned names (messages show the names as the user gave them)."""
    shown = Register(sequence)
    register = pinned_register(conn, sequence)
    _, problem = sequence_problem(conn, shown, register)
    if problem is None:
        problem = next(iter(register_problems(conn, shown, register)), None)
    return problem.sentence() if problem is not None else scope_trigger_problem(conn, register)


def behind_pooler(conn: Connection) -> bool:
    """Whether ``conn`` reaches PostgreSQL through a pooler: the backend pid the
    start-up gave (the pooler's) is not ``pg_backend_pid()``.  False unless psycopg."""
    dbapi_conn = conn.connection.driver_connection
    client_pid = getattr(getattr(dbapi_conn, "info", None), "backend_pid", None)
    if client_pid is None:
        return False
    return bool(conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != client_pid)


def pooler_problem(conn: Connection) -> str | None:
    """What keeps a transaction pooler in front of the database from working, or None.

    psycopg prepares a statement it has run five times, and a pooler that pools by transaction
    runs it where it was never prepared.  Session pooling or PgBouncer >= 1.21 would work but
    cannot be told apart from here, so the fix (one parse per call) is asked for in every case.
    """
    if getattr(conn.connection.driver_connection, "prepare_threshold", None) is None:
        return None  # not psycopg, or it never prepares
    if not behind_pooler(conn):
        return None  # connected to the server itself
    return (
        "the engine connects through a connection pooler (PgBouncer?): its connections do not "
        "reach the server they started with. psycopg prepares statements it runs often, and a "
        "pooler that pools by transaction (PgBouncer pool_mode = transaction before 1.21, or with "
        "max_prepared_statements = 0) mixes them up between clients ('prepared statement "
        "\"_pg3_0\" already exists'). Create the engine with connect_args={'prepare_threshold': "
        f"None}} (see {_failures.POOLER_DOC})."
    )


def token_error(
    name: str,
    exc: BaseException,
    lock_timeout_ms: int,
    *,
    operation: str = "token",
    sequence: str = DEFAULT_SEQUENCE,
    tokens: TokenSource | None = None,
) -> LeaseBackendError | FencingConfigError:
    """The error for a failed token draw (``operation="token"``) or set-up check
    (``"check"``): a set-up mistake (:func:`sa_fence._failures.classify_postgres`)
    is a FencingConfigError with the fix; an outage, a failover or a wait for the
    register row is a LeaseBackendError (naming, with ``tokens``, who holds the row).
    Raise it ``from None`` (``.cause`` keeps it)."""
    orig = getattr(exc, "orig", None)
    sqlstate = getattr(orig, "sqlstate", None)
    kind, problem = _failures.classify_postgres(sqlstate, str(orig if orig is not None else exc))
    cause = _failures.cause_text(exc)
    if sqlstate == "55P03":  # lock_not_available
        held_by = (
            ""
            if tokens is None
            else " " + blockers.describe(tokens.engine, tokens.register.table_sql, name)
        )
        detail = (
            f"waited {lock_timeout_ms} ms for the lease register row of {name!r}, held "
            "by a transaction committing under an older lease of this name (its commit "
            "check holds the row until the transaction ends: COMMIT, or COMMIT/ROLLBACK "
            f"PREPARED for a prepared one).{held_by} Nothing was granted; try again. If "
            "this repeats, that transaction is stuck: end it."
        )
    elif sqlstate == "57014":  # query_canceled: statement_timeout, or pg_cancel_backend
        detail = (
            f"the grant's statement was cancelled ({cause}): a statement_timeout shorter than "
            f"the grant's lock_timeout ({lock_timeout_ms} ms) ends its wait for the lease "
            f"register row of {name!r} (held by a transaction committing under an older lease), "
            "and an administrator's pg_cancel_backend ends it too. Nothing was granted; try "
            "again. Give the Fencer's engine no statement_timeout, or one above lock_timeout."
        )
    elif kind == _failures.SETUP and problem is not None:
        register = Register(sequence)
        fix = _failures.postgres_setup_fix(problem, register=register)
        return FencingConfigError(
            f"{operation} of lease {name!r} failed: PostgreSQL refused the set-up ({cause}). {fix}",
            cause=exc,
        )
    else:
        # Whether a draw committed is unknown only when its connection was lost after
        # it was sent (TokenSource._redraw notes the sends on the exception).
        maybe_ran = getattr(exc, "sa_fence_maybe_ran", None)
        if maybe_ran is None:
            maybe_ran = sqlstate is None and "connection failed" not in cause.lower()
        failure = _failures.Failure(
            kind, operation == "token" and kind == _failures.OUTAGE and maybe_ran, cause
        )
        detail = _failures.outage_detail(
            "PostgreSQL", failure, max(1, getattr(exc, "sa_fence_sends", 1))
        )
    return LeaseBackendError(
        backend="postgresql", operation=operation, name=name, cause=exc, detail=detail
    )


def _sync_commit_error(value: str) -> FencingConfigError:
    return FencingConfigError(
        f"synchronous_commit is {value!r} on the token connection: a token could be handed out "
        "twice after a crash. Set it to 'on' (ALTER DATABASE <db> SET synchronous_commit = on, or "
        "remove the override from the engine's connect_args / postgresql.conf)."
    )


@dataclass
class TokenSource:
    """Draws tokens and advances the lease register through the protected database's engine.

    One statement per grant (:mod:`sa_fence.db.register`).  The token is durable when the grant
    returns; the register advance too, unless the statement skipped the WAL flush
    (:attr:`skip_flush`): then at the latest at the holder's first commit.
    """

    engine: Engine
    sequence: str
    #: Bound (ms) on a grant's wait for a committing holder's share lock on
    #: the register row; the wait ends in LeaseBackendError naming it.
    lock_timeout_ms: int = DEFAULT_GRANT_LOCK_TIMEOUT_MS
    #: Let a grant skip the WAL flush when its token is already durable
    #: (docs/guarantees.md, "A PostgreSQL crash"); False: every grant waits for it.
    skip_flush: bool = True
    #: Whether :meth:`check` has passed (a fencer runs it before its first token).
    checked: bool = field(default=False, init=False)
    # The connection tokens are drawn on when no other thread is drawing one.
    _held: Any = field(default=None, init=False, repr=False)
    _held_pid: int = field(default=0, init=False, repr=False)
    _held_since: float = field(default=0.0, init=False, repr=False)
    _held_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    #: Sends of one grant's statement when its connection turns out lost (a server restart, a
    #: failover, an idle timeout: the pool may hold connections from before).  Resending is
    #: safe: a token whose answer was lost is never used (a gap).
    draw_attempts: int = field(default=2, init=False, repr=False)
    #: Whether the latest grant's commit waited for the WAL flush (None: no grant yet).
    last_flushed: bool | None = field(default=None, init=False, repr=False)
    #: (system identifier, database name) of the register's database, once checked
    database_id: tuple[Any, ...] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        #: where the register and its check function live (read at every commit)
        self.register = Register(self.sequence)

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
        # every statement from here on names the schema found now, never the search_path's
        self.register = register
        self.checked = True

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
        # An engine with statement listeners (logging, tracing, tests) keeps the
        # SQLAlchemy path, so that they still see the grant statement.
        if (
            not pooled
            and self.engine.dialect.driver == "psycopg"
            and not getattr(self.engine, "_has_events", True)
        ):
            row = self._next_token_psycopg(params)
        else:
            row = self._redraw(self._draw_connection, params)
        return self.granted(row, name)

    def _draw_connection(self, params: dict[str, Any]) -> Any:
        """The grant statement through a pooled ``Connection`` in autocommit."""
        with self.engine.connect() as conn:  # closed even if setting autocommit fails
            conn.execution_options(isolation_level="AUTOCOMMIT")
            return conn.execute(self.register.grant_text, params).one_or_none()

    def _redraw(
        self, draw: Callable[[dict[str, Any]], Any], params: dict[str, Any], sent_before: int = 0
    ) -> Any:
        """``draw(params)``, sent again when its connection was lost (as SQLAlchemy does on a
        disconnect, the pool was invalidated: the next try gets a fresh connection), at most
        :attr:`draw_attempts` times.  The error that ends it notes for :func:`token_error` how
        many sends there were (``sent_before`` on the held connection first) and whether one
        may have run."""
        attempt = 1
        while True:
            try:
                return draw(params)
            except DBAPIError as exc:
                if not exc.connection_invalidated or attempt >= self.draw_attempts:
                    # the attempts before were sent and lost; this one was sent unless
                    # its connection could not be made (no statement then)
                    sent = exc.statement is not None
                    note: Any = exc
                    note.sa_fence_sends = sent_before + attempt - 1 + sent
                    note.sa_fence_maybe_ran = bool(
                        sent_before or attempt > 1 or (sent and exc.connection_invalidated)
                    )
                    raise
                log.info(
                    "the token draw for lease %r lost its connection (%s); drawing again on a "
                    "fresh one",
                    params["name"],
                    (str(exc.orig or exc).strip().splitlines() or [type(exc).__name__])[0],
                )
                attempt += 1

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
        token, sync, drawn, held, flushed, clash = row
        self.last_flushed = bool(flushed)
        if sync == "off":
            raise _sync_commit_error(sync)
        if token is not None:
            return int(token)
        if clash:  # the drawn token is another name's: the sequence was set back
            held = drawn
        # ``held`` is of the statement's snapshot, taken before its draw.  Less than the
        # drawn token (or no row): a newer grant drew after us and committed, so our Redis
        # lease had expired.  At least the drawn token: the sequence is behind the register.
        if held is None or held < drawn:
            raise LeaseLostError(overtaken_grant_message(name, int(drawn)))
        raise FencingConfigError(
            f"lease {name!r} was not granted: the token sequence {self.sequence!r} is behind "
            f"the lease register: it drew token {int(drawn)}, but the register already holds "
            f"token {held} for {'another' if clash else 'this'} name. The sequence was set back "
            "(setval, a restore from "
            "backup, a promoted replica), so it would hand out tokens already held: the drawn "
            "token was thrown away and nothing was granted. Stop the workers and run `sa-fence "
            f"repair-sequence --url ... --sequence {self.sequence}` (it moves the sequence past "
            "every fence and every registered token)."
        )

    def newest(self, name: str) -> int | None:
        """The register's token for ``name`` now, or None (no row, or it cannot be read).

        For a refused commit's error (the failure path only): the commit check finds the
        register row by the token alone, so it can name the newer grant only when that was the
        one grant since."""
        try:
            with self.engine.connect() as conn:
                found = conn.execute(
                    text(f"SELECT token FROM {self.register.table_sql} WHERE name = :name"),
                    {"name": name},
                ).scalar()
        except Exception:  # (best effort: the refusal is raised all the same)
            log.debug("could not read the register's token of lease %r", name, exc_info=True)
            return None
        return None if found is None else int(found)

    def withdraw(self, name: str, token: int) -> None:
        """Put the register back to the token before ``token`` if it still holds ``token``
        (a grant lost before its confirm; best effort, the failure path)."""
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
        """The same statement on one psycopg connection the pool made and let go, in
        autocommit, sparing SQLAlchemy's per-checkout work (docs/benchmarks.md).  A
        thread that finds it busy, or a call after it failed, uses a pooled connection;
        errors are ``DBAPIError``s, and a connection that failed is never used again."""
        held_sent = 0
        if self._held_lock.acquire(blocking=False):
            try:
                held = self._held_connection()
                try:
                    held_sent = 1
                    return self._draw(held, params)
                except Exception as exc:
                    if not (held.closed or held.broken):  # refused: the connection is fine
                        self._reraise(exc, params, lost=False)
                    self._drop_held()  # lost: the pool's path below (pre-ping) decides
                except BaseException:
                    self._drop_held()
                    raise
            finally:
                self._held_lock.release()
        return self._redraw(self._draw_pooled, params, held_sent)

    def _raw_connection(self) -> Any:
        try:
            return self.engine.raw_connection()
        except self.engine.dialect.loaded_dbapi.Error as exc:  # Engine.connect() wraps it too
            self._reraise(exc, None, lost=False)

    def _draw_pooled(self, params: dict[str, Any]) -> Any:
        """One grant statement on a pooled connection, put in autocommit for it."""
        raw = self._raw_connection()
        dbapi_conn: Any = raw.driver_connection
        try:
            autocommit = dbapi_conn.autocommit  # restored: the engine may set either
            dbapi_conn.autocommit = True
            drawn = self._draw(dbapi_conn, params)
            dbapi_conn.autocommit = autocommit
        except BaseException as exc:
            lost = bool(dbapi_conn.closed or dbapi_conn.broken)
            if lost:
                # As SQLAlchemy does on a disconnect: this one and every older
                # connection are recycled, so the retry gets a fresh one.
                self.engine.pool._invalidate(raw, exc)
            else:
                raw.invalidate(exc)  # also returns it to the pool, closed
            self._reraise(exc, params, lost=lost)
        raw.close()
        return drawn

    def _draw(self, dbapi_conn: Any, params: dict[str, Any]) -> Any:
        with dbapi_conn.cursor() as cursor:
            cursor.execute(self.register.grant_sql, params)
            return cursor.fetchone()

    def _reraise(
        self, exc: BaseException, params: dict[str, Any] | None, *, lost: bool
    ) -> NoReturn:
        """``exc`` again; a driver error wrapped as SQLAlchemy does (``connection_invalidated``:
        its connection was lost, not refused)."""
        dialect = self.engine.dialect
        if not isinstance(exc, dialect.loaded_dbapi.Error):
            raise exc
        raise DBAPIError.instance(
            self.register.grant_sql if params else None,
            params,
            exc,
            dialect.loaded_dbapi.Error,
            connection_invalidated=lost,
            dialect=dialect,
        ) from exc

    def _held_connection(self) -> Any:
        """The held connection, made on first use and again after a failure."""
        held = self._held
        if held is not None and (
            self._held_pid != os.getpid()  # forked: the parent's socket, never touch it
            or held.closed
            or -1 < getattr(self.engine.pool, "_recycle", -1) < time.monotonic() - self._held_since
        ):
            self._drop_held()
            held = None
        if held is None:
            raw = self._raw_connection()
            held = cast("Any", raw.driver_connection)
            raw.detach()  # no longer the pool's: its slot is free again
            held.autocommit = True
            self._held, self._held_pid, self._held_since = held, os.getpid(), time.monotonic()
        return held

    def _drop_held(self) -> None:
        held, self._held = self._held, None
        if held is not None and self._held_pid != os.getpid():
            _FORKED_AWAY.append(held)  # closing it would close the parent's session
        elif held is not None:
            with contextlib.suppress(Exception):  # already broken: nothing to give back
                held.close()

    def close(self) -> None:
        """Close the held token connection (the next token opens a new one)."""
        with self._held_lock:
            self._drop_held()


def overtaken_grant_message(name: str, drawn: int) -> str:
    return (
        f"lease {name!r} was not granted: a newer grant of that name committed while this one "
        f"(token {drawn}) was in flight, so this acquire's lease expired or was taken over before "
        "its token could be recorded; the token was thrown away. Use a longer ttl if this repeats."
    )
