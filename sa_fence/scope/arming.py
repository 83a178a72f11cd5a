"""Lease scope: PostgreSQL holds a bound transaction to its lease at COMMIT.

A transaction in lease scope is *armed*: it holds one row (lease name, token) in
``sa_fence_scope``, and a deferred constraint trigger on that table checks the lease
register when the transaction commits or prepares, whatever sends the COMMIT
(docs/lease-scope.md, docs/how-it-works.md).  This module puts the arm in place and keeps
every way out of it shut, at three levels:

1. The Connection (:func:`enter_scope`, called by the flush hook in :mod:`sa_fence.orm.flush`
   when a bound session or ``fence_connection()`` begins, and :func:`check_scope_and_commit`
   at its COMMIT, which maps the trigger's refusal to StaleTokenError).
2. psycopg's BEGIN (:func:`_start_query_armed`): the arm travels in the BEGIN message, one
   simple-protocol message, so arming costs no round trip; psycopg's own ``transaction()``
   and ``tpc_begin()`` are refused where their BEGIN would carry no arm.  Without the
   psycopg internals this needs (:data:`PSYCOPG_BEGIN_HOOK`), every arm is a statement.
3. The driver's cursors (:func:`_checked_cursor`): SQL sent on them in scope is read first,
   and SQL that would end the transaction and go on (``COMMIT; BEGIN``, ``COMMIT AND
   CHAIN``; in pipeline mode any that ends it) is refused before it is sent
   (:mod:`sa_fence.scope.transaction_sql`).
What it keeps per Connection or psycopg connection lives in its ``__dict__``
(as orm.statements' does).
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from psycopg import AsyncCursor, errors, generators
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.sql import Composable
from sqlalchemy.exc import MissingGreenlet

from .. import telemetry as _telemetry
from ..db.guard import lease_error_from_check
from ..db.register import DATABASE_ID_SQL, SCOPE_TABLE, name_key
from ..errors import FencingConfigError, StaleTokenError
from .transaction_sql import ends_transaction, might_end, might_leave_scope, scope_effect

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import TypeAlias

    from sqlalchemy import Connection

    from .._lease_view import LeaseView

    Lease: TypeAlias = LeaseView  # a Lease or an AsyncLease


class ScopeMark:
    """The lease core inherits this (through ``_flush.Marks``): only this module touches it."""

    #: (engine, its scope table) of its last arm: _same_database, the table to write, no call
    _scoped: Any = None


class _Fenced(Protocol):
    """What a Connection's active fenced session (``_flush.SessionState``) shows here."""

    lease: Lease | None


#: the fenced session (or fence_connection() block) whose transaction runs on it
ACTIVE = "_sa_fence_active"
#: {(name, token): lease} its transaction's COMMIT checks; dropped when the transaction ends
SCOPE = "_sa_fence_scope"
#: its transaction's arm was a statement of its own (not in BEGIN): a savepoint may hold it
ARMED_APART = "_sa_fence_armed_apart"


def scope_setup_error(orig: BaseException) -> FencingConfigError | None:
    """The scope table is missing, or the role may not write it: a set-up mistake."""
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate not in ("42501", "42P01") or SCOPE_TABLE not in str(orig):
        return None
    if sqlstate == "42P01":
        return FencingConfigError(
            f"the lease scope table {SCOPE_TABLE} is missing in this database ({orig}), so "
            "PostgreSQL cannot hold this transaction to its lease at COMMIT. Create it with "
            "op.create_fence_register() in a migration (or sa_fence.fence_schema(metadata) "
            "and metadata.create_all()); `sa-fence check` lists what else is missing. Nothing "
            "was committed."
        )
    return FencingConfigError(
        f"this role may not write the lease scope table {SCOPE_TABLE} ({orig}), so its "
        "transactions cannot be held to their lease at COMMIT. Grant it: GRANT INSERT ON "
        f"{SCOPE_TABLE} TO <your workers' role>; (`sa-fence check`, run as that role, prints "
        "the exact GRANT)."
    )


def in_scope(conn: Connection, lease: Lease) -> bool:
    """Whether ``conn``'s transaction checks ``lease`` at COMMIT."""
    scope = conn.__dict__.get(SCOPE)
    return scope is not None and (lease.name, lease.token) in scope


#: Engine -> the (system identifier, database name) its connections reach.
_database_ids: weakref.WeakKeyDictionary[Any, tuple[Any, ...] | None] = weakref.WeakKeyDictionary()


def _same_database(conn: Connection, lease: Lease) -> bool:
    """Whether ``conn`` writes to the database of ``lease``'s register: equal URLs, or the
    same cluster id and database name (read once per engine); unknown: in scope."""
    fencer_engine: Any = lease.fencer.engine
    a, b = conn.engine.url, fencer_engine.url
    if (a.host, a.port, a.database) == (b.host, b.port, b.database):
        return True
    theirs = lease.fencer.token_source.database_id
    if conn.engine not in _database_ids:
        _database_ids[conn.engine] = _read_database_id(conn)
    ours = _database_ids[conn.engine]
    return theirs is None or ours is None or ours == theirs


def _read_database_id(conn: Connection) -> tuple[Any, ...] | None:
    try:
        row = _run(conn, DATABASE_ID_SQL, fetch=True)
    except Exception:
        return None
    return None if row is None else tuple(row)


def enter_scope(conn: Connection, lease: Lease) -> None:
    """Make ``conn``'s transaction commit only while ``lease`` is its name's newest grant."""
    attrs = conn.__dict__
    scope = attrs[SCOPE] if SCOPE in attrs else None  # noqa: SIM401
    if scope is not None and (lease.name, lease.token) in scope:
        if not PSYCOPG_BEGIN_HOOK:
            _rearm_if_ended(conn, scope)
        return
    known = lease._scoped
    if (known is None or known[0] is not conn.engine) and not _same_database(conn, lease):
        return  # another database: outside lease scope (documented)
    if scope is None:
        scope = attrs[SCOPE] = {}
    _arm(conn, lease)
    scope[(lease.name, lease.token)] = lease  # (after the arm: a failed one is tried again)


# ------------------------------------------- arming: lease scope in PostgreSQL
#
# A transaction in lease scope holds one row (name, token) in sa_fence_scope, written by
# its BEGIN message (docs/how-it-works.md); when BEGIN was already sent or the driver is
# not psycopg 3, the arm is a statement of its own.

#: psycopg connection attribute: {scope table: [VALUES rows]} every BEGIN carries in scope
_ARMS = "_sa_fence_arms"
#: psycopg connection attribute: sa-fence's _start_query is installed
_ARMED_START = "_start_query"
#: psycopg connection attribute: weakref to the Connection the arms belong to (they never
#: outlive its scope, e.g. into another pool user)
_ARMS_OWNER = "_sa_fence_arms_owner"


def _scope_table(conn: Connection, lease: Lease) -> str:
    """The scope table of ``lease``'s register, schema-qualified: the fencer's check, run
    before its first grant, pinned the schema (never ``pg_temp``, which could swallow the arm)."""
    register = lease.fencer.token_source.register
    assert register.schema is not None, "a lease is granted only after Fencer.check()"
    lease._scoped = (conn.engine, register.scope_sql)
    return register.scope_sql


def _run(conn: Connection, sql: str, *, fetch: bool = False) -> Any:
    """Send ``sql`` on ``conn``'s DBAPI connection (no events); the first row if ``fetch``.
    An interruption leaves the connection's state unknown: it is invalidated."""
    dbapi_conn: Any = conn.connection.dbapi_connection
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute(sql)
        return cursor.fetchone() if fetch else None
    except conn.dialect.loaded_dbapi.Error as exc:
        setup = scope_setup_error(exc)
        if setup is not None:
            raise setup from exc
        raise
    except BaseException as exc:  # (outside an asyncio greenlet: nothing was sent)
        if not isinstance(exc, MissingGreenlet):
            _invalidate(conn)
        raise
    finally:
        with contextlib.suppress(Exception):
            cursor.close()


def _invalidate(conn: Connection) -> None:
    with contextlib.suppress(Exception):
        conn.invalidate()


def _arm_row(lease: Lease) -> str:
    """The arm's row: the lease's token and its name's key, two numbers, never the name (a
    number is read alike in every client encoding: no text of the user's is in the SQL)."""
    return f"({int(lease.token)}, {name_key(lease.name)})"


#: Connection attribute: (DBAPI connection, its driver connection), read once per DBAPI connection
_DRIVER = "_sa_fence_driver"


def driver_of(conn: Connection, fairy: Any = None) -> Any:
    """``conn``'s driver connection, cached: a reconnect or a checkout is another DBAPI one."""
    fairy = conn.connection if fairy is None else fairy
    attrs, dbapi_conn = conn.__dict__, fairy.dbapi_connection
    cached = attrs[_DRIVER] if _DRIVER in attrs else (None, None)  # noqa: SIM401
    if cached[0] is not dbapi_conn:
        cached = attrs[_DRIVER] = (dbapi_conn, fairy.driver_connection)
    return cached[1]


def _arm(conn: Connection, lease: Lease) -> None:
    """Arm ``conn``'s transaction (now or in its BEGIN) for ``lease``."""
    driver: Any = driver_of(conn)
    psycopg3 = hasattr(driver, "_get_tx_start_command")  # (else: no dialect check, in a test)
    hooked = PSYCOPG_BEGIN_HOOK and psycopg3
    read_only = driver.read_only if psycopg3 else getattr(driver, "read_only", None)
    if read_only and not (hooked and driver.pgconn.transaction_status == _IDLE):
        raise _read_only_error()
    known = lease._scoped
    table = known[1] if known is not None and known[0] is conn.engine else _scope_table(conn, lease)
    row = _arm_row(lease)
    if psycopg3 and driver._num_transactions:  # (a psycopg transaction() block is open: the
        _refuse_arm_in_psycopg_block(driver)  # arm would go apart; refused before any is kept)
    if hooked:
        attrs = driver.__dict__  # (`in` and [], not get(): no calls)
        owner = attrs[_ARMS_OWNER] if _ARMS_OWNER in attrs else None  # noqa: SIM401
        if owner is None or owner() is not conn:
            attrs[_ARMS], attrs[_ARMS_OWNER] = (), weakref.ref(conn)
        attrs[_ARMS] = _with_arm(attrs[_ARMS] if _ARMS in attrs else (), table, row)  # noqa: SIM401
        if _ARMED_START not in attrs:
            driver._start_query = types.MethodType(_start_query_armed, driver)
            for method in ("transaction", "tpc_begin"):
                setattr(driver, method, types.MethodType(_guarded_own_begin(method), driver))
        cursors = driver.cursor_factory  # (per arm: a factory set since is checked too)
        if cursors not in reading_cursors:
            driver.cursor_factory = _checked_cursor(cursors)
        if driver.pgconn.transaction_status == _IDLE:
            if read_only:  # (refused after the hooks: a BEGIN sent below SQLAlchemy refuses too)
                raise _read_only_error()
            return  # not begun: it travels in this transaction's BEGIN
    elif psycopg3 and not driver.autocommit and driver.info.transaction_status == _IDLE:
        return  # not begun: sent before its first statement (_rearm_if_ended)
    refuse_armed_autocommit(psycopg3 and driver.autocommit)  # (it would commit at once)
    conn.__dict__[ARMED_APART] = True
    _run(conn, _arm_sql(table, [row]))


def _refuse_arm_in_psycopg_block(driver: Any) -> None:
    """Refuse an arm sent apart inside psycopg's own ``transaction()`` block.

    Inside a transaction the block is a savepoint, and an arm sent in it belongs to it; the
    block's exit rolls it back through psycopg's ``_exec_command`` (no cursor, no step of
    SQLAlchemy's), so the ``ROLLBACK TO`` that undoes the arm is never seen, unlike one sent
    as SQL or SQLAlchemy's ``begin_nested()``, after which the arm is sent again.  Re-arming
    at the block's exit is not robust: the block may have been entered before this driver
    was ever armed (nothing of sa-fence's wraps it then), and its exit runs inside psycopg's
    connection lock and its rollback generator, which swallows errors.  Refusing here, the
    one place a transaction's first arm is sent apart, holds whenever the block was entered
    and however it ends: every first arm is sent outside psycopg's blocks, and an arm sent
    again after a ``ROLLBACK TO`` only restores one that such a block cannot undo."""
    raise FencingConfigError(
        "a lease would be bound (or a bound session would join this transaction) inside "
        "psycopg's own transaction() block on the driver connection: its arm would be a "
        "statement inside the block's savepoint, which the block's rollback undoes without "
        "sa-fence seeing it, so the transaction's COMMIT would no longer be checked against "
        "the register. Bind the lease, and begin the session's work, before entering "
        "transaction(), or use session.begin_nested() / connection.begin_nested() instead of "
        "psycopg's transaction(). Nothing was sent."
    )


def _arm_sql(table: str, rows: Sequence[str]) -> str:
    return f"INSERT INTO {table} (token, name_key) VALUES {', '.join(rows)}"


Arms = tuple[tuple[str, tuple[str, ...]], ...]  # ((scope table, its VALUES rows), ...)


@functools.lru_cache(maxsize=256)  # (arms are immutable: no call when cached)
def _with_arm(arms: Arms, table: str, row: str) -> Arms:
    rows = dict(arms)
    rows[table] = (*rows.get(table, ()), row)
    return tuple(rows.items())


@functools.lru_cache(maxsize=256)
def _arm_inserts(arms: Arms) -> tuple[bytes, ...]:
    return tuple(_arm_sql(table, rows).encode() for table, rows in arms)


def _rearm_if_ended(conn: Connection, scope: dict[tuple[str, int], Lease]) -> None:
    """Without the BEGIN hook: re-arm, first, a transaction begun after a COMMIT sent as SQL."""
    driver: Any = conn.connection.driver_connection  # (psycopg 3: check_dialect)
    refuse_armed_autocommit(driver.autocommit)  # (set on the driver since the bind)
    if driver.info.transaction_status == _IDLE:
        if driver.read_only:  # (set since the arm was due, as the BEGIN hook checks)
            raise _read_only_error()
        send_arms(conn, scope)


def send_arms(conn: Connection, scope: dict[tuple[str, int], Lease]) -> None:
    for sql in _apart_arms(conn, scope):
        _run(conn, sql)


def _apart_arms(conn: Connection, scope: dict[tuple[str, int], Lease]) -> list[str]:
    """The arms of ``conn``'s scope as statements of their own (a savepoint may hold them)."""
    conn.__dict__[ARMED_APART] = True
    return [_arm_sql(_scope_table(conn, lease), [_arm_row(lease)]) for lease in scope.values()]


def refuse_armed_autocommit(in_scope: bool) -> None:
    """Refuse autocommit in lease scope: at the bind, or set on the driver since (no BEGIN)."""
    if in_scope:
        raise FencingConfigError(
            "this connection is in AUTOCOMMIT mode: every statement commits on its own, so "
            "the lease could not be checked before its writes commit (lease-scoped "
            "fencing). Fence a connection in a transaction (the default isolation "
            "level; conn.begin() or commit-as-you-go), and run what needs autocommit "
            "(VACUUM, CREATE INDEX CONCURRENTLY) on a connection with no lease bound, not "
            "by setting the driver's autocommit. Nothing was sent."
        )


def _read_only_error() -> FencingConfigError:
    return FencingConfigError(
        "this transaction is READ ONLY (postgresql_readonly / psycopg read_only), so it cannot "
        "write the row that holds it to its lease at COMMIT, and a read-only transaction can still "
        "send NOTIFY. Run a bound session's transactions read-write, or do read-only work in a "
        "session with no lease bound. Nothing was sent."
    )


def disarm(conn: Connection) -> None:
    """The transaction ended: later BEGINs on this connection carry no arm."""
    with contextlib.suppress(Exception):
        driver: Any = conn.connection.driver_connection
        if driver is not None:
            driver.__dict__.pop(_ARMS, None)


def _psycopg_begin_hook() -> bool:
    """Whether psycopg has the internals :func:`_start_query_armed` uses (pinned by
    tests/scope/test_scope_trigger.py); without them every arm is its own statement."""
    try:
        from psycopg._connection_base import BaseConnection
    except ImportError:
        return False
    return all(
        callable(getattr(BaseConnection, name, None))
        for name in ("_start_query", "_get_tx_start_command", "_exec_command")
    )


PSYCOPG_BEGIN_HOOK = _psycopg_begin_hook()
_IDLE = TransactionStatus.IDLE


def _guarded_own_begin(method: str) -> Any:
    """psycopg's ``transaction()`` or ``tpc_begin()``, refused where its own BEGIN would
    begin a transaction in lease scope (inside one, transaction() is a savepoint: allowed)."""

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_own_begin(self, method)
        return getattr(type(self), method)(self, *args, **kwargs)

    return guarded


def _arms_between(driver: Any, conn: Connection | None) -> Arms | None:
    """The arm of a BEGIN that ``driver`` sends for itself (raw driver use) while ``conn``,
    the Connection that last armed it, is fenced but has no transaction of SQLAlchemy's
    open: with its lease, if its register's database is this one; else None."""
    state: _Fenced | None = conn.__dict__.get(ACTIVE) if conn is not None else None
    lease = state.lease if state is not None else None
    known = lease._scoped if lease is not None else None
    if conn is None or lease is None or known is None or known[0] is not conn.engine:
        return None  # (not fenced, or its register is in another database: outside scope)
    if conn.closed or conn.invalidated or conn.connection.driver_connection is not driver:
        return None  # (its DBAPI connection is not this one any more)
    return _with_arm((), known[1], _arm_row(lease))


def _scope_owner(driver: Any) -> Connection | None:
    """The Connection whose lease scope ``driver`` is in (armed, or between its transactions)."""
    attrs = driver.__dict__
    owner: Connection | None = attrs[_ARMS_OWNER]() if _ARMS_OWNER in attrs else None
    armed = owner is not None and bool(attrs.get(_ARMS)) and SCOPE in owner.__dict__
    return owner if armed or _arms_between(driver, owner) is not None else None


def _refuse_own_begin(driver: Any, method: str) -> None:
    if driver.pgconn.transaction_status == _IDLE and _scope_owner(driver) is not None:
        raise FencingConfigError(
            f"psycopg's {method}() would begin this transaction with a BEGIN of its own, on "
            "a connection in lease scope: no arm travels in it, so its COMMIT would not be "
            "checked against the register. Begin through SQLAlchemy (the session or "
            "Connection; psycopg's transaction() inside it is a savepoint, which is fine), "
            "or use a connection with no lease bound. Nothing was sent."
        )


def _start_query_armed(self: Any) -> Any:
    """psycopg's ``_start_query`` (run before every statement) with the arm in BEGIN."""
    if self.pgconn.transaction_status != _IDLE:
        return None  # as psycopg's step; in a transaction: armed when it began
    attrs = self.__dict__  # (`in` and [], not get(): no calls)
    arms: Arms | None = attrs[_ARMS] if _ARMS in attrs else None  # noqa: SIM401
    if arms:
        owner = attrs[_ARMS_OWNER] if _ARMS_OWNER in attrs else None  # noqa: SIM401
        conn = owner() if owner is not None else None
        if conn is None or SCOPE not in conn.__dict__:  # its lease scope has ended
            attrs.pop(_ARMS, None)
            arms = None
    if not arms and _ARMS_OWNER in attrs:  # a fenced Connection between its transactions?
        conn = attrs[_ARMS_OWNER]()
        if conn is not None and ACTIVE in conn.__dict__ and conn.__dict__[ACTIVE] is not None:
            arms = _arms_between(self, conn)
    if self._autocommit:  # (as psycopg's step: no BEGIN)
        return refuse_armed_autocommit(True) if arms else None
    if not arms:
        return (yield from type(self)._start_query(self))
    if self._read_only:  # (the read_only property's own attribute)
        raise _read_only_error()
    begin = self._get_tx_start_command()
    if self._pipeline:
        yield from self._exec_command(begin)
        for insert in _arm_inserts(arms):
            yield from self._exec_command(insert)
        yield from self._pipeline._sync_gen()
        return None
    self.pgconn.send_query(b"; ".join([begin, *_arm_inserts(arms)]))
    results = yield from generators.execute(self.pgconn)
    for result in results:
        if result.status == ExecStatus.FATAL_ERROR:
            raise errors.error_from_result(result, encoding=self.pgconn._encoding)
    return None


# -------------------------------------------- driver SQL: what an armed driver's cursors send
#
# SQL sent on the driver's own cursors (``dbapi_connection.cursor()``, ``.execute()``) passes no
# step of SQLAlchemy's: an armed driver's cursor class is swapped for a subclass that reads each
# statement first in lease scope (refused if it leaves scope; a ROLLBACK TO that may undo an arm
# sent apart is followed by it again).  orm.statements' _exec_single_context leaves
# SQLAlchemy's SQL to it.

#: The checked subclasses (:func:`_checked_cursor`'s results).
reading_cursors: set[type] = set()


@functools.cache  # one subclass per cursor class
def _checked_cursor(base: type) -> type:
    """``base``'s subclass whose execute, executemany, stream and copy read the SQL first."""
    is_async = issubclass(base, AsyncCursor)
    methods = {
        "execute": (_rearming_async if is_async else _checked_execute)(base.execute),  # type: ignore[attr-defined]
        "executemany": (_rearming_async if is_async else _rearming)(base.executemany),  # type: ignore[attr-defined]
        "stream": _read_first(base.stream),  # type: ignore[attr-defined]
        "copy": _read_first(base.copy),  # type: ignore[attr-defined]
    }
    made = type(f"Checked{base.__name__}", (base,), {"__slots__": (), **methods})
    reading_cursors.add(made)
    return made


def _cursor_sql(driver: Any, sql: Any, *, rearm: bool = True) -> Connection | None:
    """Before a cursor of ``driver`` sends ``sql``: refused if it leaves lease scope (or, in
    pipeline mode, ends the transaction); the Connection to send the arms of again after it
    (a ROLLBACK TO in a transaction armed apart, when ``rearm``; else refused too), or None."""
    pipelined = driver._pipeline is not None
    if sql.__class__ is str and not pipelined and not might_leave_scope(sql):
        return None
    if (owner := _scope_owner(driver)) is None:
        return None  # out of lease scope (the pool's next user, say): sent as it is
    text = _sql_text(driver, sql)
    rolls_back = might_leave_scope(text) and _refuse_leaving_scope(text, driver)
    if pipelined:
        _refuse_ending_in_pipeline(text, driver)
    if not rolls_back or ARMED_APART not in owner.__dict__:  # (set only with the scope)
        return None
    if not rearm:
        raise FencingConfigError(
            f"this SQL rolls back to a savepoint ({text[:60]!r}) that may hold the arm of a "
            "lease bound inside it, through stream() or copy(), after which sa-fence cannot "
            "send the arm again. Send it with execute(), or roll the savepoint back through "
            "SQLAlchemy. Nothing was sent."
        )
    return owner


def _checked_execute(execute: Any) -> Any:
    def checked(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if query.__class__ is str and self._conn._pipeline is None:  # (not pipeline mode)
            lowered = query.lower()  # might_leave_scope(), inlined: no call per statement
            if ";" not in query and "chain" not in lowered and "rollback" not in lowered:
                return execute(self, query, params, **kwargs)
        return rearming(self, query, params, **kwargs)

    rearming = _rearming(execute)
    return checked


def _rearming(method: Any) -> Any:
    def checked(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        owner = _cursor_sql(self._conn, query)
        result = method(self, query, *args, **kwargs)
        if owner is not None:
            send_arms(owner, owner.__dict__[SCOPE])
        return result

    return checked


def _rearming_async(method: Any) -> Any:
    async def checked(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        owner = _cursor_sql(self._conn, query)
        result = await method(self, query, *args, **kwargs)
        if owner is not None:
            await _send_arms_async(self._conn, owner)
        return result

    return checked


def _read_first(method: Any) -> Any:
    def checked(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        _cursor_sql(self._conn, query, rearm=False)  # (sync or async: it returns an object)
        return method(self, query, *args, **kwargs)

    return checked


async def _send_arms_async(driver: Any, conn: Connection) -> None:
    """:func:`send_arms` on an async driver, from its cursor (no greenlet there).  An
    interruption closes the driver connection: a transaction whose arm was undone must
    never commit (PostgreSQL rolls it back)."""
    try:
        for sql in _apart_arms(conn, conn.__dict__[SCOPE]):
            await driver.execute(sql)
    except errors.Error as exc:  # (the server refused it: the transaction is aborted)
        if (setup := scope_setup_error(exc)) is not None:
            raise setup from exc
        raise
    except BaseException:
        driver.pgconn.finish()
        raise


def _sql_text(driver: Any, sql: Any) -> str:
    """SQL given to ``driver`` (a psycopg connection) as the text it sends; other types refused."""
    if isinstance(sql, bytes | bytearray | memoryview):  # driver SQL (invalid: server refuses)
        return bytes(sql).decode(driver.info.encoding, errors="replace")
    if isinstance(sql, Composable):  # driver SQL as a psycopg sql object, as psycopg renders it
        return sql.as_string(driver)
    if not isinstance(sql, str):
        raise FencingConfigError(
            f"sa-fence cannot read SQL given as {type(sql).__name__}, as it must with a lease "
            "bound: pass str, bytes or a psycopg sql.SQL or sql.Composed. Nothing was sent."
        )
    return sql


# ------------------------------- the Connection's steps: SQL, BEGIN, COMMIT (from orm.statements)
def before_bound_sql(conn: Connection, lease: Lease, sql: Any) -> bool:
    """Before SQL on a bound connection: re-arm, without the BEGIN hook, after a COMMIT sent as
    SQL; refuse SQL that leaves lease scope (in pipeline mode: that ends the transaction).
    Whether it rolls back an arm sent apart."""
    sql = sql if sql.__class__ is str else _sql_text(driver_of(conn), sql)
    # might_leave_scope() inlined (no call per statement); and only SQL holding a word that may
    # end the transaction (PREPARE TRANSACTION too) asks whether the driver is in pipeline mode
    lowered = sql.lower()
    rolls = "rollback" in lowered
    leaves = (rolls or ";" in sql or "chain" in lowered) and _refuse_leaving_scope(
        sql, driver_of(conn)
    )
    ends = rolls or "commit" in lowered or "end" in lowered or "abort" in lowered
    if (ends or "prepare" in lowered) and getattr(driver_of(conn), "_pipeline", None) is not None:
        _refuse_ending_in_pipeline(sql, driver_of(conn))
    if not PSYCOPG_BEGIN_HOOK:  # (after a refusal: nothing is sent, not even an arm)
        enter_scope(conn, lease)
    return leaves and ARMED_APART in conn.__dict__


def _refuse_unreadable(sql: str, driver: Any) -> None:
    """Refuse to read SQL where the server lexes strings unlike PostgreSQL's parser in sa-fence
    (:mod:`sa_fence.scope.transaction_sql`): ``standard_conforming_strings`` is off, so a backslash
    in a ``'...'`` string escapes a quote there and not here (the server reports the setting)."""
    info = getattr(driver, "info", None)
    if info is not None and info.parameter_status("standard_conforming_strings") == "off":
        raise FencingConfigError(
            f"this SQL may end the transaction ({sql[:60] + '...' * (len(sql) > 60)!r}), and "
            "sa-fence reads such SQL with PostgreSQL's own parser, which reads strings as "
            "standard_conforming_strings = on; this connection has it off, so the server could "
            "split the SQL elsewhere. Set standard_conforming_strings = on (the default since "
            "PostgreSQL 9.1), or send each statement on its own, without ';'. Nothing was sent."
        )


def _refuse_leaving_scope(sql: str, driver: Any) -> bool:
    """Refuse SQL that ends the transaction and goes on (``COMMIT; BEGIN``, ``COMMIT AND
    CHAIN``): no BEGIN of sa-fence's would arm what runs after the end.  Returns whether
    it rolls back to a savepoint."""
    _refuse_unreadable(sql, driver)
    leaves, rolls_back = scope_effect(sql)  # (one split of the SQL for both)
    if leaves:
        raise FencingConfigError(
            f"this SQL ends its transaction and goes on ({sql[:60] + '...' * (len(sql) > 60)!r}): "
            "a statement after COMMIT, END, ROLLBACK, ROLLBACK TO, ABORT or PREPARE "
            "TRANSACTION, or AND CHAIN. PostgreSQL would run what follows in a transaction "
            "outside lease scope, so a stale holder's later writes could commit unchecked. "
            "Send the COMMIT (or ROLLBACK TO) as a statement of its own, last, without AND "
            "CHAIN (or call session.commit() / connection.commit()); the next statement begins "
            "a new transaction in lease scope. Nothing was sent."
        )
    return rolls_back


def _refuse_ending_in_pipeline(sql: str, driver: Any) -> None:
    """Refuse SQL that ends the transaction while the driver is in pipeline mode.

    A pipeline's statements are answered only at its sync, and until then libpq reports the
    connection ACTIVE, not IDLE, so psycopg sends no BEGIN (and no arm rides one) before what
    is queued after a ``COMMIT`` or ``ROLLBACK``: it runs in the pipeline's implicit
    transaction, which commits at the sync, unchecked.  Whether anything follows is not
    known when the statement is sent, so the statement that ends the transaction is refused,
    alone too.  Entering pipeline mode is not refused: psycopg's own ``executemany()`` runs in
    a pipeline (SQLAlchemy's batched statements use it), and a pipeline inside a transaction
    is held to the lease like any statement.  The driver's ``commit()`` and ``rollback()``
    sync the pipeline after their COMMIT or ROLLBACK, so the next statement finds the
    connection idle and begins an armed transaction: they stay the way to end one there."""
    if might_end(sql):
        _refuse_unreadable(sql, driver)
    if ends_transaction(sql):
        raise FencingConfigError(
            f"this SQL ends the transaction ({sql[:60] + '...' * (len(sql) > 60)!r}) while the "
            "driver connection is in pipeline mode: until the pipeline syncs, psycopg sends no "
            "BEGIN before the statements queued after it, which would run outside lease scope "
            "and commit at the sync unchecked. End the transaction with the driver "
            "connection's commit() or rollback() (they sync the pipeline), session.commit() / "
            "rollback(), or send the COMMIT or ROLLBACK outside the pipeline() block. Nothing "
            "was sent."
        )


def scope_on_begin(conn: Connection) -> None:
    """A transaction begins, or a default runs past the statement steps (``scalar(Sequence)``,
    maybe first after a COMMIT sent as SQL), on a fenced connection: scope it now."""
    state: _Fenced | None = getattr(conn, ACTIVE, None)
    if state is not None and state.lease is not None:
        enter_scope(conn, state.lease)


def check_scope_and_commit(conn: Connection) -> None:
    """Commit ``conn``'s transaction, mapping the scope trigger's refusal to StaleTokenError;
    an interruption invalidates the connection (docs/guarantees.md)."""
    if ARMED_APART in conn.__dict__:  # (`in` and del, not pop(): no call)
        del conn.__dict__[ARMED_APART]
    scope: dict[tuple[str, int], Lease] | None = conn.__dict__.pop(SCOPE, None)
    if scope is None:
        return
    if not scope:
        disarm(conn)
        return
    fairy = conn.connection
    driver: Any = driver_of(conn, fairy)
    if driver is not None and _ARMS in driver.__dict__:
        del driver.__dict__[_ARMS]  # later BEGINs carry no arm
    dbapi_conn = fairy.dbapi_connection
    assert dbapi_conn is not None
    check = _telemetry.commit_check(scope)  # None: no span or latency to record
    if check is None:
        try:
            _commit_in_scope(conn, dbapi_conn, scope)
        except StaleTokenError as exc:
            _telemetry.commit_refused(scope, exc)  # counted all the same
            raise
        return
    with check:  # latency, span; a stale refusal is counted
        _commit_in_scope(conn, dbapi_conn, scope)


def _commit_in_scope(conn: Connection, dbapi_conn: Any, scope: dict[Any, Lease]) -> None:
    dialect = conn.dialect
    try:
        _send_commit(dbapi_conn)
    except dialect.loaded_dbapi.Error as exc:  # (the server ended the transaction: no rollback)
        stale = lease_error_from_check(exc, scope)
        if stale is not None:
            raise stale from None
        # as SQLAlchemy's own commit step: a lost connection is told apart and invalidated
        # (not handed back to the pool), and handle_error listeners see it
        conn._handle_dbapi_exception(exc, None, None, None, None)
        raise  # (it always raises)
    except BaseException:
        _invalidate(conn)
        raise


def _send_commit(dbapi_conn: Any) -> None:
    """Send the COMMIT (a test seam); the driver's ``commit()``: 30 calls less than a cursor."""
    dbapi_conn.commit()
