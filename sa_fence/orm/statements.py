"""The statement hook: a session's fenced Connection (its class swapped for
:class:`FencedConnection`), whose private execute, begin, commit and rollback steps run
sa-fence's code first; no event listener is dispatched per statement.

Every fenced UPDATE, DELETE and INSERT is rewritten (:mod:`sa_fence.orm.rewrite`), and one
targeted by primary key (or an upsert) has its row count checked (:func:`_after_execute`);
a write the rewrite cannot fence is refused before it is sent.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import sqlalchemy
from sqlalchemy import (
    CTE,
    Alias,
    Connection,
    TextClause,
    event,
    select,
)
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.attributes import instance_dict, instance_state
from sqlalchemy.sql import visitors
from sqlalchemy.sql.dml import Delete, Insert, Update
from sqlalchemy.sql.elements import BindParameter, ColumnElement, _anonymous_label
from sqlalchemy.sql.selectable import TextualSelect

from .. import telemetry as _telemetry
from ..db import guard as _guard
from ..db.guard import error_from_guard, lease_error_from_check, quote_ident
from ..errors import (
    FenceError,
    FencingConfigError,
    StaleTokenError,
    UnfencedWriteError,
)
from ..scope import arming
from ..scope.arming import ACTIVE, ARMED_APART, SCOPE
from .model import (
    fence_column_of,
    mappers,
    missing_fence_column,
    orm_index,
)
from .rewrite import TOKEN_BIND, FencedStatement, key_binds, rewrite, rewritten
from .session_state import Pending, SessionState

if TYPE_CHECKING:
    from typing import TypeAlias

    from sqlalchemy import Table
    from sqlalchemy.orm import InstanceState

    from .._lease_view import LeaseView
    from .model import Covered, Readback

    Lease: TypeAlias = LeaseView  # a Lease or an AsyncLease


Target = type[Session] | sessionmaker[Any] | Session


#
# What sa-fence keeps per Connection lives in its own __dict__, read with `in` and [] (no call:
# a get() is one, hence the SIM401 noqas on the hot path; a Mock would make up attributes).

#: the installed sessions whose transactions run on it, oldest first (the newest is active)
SHARING = "_sa_fence_sharing"


class FencedConnection(Connection):
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
        scoped = arming.PSYCOPG_BEGIN_HOOK and SCOPE in attrs and attrs[SCOPE]
        cursor = context.cursor.__class__
        if scoped and (
            cursor in arming.reading_cursors
            or arming.driver_of(self).cursor_factory in arming.reading_cursors
        ):
            return super()._exec_single_context(dialect, context, statement, parameters)
        rolls_back = arming.before_bound_sql(self, state.lease, sql)
        result = super()._exec_single_context(dialect, context, statement, parameters)
        if rolls_back:  # a ROLLBACK TO may undo an arm sent after BEGIN: send it again
            arming.send_arms(self, attrs[SCOPE])
        return result

    def _exec_insertmany_context(self, dialect: Any, context: Any) -> Any:
        state: SessionState | None = self.__dict__.get(ACTIVE)
        cs = context.compiled.__dict__  # (an INSERT with a CTE: as _exec_single_context)
        if state is not None and "ctes" in cs and cs["ctes"] is not None:
            _refuse_nested_dml(state, context.compiled)
        if state is not None and state.lease is not None:
            # (an INSERT: no ROLLBACK TO)
            arming.before_bound_sql(self, state.lease, context.statement)
        return super()._exec_insertmany_context(dialect, context)

    def _execute_default(self, *args: Any, **kwargs: Any) -> Any:
        arming.scope_on_begin(self)
        return super()._execute_default(*args, **kwargs)

    def _begin_impl(self, transaction: Any) -> None:
        arming.scope_on_begin(self)
        super()._begin_impl(transaction)

    def _commit_impl(self) -> None:
        arming.check_scope_and_commit(self)
        super()._commit_impl()

    def _rollback_impl(self) -> None:
        _end_scope(self)
        super()._rollback_impl()


def check_connection_api(cls: type) -> None:
    """Refuse a Connection class lacking (or changing) a method FencedConnection overrides:
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
#: Connection class -> its fenced subclass (``FencedConnection`` for Connection).
hooked_classes: dict[type, type] = {Connection: FencedConnection}
#: Dialect attribute: sa-fence's handle_error listener is attached.
_GUARD_ERRORS = "_sa_fence_maps_guard_errors"


def hook_connection(connection: Connection) -> None:
    """Swap in a fenced subclass (same layout); attach handle_error once per dialect."""
    cls = type(connection)
    if cls not in hooked_classes:
        hooked_classes[cls] = type(
            f"Fenced{cls.__name__}", (FencedConnection, cls), {"__slots__": ()}
        )
    connection.__class__ = hooked_classes[cls]
    dialect = connection.dialect
    if _GUARD_ERRORS not in dialect.__dict__:  # (set below, as an attribute: no getattr call)
        if not event.contains(dialect, "handle_error", _map_guard_error):
            event.listen(dialect, "handle_error", _map_guard_error)
        dialect.__dict__[_GUARD_ERRORS] = True


def attach(connection: Connection, state: SessionState) -> None:
    """Route ``connection``'s statements through the hook for ``state`` (not a Mock's)."""
    connection.__dict__[ACTIVE] = state
    cls = type(connection)
    if not issubclass(cls, FencedConnection) and issubclass(cls, Connection):
        hook_connection(connection)


def _end_scope(conn: Connection) -> None:
    """The transaction ended (rolled back, or its COMMIT sent as SQL refused): unscope it."""
    if conn.__dict__.pop(SCOPE, None) is not None:
        conn.__dict__.pop(ARMED_APART, None)  # (set only in scope, as the arms are)
        arming.disarm(conn)  # (arms are only ever set in scope)


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
        error = lease_error_from_check(orig, scope) or arming.scope_setup_error(orig)
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
) -> tuple[Any, Sequence[Mapping[str, Any]], Pending | None]:
    """A statement on a fenced connection, before it is sent: the statement and parameter
    sets to send instead and, when its row count tells a stale write apart, what
    :func:`_after_execute` checks."""
    lease, attrs = state.lease, conn.__dict__
    if lease is not None and (  # no BEGIN hook: re-arm before SQLAlchemy draws any default
        not arming.PSYCOPG_BEGIN_HOOK
        or SCOPE not in attrs
        or (lease.name, lease.token) not in attrs[SCOPE]
    ):
        arming.enter_scope(conn, lease)
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
    readback = None
    if "compiled_cache" in options and elem.is_update and fenced.pk_names:  # a flush's?
        readback = _flush_readback(state, elem, options, fence_col.table)
    params = _with_token(params, key, lease.token, readback)
    return _pending_for(conn, state, elem, fenced, fence_col.table, params, lease, readback)


def _with_token(
    params: Sequence[Any], key: str, token: int, readback: Readback | None
) -> Sequence[Mapping[str, Any]]:
    """The parameter sets with the token bound and no fence of the caller's."""
    if readback is not None:  # the unit of work's own parameter sets, made for this statement
        for p in params:
            p[TOKEN_BIND] = token
            if key in p:  # a flagged fence
                del p[key]
        return params
    # a fence in the parameters (bulk mappings, row dicts, the bump) is never taken
    params = [{**(_without(p, key) if key in p else p), TOKEN_BIND: token} for p in params]
    return params or [{TOKEN_BIND: token}]


def _pending_for(
    conn: Connection,
    state: SessionState,
    elem: Any,
    fenced: FencedStatement,
    table: Table,
    params: Sequence[Mapping[str, Any]],
    lease: Lease,
    readback: Readback | None,
) -> tuple[Any, Sequence[Mapping[str, Any]], Pending | None]:
    """The statement to send and what :func:`_after_execute` checks of its row count."""
    pk_names = fenced.pk_names
    if pk_names is None or fenced.pk_cols is None:
        if fenced.upsert_rows is None and (len(params) == 1 or isinstance(elem, Insert)):
            return fenced.statement, params, None
        pending = _unkeyed_pending(conn, state, fenced, table, params, lease)
        return fenced.statement, params, pending
    for name in pk_names:
        if name not in params[0]:
            return fenced.statement, params, None
    statement = fenced.statement if readback is None else fenced.bare
    pending = Pending(statement, table, lease.token, fenced.pk_cols, pk_names, params, lease.name)
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


def _show_token(conn: Connection, state: SessionState, p: Pending, readback: Readback) -> None:
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
) -> Pending:
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
    pending = state.pending = Pending(
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


def _after_execute(conn: Connection, state: SessionState, pending: Pending, result: Any) -> None:
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


def _stale_error(conn: Connection, p: Pending) -> StaleTokenError | None:
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


def _proposed_keys(p: Pending) -> list[tuple[Any, ...]]:
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
