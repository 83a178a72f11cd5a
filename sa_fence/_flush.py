"""The fenced flush: session events plus a hook on each fenced connection.

1. ``install(maker)`` adds session listeners (``_EVENTS``); the Engine and the bind stay.
2. When the session begins a transaction on a Connection, its class is swapped for
   :class:`_FencedConnection`, whose private execute, begin, commit and rollback
   steps run sa-fence's code first (no event listener is dispatched per statement).
3. Lease scope (:mod:`sa_fence._scope`): PostgreSQL checks the lease register at COMMIT,
   whatever sends it; the connection's begin and commit steps arm and check it.
4. The row fence: ``before_flush`` refuses fenced writes without a lease, with
   a released lease or with a fence assigned by hand; every fenced UPDATE,
   DELETE and INSERT is rewritten (:mod:`sa_fence._rewrite`), and one targeted
   by primary key (or an upsert) has its row count checked (:func:`_after_execute`).

``<=`` lets one holder write a row many times (``version_id_col`` compares for equality).
"""

from __future__ import annotations

import inspect
import logging
import sys
import typing
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy
from sqlalchemy import (
    CTE,
    Alias,
    Connection,
    Engine,
    TextClause,
    event,
    func,
    literal,
    select,
    true,
)
from sqlalchemy.exc import MissingGreenlet
from sqlalchemy.orm import NO_VALUE, Session, scoped_session, sessionmaker
from sqlalchemy.orm.attributes import flag_modified, instance_dict, instance_state
from sqlalchemy.sql import visitors
from sqlalchemy.sql.dml import Delete, Insert, Update
from sqlalchemy.sql.elements import BindParameter, ColumnElement, _anonymous_label
from sqlalchemy.sql.selectable import TextualSelect

from . import _guard, _scope, _telemetry
from ._dialect import check_dialect
from ._guard import TOKEN_SETTING, error_from_guard, lease_error_from_check, quote_ident
from ._model import (
    fence_column_of,
    fence_key_of,
    is_fenced_class,
    mappers,
    missing_fence_column,
    orm_index,
)
from ._rewrite import TOKEN_BIND, FencedStatement, key_binds, rewrite, rewritten
from ._scope import ACTIVE, ARMED_APART, SCOPE
from .errors import (
    FenceError,
    FencingConfigError,
    LeaseLostError,
    StaleTokenError,
    UnfencedWriteError,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    from sqlalchemy import Column, Table
    from sqlalchemy.orm import InstanceState, ORMExecuteState, SessionTransaction, UOWTransaction

    from ._lease_view import LeaseView
    from ._model import Covered, Readback

    Lease: TypeAlias = LeaseView  # a Lease or an AsyncLease

log = logging.getLogger(__name__)  # a child of "sa_fence"

_STATE_KEY = "sa_fence.state"

Target = type[Session] | sessionmaker[Any] | Session
T = TypeVar("T", bound=Target | scoped_session[Any])


# ---------------------------------------------------------------- per session
@dataclass(slots=True)
class _Pending:
    """A primary-key targeted statement whose row count after_execute checks."""

    statement: Any
    table: Table
    token: int
    pk_cols: list[Column[Any]]
    pk_names: list[str]
    param_sets: Sequence[Mapping[str, Any]]
    lease_name: str
    only_keys: bool = True  # nothing but the key in its WHERE clause: only the fence skips rows
    expected: int | None = None  # the row count due; None: one row per parameter set
    counted: int = 0  # rows an upsert's cursor executions reported
    readback: Readback | None = None  # a flush's UPDATE: its objects are shown the token


@dataclass(slots=True, weakref_slot=True, eq=False)
class SessionState:
    """What sa-fence keeps on one session (in ``session.info``)."""

    lease: Lease | None = None
    unfenced: int = 0
    poisoned: FenceError | None = None
    pending: _Pending | None = None
    connections: list[Connection] = field(default_factory=list)
    bumped: list[Any] = field(default_factory=list)  # joined-inheritance objects this flush bumps
    presented_in: tuple[Any, int] | None = None  # (transaction, token) presented for raw SQL
    flush_span: Any = None  # the span of the fenced flush under way
    session: Callable[[], Session | None] = lambda: None  # a weak reference (none: a connection)
    flush: Callable[[], UOWTransaction | None] = lambda: None  # a weak reference: the last flush

    def in_flush(self, elem: Any, options: Mapping[str, Any], of: Covered | Readback) -> bool:
        """Whether ``elem`` is one of the running flush's statements: sent with the compiled
        cache of ``of``'s hierarchy (a listener's Core statement has none), not an ORM bulk
        statement (those are annotated), in the transaction the flush holds (a bulk method
        begins its own)."""
        session, flush, cache = self.session(), self.flush(), options.get("compiled_cache")
        if session is None or cache is not of.base_mapper._compiled_cache:
            return False
        bulk = "_emit_update_table" in elem._annotations
        return not bulk and getattr(flush, "transaction", 0) is session._transaction

    def require_lease(self) -> Lease | None:
        """The lease to fence with; None when the caller opted out explicitly."""
        lease = self.lease
        if lease is not None:
            # released, lost or (fail_fast) past its validity: LeaseLostError, no SQL sent
            lease.check(for_write=True)
            return lease
        if self.unfenced:
            return None
        _telemetry.unfenced_refused()
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

    def present_for_raw_sql(self, conn: Connection) -> None:
        """Before raw SQL (``text()``), which cannot carry the token: present it to guards
        once per transaction."""
        lease = self.lease
        if lease is None or lease.released:
            return
        transaction = conn.get_transaction()
        if transaction is not None and self.presented_in == (transaction, lease.token):
            return
        token = literal(str(lease.token))  # presented to guards for the rest of the transaction
        conn.execute(select(func.set_config(literal(TOKEN_SETTING), token, true())))
        self.presented_in = (conn.get_transaction(), lease.token)


def _state(session: Session) -> SessionState | None:
    return session.info.get(_STATE_KEY)


class Marks(_scope.ScopeMark):
    """The lease core inherits this: only the flush hook touches these."""

    #: Set once the lease is bound to a session or connection.
    _bound: bool = False
    #: Set at the first write statement under the lease (its timing, _telemetry.wrote).
    _wrote: bool = False


def bound_lease(session: Session) -> Lease | None:
    state = _state(session)
    return None if state is None else state.lease


def state_for(session: Session) -> SessionState:
    info = session.info  # (`in` and [], not get(): no call)
    if _STATE_KEY not in info:
        info[_STATE_KEY] = SessionState(session=weakref.ref(session))
    return info[_STATE_KEY]  # type: ignore[no-any-return]


# ----------------------------------------------------------- statement hook
#
# What sa-fence keeps per Connection lives in its own __dict__, read with `in` and [] (no call:
# a get() is one, hence the SIM401 noqas on the hot path; a Mock would make up attributes).

#: the installed sessions whose transactions run on it, oldest first (the newest is active)
_SHARING = "_sa_fence_sharing"


class _FencedConnection(Connection):
    """A Connection whose statements, BEGIN, COMMIT and ROLLBACK pass sa-fence first (its
    class is swapped in; the methods are those SQLAlchemy 2.0/2.1 fire Connection events from)."""

    __slots__ = ()

    def _execute_clauseelement(
        self, elem: Any, distilled_parameters: Any, execution_options: Any
    ) -> Any:
        attrs = self.__dict__  # (`in` and [], not get(): no call per statement)
        state: SessionState | None = attrs[ACTIVE] if ACTIVE in attrs else None  # noqa: SIM401
        if state is None:
            return super()._execute_clauseelement(elem, distilled_parameters, execution_options)
        elem, distilled_parameters, pending = _before_execute(
            self, state, elem, distilled_parameters, execution_options
        )
        result = super()._execute_clauseelement(elem, distilled_parameters, execution_options)
        if pending is not None:
            _after_execute(self, state, pending, result)
        return result

    def _exec_single_context(
        self, dialect: Any, context: Any, statement: Any, parameters: Any
    ) -> Any:
        attrs, sql = self.__dict__, context.statement  # (`in` and [], not get(): no call)
        state: SessionState | None = attrs[ACTIVE] if ACTIVE in attrs else None  # noqa: SIM401
        if state is None:
            return super()._exec_single_context(dialect, context, statement, parameters)
        # a DML of a fenced table in a CTE? The compiler sets `ctes` (a dict, emptied of nesting
        # CTEs) once it meets one; a statement without: no call (DDL's compiler has no `ctes`)
        compiled = context.compiled  # (None: driver SQL)
        if compiled is not None and "ctes" in (cs := compiled.__dict__) and cs["ctes"] is not None:
            _refuse_nested_dml(state, compiled)
        if state.lease is None:
            return super()._exec_single_context(dialect, context, statement, parameters)
        # in scope, on a cursor that reads it as raw SQL (asyncio's is SQLAlchemy's adapter)
        scoped = _scope.PSYCOPG_BEGIN_HOOK and SCOPE in attrs and attrs[SCOPE]
        cursor = context.cursor.__class__
        if scoped and (
            cursor in _scope.reading_cursors
            or _scope.driver_of(self).cursor_factory in _scope.reading_cursors
        ):
            return super()._exec_single_context(dialect, context, statement, parameters)
        rolls_back = _scope.before_bound_sql(self, state.lease, sql)
        result = super()._exec_single_context(dialect, context, statement, parameters)
        if rolls_back:  # a ROLLBACK TO may undo an arm sent after BEGIN: send it again
            _scope.send_arms(self, attrs[SCOPE])
        return result

    def _exec_insertmany_context(self, dialect: Any, context: Any) -> Any:
        state: SessionState | None = self.__dict__.get(ACTIVE)
        cs = context.compiled.__dict__  # (an INSERT with a CTE: as _exec_single_context)
        if state is not None and "ctes" in cs and cs["ctes"] is not None:
            _refuse_nested_dml(state, context.compiled)
        if state is not None and state.lease is not None:
            # (an INSERT: no ROLLBACK TO)
            _scope.before_bound_sql(self, state.lease, context.statement)
        return super()._exec_insertmany_context(dialect, context)

    def _execute_default(self, *args: Any, **kwargs: Any) -> Any:
        _scope.scope_on_begin(self)
        return super()._execute_default(*args, **kwargs)

    def _begin_impl(self, transaction: Any) -> None:
        _scope.scope_on_begin(self)
        super()._begin_impl(transaction)

    def _commit_impl(self) -> None:
        _scope.check_scope_and_commit(self)
        super()._commit_impl()

    def _rollback_impl(self) -> None:
        _end_scope(self)
        super()._rollback_impl()


def check_connection_api(cls: type) -> None:
    """Refuse a Connection class lacking (or changing) a method _FencedConnection overrides:
    an override never called would leave writes unfenced without a word."""
    wanted = {
        "_execute_clauseelement": ["self", "elem", "distilled_parameters", "execution_options"],
        "_exec_single_context": ["self", "dialect", "context", "statement", "parameters"],
        "_exec_insertmany_context": ["self", "dialect", "context"],
        "_execute_default": None,
        "_begin_impl": ["self", "transaction"],
        "_commit_impl": ["self"],
        "_rollback_impl": ["self"],
    }
    for name, parameters in wanted.items():
        method = getattr(cls, name, None)
        if not callable(method) or (
            parameters is not None and list(inspect.signature(method).parameters) != parameters
        ):
            raise ImportError(
                f"sa-fence cannot fence connections of SQLAlchemy {sqlalchemy.__version__}: "
                f"Connection.{name} is missing or takes other arguments than the "
                "SQLAlchemy 2.0/2.1 sa-fence was built for. Install a SQLAlchemy 2.0 or 2.1 "
                "release, or an sa-fence release that supports this one."
            )


check_connection_api(Connection)

#: Connection attribute: its ``after_cursor_execute`` listener counts upserted rows.
_COUNTS_UPSERTS = "_sa_fence_counts_upserts"
#: Connection class -> its fenced subclass (``_FencedConnection`` for Connection).
_hooked_classes: dict[type, type] = {Connection: _FencedConnection}
#: Dialect attribute: sa-fence's handle_error listener is attached.
_GUARD_ERRORS = "_sa_fence_maps_guard_errors"


def _hook_connection(connection: Connection) -> None:
    """Swap in a fenced subclass (same layout); attach handle_error once per dialect."""
    cls = type(connection)
    if cls not in _hooked_classes:
        _hooked_classes[cls] = type(
            f"Fenced{cls.__name__}", (_FencedConnection, cls), {"__slots__": ()}
        )
    connection.__class__ = _hooked_classes[cls]
    dialect = connection.dialect
    if _GUARD_ERRORS not in dialect.__dict__:  # (set below, as an attribute: no getattr call)
        if not event.contains(dialect, "handle_error", _map_guard_error):
            event.listen(dialect, "handle_error", _map_guard_error)
        dialect.__dict__[_GUARD_ERRORS] = True


def _attach(connection: Connection, state: SessionState) -> None:
    """Route ``connection``'s statements through the hook for ``state`` (not a Mock's)."""
    connection.__dict__[ACTIVE] = state
    cls = type(connection)
    if not issubclass(cls, _FencedConnection) and issubclass(cls, Connection):
        _hook_connection(connection)


def _end_scope(conn: Connection) -> None:
    """The transaction ended (rolled back, or its COMMIT sent as SQL refused): unscope it."""
    if conn.__dict__.pop(SCOPE, None) is not None:
        conn.__dict__.pop(ARMED_APART, None)  # (set only in scope, as the arms are)
        _scope.disarm(conn)  # (arms are only ever set in scope)


def _map_guard_error(context: Any) -> None:
    conn, orig = context.connection, context.original_exception
    state: SessionState | None = getattr(conn, ACTIVE, None)
    if state is None:
        return
    _refuse_missing_fence_column(context)
    lease = state.lease
    error: FenceError | None = error_from_guard(
        orig, lease.name if lease else None, lease.token if lease else None
    )
    scope = conn.__dict__.get(SCOPE) or ({(lease.name, lease.token): lease} if lease else {})
    if error is None and scope:  # a COMMIT sent as SQL (or PREPARE), refused by lease scope?
        error = lease_error_from_check(orig, scope) or _scope.scope_setup_error(orig)
        if isinstance(error, StaleTokenError):  # the server ended the transaction: as rolled back
            _telemetry.commit_refused(scope, error)  # (under the lease it names)
            _end_scope(conn)
            raise state.fail(error) from orig
    if error is None:
        return
    if isinstance(error, UnfencedWriteError):
        _telemetry.unfenced_refused(_telemetry.GUARD)
    elif isinstance(error, StaleTokenError):
        _telemetry.stale_refused(lease, _telemetry.GUARD, error)
    raise state.fail(error) from orig


def _refuse_missing_fence_column(context: Any) -> None:
    """A fenced model's table lacks its fence column: say how to add it."""
    compiled = getattr(context.execution_context, "compiled", None)
    missing = missing_fence_column(context.original_exception, getattr(compiled, "statement", None))
    if missing is None:
        return
    schema, table, column = missing
    shown = f"{schema}.{table}" if schema else table
    raise FencingConfigError(
        f"table {shown} has no fence column {column!r} in this database, but the model maps it as "
        "fenced (sa_fence.Fenced or fence_column()); create_all() does not add columns to a table "
        f"that exists. Add it: in an Alembic migration op.add_fence_column({table!r}"
        + ("" if column == "fence" else f", {column!r}")
        + ("" if schema is None else f", schema={schema!r}")
        + f"); without Alembic: ALTER TABLE {_guard.qualified(table, schema)} ADD COLUMN "
        f"{quote_ident(column)} bigint NOT NULL DEFAULT 0; then the guard: "
        f"sa_fence.create_fence_guard(engine, {table!r}). `sa-fence check` lists every "
        "such table. Nothing was written.",
        cause=context.original_exception,
    ) from context.original_exception


def _before_execute(
    conn: Connection, state: SessionState, elem: Any, params: Sequence[Any], options: Any
) -> tuple[Any, Sequence[Mapping[str, Any]], _Pending | None]:
    """A statement on a fenced connection, before it is sent: the statement and parameter
    sets to send instead and, when its row count tells a stale write apart, what
    :func:`_after_execute` checks."""
    lease, attrs = state.lease, conn.__dict__
    if lease is not None and (  # no BEGIN hook: re-arm before SQLAlchemy draws any default
        not _scope.PSYCOPG_BEGIN_HOOK
        or SCOPE not in attrs
        or (lease.name, lease.token) not in attrs[SCOPE]
    ):
        _scope.enter_scope(conn, lease)
    if not (elem.is_dml and isinstance(elem, Update | Delete | Insert)):  # (a SELECT: no call)
        if isinstance(elem, TextClause | TextualSelect):  # (text(), text().columns())
            state.present_for_raw_sql(conn)
        return elem, params, None
    if lease is not None and not lease._wrote:
        lease._wrote = True
        _telemetry.wrote(lease)  # the first write under the lease is timed
    fenced = rewritten(elem)  # a statement met before: its rewrite and fence column
    if fenced is None:
        table = _written_table(elem)
        fence_col = fence_column_of(table)
        if fence_col is None:
            _before_unfenced_table(conn, state, elem, table, params, options)
            return elem, params, None
    else:
        fence_col = fenced.fence_col
    try:
        if lease is None:
            lease = state.require_lease()
        else:  # (require_lease(), inlined)
            lease.check(for_write=True)
        if fenced is None:
            fenced = rewrite(elem, fence_col)
    except FenceError as exc:
        raise state.fail(exc) from None
    key = fence_col.key
    if lease is None:  # sa_fence.unfenced(): no comparison, and no caller's fence either
        if params and key in params[0]:
            params = [_without(p, key) for p in params]
        return elem, params, None
    token, pk_names, readback = lease.token, fenced.pk_names, None
    if "compiled_cache" in options and elem.is_update and pk_names:  # the ORM's: a flush's?
        readback = _flush_readback(state, elem, options, fence_col.table)
    if readback is not None:  # the unit of work's own parameter sets, made for this statement
        for p in params:
            p[TOKEN_BIND] = token
            if key in p:  # a flagged fence
                del p[key]
    else:  # a fence in the parameters (bulk mappings, row dicts, the bump) is never taken
        params = [{**(_without(p, key) if key in p else p), TOKEN_BIND: token} for p in params]
        params = params or [{TOKEN_BIND: token}]
    if pk_names is None or fenced.pk_cols is None:
        if fenced.upsert_rows is None and (len(params) == 1 or isinstance(elem, Insert)):
            return fenced.statement, params, None
        pending = _unkeyed_pending(conn, state, fenced, fence_col.table, params, lease)
        return fenced.statement, params, pending
    for name in pk_names:
        if name not in params[0]:
            return fenced.statement, params, None
    table, statement = fence_col.table, fenced.statement if readback is None else fenced.bare
    pending = _Pending(statement, table, token, fenced.pk_cols, pk_names, params, lease.name)
    pending.only_keys, pending.readback = fenced.only_keys, readback
    return statement, params, pending


def _flush_readback(
    state: SessionState, elem: Any, options: Mapping[str, Any], table: Any
) -> Readback | None:
    """How to show the objects of the flush's UPDATE ``elem`` of fence table ``table`` the token
    it wrote (None: not a flush's statement, or no identity to find its objects by)."""
    index = orm_index().readback
    fenced = index[table] if table in index else []  # noqa: SIM401
    return next((r for r in fenced if r.attr and state.in_flush(elem, options, r)), None)


def _show_token(conn: Connection, state: SessionState, p: _Pending, readback: Readback) -> None:
    """A flush's UPDATE wrote every row it targeted: each object now shows its row's token, as
    a refresh would (the ORM reads back no bare bind)."""
    cols, names, key_cols = p.pk_cols, p.pk_names, readback.key_cols
    order = names if key_cols == cols else [names[cols.index(c)] for c in key_cols]
    # each parameter set's key, as the identity map holds it (a tuple, even of one value)
    by_key = map(itemgetter(*order), p.param_sets)
    keys = list(by_key if order[1:] else zip(by_key))
    attr, token = readback.attr, p.token
    for obj in _flush_objects(conn, state, readback.base_mapper.class_, keys):
        if obj is not None:
            instance_dict(obj)[attr] = token


def _flush_objects(conn: Connection, state: SessionState, cls: type, keys: list[Any]) -> list[Any]:
    """The objects of ``cls``'s hierarchy (its base class) with these primary keys that the
    running flush writes through ``conn`` (None where it has none): from the identity map's own
    dictionary (no call a key), else, for an object loaded with an identity token, from the
    flush's states (:func:`_written_through`)."""
    session = state.session()
    states = {} if session is None else session.identity_map._dict
    # (built and looked up in C: one hash a key, and no Python call a row)
    held = map(states.get, zip(repeat(cls), keys, repeat(None)))
    found = [None if s is None else s.obj() for s in held]
    if None in found and (flush := state.flush()) is not None:  # an identity token?
        mine: dict[Any, list[InstanceState[Any]]] = {}  # (by key without its identity token)
        for s in flush.states:
            mine.setdefault(s.key and s.key[:2], []).append(s)
        for i in [i for i, o in enumerate(found) if o is None]:  # (it may ask for a connection)
            found[i] = _written_through(conn, session, mine.get((cls, keys[i])))
    return found


def _written_through(conn: Connection, session: Any, states: list[Any] | None) -> Any:
    """Of the flush's objects of one key under several identity tokens (a ShardedSession's),
    the one it writes through ``conn`` (a Cat taken for the Dog would leave the Dog's row
    uncompared); the first if none is (a session routing objects some other way)."""
    for s in states if states and states[1:] else ():
        if (obj := s.obj()) is not None and _sent_through(conn, session, obj):
            return obj
    return states[0].obj() if states else None


def _sent_through(conn: Connection, session: Any, obj: Any) -> bool:
    """Whether the flush writes ``obj``'s rows through ``conn``: always, unless the session
    routes objects to connections of its own (a ShardedSession's ``connection_callable``)."""
    pick: Any = getattr(session, "connection_callable", None)
    return pick is None or pick(instance_state(obj).mapper, obj) is conn


def _written_table(elem: Any) -> Any:
    """The table ``elem`` writes: the statements of an ORM bulk INSERT or UPDATE by primary key
    carry the entity's table (a joined subclass's own) and write each of its tables in turn."""
    marks = elem._annotations  # (`in` and [], not get(): no call)
    if "_emit_update_table" in marks:
        return marks["_emit_update_table"]
    return marks["_emit_insert_table"] if "_emit_insert_table" in marks else elem.table  # noqa: SIM401


#: A compiled statement with a CTE -> the UPDATE, DELETE and INSERT statements nested in it,
#: each with its CTE's name (read once per compiled form, which the compiled cache keeps).
_nested_dml: weakref.WeakKeyDictionary[Any, list[tuple[Any, str | None]]] = (
    weakref.WeakKeyDictionary()
)


def _refuse_nested_dml(state: SessionState, compiled: Any) -> None:
    """Refuse, before it is sent, a statement with an UPDATE, DELETE or INSERT of fenced rows
    nested in it: a DML CTE (``WITH u AS (UPDATE jobs ...) SELECT ...``) of a SELECT, of a
    subquery, of an ``INSERT ... FROM SELECT`` or given to another statement's ``add_cte()``.
    The hook rewrites the statement it is given, not one nested in it: refused, not fenced (a
    CTE's rows cannot be counted apart from the statement's, nor told stale). The compiler's
    record of the CTEs it rendered drops the nesting ones, so the statement itself is read."""
    try:
        nested = _nested_dml[compiled]
    except KeyError:
        top, names, found = compiled.statement, {}, []
        node: Any
        for node in visitors.iterate(top):
            if isinstance(node, CTE) and node.element.is_dml:
                names[node.element] = node.name
            elif node.is_dml and node is not top and isinstance(node, Update | Delete | Insert):
                found.append(node)
        nested = _nested_dml[compiled] = [(dml, names.get(dml)) for dml in found]
    for dml, name in nested:
        outer = compiled.statement
        within = _verb(outer)[0] + (f" of {outer.table.name}" if outer.is_dml else "")
        cte = f"a CTE ({name!r})" if name else "another statement"
        _refuse_unfenceable(
            state,
            dml,
            f"inside {cte} of {within}",
            "run the {VERB} as a statement of its own, session.execute({call}({name})...), with "
            ".returning(...) for the rows it wrote, and pass those to the next statement",
        )


def _verb(stmt: Any) -> tuple[str, str]:
    """("an UPDATE", "update"), ("a DELETE", "delete"), ("an INSERT", "insert") or a SELECT."""
    if not stmt.is_dml:
        return "a SELECT", "select"
    if stmt.is_update:
        return "an UPDATE", "update"
    return ("a DELETE", "delete") if stmt.is_delete else ("an INSERT", "insert")


def _refuse_unfenceable(state: SessionState, dml: Any, how: str, instead: str) -> None:
    """``dml`` writes its table ``how`` (through an alias, inside a CTE), which the hook does
    not rewrite. Refused if the rows are fenced (a fence column, or a fenced joined subclass's
    own table) as the table's own statement is: ``FencingConfigError`` with a lease bound,
    ``UnfencedWriteError`` without (nothing in an ``unfenced()`` block, which compares nothing);
    an association row of a fenced entity needs a lease. Any other table's is sent as written.
    ``instead`` says what to write (``{VERB}``, ``{call}``, ``{name}``: UPDATE, update, Job)."""
    target = table = dml.table
    while isinstance(table, Alias):  # (an alias of an alias)
        table = table.element
    table, index, lease = table._deannotate(), orm_index(), state.lease
    try:
        if fence_column_of(table) is None and table not in index.covered:
            if lease is None and table in index.association_tables:
                state.require_lease()
            return
        if lease is None and state.unfenced:
            return
        verb, call = _verb(dml)
        entity = target._annotations.get("parententity")  # an ORM statement's
        mapped = [m.class_ for m in mappers() if m.local_table is table]
        shown = entity.class_ if entity is not None else mapped[0] if mapped else None
        name = table.name if shown is None else shown.__name__
        what = f"{verb} of fenced table {table.name!r} {how}"
        fix = instead.format(VERB=call.upper(), call=call, name=name)
        if lease is None:
            _telemetry.unfenced_refused()
            raise UnfencedWriteError(
                f"{what}, with no lease bound: this session may not write fenced rows, and "
                "sa-fence fences only a statement on the table itself. Acquire a lease, call "
                f"lease.bind(session) and {fix}; admin scripts that must write without one can "
                "wrap the writes in `with sa_fence.unfenced(session):`. Nothing was sent."
            )
        raise FencingConfigError(
            f"{what}: sa-fence compares and writes the fence only in a statement on the table "
            f"itself, so this one could overwrite rows a newer holder wrote. Instead, {fix}. "
            "Nothing was sent."
        )
    except FenceError as exc:
        raise state.fail(exc) from None


def _before_unfenced_table(
    conn: Connection, state: SessionState, elem: Any, table: Any, params: Any, options: Any
) -> None:
    """DML of a table without a fence column: an association table of a fenced entity needs a
    lease; so does a table of a fenced joined-inheritance class, whose UPDATE or DELETE first
    compares and advances the same rows' fence (the flush's own: the flush does that itself)."""
    index, lease = orm_index(), state.lease
    covered = index.covered.get(table)
    if covered is None and "parententity" in (marks := elem.table._annotations):
        covered = index.covered.get((marks["parententity"], table))  # the ORM entity's table
    shared = index.shared[table] if table in index.shared else None  # noqa: SIM401
    owned = _rows_of_fenced(conn, state, elem, table, shared, params, options) if shared else []
    try:
        if not table._is_table:  # an alias (of a fenced table?): no call for a table
            _refuse_alias(state, elem)
        if lease is not None and table in index.cascading and not elem.is_insert:
            state.present_for_raw_sql(conn)  # its cascades into fenced rows meet the guard
        if lease is None:
            if covered is not None or table in index.association_tables or owned:
                state.require_lease()  # (None in an unfenced() block)
        elif covered and not elem.is_insert and not state.in_flush(elem, options, covered):
            _fence_rows_first(conn, elem, table, covered, params)
        elif covered and elem.is_update and covered.bump is not None:  # the flush's UPDATE
            session, mine = state.session(), state.bumped  # (a shard's: the objects it writes)
            flagged = {instance_state(o).identity for o in mine if _sent_through(conn, session, o)}
            _fence_rows_first(conn, elem, table, covered, params, flagged)
        for fenced_rows, rows in owned if lease is not None else ():
            _fence_rows_first(conn, elem, table, fenced_rows, rows)
    except FenceError as exc:
        raise state.fail(exc) from None


def _refuse_alias(state: SessionState, elem: Any) -> None:
    """DML of an alias (``update(aliased(Job))``, ``delete(jobs.alias())``). Refused, not
    fenced like the table's: the rewrite, the row count, the readback and a subclass table's
    comparison first all name the table's own columns, and an alias's are others (its fence
    would be ``j.fence``, its key binds ``j.id``); a statement on the table itself is always
    there to write instead, and one path is simpler to keep right than two."""
    name = elem.table.name  # (an ORM alias's is anonymous: not shown)
    _refuse_unfenceable(
        state,
        elem,
        "through an alias" + ("" if isinstance(name, _anonymous_label) else f" ({name!r})"),
        "write {call}({name}) rather than {call}() of an alias (a statement that refers to "
        "the table twice can alias the other reference, its subquery's)",
    )


def _fence_rows_first(
    conn: Connection, elem: Any, table: Any, covered: Covered, params: Any, flagged: Any = None
) -> None:
    """Before ``elem`` writes, by primary key, rows of a table of a fenced joined-inheritance
    class that has no fence column, compare the fence of the same rows in the fence's table and
    advance it (a fenced UPDATE: a stale row raises StaleTokenError before ``elem`` is sent).
    In a flush, only the rows of objects whose fence it did not flag (``flagged``: identities):
    a foreign key the unit of work set, a post-update."""
    pk_cols, pk_names, _ = key_binds(elem, table)
    if pk_cols is None or pk_names is None or covered.bump is None:
        verb, fence = "an UPDATE" if isinstance(elem, Update) else "a DELETE", covered.fence_col
        raise FencingConfigError(
            f"{verb} of table {table.name!r} outside a flush: its rows are fenced by "
            f"{fence.table.name}.{fence.name} (joined-table inheritance), whose rows sa-fence "
            "compares first, so the statement must pin every primary key column with "
            "`column == bindparam(...)`"
            + ("" if covered.bump is not None else " and the inheritance condition equate the keys")
            + ". Target the rows by primary key (session.execute(update(Entity), "
            "[{'id': ..., ...}])), or load the objects and change them. Nothing was sent."
        )
    if any(n not in p for p in params for n in pk_names):
        return  # SQLAlchemy refuses the statement itself: a value is required for each bind
    name_of = dict(zip(pk_cols, pk_names, strict=True))
    names = [name_of[col] for col, _ in covered.pk_pairs]
    if flagged:  # a flush's: it compares the rows of the objects it flagged itself
        params = [p for p in params if tuple(p[n] for n in names) not in flagged]
    if params:
        keys = [{f"sa_fence_key_{i}": p[n] for i, n in enumerate(names)} for p in params]
        conn.execute(covered.bump, keys)


def _rows_of_fenced(
    conn: Connection,
    state: SessionState,
    elem: Any,
    table: Any,
    shared: Covered,
    params: Any,
    options: Any,
) -> list[tuple[Covered, list[Any]]]:
    """A flush's UPDATE of an unfenced table that fenced joined subclasses share with unfenced
    classes (``animals`` under ``Dog``): its rows of fenced objects the flush did not flag (a
    foreign key it set), found in the identity map, by the ``Covered`` of the object's class.
    (Its DELETE of a Dog's row follows that of the dogs row, which compares the fence.)"""
    if not (elem.is_update and state.in_flush(elem, options, shared)):
        return []
    pk_cols, pk_names, _ = key_binds(elem, table)
    if pk_cols is None or pk_names is None or shared.bump is None:
        return []
    name_of, flagged = dict(zip(pk_cols, pk_names, strict=True)), set(map(id, state.bumped))
    names = [name_of[col] for col, _ in shared.pk_pairs]
    keys, cls = [tuple(p[n] for n in names) for p in params], shared.base_mapper.class_
    groups: dict[int, tuple[Covered, list[Any]]] = {}  # by covered entry (the object's class)
    for p, obj in zip(params, _flush_objects(conn, state, cls, keys), strict=True):
        covered = orm_index().covered.get((instance_state(obj).mapper, table)) if obj else None
        if covered is not None and id(obj) not in flagged:
            groups.setdefault(id(covered), (covered, []))[1].append(p)
    return list(groups.values())


def _unkeyed_pending(
    conn: Connection,
    state: SessionState,
    fenced: FencedStatement,
    table: Table,
    params: Sequence[Mapping[str, Any]],
    lease: Lease,
) -> _Pending:
    """An upsert's row count check; an executemany UPDATE or DELETE not by key is refused."""
    elem = fenced.statement
    if fenced.upsert_rows is None:
        raise state.fail(
            FencingConfigError(
                f"an executemany {'UPDATE' if isinstance(elem, Update) else 'DELETE'} of fenced "
                f"table {table.name!r} whose WHERE clause does not pin every primary "
                "key column with `column == bindparam(...)`: a stale row could be skipped "
                "without anyone noticing. Target rows by primary key, or send one statement "
                "per parameter set. Nothing was sent."
            )
        )
    # each proposed row inserts or updates: fewer than proposed were skipped as stale
    pending = state.pending = _Pending(
        elem,
        table,
        lease.token,
        list(table.primary_key.columns),
        [],
        params,
        lease.name,
        expected=fenced.upsert_rows * len(params),
    )
    if not getattr(conn, _COUNTS_UPSERTS, False):  # only such a connection pays for dispatch
        event.listen(conn, "after_cursor_execute", _count_upserted_rows)
        setattr(conn, _COUNTS_UPSERTS, True)
    return pending


def _without(params: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    if key not in params:
        return params
    return {k: v for k, v in params.items() if k != key}


def _after_execute(conn: Connection, state: SessionState, pending: _Pending, result: Any) -> None:
    """A fenced statement targeted by primary key (or an upsert) ran: were rows skipped?"""
    if pending.expected is None:
        if result.rowcount == len(pending.param_sets):
            if pending.readback is not None:
                _show_token(conn, state, pending, pending.readback)
            return
    else:
        state.pending = None
        if pending.counted == pending.expected:
            return
    error = _stale_error(conn, pending)
    if error is None:  # rows its own WHERE clause skipped, none of them newer
        return
    _telemetry.stale_refused(state.lease, _telemetry.ROW_FENCE, error)
    raise state.fail(error)


def _count_upserted_rows(
    conn: Connection, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
) -> None:
    """Add up the rows a fenced upsert's cursor executions report (``result.rowcount`` is
    -1 for an INSERT, or with ``preserve_rowcount`` and insertmanyvalues the rows sent)."""
    state: SessionState | None = getattr(conn, ACTIVE, None)
    if state is None:
        return
    pending = state.pending
    if (
        pending is not None
        and pending.expected is not None
        and context is not None
        and context.invoked_statement is pending.statement
    ):
        pending.counted += max(cursor.rowcount, 0)


def _stale_error(conn: Connection, p: _Pending) -> StaleTokenError | None:
    """Find which targeted rows carry a newer fence (failure path only); an upsert's keys
    come from its parameters and VALUES (a key the server generates is unknown)."""
    if p.expected is None:
        pks = [tuple(ps[n] for n in p.pk_names) for ps in p.param_sets]
    else:
        pks = _proposed_keys(p)
    fence_col = fence_column_of(p.table)
    assert fence_col is not None
    found: dict[tuple[Any, ...], int] = {}
    if pks:
        query = select(*p.pk_cols, fence_col).where(sqlalchemy.tuple_(*p.pk_cols).in_(pks))
        for row in conn.execute(query).all():
            found[tuple(row[: len(p.pk_cols)])] = row[-1]
    if p.expected is not None:
        statement = "UPSERT"
        stale = [pk for pk in pks if pk in found and found[pk] > p.token]
    else:
        is_delete = isinstance(p.statement, Delete)
        statement = "DELETE" if is_delete else "UPDATE"
        # A DELETE has already removed the rows it matched: missing now, but not stale.
        stale = [
            pk
            for pk in pks
            if (found.get(pk) is not None and found[pk] > p.token)
            or (found.get(pk) is None and not is_delete)
        ]
        if not stale and not p.only_keys:
            return None  # its own WHERE clause skipped them (SQLAlchemy counts no rows then)
        stale = stale or pks
    return StaleTokenError(
        table=p.table.fullname,
        statement=statement,
        token=p.token,
        primary_keys=stale,
        current_fences=[found.get(pk) for pk in stale],
        lease_name=p.lease_name,
    )


def _proposed_keys(p: _Pending) -> list[tuple[Any, ...]]:
    """The primary keys an upsert proposed, where the parameters or VALUES carry them."""
    keys = [c.key for c in p.pk_cols]
    stmt: Any = p.statement
    stmt_rows = [
        _named_values(row)
        for rows in getattr(stmt, "_multi_values", ()) or ()
        for row in rows
        if isinstance(row, dict)
    ] or [_named_values(getattr(stmt, "_values", None) or {})]
    proposed: list[tuple[Any, ...]] = []
    for params in p.param_sets:
        for row in stmt_rows:
            merged = {**row, **(params or {})}
            if not all(k in merged for k in keys):
                return []
            proposed.append(tuple(merged[k] for k in keys))
    return proposed


def _named_values(values: Any) -> dict[str, Any]:
    named: dict[str, Any] = {}
    for k, v in dict(values).items():
        name = k if isinstance(k, str) else str(getattr(k, "key", ""))
        if isinstance(v, BindParameter) and v.callable is None:
            named[name] = v.value
        elif not isinstance(v, ColumnElement):
            named[name] = v
    return named


# ------------------------------------------------------------- session events
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
    sharing: list[SessionState] | None = attrs[_SHARING] if _SHARING in attrs else None  # noqa: SIM401
    active = attrs[ACTIVE] if ACTIVE in attrs else None  # noqa: SIM401
    try:  # (a refusal sticks: the session may not flush or commit until rolled back)
        if sharing or (active is not None and active is not state):  # (else: its alone)
            _refuse_confusable(connection, state, state.lease)
        if sharing is None:
            attrs[_SHARING] = [state]
        elif state not in sharing:
            sharing.append(state)
        if type(connection) in _hooked_classes:  # (_attach, inlined: a class met before)
            attrs[ACTIVE] = state
            _hook_connection(connection)
        else:
            _attach(connection, state)
        state.connections.append(connection)
        if state.lease is not None:
            check_dialect(connection.dialect)
            if session.twophase:  # (_refuse_unscoped(), inlined: it raises)
                _refuse_unscoped(session, connection)
            _scope.enter_scope(connection, state.lease)  # (first: psycopg's BEGIN step refuses too)
            _refuse_autocommit(connection)
    except FenceError as exc:
        raise state.fail(exc) from None


def _lease_id(lease: Lease | None) -> tuple[str, int] | None:
    return None if lease is None else (lease.name, lease.token)


def _refuse_confusable(connection: Connection, state: SessionState, lease: Lease | None) -> None:
    """Refuse a second session (or fence_connection() block) on ``connection`` unless it
    has the same lease bound, or none: the hook finds the token by connection."""
    sharing: list[SessionState] | None = connection.__dict__.get(_SHARING)
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
    state = _state(session)
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
            sharing = attrs[_SHARING] if _SHARING in attrs else []  # noqa: SIM401
            if sharing == [state]:
                sharing = []
            elif state in sharing:
                sharing.remove(state)
            if not sharing and _SHARING in attrs:
                del attrs[_SHARING]
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
            _scope.enter_scope(conn, lease)
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
    if getattr(_scope.driver_of(conn), "autocommit", False):  # (a call only to refuse)
        _scope.refuse_armed_autocommit(True)


def unbind(session: Session) -> None:
    """Detach the lease from ``session``: later fenced writes need a new lease."""
    state = _state(_session_of(session, "unbind()"))
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
    _attach(conn, state)
    _scope.enter_scope(conn, lease)
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
