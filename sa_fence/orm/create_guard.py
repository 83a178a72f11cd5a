"""The guard trigger without Alembic: :func:`create_fence_guard`, :func:`drop_fence_guard`.

For a database made with ``Base.metadata.create_all(engine)``, with no migrations to run
``op.create_fence_guard()`` in: the same checks and statements, so the same guard (``sa-fence
create-guard`` is the command-line form).  Every check runs before the first statement, and the
statements run in one transaction: bad input writes nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import sqlalchemy as sa

from ..db.fitness import sequence_problem
from ..db.guard import DEFAULT_SEQUENCE, create_guard_sql, drop_guard_sql, qualified
from ..db.register import Register
from .model import fence_column_of

#: The partitioned table at the top of ``:table``'s partition tree, whose guard PostgreSQL
#: clones onto the partition (NULL: no partition).
PARTITION_ROOT_SQL = (
    "(WITH RECURSIVE up(relid, depth) AS (SELECT c.oid, 0 FROM pg_catalog.pg_class c WHERE c.oid"
    " = to_regclass(:table) AND c.relispartition UNION ALL SELECT i.inhparent, up.depth + 1 FROM"
    " up JOIN pg_catalog.pg_inherits i ON i.inhrelid = up.relid)"
    " SELECT relid::regclass::text FROM up WHERE depth > 0 ORDER BY depth DESC LIMIT 1)"
)
#: Whether ``:table`` exists, the type of its ``:column`` (NULL: no such column), its root.
_COLUMN_SQL = sa.text(
    "SELECT to_regclass(:table) IS NOT NULL AS present, (SELECT format_type(a.atttypid, NULL)"
    " FROM pg_catalog.pg_attribute a WHERE a.attrelid = to_regclass(:table) AND a.attname = :column"
    " AND a.attnum > 0 AND NOT a.attisdropped) AS data_type, " + PARTITION_ROOT_SQL + " AS root"
)


def ddl(statement: str) -> sa.TextClause:
    """``statement`` as ``text()`` with no bind parameters: a name holding `` :word`` (legal
    quoted) would otherwise be read as one, and offline SQL would carry ``%(word)s``."""
    return sa.text(statement.replace(":", "\\:"))


def shown_table(table: str, schema: str | None) -> str:
    return f"{schema}.{table}" if schema else table


def _target(
    table: str | sa.Table, column: str | None, schema: str | None
) -> tuple[str, str, str | None]:
    """(table name, fence column, schema) from the caller's arguments."""
    if isinstance(table, sa.Table):
        fence = fence_column_of(table)
        if column is None:
            if fence is None:
                raise ValueError(
                    f"table {table.fullname!r} has no fence column: add "
                    "sa_fence.fence_column() to it (or use the sa_fence.Fenced mixin), "
                    "or pass column='<name of its bigint fence column>'"
                )
            column = fence.name
        return table.name, column, schema if schema is not None else table.schema
    if not isinstance(table, str) or not table:
        raise TypeError(
            f"table must be a table name (str) or a sqlalchemy Table, got {table!r}; "
            "for a model class pass Model.__table__"
        )
    return table, column if column is not None else "fence", schema


def _begin(bind: object, what: str) -> AbstractContextManager[sa.Connection]:
    """A transaction of its own on an Engine, else the Connection's (begun if none is open)."""
    if not isinstance(bind, sa.Engine | sa.Connection):
        # An AsyncEngine or AsyncConnection proxies a sync one: told by that, not by
        # importing sqlalchemy.ext.asyncio, which fails without greenlet.
        if hasattr(bind, "sync_engine") or hasattr(bind, "sync_connection"):
            raise TypeError(
                f"{what} is synchronous: with an AsyncEngine run it as `async with engine.begin()"
                f" as conn: await conn.run_sync(sa_fence.{what}, 'jobs')`"
            )
        raise TypeError(f"{what} needs a sqlalchemy Engine or Connection, got {bind!r}")
    if bind.dialect.name != "postgresql":
        raise ValueError(
            f"{what}: the guard is a PostgreSQL trigger, but this "
            f"{type(bind).__name__} is {bind.dialect.name}"
        )
    return bind.begin() if isinstance(bind, sa.Engine) else nullcontext(bind)


def check_column(
    conn: sa.Connection, table: str, column: str, schema: str | None, create_hint: str, hint: str
) -> None:
    """Refuse a guard on a missing ``table`` or one without the bigint ``column``."""
    shown = shown_table(table, schema)
    found = conn.execute(_COLUMN_SQL, {"table": qualified(table, schema), "column": column}).one()
    if not found.present:
        problem = f"table {shown!r} does not exist; create it first {create_hint}"
    elif found.data_type != "bigint":
        what = "has no column" if found.data_type is None else f"has a {found.data_type} column"
        problem = f"table {shown!r} {what} {column!r}; the guard needs the bigint fence {hint}"
    elif found.root is not None:  # (its copy of the root's guard cannot be replaced on its own)
        problem = (
            f"table {shown!r} is a partition of {found.root}: guard {found.root} instead, whose "
            "guard PostgreSQL clones onto every partition and fires for writes to each"
        )
    else:
        return
    raise ValueError(f"create_fence_guard: {problem}")


def check_sequence(
    conn: sa.Connection, sequence: str, create: str, what: str = "create_fence_guard"
) -> None:
    """Refuse a guard whose token sequence does not exist (PL/pgSQL would take the function,
    then fail every write that raises a fence) or cannot issue tokens (no Fencer would grant
    one from it).  Looked up as the guard will: on the writer's search_path when unqualified."""
    register = Register(sequence)
    row, problem = sequence_problem(conn, register, register)
    if row is None:
        raise ValueError(
            f"{what}: the token sequence {sequence!r} does not exist (the guard reads it at every "
            f"write that raises a fence); create it first ({create}), or pass "
            "sequence= the Fencers' sequence. Nothing was written."
        )
    if problem is not None:
        raise ValueError(f"{what}: {problem.sentence()} Nothing was written.")


def create_fence_guard(
    bind: sa.Engine | sa.Connection,
    table: str | sa.Table,
    column: str | None = None,
    *,
    schema: str | None = None,
    on_missing_token: str = "reject",
    sequence: str = DEFAULT_SEQUENCE,
) -> None:
    """Create (or replace) the guard trigger on ``table``, without Alembic.

    The same trigger as ``op.create_fence_guard()`` in a migration: it refuses UPDATEs and
    DELETEs with a stale token and any write, INSERT included, of a fence no lease was granted,
    from every writer (raw SQL, ``psql``, other services).  Run it after
    ``Base.metadata.create_all(engine)``::

        sa_fence.fence_schema(Base.metadata)
        Base.metadata.create_all(engine)
        sa_fence.create_fence_guard(engine, "jobs")   # or Job.__table__

    ``bind``: an ``Engine`` (the statements run in a transaction of their own and commit) or a
    ``Connection`` (they run in its transaction, begun if none is open; commit it yourself, as
    with ``create_all``).  ``table``: a table name, or a ``Table``, whose schema and fence column
    are then used.  ``column`` defaults to the ``Table``'s fence column, else ``"fence"``.
    ``on_missing_token``: ``"reject"`` (default) refuses UPDATEs and DELETEs that present no
    token; ``"unchanged"`` lets an UPDATE that leaves the fence as it is through.  ``sequence``:
    the Fencers' token sequence.  Running it again replaces the guard (idempotent).

    Raises ``ValueError``, with nothing written, when the table, its bigint fence column or the
    sequence does not exist, the table is a partition (guard its partitioned table), the
    sequence cannot issue fencing tokens (not ``AS bigint CACHE 1 NO CYCLE``, a positive
    increment, logged), or an argument is invalid.
    """
    begin = _begin(bind, "create_fence_guard")
    name, col, schema = _target(table, column, schema)
    statements = create_guard_sql(
        name, col, schema=schema, on_missing_token=on_missing_token, sequence=sequence
    )
    with begin as conn:
        create = "(Base.metadata.create_all(engine)), then the guard"
        add = f"ALTER TABLE {qualified(name, schema)} ADD COLUMN {qualified(col, None)}"
        hint = f"column ({add} bigint NOT NULL DEFAULT 0, or op.add_fence_column() in a migration)"
        check_column(conn, name, col, schema, create, hint)
        check_sequence(conn, sequence, "sa_fence.fence_schema(Base.metadata) before create_all()")
        for statement in statements:
            conn.execute(ddl(statement))  # as op.execute() runs it


def drop_fence_guard(
    bind: sa.Engine | sa.Connection, table: str | sa.Table, *, schema: str | None = None
) -> None:
    """Drop the guard trigger of ``table`` and its function (nothing if there is none).

    ``bind`` as for :func:`create_fence_guard`."""
    begin = _begin(bind, "drop_fence_guard")
    name, _, schema = _target(table, "fence", schema)
    statements = drop_guard_sql(name, schema=schema)
    with begin as conn:
        for statement in statements:
            conn.execute(ddl(statement))
