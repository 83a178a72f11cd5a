"""Statement rewriting: how a fenced table's DML carries the token.

:func:`rewrite` turns an UPDATE, DELETE or INSERT of a table with a fence column into the
statement sa-fence sends (cached per original statement; the token travels as the bind
``sa_fence_token``):

* UPDATE and DELETE get ``AND coalesce(fence, 0) <= :token`` (:func:`fence_predicate`, which
  also presents the token to a guard);
* UPDATE and INSERT set ``fence = CAST(:token AS BIGINT)`` (a flush's UPDATE ``fence = :token``,
  ``FencedStatement.bare``: the statement hook shows the objects it wrote their token);
* ``INSERT ... ON CONFLICT DO UPDATE`` compares and writes in its DO UPDATE too;
* a statement that sets the fence itself is refused.

It also finds the primary key binds of the WHERE clause, so that the statement hook can compare
the row count with the rows targeted. Nothing here touches a connection.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Column, and_, bindparam, cast, func, literal_column, select, true
from sqlalchemy.dialects.postgresql.dml import OnConflictDoUpdate
from sqlalchemy.sql import ColumnElement, operators
from sqlalchemy.sql.dml import Delete, Insert, Update
from sqlalchemy.sql.elements import BinaryExpression, BindParameter, BooleanClauseList
from sqlalchemy.types import Text

from ..db.guard import TOKEN_SETTING
from ..errors import FencingConfigError

TOKEN_BIND = "sa_fence_token"

#: Original DML statement -> the statement as sa-fence sends it.
_rewritten: weakref.WeakKeyDictionary[Any, FencedStatement] = weakref.WeakKeyDictionary()

_TOKEN = bindparam(TOKEN_BIND, type_=BigInteger)
_ZERO = literal_column("0", BigInteger)
#: An expression, not a bare bind: the ORM then expires ``obj.fence`` after the write, so it
#: reads back the token (a bare bind would leave 0 or None with expire_on_commit=False). A
#: flush's UPDATE sends the bare bind and the hook sets each object's fence instead (the ORM
#: expiring it costs 11 calls a row).
_TOKEN_WRITTEN = cast(_TOKEN, BigInteger)


def fence_predicate(fence_col: Column[Any], token: Any) -> ColumnElement[bool]:
    """The comparison every fenced UPDATE/DELETE carries: ``fence <= :token``.

    The token goes through ``set_config('sa_fence.token', :token, true)``, which returns it and
    presents it to a guard (:mod:`sa_fence.db.guard`) for every row the statement writes, in the
    same statement (a BEFORE DELETE trigger has no NEW row to read the token from).
    """
    setting: ColumnElement[str] = literal_column(f"'{TOKEN_SETTING}'")  # rendered inline
    presented = func.set_config(setting, cast(token, Text), true())
    # coalesce: a NULL fence (a legacy row never written under a lease) is writable; its 0 is
    # written inline (a bind would be one more parameter a row for SQLAlchemy and the driver)
    return func.coalesce(fence_col, _ZERO) <= cast(presented, BigInteger)


@dataclass(slots=True)
class FencedStatement:
    """A fenced table's DML statement as sa-fence sends it (built once, cached)."""

    statement: Any
    pk_cols: list[Column[Any]] | None  # None: not targeted by primary key
    pk_names: list[str] | None  # the bind names that target pk_cols
    only_keys: bool = False  # its WHERE clause holds nothing but pk_cols = bind
    upsert_rows: int | None = None  # the rows one execution of a checked upsert proposes
    fence_col: Any = None  # the fence column it compares and writes
    bare: Any = None  # an UPDATE writing the fence as a bare bind (the ORM does not expire it)


def rewritten(elem: Any) -> FencedStatement | None:
    """``elem`` as :func:`rewrite` made it before, or None: its cache read as a dict (one call)."""
    try:
        ref, data = weakref.ref(elem), _rewritten.data  # type: ignore[attr-defined]
    except TypeError:  # not weak-referenceable: never cached
        return None
    return data[ref] if ref in data else None  # noqa: SIM401


def rewrite(elem: Any, fence_col: Column[Any]) -> FencedStatement:
    """``elem`` fenced by ``fence_col``, cached (read by :func:`rewritten` first)."""
    _refuse_caller_fence(elem, fence_col)
    if isinstance(elem, Insert):
        stmt, upsert_rows = _fence_upsert(_with_value(elem, fence_col, _TOKEN_WRITTEN), fence_col)
        fenced = FencedStatement(stmt, None, None, upsert_rows=upsert_rows)
    else:
        stmt = bare = elem.where(fence_predicate(fence_col, _TOKEN))
        if isinstance(elem, Update):
            bare = _with_value(stmt, fence_col, _TOKEN)
            stmt = _with_value(stmt, fence_col, _TOKEN_WRITTEN)
        fenced = FencedStatement(stmt, *key_binds(elem, fence_col.table), bare=bare)
    fenced.fence_col = fence_col
    with contextlib.suppress(TypeError):  # not weak-referenceable: not cached
        _rewritten[elem] = fenced
    return fenced


def _with_value(stmt: Any, column: Column[Any], value: Any) -> Any:
    """``stmt`` also setting ``column = value`` (``values()`` refuses ordered values, so those
    statements are cloned: 2.0 keeps ``_ordered_values``, 2.1 a flag beside ``_values``)."""
    if getattr(stmt, "_ordered_values", None):  # SQLAlchemy 2.0
        clone = stmt._generate()
        clone._ordered_values = [*stmt._ordered_values, (column, value)]
        return clone
    if getattr(stmt, "_maintain_values_ordering", False):  # SQLAlchemy 2.1
        clone = stmt._generate()
        clone._values = stmt._values.union({column: value})
        return clone
    if isinstance(stmt, Insert) and stmt.select is not None:
        # INSERT ... SELECT: values() is refused; the SELECT gets the column instead
        # (wrapped, so a UNION or a DISTINCT works as written)
        clone = stmt._generate()
        source = stmt.select.subquery()
        clone._select_names = [*(stmt._select_names or ()), column.key]
        clone.select = select(*source.c, value)
        return clone
    multi = getattr(stmt, "_multi_values", ())
    if multi:  # INSERT ... VALUES (...), (...): values() would refuse to mix the forms
        clone = stmt._generate()
        clone._multi_values = tuple(
            [_row_with(row, stmt.table, column, value) for row in rows] for rows in multi
        )
        return clone
    return stmt.values({column: value})


def _row_with(row: Any, table: Any, column: Column[Any], value: Any) -> dict[Any, Any]:
    if isinstance(row, dict):
        return {**row, column.key: value}
    return {**dict(zip(table.columns, row, strict=False)), column: value}


def _upsert_clause(elem: Any) -> OnConflictDoUpdate | None:
    clause = getattr(elem, "_post_values_clause", None)
    return clause if isinstance(clause, OnConflictDoUpdate) else None


def _fence_upsert(stmt: Any, fence_col: Column[Any]) -> tuple[Any, int | None]:
    """The DO UPDATE of an upsert also writes ``fence = :token``, where ``fence <= :token``.

    Returns it and the rows one execution proposes (each inserts or updates, so
    fewer rows mean stale ones); None for ``INSERT ... SELECT`` and a ``where=``
    of the caller's, which may skip rows on purpose (docs/statements.md). The ON
    CONFLICT clause is cloned and its two attributes replaced (no public API).
    """
    clause = _upsert_clause(stmt)
    if clause is None:
        return stmt, None
    fenced: Any = clause._clone()
    values: Any = clause.update_values_to_set
    if isinstance(values, dict):  # SQLAlchemy 2.1
        fenced.update_values_to_set = {**values, fence_col.key: _TOKEN_WRITTEN}
    else:  # SQLAlchemy 2.0: a list of pairs
        fenced.update_values_to_set = [*values, (fence_col.key, _TOKEN_WRITTEN)]
    own_where = clause.update_whereclause
    predicate = fence_predicate(fence_col, _TOKEN)
    fenced.update_whereclause = predicate if own_where is None else and_(own_where, predicate)
    out = stmt._generate()
    out._post_values_clause = fenced
    if own_where is not None or getattr(stmt, "select", None) is not None:
        return out, None
    multi = getattr(stmt, "_multi_values", ()) or ()
    return out, len(multi[0]) if multi else 1


def _keys(mapping_keys: Any) -> set[str]:
    return {k if isinstance(k, str) else str(getattr(k, "key", "")) for k in mapping_keys}


def _refuse_caller_fence(elem: Any, fence_col: Column[Any]) -> None:
    """Refuse a statement that sets the fence itself (one in the parameters is dropped)."""
    names = {fence_col.key, fence_col.name}
    given = _keys(getattr(elem, "_values", None) or ())
    given |= _keys(k for k, _ in getattr(elem, "_ordered_values", None) or ())
    if isinstance(elem, Insert) and elem.select is not None:
        given |= _keys(elem._select_names)
    for row in (r for rows in getattr(elem, "_multi_values", ()) or () for r in rows):
        given |= _keys(row if isinstance(row, dict) else elem.table.c[: len(row)])  # (by position)
    upsert = _upsert_clause(elem)
    if upsert is not None and _keys(dict(upsert.update_values_to_set)) & names:
        what = "this upsert's on_conflict_do_update(set_=...)"
        where, drop = " (on the INSERT and in the DO UPDATE)", "set_"
    elif given & names:
        what, where, drop = "this statement", "", "values() (or from_select() names)"
    else:
        return
    raise FencingConfigError(
        f"{what} sets {fence_col.table.name}.{fence_col.name} itself; the fence is written by "
        f"sa-fence from the bound lease's token{where} and no value a caller gives is taken (a "
        "low one would re-open the row to stale holders, a high one would lock every later "
        f"holder out). Drop {fence_col.name!r} from {drop}. Nothing was sent."
    )


def key_binds(
    elem: Update | Delete, written: Any
) -> tuple[list[Column[Any]] | None, list[str] | None, bool]:
    """The primary key columns of table ``written`` and the binds the WHERE clause pins them to
    with ``=``, ``(None, None, False)`` unless every primary key column is pinned to a bind; and
    whether the clause holds nothing else (then only the fence can skip a targeted row)."""

    table: Any = written._deannotate()  # the ORM's statements carry an AnnotatedTable
    pk_cols: list[Column[Any]] = list(table.primary_key.columns)
    by_column: dict[Any, str] = {}
    only_keys = True
    for criterion in getattr(elem, "_where_criteria", ()):
        for leaf in _conjuncts(criterion):
            pinned = False
            if isinstance(leaf, BinaryExpression) and leaf.operator is operators.eq:
                for col, other in ((leaf.left, leaf.right), (leaf.right, leaf.left)):
                    if (
                        isinstance(col, Column)
                        and col.table is table
                        and isinstance(other, BindParameter)
                        and other.callable is None
                        and other.value is None
                    ):
                        by_column.setdefault(col, str(other.key))
                        pinned = pinned or col in pk_cols
            only_keys = only_keys and pinned
    if not pk_cols or any(c not in by_column for c in pk_cols):
        return None, None, False
    return pk_cols, [by_column[c] for c in pk_cols], only_keys


def _conjuncts(clause: Any) -> Iterator[Any]:
    """The conditions ANDed together in ``clause``."""
    if isinstance(clause, BooleanClauseList) and clause.operator is operators.and_:
        for sub in clause.clauses:
            yield from _conjuncts(sub)
    else:
        yield clause
