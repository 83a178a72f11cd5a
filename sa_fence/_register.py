"""The lease register: the database's memory of the newest token per lease name.

The row fence refuses a stale write only to a row a newer holder has
already written.  The register closes the rest (INSERTs, association and
subclass tables, the database's own cascades, rows the newer holder has not
reached yet): a transaction of a session bound to a lease commits only
while the register still holds that lease's token (DESIGN.md, I7, I8)::

    sa_fence_leases
      name        text PRIMARY KEY   the lease name
      token       bigint NOT NULL    the newest token granted for it
                  DEFAULT nextval('<the token sequence>')
      granted_at  timestamptz NOT NULL
      previous    bigint             the token before it (for a withdrawn grant)

The token column's default names the register's one sequence: every grant
draws from the sequence the default depends on, and a Fencer naming another
sequence is refused (two sequences on one set of rows would let a stale
holder's token overtake a newer one).

**Grant** (:data:`GRANT_SQL`): one autocommit statement draws the token and
advances the register.  The upsert writes a row, so the transaction has an
xid and its commit flushes the WAL (with ``synchronous_commit`` on): a crash
cannot hand the token out again.  The same statement checks the sequence's
fitness (``CACHE 1``, ``NO CYCLE``, increment > 0, ``bigint``) and that it is
the register's own; an unfit sequence draws nothing and the statement
returns no row.  ``lock_timeout`` bounds the wait for a committing holder's
share lock on the register row.

**Withdraw** (:data:`WITHDRAW_SQL`): when the lease turned out lost before
its token could be confirmed in Redis, the token was never used; the register
goes back to the token before it (compare-and-set on our token), so a live
holder granted in between is not fenced out.

**Commit check** (:func:`check_function_sql`): ``<schema>.sa_fence_check_lease
(name, token)``, sent in the same message as ``COMMIT``: in a transaction that
wrote anything (it has an xid) it takes a share lock on the register row and
raises SQLSTATE :data:`LEASE_STALE_SQLSTATE` unless the row still holds the
token.  The lock is held until the ``COMMIT`` right behind it ends, so a
newer grant happens either before the check (refused) or after the commit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from sqlalchemy import (
    DDL,
    BigInteger,
    Column,
    MetaData,
    Sequence,
    Table,
    Text,
    event,
    text,
)
from sqlalchemy.dialects.postgresql import TIMESTAMP

from ._guard import qualified

#: The register table's name (in the schema of the token sequence).
REGISTER_TABLE = "sa_fence_leases"
#: The commit check function's name (same schema).
CHECK_FUNCTION = "sa_fence_check_lease"
#: SQLSTATE of a refused commit: a newer lease of the same name was granted.
LEASE_STALE_SQLSTATE = "SF003"
#: Which database a connection reaches, whatever URL it was reached by (host
#: names, sockets and poolers differ; the cluster's identifier does not).
DATABASE_ID_SQL = "SELECT system_identifier, current_database() FROM pg_control_system()"
#: Default bound (ms) on a grant's wait for a committing holder's share lock.
DEFAULT_GRANT_LOCK_TIMEOUT_MS = 5000

#: What the register must look like: column -> (type, not null).
REGISTER_SHAPE: dict[str, tuple[str, bool]] = {
    "name": ("text", True),
    "token": ("bigint", True),
    "granted_at": ("timestamp with time zone", True),
    "previous": ("bigint", False),
}


def split_name(name: str) -> tuple[str | None, str]:
    """``"schema.name"`` -> ``("schema", "name")``; ``"name"`` -> ``(None, "name")``."""
    schema, _, bare = name.rpartition(".")
    return (schema or None), bare


@dataclass(frozen=True)
class Register:
    """Where one token sequence's register and check function live (all SQL-quoted)."""

    sequence: str  # as the user named it: "seq" or "schema.seq"

    @cached_property
    def schema(self) -> str | None:
        return split_name(self.sequence)[0]

    @cached_property
    def sequence_sql(self) -> str:
        schema, name = split_name(self.sequence)
        return qualified(name, schema)

    @cached_property
    def table_sql(self) -> str:
        return qualified(REGISTER_TABLE, self.schema)

    @cached_property
    def table_display(self) -> str:
        return f"{self.schema}.{REGISTER_TABLE}" if self.schema else REGISTER_TABLE

    @cached_property
    def function_sql(self) -> str:
        return qualified(CHECK_FUNCTION, self.schema)

    def pinned(self, schema: str | None) -> Register:
        """This register with its schema named (``schema``: where the sequence was found)."""
        if self.schema is not None or schema is None:
            return self
        return Register(f"{schema}.{split_name(self.sequence)[1]}")

    def grant_sql(self) -> str:
        """The draw-and-register statement (psycopg pyformat: ``%(name)s``)."""
        return self._grant_sql

    def grant_text(self) -> Any:
        """:meth:`grant_sql` as a SQLAlchemy ``text()`` (``:name`` binds)."""
        return self._grant_text

    # Built once per register (a grant is on the lease cycle's hot path).
    @cached_property
    def _grant_sql(self) -> str:
        return _GRANT_SQL.format(register=self.table_sql)

    @cached_property
    def _grant_text(self) -> Any:
        return text(
            self._grant_sql.replace("%(name)s", ":name")
            .replace("%(sequence)s", ":sequence")
            .replace("%(register)s", ":register")
            .replace("%(lock_timeout)s", ":lock_timeout")
        )

    def withdraw_sql(self) -> Any:
        return text(
            f"UPDATE {self.table_sql} SET token = previous, previous = NULL "
            "WHERE name = :name AND token = :token AND previous IS NOT NULL"
        )

    def check_call(self, name: str, token: int) -> str:
        """``SELECT <function>('<name>', <token>)`` with the name as a safe literal."""
        return f"SELECT {self.function_sql}({quote_literal(name)}, {int(token)})"


#: The schema an unqualified sequence name stands for: the first schema of the
#: search_path holding a sequence of that name, never the session's temporary
#: schema (where any role can create a stand-in); when none holds one, the first
#: non-temporary schema of the search_path (so that what is missing is reported
#: missing, not found in pg_temp).  NULL: no schema at all.
SEQUENCE_SCHEMA_SQL = text(
    """
    SELECT coalesce(
        (SELECT p.nspname
           FROM unnest(pg_catalog.current_schemas(false)) WITH ORDINALITY AS p(nspname, pos)
           JOIN pg_catalog.pg_namespace n ON n.nspname = p.nspname
           JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid
          WHERE c.relname = :name AND c.relkind = 'S' AND n.oid <> pg_catalog.pg_my_temp_schema()
          ORDER BY p.pos LIMIT 1),
        (SELECT p.nspname
           FROM unnest(pg_catalog.current_schemas(false)) WITH ORDINALITY AS p(nspname, pos)
           JOIN pg_catalog.pg_namespace n ON n.nspname = p.nspname
          WHERE n.oid <> pg_catalog.pg_my_temp_schema() AND p.nspname <> 'pg_catalog'
          ORDER BY p.pos LIMIT 1)) AS schema
    """
)


def pinned_register(conn: Any, sequence: str) -> Register:
    """The register of ``sequence`` with every name schema-qualified (DESIGN.md, I9
    and the register's "never through search_path"): an unqualified sequence name
    is resolved once, here, by :data:`SEQUENCE_SCHEMA_SQL`; every statement after
    names the sequence and the register by that schema.  ``conn``: a SQLAlchemy
    ``Connection``."""
    register = Register(sequence)
    if register.schema is not None:
        return register
    schema = conn.execute(SEQUENCE_SCHEMA_SQL, {"name": split_name(sequence)[1]}).scalar()
    return register.pinned(schema)


def quote_literal(value: str) -> str:
    """A PostgreSQL string literal for ``value``, safe whatever
    ``standard_conforming_strings`` is: the ``E''`` form escapes both quotes
    and backslashes.  (Used for the commit check, which must travel in one
    simple-protocol message with ``COMMIT`` and so cannot take parameters.)"""
    if "\x00" in value:
        raise ValueError("a lease name cannot contain NUL characters")
    return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


# One statement, autocommit.  `drawn` has a row only when the sequence is fit
# (bigint, CACHE 1, NO CYCLE, increment > 0) and is the one the register's
# token default draws from; it then draws the one token (a CTE with a volatile
# function is evaluated once).  The upsert advances the register only forward
# (DESIGN.md, I9): a drawn token not greater than the name's register token
# (the sequence was set back: setval, a restore, a promoted replica) updates
# nothing, and the row comes back with `token` NULL beside the drawn token and
# the register's, for the refusal.  `previous` keeps the replaced token for a
# withdrawal.  synchronous_commit is read to refuse 'off' (I4b).  The register
# and sequence arrive schema-qualified (Register.pinned): nothing on the
# search_path (a temporary table, another schema) can stand in for them.
_GRANT_SQL = """\
WITH drawn AS (
    SELECT pg_catalog.nextval(s.seqrelid) AS token
      FROM pg_catalog.pg_sequence s
     WHERE s.seqrelid = CAST(%(sequence)s AS pg_catalog.regclass)
       AND s.seqtypid = 'pg_catalog.int8'::pg_catalog.regtype
       AND s.seqcache = 1 AND NOT s.seqcycle AND s.seqincrement > 0
       AND EXISTS (
           SELECT 1
             FROM pg_catalog.pg_attrdef d
             JOIN pg_catalog.pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
             JOIN pg_catalog.pg_depend p
               ON p.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass AND p.objid = d.oid
              AND p.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
            WHERE d.adrelid = CAST(%(register)s AS pg_catalog.regclass)
              AND a.attname = 'token' AND p.refobjid = s.seqrelid)
       AND pg_catalog.set_config('lock_timeout', %(lock_timeout)s, true) IS NOT NULL
), granted AS (
    INSERT INTO {register} AS r (name, token, granted_at)
    SELECT %(name)s, drawn.token, pg_catalog.clock_timestamp() FROM drawn
    ON CONFLICT (name) DO UPDATE
       SET token = EXCLUDED.token, granted_at = EXCLUDED.granted_at, previous = r.token
     WHERE r.token < EXCLUDED.token
    RETURNING r.token
)
SELECT (SELECT g.token FROM granted g) AS token,
       pg_catalog.current_setting('synchronous_commit') AS synchronous_commit,
       drawn.token AS drawn,
       (SELECT o.token FROM {register} o WHERE o.name = %(name)s) AS held
  FROM drawn"""


_CHECK_FUNCTION_SQL = """\
CREATE OR REPLACE FUNCTION {function}(lease_name text, lease_token bigint)
RETURNS void LANGUAGE plpgsql AS $sa_fence$
-- sa-fence commit check (lease-scoped fencing).  Sent in one message with
-- COMMIT by a session bound to a lease: a transaction that wrote anything
-- commits only while the register still holds its lease's token.  The share
-- lock taken here holds a newer grant back until that COMMIT ends.
-- Generated by sa_fence; recreate it with op.create_fence_register().
DECLARE
    newest bigint;
    granted timestamptz;
BEGIN
    IF pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN
        RETURN;  -- the transaction wrote nothing: nothing to commit
    END IF;
    SELECT r.token, r.granted_at INTO newest, granted
      FROM {register} r WHERE r.name = lease_name FOR SHARE;
    IF newest IS DISTINCT FROM lease_token THEN
        RAISE EXCEPTION 'sa-fence: lease % (token %) is stale: the register holds token %',
            quote_literal(lease_name), lease_token, coalesce(newest::text, 'none')
            USING ERRCODE = '{sqlstate}',
                  DETAIL = jsonb_build_object(
                      'name', lease_name, 'token', lease_token, 'newest', newest,
                      'granted_at', granted)::text,
                  HINT = 'A newer lease of this name was granted; nothing of this '
                         'transaction was committed.  Roll back and re-read.';
    END IF;
END
$sa_fence$"""


def check_function_sql(register: Register) -> str:
    return _CHECK_FUNCTION_SQL.format(
        function=register.function_sql,
        register=register.table_sql,
        sqlstate=LEASE_STALE_SQLSTATE,
    )


def create_register_sql(sequence: str) -> list[str]:
    """The statements that create the register and its check function (idempotent)."""
    register = Register(sequence)
    return [
        f"CREATE TABLE IF NOT EXISTS {register.table_sql} (\n"
        "    name text PRIMARY KEY,\n"
        f"    token bigint NOT NULL DEFAULT nextval('{register.sequence_sql}'::regclass),\n"
        "    granted_at timestamptz NOT NULL DEFAULT clock_timestamp(),\n"
        "    previous bigint\n"
        ")",
        check_function_sql(register),
    ]


def drop_register_sql(sequence: str) -> list[str]:
    register = Register(sequence)
    return [
        f"DROP FUNCTION IF EXISTS {register.function_sql}(text, bigint)",
        f"DROP TABLE IF EXISTS {register.table_sql}",
    ]


def register_table(metadata: MetaData, sequence: Sequence) -> Table:
    """The register as a ``Table`` in ``metadata``, drawing tokens from ``sequence``.

    ``metadata.create_all()`` creates the sequence first, then this table
    and (after it) its commit check function.
    """
    existing = metadata.tables.get(
        f"{sequence.schema}.{REGISTER_TABLE}" if sequence.schema else REGISTER_TABLE
    )
    if existing is not None:
        return existing
    table = Table(
        REGISTER_TABLE,
        metadata,
        Column("name", Text, primary_key=True),
        Column("token", BigInteger, nullable=False, server_default=sequence.next_value()),
        Column(
            "granted_at",
            TIMESTAMP(timezone=True),
            nullable=False,
            server_default=text("clock_timestamp()"),
        ),
        Column("previous", BigInteger, nullable=True),
        schema=sequence.schema,
        info={"sa_fence.register": True},
    )
    register = Register(f"{sequence.schema}.{sequence.name}" if sequence.schema else sequence.name)
    function = check_function_sql(register).replace("%", "%%")  # DDL() formats with %
    create = DDL(function)  # type: ignore[no-untyped-call]
    drop = DDL(f"DROP FUNCTION IF EXISTS {register.function_sql}(text, bigint)")  # type: ignore[no-untyped-call]
    event.listen(table, "after_create", create.execute_if(dialect="postgresql"))
    event.listen(table, "before_drop", drop.execute_if(dialect="postgresql"))
    return table


#: The register's columns as the catalog has them (for the checks).
REGISTER_COLUMNS_SQL = text(
    """
    SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS data_type,
           a.attnotnull AS not_null
      FROM pg_catalog.pg_attribute a
     WHERE a.attrelid = to_regclass(:register) AND a.attnum > 0 AND NOT a.attisdropped
    """
)

#: The sequence the register's token default draws from (NULL: none).
REGISTER_SEQUENCE_SQL = text(
    """
    SELECT p.refobjid::regclass::text AS sequence
      FROM pg_catalog.pg_attrdef d
      JOIN pg_catalog.pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
      JOIN pg_catalog.pg_depend p
        ON p.classid = 'pg_catalog.pg_attrdef'::regclass AND p.objid = d.oid
       AND p.refclassid = 'pg_catalog.pg_class'::regclass
      JOIN pg_catalog.pg_class c ON c.oid = p.refobjid AND c.relkind = 'S'
     WHERE d.adrelid = to_regclass(:register) AND a.attname = 'token'
    """
)

#: Does the check function exist (with the right arguments)?
CHECK_FUNCTION_SQL = text(
    "SELECT to_regprocedure(:function || '(text, bigint)') IS NOT NULL AS present"
)

#: The rights the current role needs on the register (SELECT, INSERT, UPDATE).
REGISTER_RIGHTS_SQL = text(
    """
    SELECT has_table_privilege(to_regclass(:register), 'SELECT') AS can_select,
           has_table_privilege(to_regclass(:register), 'INSERT') AS can_insert,
           has_table_privilege(to_regclass(:register), 'UPDATE') AS can_update,
           has_sequence_privilege(to_regclass(:sequence), 'USAGE') AS can_draw,
           has_function_privilege(to_regprocedure(:function || '(text, bigint)'), 'EXECUTE')
               AS can_check
    """
)


def shape_problems(columns: Iterable[Any]) -> list[str]:
    """Why the register's columns (rows of REGISTER_COLUMNS_SQL) are not the expected shape."""
    found = {row.name: (row.data_type, bool(row.not_null)) for row in columns}
    problems = []
    for column, (data_type, not_null) in REGISTER_SHAPE.items():
        if column not in found:
            problems.append(f"has no column {column!r} ({data_type})")
            continue
        has_type, has_not_null = found[column]
        if has_type != data_type:
            problems.append(f"column {column!r} is {has_type} (need {data_type})")
        if not_null and not has_not_null:
            problems.append(f"column {column!r} allows NULL (need NOT NULL)")
    return problems
