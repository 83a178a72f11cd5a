"""The fenced flush: session events plus a per-connection statement hook.

How a write to a fenced row becomes token-compared, without an extra round
trip and without writing any row twice:

* ``before_flush`` (session event) refuses the flush when fenced entities
  would be written without a lease (:class:`UnfencedWriteError`, before any
  SQL), and assigns ``fence = token`` on every new or modified fenced object,
  so the ORM's own INSERT/UPDATE carries the new fence.
* ``before_execute`` (event on the session's :class:`~sqlalchemy.engine.Connection`
  only, attached while a fenced session uses it) adds ``AND fence <= :token``
  to every UPDATE and DELETE of a fenced table: the ORM's own batched
  executemany UPDATE, ORM-enabled ``update()``/``delete()``, and Core DML
  sent through the session.  INSERTs without a fence get ``fence = :token``.
* ``after_execute`` compares the row count of primary-key targeted statements
  (the flush, ORM bulk UPDATE by primary key) with the number of rows they
  targeted and raises :class:`StaleTokenError` naming table, key and token.

``<=`` (not ``<``) lets the same holder write one row many times.
SQLAlchemy's ``version_id_col`` cannot be used: it compares for equality
with the loaded version and forces one UPDATE per row.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    Connection,
    Table,
    Text,
    TextClause,
    bindparam,
    cast,
    event,
    func,
    inspect,
    literal,
    literal_column,
    select,
    true,
    tuple_,
)
from sqlalchemy.orm import (
    ORMExecuteState,
    Session,
    SessionTransaction,
    UOWTransaction,
    sessionmaker,
)
from sqlalchemy.sql.dml import Delete, Insert, Update

from ._guard import TOKEN_SETTING, error_from_guard
from ._lease import check_dialect
from ._model import fence_column_of, fence_key_of, writing_fence
from .errors import (
    FenceError,
    FencingConfigError,
    LeaseLostError,
    StaleTokenError,
    UnfencedWriteError,
)

if TYPE_CHECKING:
    from ._lease import Lease

log = logging.getLogger("sa_fence")

_STATE_KEY = "sa_fence.state"
TOKEN_BIND = "sa_fence_token"

Target = type[Session] | sessionmaker[Any] | Session
T = TypeVar("T", bound=Target)


# ---------------------------------------------------------------- per session


class _SessionState:
    """What sa-fence keeps on one session (in ``session.info``)."""

    __slots__ = ("__weakref__", "hooks", "lease", "poisoned", "unfenced")

    def __init__(self) -> None:
        self.lease: Lease | None = None
        self.unfenced = 0
        self.poisoned: FenceError | None = None
        self.hooks: list[_ConnectionHook] = []

    def require_lease(self) -> Lease | None:
        """The lease to fence with; None when the caller opted out explicitly."""
        lease = self.lease
        if lease is not None:
            # Released, lost (renewal or extend found it gone) or, with
            # fail_fast, past its local validity: LeaseLostError, no SQL sent.
            lease._check_for_write()
            return lease
        if self.unfenced:
            return None
        raise UnfencedWriteError(
            "this session has no lease bound, so it may not write fenced rows. Acquire a "
            "lease and call lease.bind(session); admin scripts that must write without one "
            "can wrap the writes in `with sa_fence.unfenced(session):`. Nothing was sent."
        )

    def fail(self, error: FenceError) -> FenceError:
        """Remember a fencing error: the session may not commit until rolled back."""
        if self.poisoned is None:
            self.poisoned = error
        return error

    def check_not_poisoned(self, what: str) -> None:
        if self.poisoned is not None:
            raise FenceError(
                f"{what} refused: this session hit a fencing error ({self.poisoned}) and "
                "may not commit any part of this transaction. Call session.rollback()."
            ) from self.poisoned

    def attach(self, connection: Connection) -> None:
        hook = _ConnectionHook.of(connection)
        if hook.state is not self:
            hook.state = self
            self.hooks.append(hook)

    def detach_all(self) -> None:
        for hook in self.hooks:
            if hook.state is self:
                hook.state = None
        self.hooks.clear()


def _state(session: Session) -> _SessionState | None:
    return session.info.get(_STATE_KEY)


def _state_for(session: Session) -> _SessionState:
    st = session.info.get(_STATE_KEY)
    if st is None:
        st = session.info[_STATE_KEY] = _SessionState()
    return st


# ------------------------------------------------------------- per connection


def fence_predicate(fence_col: Column[Any], token: Any) -> ColumnElement[bool]:
    """The comparison every fenced UPDATE/DELETE carries: ``fence <= :token``.

    The token is compared through ``set_config('sa_fence.token', :token, true)``,
    which returns it and also presents it to a database-side guard
    (:mod:`sa_fence._guard`) for the rest of the transaction: the same
    statement, no extra round trip, whether or not the table has a guard.  The
    comparison cannot be true without the token having been presented, so
    the guard sees it for every row the statement writes (the ORM's DELETE
    needs this: a BEFORE DELETE trigger has no NEW row to read the token
    from).  On a table without a guard it costs one function call per row
    the statement examines, computed in the server.
    """
    setting: ColumnElement[str] = literal_column(f"'{TOKEN_SETTING}'")  # rendered inline
    presented = func.set_config(setting, cast(token, Text), true())
    comparison: ColumnElement[bool] = fence_col <= cast(presented, BigInteger)
    return comparison


def present_token(conn: Connection, token: int) -> None:
    """Present ``token`` to guards for the rest of ``conn``'s transaction (one round trip)."""
    conn.execute(select(func.set_config(literal(TOKEN_SETTING), literal(str(token)), true())))


@dataclass(slots=True)
class _Pending:
    """A primary-key targeted statement whose row count after_execute checks."""

    statement: Any
    table: Table
    token: int
    pk_cols: list[Column[Any]]
    pk_names: list[str]
    param_sets: Sequence[dict[str, Any]]
    lease_name: str


class _ConnectionHook:
    """Statement rewriting for one Connection, active while ``state`` is set.

    Attached once per Connection object (SQLAlchemy's Session takes a new
    Connection per transaction, and ``event.listen`` on it is the only public
    way to see the flush's statements without listening on the whole Engine).
    """

    __slots__ = ("__weakref__", "_memo", "_presented_in", "pending", "state")
    _by_connection: ClassVar[weakref.WeakKeyDictionary[Connection, _ConnectionHook]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self) -> None:
        self.state: _SessionState | None = None
        self.pending: _Pending | None = None
        # original statement -> (token, fenced statement); one entry per statement
        self._memo: weakref.WeakKeyDictionary[Any, tuple[int, Any]] = weakref.WeakKeyDictionary()
        # (transaction, token) for which raw SQL presentation already ran
        self._presented_in: tuple[Any, int] | None = None

    @classmethod
    def of(cls, connection: Connection) -> _ConnectionHook:
        hook = cls._by_connection.get(connection)
        if hook is None:
            check_dialect(connection.dialect)
            hook = cls()
            event.listen(connection, "before_execute", hook.before_execute, retval=True)
            event.listen(connection, "after_execute", hook.after_execute)
            _listen_for_guard_errors(connection)
            cls._by_connection[connection] = hook
        return hook

    def present_for_raw_sql(self, conn: Connection) -> None:
        """Before raw SQL (``text()``): present the token once per transaction.

        Raw SQL cannot be rewritten to carry the token, so a guard would see
        none; one ``set_config`` per transaction (only when raw SQL runs on
        a connection with a lease) fixes that.
        """
        state = self.state
        lease = state.lease if state is not None else None
        if lease is None or lease.released:
            return
        transaction = conn.get_transaction()
        if transaction is not None and self._presented_in == (transaction, lease.token):
            return
        present_token(conn, lease.token)
        self._presented_in = (conn.get_transaction(), lease.token)

    def before_execute(
        self,
        conn: Connection,
        elem: Any,
        multiparams: Sequence[dict[str, Any]],
        params: dict[str, Any],
        execution_options: Any,
    ) -> tuple[Any, Sequence[dict[str, Any]], dict[str, Any]]:
        state = self.state
        if state is not None and isinstance(elem, TextClause):
            self.present_for_raw_sql(conn)
        if state is None or not isinstance(elem, Update | Delete | Insert):
            return elem, multiparams, params
        fence_col = fence_column_of(elem.table)
        if fence_col is None:
            return elem, multiparams, params
        try:
            lease = state.require_lease()
        except FenceError as exc:
            raise state.fail(exc) from None
        if lease is None:
            return elem, multiparams, params
        param_sets: Sequence[dict[str, Any]] = multiparams or ([params] if params else [])
        if isinstance(elem, Insert):
            _refuse_upsert(elem, fence_col)
        fenced = self._fenced(elem, fence_col, lease.token, param_sets)
        if isinstance(elem, Insert):
            return fenced, multiparams, params
        table = fence_col.table
        pk_cols = list(table.primary_key.columns)
        pk_names = [str(c._label if isinstance(elem, Update) else c.key) for c in pk_cols]
        if param_sets and all(n in param_sets[0] for n in pk_names):
            self.pending = _Pending(
                statement=fenced,
                table=table,
                token=lease.token,
                pk_cols=pk_cols,
                pk_names=pk_names,
                param_sets=param_sets,
                lease_name=lease.name,
            )
        return fenced, multiparams, params

    def _fenced(
        self, elem: Any, fence_col: Column[Any], token: int, param_sets: Sequence[dict[str, Any]]
    ) -> Any:
        memo = self._memo.get(elem)
        if memo is not None and memo[0] == token:
            return memo[1]
        tok = bindparam(TOKEN_BIND, token, type_=BigInteger)
        sets_fence = bool(param_sets) and fence_col.key in param_sets[0]
        fenced = elem
        if not isinstance(elem, Insert):
            fenced = fenced.where(fence_predicate(fence_col, tok))
        if not isinstance(elem, Delete) and not sets_fence:
            fenced = fenced.values({fence_col: tok})
        self._memo[elem] = (token, fenced)
        return fenced

    def after_execute(
        self,
        conn: Connection,
        elem: Any,
        multiparams: Any,
        params: Any,
        execution_options: Any,
        result: Any,
    ) -> None:
        pending = self.pending
        if pending is None or pending.statement is not elem:
            return
        self.pending = None
        expected = len(pending.param_sets)
        if result.rowcount == expected:
            return
        state = self.state
        error = _stale_error(conn, pending, elem)
        raise (state.fail(error) if state is not None else error)


def _listen_for_guard_errors(connection: Connection) -> None:
    """Map the guard's SQLSTATEs to sa-fence errors on connections sa-fence attached to.

    Since SQLAlchemy 2.0 ``handle_error`` is a Dialect event: it cannot be
    attached to one Connection.  So it is attached, once and lazily (the
    first time sa-fence attaches to a connection of that engine), to that
    engine's dialect, and it acts only on connections that have a
    :class:`_ConnectionHook`; every other connection's errors pass through
    untouched.
    """
    dialect = connection.dialect
    if not event.contains(dialect, "handle_error", _map_guard_error):
        event.listen(dialect, "handle_error", _map_guard_error)


def _map_guard_error(context: Any) -> None:
    conn = context.connection
    hook = _ConnectionHook._by_connection.get(conn) if conn is not None else None
    if hook is None:
        return
    state = hook.state
    lease = state.lease if state is not None else None
    error = error_from_guard(
        context.original_exception,
        lease.name if lease else None,
        lease.token if lease else None,
    )
    if error is None:
        return
    raise (state.fail(error) if state is not None else error) from context.original_exception


def _refuse_upsert(elem: Insert, fence_col: Column[Any]) -> None:
    """Refuse INSERT ... ON CONFLICT DO UPDATE on a fenced table.

    Its DO UPDATE branch would overwrite an existing row without comparing
    the fence, and there is no public API to add the comparison to an
    existing statement's ON CONFLICT clause.  (DO NOTHING is harmless.)
    The attribute read is SQLAlchemy's PostgreSQL ``Insert`` internals.
    """
    clause = getattr(elem, "_post_values_clause", None)
    if clause is not None and type(clause).__name__ == "OnConflictDoUpdate":
        raise FencingConfigError(
            f"INSERT ... ON CONFLICT DO UPDATE on fenced table {fence_col.table.name!r} "
            "would overwrite rows without comparing their fence. Use the ORM (load, "
            "modify, flush) or on_conflict_do_nothing() followed by an UPDATE."
        )


def _stale_error(conn: Connection, p: _Pending, elem: Any) -> StaleTokenError:
    """Find which targeted rows carry a newer fence (failure path only)."""
    pks = [tuple(ps[n] for n in p.pk_names) for ps in p.param_sets]
    fence_col = fence_column_of(p.table)
    assert fence_col is not None
    found: dict[tuple[Any, ...], int] = {}
    rows = conn.execute(select(*p.pk_cols, fence_col).where(tuple_(*p.pk_cols).in_(pks))).all()
    for row in rows:
        found[tuple(row[: len(p.pk_cols)])] = row[-1]
    stale = [pk for pk in pks if found.get(pk) is None or found[pk] > p.token] or pks
    return StaleTokenError(
        table=p.table.fullname,
        statement="DELETE" if isinstance(elem, Delete) else "UPDATE",
        token=p.token,
        primary_keys=stale,
        current_fences=[found.get(pk) for pk in stale],
        lease_name=p.lease_name,
    )


# ------------------------------------------------------------- session events


def _before_flush(session: Session, flush_context: UOWTransaction, instances: Any) -> None:
    state = _state_for(session)
    state.check_not_poisoned("flush")
    writes: list[tuple[Any, str | None]] = []
    mappers = set()
    for obj in session.new:
        key = fence_key_of(inspect(obj).mapper)
        if key is not None:
            writes.append((obj, key))
    for obj in session.dirty:
        key = fence_key_of(inspect(obj).mapper)
        if key is not None and session.is_modified(obj, include_collections=False):
            writes.append((obj, key))
    for obj in session.deleted:
        key = fence_key_of(inspect(obj).mapper)
        if key is not None:
            writes.append((obj, None))
    if not writes:
        return
    try:
        lease = state.require_lease()
    except FenceError as exc:
        raise state.fail(exc) from None
    if lease is None:
        log.warning("flushing %d fenced object(s) without a lease (unfenced)", len(writes))
        return
    token = lease.token
    with writing_fence():
        for obj, key in writes:
            mappers.add(inspect(obj).mapper)
            if key is not None:
                setattr(obj, key, token)
    for mapper in mappers:
        state.attach(session.connection(bind_arguments={"mapper": mapper}))


def _do_orm_execute(orm_state: ORMExecuteState) -> None:
    if not (orm_state.is_update or orm_state.is_delete or orm_state.is_insert):
        return
    stmt: Any = orm_state.statement
    if fence_column_of(stmt.table) is None:
        return
    session = orm_state.session
    state = _state_for(session)
    state.check_not_poisoned("write")
    try:
        lease = state.require_lease()
    except FenceError as exc:
        raise state.fail(exc) from None
    if lease is None:
        return
    state.attach(session.connection(bind_arguments=orm_state.bind_arguments))
    by_primary_key = isinstance(orm_state.parameters, list)
    # 'evaluate' would copy the new values onto in-session objects whose rows
    # were skipped as newer; 'fetch' (RETURNING) reports the rows the fenced
    # statement really changed.
    if (
        (orm_state.is_update or orm_state.is_delete)
        and not by_primary_key
        and orm_state.execution_options.get("synchronize_session", "auto") is not False
    ):
        orm_state.update_execution_options(synchronize_session="fetch")


def _after_begin(session: Session, transaction: SessionTransaction, connection: Connection) -> None:
    state = _state(session)
    if state is not None and state.lease is not None:
        state.attach(connection)


def _before_commit(session: Session) -> None:
    state = _state(session)
    if state is not None:
        state.check_not_poisoned("commit")


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        state = _state(session)
        if state is not None:
            state.poisoned = None
            state.detach_all()


_EVENTS = (
    ("before_flush", _before_flush),
    ("do_orm_execute", _do_orm_execute),
    ("after_begin", _after_begin),
    ("before_commit", _before_commit),
    ("after_transaction_end", _after_transaction_end),
)


def _check_target(target: object) -> Target:
    if target is Session:
        raise TypeError(
            "refusing to install on sqlalchemy.orm.Session itself: that would fence every "
            "session in the process. Install on your sessionmaker, a Session subclass, "
            "or one session."
        )
    if isinstance(target, Session | sessionmaker) or (
        isinstance(target, type) and issubclass(target, Session)
    ):
        return target
    raise TypeError(
        "install()/uninstall() take a Session subclass, a sessionmaker or a Session, "
        f"got {target!r}. (For AsyncSession pass its sync_session_class or "
        "async_session.sync_session.)"
    )


def install(target: T) -> T:
    """Install the fenced-flush hook on a Session subclass, a sessionmaker, or one session.

    Sessions covered by the hook refuse to write fenced entities unless a
    lease is bound (:meth:`Lease.bind`) and compare the lease's token on every
    UPDATE/DELETE of a fenced row.  Idempotent; never touches Mapper or
    Engine.  Returns ``target``.
    """
    _check_target(target)
    holder = _hook_holder(target)
    if not vars(holder).get(_INSTALLED, False):
        for name, fn in _EVENTS:
            event.listen(target, name, fn)
        setattr(holder, _INSTALLED, True)
    return target


def uninstall(target: T) -> T:
    """Remove what :func:`install` added to ``target``.  Idempotent."""
    _check_target(target)
    holder = _hook_holder(target)
    if vars(holder).get(_INSTALLED, False):
        for name, fn in _EVENTS:
            event.remove(target, name, fn)
        delattr(holder, _INSTALLED)
    return target


_INSTALLED = "_sa_fence_hook_installed"


def _hook_holder(target: Target) -> Any:
    """The object whose own ``__dict__`` records that the hook is installed.

    Not ``event.contains()``: SQLAlchemy keys its listener registry on
    ``id(target)`` and keeps class-level entries after the class is collected,
    so a new sessionmaker whose generated class reuses a dead one's address
    "contains" the hook without having it (and ``install`` skipped it).
    """
    return target.class_ if isinstance(target, sessionmaker) else target


def is_installed(session: Session) -> bool:
    """True when ``session`` runs the fenced-flush hook (via any target)."""
    return any(fn in session.dispatch.before_flush for fn in (_before_flush,))


def bind_lease(session: Session, lease: Lease) -> None:
    if not isinstance(session, Session):
        raise TypeError(
            f"bind() takes a sqlalchemy Session, got {type(session).__name__} "
            "(for an AsyncSession pass async_session.sync_session)"
        )
    if not is_installed(session):
        raise FencingConfigError(
            "this session does not have the sa-fence flush hook, so binding a lease would "
            "fence nothing. Call sa_fence.install() on the session, its sessionmaker or "
            "its Session class first."
        )
    check_dialect(session.get_bind().dialect)
    state = _state_for(session)
    state.lease = lease
    if session.in_transaction():
        for conn in _transaction_connections(session):
            state.attach(conn)


def _transaction_connections(session: Session) -> Iterator[Connection]:
    # Session.connection() returns the transaction's connection for the
    # default bind; a multi-bind session attaches the rest lazily at flush.
    try:
        yield session.connection()
    except Exception:  # no default bind: attached lazily
        return


def unbind(session: Session) -> None:
    """Detach the lease from ``session``: later fenced writes need a new lease."""
    state = _state(session)
    if state is not None:
        state.lease = None


@contextmanager
def fence_connection(conn: Connection, lease: Lease) -> Iterator[Connection]:
    """Fence a Core ``Connection``'s writes with ``lease`` inside the block.

    Core UPDATE/DELETE/INSERT of fenced tables on ``conn`` are rewritten as
    in a bound session (token compared, fence written, a stale write by
    primary key raises :class:`StaleTokenError`).  The token is also
    presented to database-side guards now, for the connection's current
    transaction, and again once per later transaction before raw ``text()``
    SQL; a guard's refusal raises :class:`StaleTokenError` (or
    :class:`UnfencedWriteError`) instead of a driver error.  Statements sent
    with ``exec_driver_sql`` in a transaction begun later inside the block
    are not seen: present the token there with ``text()`` SQL first.

    Presenting the token on entry begins the connection's transaction if
    none is open: call ``conn.begin()`` before entering, or use
    commit-as-you-go (``conn.commit()``) inside the block.
    """
    if not isinstance(conn, Connection):
        raise TypeError(
            f"fence_connection() takes a sqlalchemy Connection, got {type(conn).__name__} "
            "(for a Session use lease.bind(session))"
        )
    if lease.released:
        raise LeaseLostError(
            f"the lease {lease.name!r} (token {lease.token}) was released; acquire a new "
            "lease before fencing a connection with it"
        )
    hook = _ConnectionHook.of(conn)
    previous = hook.state
    state = _SessionState()
    state.lease = lease
    hook.state = state
    try:
        hook.present_for_raw_sql(conn)
        yield conn
    finally:
        hook.state = previous
        hook.pending = None
        hook._presented_in = None


@contextmanager
def unfenced(session: Session) -> Iterator[Session]:
    """Let ``session`` write fenced entities without a lease (admin scripts only).

    Inside the block, a session with no lease bound writes fenced rows with
    plain, uncompared statements: UPDATEs leave ``fence`` as it is and
    INSERTs get ``fence = 0``.  A bound lease still fences as usual.  Each
    such flush logs a warning on the ``sa_fence`` logger.
    """
    state = _state_for(session)
    state.unfenced += 1
    try:
        yield session
    finally:
        state.unfenced -= 1
