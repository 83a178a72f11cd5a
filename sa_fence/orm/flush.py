"""The fenced flush: session events plus a hook on each fenced connection.

1. ``install(maker)`` adds session listeners (``_EVENTS``); the Engine and the bind stay.
2. When the session begins a transaction on a Connection, its class is swapped for
   :class:`FencedConnection`, whose private execute, begin, commit and rollback
   steps run sa-fence's code first (no event listener is dispatched per statement).
3. Lease scope (:mod:`sa_fence.scope.arming`): PostgreSQL checks the lease register at COMMIT,
   whatever sends it; the connection's begin and commit steps arm and check it.
4. The row fence: ``before_flush`` refuses fenced writes without a lease, with
   a released lease or with a fence assigned by hand; every fenced UPDATE,
   DELETE and INSERT is rewritten (:mod:`sa_fence.orm.rewrite`), and one targeted
   by primary key (or an upsert) has its row count checked (:func:`_after_execute`).

``<=`` lets one holder write a row many times (``version_id_col`` compares for equality).
"""

from __future__ import annotations

import logging
import sys
import typing
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    event,
)
from sqlalchemy.exc import MissingGreenlet
from sqlalchemy.orm import NO_VALUE, Session, scoped_session, sessionmaker
from sqlalchemy.orm.attributes import flag_modified

from .. import telemetry as _telemetry
from ..db.dialect import check_dialect
from ..errors import (
    FenceError,
    FencingConfigError,
    LeaseLostError,
)
from ..scope import arming
from ..scope.arming import ACTIVE
from .model import (
    fence_column_of,
    fence_key_of,
    is_fenced_class,
    orm_index,
)
from .session_state import SessionState, state_for, state_of
from .statements import SHARING, attach, hook_connection, hooked_classes

if TYPE_CHECKING:
    from typing import TypeAlias

    from sqlalchemy.orm import ORMExecuteState, SessionTransaction, UOWTransaction

    from .._lease_view import LeaseView

    Lease: TypeAlias = LeaseView  # a Lease or an AsyncLease

log = logging.getLogger(__name__)  # a child of "sa_fence"

_STATE_KEY = "sa_fence.state"

Target = type[Session] | sessionmaker[Any] | Session
T = TypeVar("T", bound=Target | scoped_session[Any])


def _writes_fenced(session: Session) -> bool:
    return any(
        is_fenced_class(type(obj)) for obj in chain(session.new, session.dirty, session.deleted)
    )


def _really_writes_fenced(session: Session) -> bool:
    """Like _writes_fenced, ignoring objects whose changes net out (error path only)."""
    if any(is_fenced_class(type(obj)) for obj in chain(session.new, session.deleted)):
        return True
    # collections count: a many-to-many member added or removed writes an association row
    return any(
        is_fenced_class(type(obj)) and session.is_modified(obj, include_collections=True)
        for obj in session.dirty
    )


def _refuse_assigned_fences(session: Session) -> None:
    """Refuse, before any SQL, a fence assigned on a new or loaded object (the hook would
    drop it silently); bulk mappings carry it as data and have it dropped (docs/statements.md)."""
    # Session._new and identity_map._modified read directly: building the
    # Session.new and .dirty IdentitySets cost 5x this loop on every flush.
    keys: dict[Any, str | None] = {}
    deleted = session._deleted
    for obj_state in chain(session._new, session.identity_map._modified):
        committed = obj_state.committed_state
        if not committed:
            continue
        mapper = obj_state.manager.mapper  # (memoized on the class: no call per object)
        key = keys[mapper] if mapper in keys else keys.setdefault(mapper, fence_key_of(mapper))
        if key is None or key not in committed or obj_state in deleted:
            continue
        before = committed[key]
        after = obj_state.dict.get(key, NO_VALUE)
        if before is not NO_VALUE and before == after:
            continue
        cls = obj_state.class_.__name__
        identity = obj_state.identity
        which = f"{cls} {identity!r}" if identity is not None else f"a new {cls}"
        raise FencingConfigError(
            f"{cls}.{key} was assigned ({after!r}) on {which}: the fence is written by sa-fence "
            "from the bound lease's token at every flush, and no value a caller gives is taken (a "
            f"low one would re-open the row to stale holders, a high one would lock every later "
            f"holder out). Never set {cls}.{key}; read it after the flush to see the token the row "
            "carries. Nothing was sent. Call session.rollback()."
        )


def _before_flush(session: Session, flush_context: UOWTransaction, instances: Any) -> None:
    state = session.info[_STATE_KEY] if _STATE_KEY in session.info else state_for(session)
    if state.poisoned is not None:
        state.check_not_poisoned("flush")
    if state.lease is not None:  # the hot path: the statement hook fences
        try:
            _refuse_assigned_fences(session)
            state.require_lease()
        except FenceError as exc:
            raise state.fail(exc) from None
        state.flush = weakref.ref(flush_context)  # its own statements: no bump first, readback
        bump_keys = orm_index().bump_keys
        if bump_keys:
            _flag_fences(session, state, bump_keys)
        if state.flush_span is not None:  # a flush that found nothing to write
            _telemetry.flush_ended(state.flush_span)
        state.flush_span = _telemetry.flush_started(state.lease)
        return
    if orm_index().shared:  # a write of a shared table may be an unchanged fenced object's
        state.flush = weakref.ref(flush_context)
    if not (_writes_fenced(session) and (state.unfenced or _really_writes_fenced(session))):
        return
    try:
        if state.unfenced:
            _refuse_assigned_fences(session)
        state.require_lease()  # (None under unfenced())
    except FenceError as exc:
        raise state.fail(exc) from None
    if state.unfenced:
        log.warning("flushing fenced objects without a lease (sa_fence.unfenced)")


def _flag_fences(session: Session, state: SessionState, bump_keys: dict[type, str]) -> None:
    """Joined inheritance: flag the fence so a change to a table without it also updates (and
    fences) the fence's table (the flagged value itself is never written)."""
    for obj in session.dirty:
        key = bump_keys.get(type(obj))
        if key is not None and session.is_modified(obj, include_collections=False):
            flag_modified(obj, key)
            state.bumped.append(obj)


def _after_flush_postexec(session: Session, flush_context: UOWTransaction) -> None:
    info = session.info
    state: SessionState | None = info[_STATE_KEY] if _STATE_KEY in info else None  # noqa: SIM401
    if state is not None and state.flush_span is not None:
        span, state.flush_span = state.flush_span, None
        _telemetry.flush_ended(span)
    if state is not None and state.bumped:  # (their objects were shown the token: _show_token)
        state.bumped = []


def _do_orm_execute(orm_state: ORMExecuteState) -> None:
    stmt: Any = orm_state.statement
    # (ORMExecuteState.is_update etc. without their calls: every SELECT passes here)
    if not (stmt.is_dml and (stmt.is_update or stmt.is_delete or stmt.is_insert)):
        return
    dml = stmt if hasattr(stmt, "table") else getattr(stmt, "element", None)
    table = getattr(dml, "table", None)  # None: not a table's DML after all
    if table is None or fence_column_of(table) is None:
        return
    state = state_for(orm_state.session)
    state.check_not_poisoned("write")
    try:
        lease = state.require_lease()
        if lease is not None and dml is not stmt:
            _refuse_from_statement(table)
    except FenceError as exc:
        if not orm_state.session.in_transaction():  # refused before any began: no rollback
            raise  # would come to clear a mark on the session, nor is any needed
        raise state.fail(exc) from None
    if lease is None:
        return
    # 'evaluate' would copy the new values onto objects whose rows were skipped
    # as newer; 'fetch' (RETURNING) reports the rows the statement really changed.
    if (
        (stmt.is_update or stmt.is_delete)
        and not isinstance(orm_state.parameters, list)  # (a list: by primary key)
        and orm_state.execution_options.get("synchronize_session", "auto") is not False
    ):
        orm_state.update_execution_options(synchronize_session="fetch")


def _refuse_from_statement(table: Any) -> None:
    """``select(...).from_statement(update(...))`` reaches the connection as a SELECT."""
    raise FencingConfigError(
        f"select(...).from_statement() around a DML statement of fenced table {table.name!r} "
        f"reaches the connection as a SELECT, so its WHERE clause could not carry the token. "
        "Execute the statement itself, with .returning(...) for the rows: "
        "session.scalars(update(...).returning(...)). Nothing was sent."
    )


def _after_begin(session: Session, transaction: SessionTransaction, connection: Connection) -> None:
    info, attrs = session.info, connection.__dict__  # (`in` and [], not get(): no calls)
    state = info[_STATE_KEY] if _STATE_KEY in info else state_for(session)
    sharing: list[SessionState] | None = attrs[SHARING] if SHARING in attrs else None  # noqa: SIM401
    active = attrs[ACTIVE] if ACTIVE in attrs else None  # noqa: SIM401
    try:  # (a refusal sticks: the session may not flush or commit until rolled back)
        if sharing or (active is not None and active is not state):  # (else: its alone)
            _refuse_confusable(connection, state, state.lease)
        if sharing is None:
            attrs[SHARING] = [state]
        elif state not in sharing:
            sharing.append(state)
        if type(connection) in hooked_classes:  # (attach, inlined: a class met before)
            attrs[ACTIVE] = state
            hook_connection(connection)
        else:
            attach(connection, state)
        state.connections.append(connection)
        if state.lease is not None:
            check_dialect(connection.dialect)
            if session.twophase:  # (_refuse_unscoped(), inlined: it raises)
                _refuse_unscoped(session, connection)
            arming.enter_scope(connection, state.lease)  # (first: psycopg's BEGIN step refuses too)
            _refuse_autocommit(connection)
    except FenceError as exc:
        raise state.fail(exc) from None


def _lease_id(lease: Lease | None) -> tuple[str, int] | None:
    return None if lease is None else (lease.name, lease.token)


def _refuse_confusable(connection: Connection, state: SessionState, lease: Lease | None) -> None:
    """Refuse a second session (or fence_connection() block) on ``connection`` unless it
    has the same lease bound, or none: the hook finds the token by connection."""
    sharing: list[SessionState] | None = connection.__dict__.get(SHARING)
    active: SessionState | None = connection.__dict__.get(ACTIVE)
    if not sharing and (active is None or active is state):
        return  # the hot path: a connection of this session's alone
    others = [s for s in sharing or () if s is not state]
    # a fence_connection() block is active without being among the sharing sessions
    if active is not None and active is not state and active not in others:
        others.append(active)
    mine = _lease_id(lease)
    for other in others:
        theirs = _lease_id(other.lease)
        if theirs != mine:
            raise FencingConfigError(
                "two fenced sessions (or a fenced session inside sa_fence.fence_connection()) "
                f"share one Connection with different leases bound ({_describe(theirs)} and "
                f"{_describe(mine)}): statements on it could not tell whose token to carry. "
                "Bind the same lease to both, give each its own Connection, or close the "
                "first one before the second begins."
            )


def _describe(lease_id: tuple[str, int] | None) -> str:
    return "no lease" if lease_id is None else f"{lease_id[0]!r} token {lease_id[1]}"


def _after_soft_rollback(session: Session, previous_transaction: SessionTransaction) -> None:
    """A failed flush rolls back: end its span as failed."""
    state = state_of(session)
    if state is not None and state.flush_span is not None:
        span, state.flush_span = state.flush_span, None
        _telemetry.flush_ended(span, failed=True)


def _before_commit(session: Session) -> None:
    info = session.info
    state: SessionState | None = info[_STATE_KEY] if _STATE_KEY in info else None  # noqa: SIM401
    if state is not None and state.poisoned is not None:
        state.check_not_poisoned("commit")


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    # (._parent, not .parent's call: this runs for the flush's subtransaction too)
    if transaction.nested and _STATE_KEY in session.info:  # a savepoint's: its ROLLBACK TO
        session.info[_STATE_KEY].presented_in = None  # undid a token presented inside it
    if transaction._parent is None and _STATE_KEY in session.info:
        state: SessionState = session.info[_STATE_KEY]  # (never None: state_for's)
        state.poisoned = state.pending = state.presented_in = None
        if state.bumped:
            state.bumped.clear()
        for conn in state.connections:
            attrs = conn.__dict__  # (`in`, [] and del: no calls on the path of one session)
            sharing = attrs[SHARING] if SHARING in attrs else []  # noqa: SIM401
            if sharing == [state]:
                sharing = []
            elif state in sharing:
                sharing.remove(state)
            if not sharing and SHARING in attrs:
                del attrs[SHARING]
            if ACTIVE in attrs and attrs[ACTIVE] is state:  # another session's may still run
                attrs[ACTIVE] = sharing[-1] if sharing else None
        state.connections = []


_EVENTS = (
    ("before_flush", _before_flush),
    ("do_orm_execute", _do_orm_execute),
    ("after_begin", _after_begin),
    ("after_flush_postexec", _after_flush_postexec),
    ("after_soft_rollback", _after_soft_rollback),
    ("before_commit", _before_commit),
    ("after_transaction_end", _after_transaction_end),
)


def _inner_target(target: object) -> tuple[Any, Any]:
    """(the ``session_factory`` of a scoped_session or async_scoped_session, or an
    AsyncSession's sync session; an async_sessionmaker), else (None, None)
    (sqlalchemy.ext.asyncio is read only if imported: sync users need no greenlet)."""
    if isinstance(target, scoped_session):
        return target.session_factory, None
    ext = sys.modules.get("sqlalchemy.ext.asyncio")
    if ext is None:
        return None, None
    if isinstance(target, ext.async_scoped_session):
        return target.session_factory, None
    if isinstance(target, ext.AsyncSession):
        return target.sync_session, None
    if isinstance(target, ext.async_sessionmaker):
        return None, target
    if isinstance(target, type) and issubclass(target, ext.AsyncSession):
        raise TypeError(
            f"install()/uninstall() cannot take the AsyncSession class {target.__name__}: "
            "its events run on its sync_session_class. Install on your async_sessionmaker, "
            "on one AsyncSession, or on a Session subclass you pass as sync_session_class."
        )
    return None, None


_SYNC_CLASS = "_sa_fence_private_sync_class"


def _fenced_sync_class(maker: Any) -> type[Session]:
    """The private Session subclass an async_sessionmaker's sessions run on."""
    current: type[Session] = maker.kw.get("sync_session_class") or maker.class_.sync_session_class
    if vars(current).get(_SYNC_CLASS):
        return current
    private = type(f"Fenced{current.__name__}", (current,), {_SYNC_CLASS: current})
    maker.configure(sync_session_class=private)
    return private


def _check_target(target: object) -> None:
    if target is Session:
        raise TypeError(
            "refusing to install on sqlalchemy.orm.Session itself: that would fence every session "
            "in the process. Install on your sessionmaker, a Session subclass, or one session."
        )
    if isinstance(target, Session | sessionmaker) or (
        isinstance(target, type) and issubclass(target, Session)
    ):
        return
    raise TypeError(
        "install()/uninstall() take a Session subclass, a sessionmaker, a scoped_session "
        f"or a Session (or their asyncio kinds), got {target!r}"
    )


def install(target: T) -> T:
    """Install the fenced-flush hook on a Session subclass, a sessionmaker, or one session.

    Its sessions refuse to write fenced entities unless a lease is bound (:meth:`Lease.bind`)
    and compare the lease's token on every UPDATE/DELETE of a fenced row. Idempotent; the
    Mapper, the Engine and the bind stay yours. An ``async_sessionmaker`` or ``AsyncSession`` is
    fenced through its sync session, a ``scoped_session`` (Flask-SQLAlchemy's ``db.session``) or
    ``async_scoped_session`` through its ``session_factory``. An Engine bind that cannot fence
    (not PostgreSQL with psycopg) is refused here. Returns ``target``.
    """
    inner, maker = _inner_target(target)
    if maker is not None:
        _check_bind(maker.kw.get("bind"))
        install(_fenced_sync_class(maker))
    elif inner is not None:
        install(inner)
    else:
        _check_target(target)
        plain = typing.cast("Target", target)  # _check_target() passed: no scoped session
        _check_bind(
            plain.kw.get("bind")
            if isinstance(plain, sessionmaker)
            else getattr(plain, "bind", None)
        )
        holder = _hook_holder(plain)
        if not vars(holder).get(_INSTALLED):
            # a session gets listeners of its own: SQLAlchemy keeps dead targets'
            # ``id(listener)`` keys, so shared ones could clash
            listeners = (
                tuple((name, _own_listener(fn)) for name, fn in _EVENTS)
                if isinstance(plain, Session)
                else _EVENTS
            )
            for name, fn in listeners:
                event.listen(target, name, fn)
            setattr(holder, _INSTALLED, listeners)  # what uninstall() removes
    return target


def uninstall(target: T) -> T:
    """Remove what :func:`install` added to ``target``.  Idempotent."""
    inner, maker = _inner_target(target)
    if maker is not None:
        current = maker.kw.get("sync_session_class")
        if current is not None and vars(current).get(_SYNC_CLASS):
            uninstall(current)
            maker.configure(sync_session_class=vars(current)[_SYNC_CLASS])
    elif inner is not None:
        uninstall(inner)
    else:
        _check_target(target)
        holder = _hook_holder(typing.cast("Target", target))
        listeners = vars(holder).get(_INSTALLED)
        if listeners:
            for name, fn in listeners:
                event.remove(target, name, fn)
            delattr(holder, _INSTALLED)
    return target


_INSTALLED = "_sa_fence_hook_installed"


def _own_listener(fn: Callable[..., Any]) -> Callable[..., Any]:
    def listener(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return listener


def _hook_holder(target: Target) -> Any:
    """The object whose own ``__dict__`` records the install (not ``event.contains()``:
    SQLAlchemy's registry keys on ``id(target)``, and a dead class's address is reused)."""
    return target.class_ if isinstance(target, sessionmaker) else target


def _check_bind(bind: object) -> None:
    """Refuse an Engine or AsyncEngine bind sa-fence cannot fence through, at install time
    (other binds are checked per connection once a lease fences it)."""
    engine = getattr(bind, "sync_engine", bind)  # an AsyncEngine's sync Engine
    if isinstance(engine, Engine):
        check_dialect(engine.dialect)


def is_installed(session: Session) -> bool:
    """Whether ``session`` runs the hook: :func:`install`'s marker on it or its class."""
    return bool(session.__dict__.get(_INSTALLED) or getattr(type(session), _INSTALLED, False))


def _session_of(target: Any, call: str = "bind()") -> Session:
    """The Session that ``call`` acts on for a scoped session or an AsyncSession."""
    inner, _ = _inner_target(target)
    if inner is not None and not isinstance(inner, Session):  # a scoped session's factory
        target = target()  # its current session
        inner, _ = _inner_target(target)
    if isinstance(inner, Session):  # an AsyncSession: fenced through its sync session
        target = inner
    if not isinstance(target, Session):
        raise TypeError(
            f"{call} takes a sqlalchemy Session or AsyncSession (a sessionmaker makes one: "
            f"Session()), got {type(target).__name__}"
        )
    return target


def bind_lease(session: Session | scoped_session[Any], lease: Lease) -> None:
    if not isinstance(session, Session):
        session = _session_of(session)
    if not (_INSTALLED in session.__dict__ or getattr(type(session), _INSTALLED, False)):
        raise FencingConfigError(  # (is_installed(), inlined; install()'s mark is never empty)
            "this session does not have the sa-fence flush hook, so binding a lease would "
            "fence nothing. Call sa_fence.install() on the session, its sessionmaker or "
            "its Session class first (for a scoped_session, such as Flask-SQLAlchemy's "
            "db.session: sa_fence.install(db.session))."
        )
    orm_index()  # meets every fenced mapper: merge() then leaves loaded fences behind
    state = state_for(session)
    for conn in state.connections:  # a session sharing its connection has another lease
        check_dialect(conn.dialect)
        _refuse_confusable(conn, state, lease)
        _refuse_unscoped(session, conn)
    previous, state.lease = state.lease, lease
    if previous is not lease:  # the token presented to guards so far may be another's
        state.presented_in = None
    try:
        for conn in state.connections:  # bound mid-transaction: the COMMIT checks it too
            arming.enter_scope(conn, lease)
    except BaseException as exc:
        state.lease = previous  # a bind that failed leaves the session as it was
        if isinstance(exc, MissingGreenlet):
            raise FencingConfigError(
                "this AsyncSession is in the middle of a transaction, so binding the lease "
                "must send its arm now, which needs the event loop. Bind the lease before "
                "the session's first statement, or from inside it: await "
                "session.run_sync(lambda s: lease.bind(s)). The session is not bound."
            ) from None
        raise
    lease._bound = True


def _refuse_unscoped(session: Session, conn: Connection) -> None:
    """Refuse what would commit a bound session's writes without the register check."""
    if session.twophase:
        raise FencingConfigError(
            "this session uses two-phase commit (twophase=True), which sa-fence does not "
            "fence: the driver begins such a transaction itself (tpc_begin), outside the "
            "BEGIN that holds a transaction to its lease. Use a plain session for fenced "
            "work; a PREPARE TRANSACTION sent as SQL from it is checked by PostgreSQL."
        )
    _refuse_autocommit(conn)


def _refuse_autocommit(conn: Connection) -> None:
    """Lease scope needs a transaction to check at COMMIT: refuse autocommit connections."""
    if getattr(arming.driver_of(conn), "autocommit", False):  # (a call only to refuse)
        arming.refuse_armed_autocommit(True)


def unbind(session: Session) -> None:
    """Detach the lease from ``session``: later fenced writes need a new lease."""
    state = state_of(_session_of(session, "unbind()"))
    if state is not None:
        state.lease = None


@contextmanager
def fence_connection(conn: Connection, lease: Lease) -> Iterator[Connection]:
    """Fence a Core ``Connection``'s writes with ``lease`` inside the block.

    Core UPDATE/DELETE/INSERT of fenced tables on ``conn`` are rewritten as in a bound session
    (a stale write by primary key raises :class:`StaleTokenError`), and every transaction of
    ``conn`` in the block commits only while ``lease`` is its name's newest grant. The token is
    presented to guards now and once per later transaction before raw ``text()`` SQL (not before
    ``exec_driver_sql``: send ``text()`` first); a guard's refusal raises StaleTokenError or
    UnfencedWriteError. Presenting it on entry begins a transaction if none is open: call
    ``conn.begin()`` first, or commit as you go (``conn.commit()``).
    """
    if not isinstance(conn, Connection):
        raise TypeError(
            f"fence_connection() takes a sqlalchemy Connection, got {type(conn).__name__} "
            "(for a Session use lease.bind(session))"
        )
    if not (hasattr(lease, "token") and hasattr(lease, "released")):
        raise TypeError(f"fence_connection() takes a lease (fencer.acquire()), got {lease!r}")
    if lease.released:
        raise LeaseLostError(
            f"the lease {lease.name!r} (token {lease.token}) was released; acquire a new "
            "lease before fencing a connection with it"
        )
    check_dialect(conn.dialect)
    _refuse_autocommit(conn)
    previous: SessionState | None = vars(conn).get(ACTIVE)
    state = SessionState()
    _refuse_confusable(conn, state, lease)  # a session on it with another lease, or none
    state.lease = lease
    lease._bound = True
    attach(conn, state)
    arming.enter_scope(conn, lease)
    try:
        state.present_for_raw_sql(conn)
        yield conn
    finally:
        vars(conn)[ACTIVE] = previous


@contextmanager
def unfenced(session: Session) -> Iterator[Session]:
    """Let ``session`` write fenced entities without a lease (admin scripts only).

    Inside the block, a session with no lease bound writes fenced rows with plain, uncompared
    statements: UPDATEs leave ``fence`` as it is and INSERTs get ``fence = 0``.  A bound lease
    still fences as usual.  Each such flush logs a warning on the ``sa_fence`` logger.
    """
    state = state_for(_session_of(session, "unfenced()"))
    state.unfenced += 1
    try:
        yield session
    finally:
        state.unfenced -= 1
