"""The lease register: the database's memory of the newest token per lease name.

The row fence refuses a stale write only to a row a newer holder has already written; the
register closes the rest (INSERTs, other tables, cascades): a transaction of a session bound to
a lease commits only while the register still holds that lease's token (docs/architecture.md,
"The tables"; docs/guarantees.md; docs/lease-scope.md).  :attr:`Register.grant_sql` draws and
registers a token in one statement, :meth:`Register.withdraw_sql` gives back a token lost before
its confirm, and :func:`check_function_sql` makes the deferred trigger that refuses a stale
COMMIT (:data:`LEASE_STALE_SQLSTATE`).  Every name is schema-qualified, types and operators too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from sqlalchemy import DDL, BigInteger, Column, MetaData, Sequence, Table, Text, event, text
from sqlalchemy.dialects.postgresql import TIMESTAMP

from ._fitness import SEQUENCE_FIT_SQL, token_sequences_sql
from ._guard import LEASE_STALE_SQLSTATE, qualified, quote_literal

#: The register table's name (in the schema of the token sequence).
REGISTER_TABLE = "sa_fence_leases"
#: The commit check function's name (same schema).
CHECK_FUNCTION = "sa_fence_check_lease"
#: Which database a connection reaches, whatever URL it was reached by (host
#: names, sockets and poolers differ; the cluster's identifier does not).
DATABASE_ID_SQL = "SELECT system_identifier, current_database() FROM pg_control_system()"
#: Default bound (ms) on a grant's wait for a committing holder's share lock.
DEFAULT_GRANT_LOCK_TIMEOUT_MS = 5000


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
        return qualified(split_name(self.sequence)[1], self.schema)

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

    @cached_property
    def scope_sql(self) -> str:
        return qualified(SCOPE_TABLE, self.schema)

    @cached_property
    def scope_display(self) -> str:
        return f"{self.schema}.{SCOPE_TABLE}" if self.schema else SCOPE_TABLE

    @cached_property  # built once per register: a grant is on the lease cycle's hot path
    def grant_sql(self) -> str:
        """The draw-and-register statement (psycopg pyformat: ``%(name)s``)."""
        return _GRANT_SQL.format(
            register=self.table_sql,
            sequence_fit=SEQUENCE_FIT_SQL,
            token_sequences=token_sequences_sql("CAST(%(register)s AS pg_catalog.regclass)"),
        )

    @cached_property
    def grant_text(self) -> Any:
        """:attr:`grant_sql` as a SQLAlchemy ``text()`` (``:name`` binds)."""
        return text(re.sub(r"%\((\w+)\)s", r":\1", self.grant_sql))

    def withdraw_sql(self) -> Any:
        return text(
            f"UPDATE {self.table_sql} SET token = previous, previous = NULL "
            "WHERE name = :name AND token = :token AND previous IS NOT NULL"
        )

    def check_call(self, name: str, token: int) -> str:
        """``SELECT <function>('<name>', <token>)`` with the name as a safe literal."""
        return f"SELECT {self.function_sql}({quote_literal(name)}, {int(token)})"


#: The schema an unqualified sequence name stands for: the first schema of the search_path
#: holding a sequence of that name, never the session's temporary schema (where any role can
#: create a stand-in); when none does, the first non-temporary schema of the search_path (so
#: that what is missing is reported missing, not found in pg_temp).  NULL: no schema at all.
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
    """The register of ``sequence`` with every name schema-qualified, an unqualified
    name resolved once by :data:`SEQUENCE_SCHEMA_SQL` (docs/guarantees.md, "Nothing on
    the search path stands in for sa-fence's objects")."""
    register = Register(sequence)
    if register.schema is not None:
        return register
    schema = conn.execute(SEQUENCE_SCHEMA_SQL, {"name": split_name(sequence)[1]}).scalar()
    return register.pinned(schema)


# One statement, autocommit.  `drawn` has a row only when the sequence is fit (sa_fence._fitness)
# and is the one the register's token default draws from; it draws the one token (a CTE with a
# volatile function is evaluated once).  The upsert only advances the register (docs/guarantees.md,
# "The register only moves forward"): a drawn token not above the name's (the sequence was set
# back) updates nothing, and the row comes back with `token` NULL beside the drawn and the held
# token, for the refusal.  `previous` keeps the replaced token for a withdrawal.
# synchronous_commit is read before `commit_mode` may change it, to refuse 'off'
# (docs/reliability.md).  `commit_mode` skips the commit's WAL flush only when the flush position
# has reached the WAL insert position read after the draw, so the record that makes the token
# durable is on disk, and never with synchronous standbys (docs/guarantees.md, "A PostgreSQL
# crash", says why that is enough); with them, 'local' is raised to 'on' for the grant, which
# then waits for the standbys as the docs promise (a promoted standby has every grant).
_GRANT_SQL = """\
WITH drawn AS (
    SELECT pg_catalog.nextval(s.seqrelid) AS token,
           pg_catalog.current_setting('synchronous_commit') AS synchronous_commit
      FROM pg_catalog.pg_sequence s
     WHERE s.seqrelid = CAST(%(sequence)s AS pg_catalog.regclass)
       AND {sequence_fit}
       AND s.seqrelid IN {token_sequences}
       AND pg_catalog.set_config('lock_timeout', %(lock_timeout)s, true) IS NOT NULL
), commit_mode AS (
    SELECT drawn.token,
           CASE WHEN CAST(%(skip_flush)s AS boolean)
                 AND drawn.synchronous_commit <> 'off'
                 AND pg_catalog.current_setting('synchronous_standby_names') = ''
                 AND pg_catalog.pg_current_wal_flush_lsn()
                     >= pg_catalog.pg_current_wal_insert_lsn()
                THEN pg_catalog.set_config('synchronous_commit', 'off', true) IS NULL
                WHEN drawn.synchronous_commit = 'local'
                 AND pg_catalog.current_setting('synchronous_standby_names') <> ''
                THEN pg_catalog.set_config('synchronous_commit', 'on', true) IS NOT NULL
                ELSE true END AS flushed
      FROM drawn
), granted AS (
    INSERT INTO {register} AS r (name, token, granted_at)
    SELECT %(name)s, m.token, pg_catalog.clock_timestamp() FROM commit_mode m
    ON CONFLICT (name) DO UPDATE
       SET token = EXCLUDED.token, granted_at = EXCLUDED.granted_at, previous = r.token
     WHERE r.token < EXCLUDED.token
    RETURNING r.token
)
SELECT (SELECT g.token FROM granted g) AS token,
       drawn.synchronous_commit,
       drawn.token AS drawn,
       (SELECT o.token FROM {register} o WHERE o.name = %(name)s) AS held,
       (SELECT m.flushed FROM commit_mode m) AS flushed
  FROM drawn"""


#: The scope table's name (same schema): one row per lease a transaction entered scope for,
#: written by the transaction's BEGIN message (the arm).
SCOPE_TABLE = "sa_fence_scope"
#: The deferred constraint trigger on it, and its function (same schema).
SCOPE_TRIGGER = "sa_fence_scope_check"
SCOPE_FUNCTION = "sa_fence_scope_check"
#: Where the DDL below names sa-fence's schema; replaced inside PostgreSQL by the schema itself
#: (quoted), so no name is ever found through search_path.
_S = "@sa_fence_schema@"

# The register check of the commit check function and the scope trigger: every name in it is
# qualified, operators and types too (a `SET search_path` clause costs ~20 us per COMMIT).
_CHECK_BODY = """\
    SELECT r.token, r.granted_at INTO newest, granted
      FROM @sa_fence_schema@.sa_fence_leases r
     WHERE r.name OPERATOR(pg_catalog.=) lease_name FOR SHARE;
    IF NOT COALESCE(newest OPERATOR(pg_catalog.=) lease_token, false) THEN
        RAISE EXCEPTION 'sa-fence: lease % (token %) is stale: the register holds token %',
            pg_catalog.quote_literal(lease_name), lease_token,
            COALESCE(CAST(newest AS pg_catalog.text), 'none')
            USING ERRCODE = '{sqlstate}',
                  DETAIL = CAST(pg_catalog.jsonb_build_object(
                      'name', lease_name, 'token', lease_token, 'newest', newest,
                      'granted_at', granted) AS pg_catalog.text),
                  HINT = 'A newer lease of this name was granted; nothing of this '
                         'transaction was committed.  Roll back and re-read.';
    END IF;"""

_CHECK_FUNCTION = """\
CREATE OR REPLACE FUNCTION @sa_fence_schema@.sa_fence_check_lease(
    lease_name pg_catalog.text, lease_token pg_catalog.int8)
RETURNS void LANGUAGE plpgsql AS $sa_fence$
-- sa-fence commit check (lease-scoped fencing), for raw writers: call it
-- before COMMIT, in the same message.  A transaction commits only while the
-- register still holds its lease's token; the share lock taken here holds a
-- newer grant back until that COMMIT ends.  (Sessions bound through sa-fence
-- are checked by the scope trigger at COMMIT, whatever sends it.)
-- Generated by sa_fence; recreate it with op.create_fence_register().
DECLARE
    newest pg_catalog.int8;
    granted pg_catalog.timestamptz;
BEGIN
{body}
END
$sa_fence$"""

_SCOPE_FUNCTION = """\
CREATE OR REPLACE FUNCTION @sa_fence_schema@.sa_fence_scope_check()
RETURNS trigger LANGUAGE plpgsql AS $sa_fence$
-- sa-fence lease scope, run by PostgreSQL at COMMIT and PREPARE TRANSACTION
-- (a deferred constraint trigger): a transaction that entered lease scope
-- (a row in sa_fence_scope) commits only while the register still holds its
-- lease's token, whichever call or statement sent the COMMIT.
-- Generated by sa_fence; recreate it with op.create_fence_register().
DECLARE
    lease_name pg_catalog.text := NEW.name;
    lease_token pg_catalog.int8 := NEW.token;
    newest pg_catalog.int8;
    granted pg_catalog.timestamptz;
BEGIN
{body}
    DELETE FROM @sa_fence_schema@.sa_fence_scope WHERE ctid OPERATOR(pg_catalog.=) NEW.ctid;
    RETURN NULL;
END
$sa_fence$"""

# No index: each row lives from the arm to its own trigger, which deletes it by ctid.
_SCOPE_TABLE = """\
CREATE UNLOGGED TABLE IF NOT EXISTS @sa_fence_schema@.sa_fence_scope (
    name text NOT NULL,
    token bigint NOT NULL
)"""

_SCOPE_TRIGGER = """\
CREATE CONSTRAINT TRIGGER sa_fence_scope_check
AFTER INSERT ON @sa_fence_schema@.sa_fence_scope
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
EXECUTE FUNCTION @sa_fence_schema@.sa_fence_scope_check()"""

# ALWAYS, or a session in replica mode commits unchecked (UNLOGGED: no replication applies
# rows here).  Sent only when needed: ALTER TABLE waits for every armed transaction.
_SCOPE_TRIGGER_ALWAYS = (
    "ALTER TABLE @sa_fence_schema@.sa_fence_scope ENABLE ALWAYS TRIGGER sa_fence_scope_check"
)

# The schema is the register's or (unqualified) current_schema(), resolved once
# inside PostgreSQL and written quoted into every statement.  One plain
# statement, so Alembic's offline (--sql) mode can emit it too.
_DO_BLOCK = """\
DO $sa_fence_do$
DECLARE s text := coalesce({schema}, pg_catalog.current_schema()); e "char";
BEGIN
{run}
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
                WHERE attrelid = pg_catalog.to_regclass(
                      pg_catalog.quote_ident(s) || '.sa_fence_scope')
                  AND attname = 'xact' AND NOT attisdropped) THEN
        {drop_xact}
    END IF;
    SELECT tgenabled INTO e FROM pg_catalog.pg_trigger WHERE tgname = 'sa_fence_scope_check'
       AND tgrelid = pg_catalog.to_regclass(pg_catalog.quote_ident(s) || '.sa_fence_scope');
    IF e IS NULL THEN {trigger} END IF;
    IF e IS DISTINCT FROM 'A' THEN {always} END IF;
END
$sa_fence_do$"""


def _execute(sql: str) -> str:
    return (
        f"EXECUTE pg_catalog.replace($sa_fence_ddl${sql}$sa_fence_ddl$, "
        f"'{_S}', pg_catalog.quote_ident(s));"
    )


def check_function_sql(register: Register) -> str:
    """The commit check function, the scope table and its deferred trigger (idempotent)."""
    body = _CHECK_BODY.format(sqlstate=LEASE_STALE_SQLSTATE)
    run = (_CHECK_FUNCTION.format(body=body), _SCOPE_TABLE, _SCOPE_FUNCTION.format(body=body))
    return _DO_BLOCK.format(
        schema=quote_literal(register.schema) if register.schema else "NULL",
        run="\n".join(f"    {_execute(sql)}" for sql in run),
        # the first scope table's indexed xact column, which the clean-up no longer reads
        drop_xact=_execute("ALTER TABLE @sa_fence_schema@.sa_fence_scope DROP COLUMN xact"),
        trigger=_execute(_SCOPE_TRIGGER),
        always=_execute(_SCOPE_TRIGGER_ALWAYS),
    )


def create_register_sql(sequence: str) -> list[str]:
    """The statements that create the register, its check function and the
    scope table with its trigger (idempotent)."""
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
    """Drop the scope table (its trigger with it), both functions, then the register."""
    register = Register(sequence)
    return [
        f"DROP TABLE IF EXISTS {register.scope_sql}",
        f"DROP FUNCTION IF EXISTS {qualified(SCOPE_FUNCTION, register.schema)}()",
        f"DROP FUNCTION IF EXISTS {register.function_sql}(text, bigint)",
        f"DROP TABLE IF EXISTS {register.table_sql}",
    ]


def check_one_register(metadata: MetaData, name: str, schema: str | None) -> None:
    """Refuse a second token sequence for the register ``metadata`` declares in ``schema``."""
    schema = schema or metadata.schema  # (a Sequence takes its MetaData's schema, as a Table)
    known = metadata.tables.get(f"{schema}.{REGISTER_TABLE}" if schema else REGISTER_TABLE)
    drawn = known is not None and getattr(known.c.token.server_default, "arg", None)
    if (seq := getattr(drawn, "sequence", None)) is not None and seq.name != name:
        raise ValueError(
            f"this metadata declares the lease register of schema {schema or '(default)'} for "
            f"sequence {seq.name!r} already: one register per schema draws from one sequence. "
            f"Declare {name!r} in another schema (schema=), or use {seq.name!r}. Nothing was "
            "declared."
        )


def register_table(metadata: MetaData, sequence: Sequence) -> Table:
    """The register as a ``Table`` in ``metadata``, drawing tokens from ``sequence``.

    ``metadata.create_all()`` creates the sequence first, then this table
    and (after it) its commit check function.
    """
    register = Register(f"{sequence.schema}.{sequence.name}" if sequence.schema else sequence.name)
    if register.table_display in metadata.tables:
        return metadata.tables[register.table_display]
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
    # The scope table is declared too, so that autogenerate finds every table
    # create_all() made (else each run logs "Detected removed table 'sa_fence_scope'").
    # Created first (the register's DDL then adds the functions and its trigger);
    # dropped after the register, then the scope function.
    scope = Table(
        SCOPE_TABLE,
        metadata,
        Column("name", Text, nullable=False),
        Column("token", BigInteger, nullable=False),
        schema=sequence.schema,
        prefixes=["UNLOGGED"],
        info={"sa_fence.scope": True},
    )
    table.add_is_dependent_on(scope)
    drop_scope = f"DROP FUNCTION IF EXISTS {qualified(SCOPE_FUNCTION, register.schema)}()"
    for target, when, sql in (
        (table, "after_create", check_function_sql(register).replace("%", "%%")),  # DDL() formats
        (table, "before_drop", f"DROP FUNCTION IF EXISTS {register.function_sql}(text, bigint)"),
        (scope, "after_drop", drop_scope),
    ):
        ddl = DDL(sql)  # type: ignore[no-untyped-call]
        event.listen(target, when, ddl.execute_if(dialect="postgresql"))
    return table


#: The scope table beside the register and its trigger, as the catalog has them.
_SCOPE_STATE_SQL = text(
    f"""
    SELECT c.oid IS NOT NULL AS has_table,
           pg_catalog.quote_ident(n.nspname) || '.{SCOPE_TABLE}' AS scope,
           t.oid IS NOT NULL AS has_trigger, t.tgenabled AS enabled,
           t.tgdeferrable AS deferrable, t.tginitdeferred AS deferred,
           EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid
                      AND a.attname = 'xact' AND NOT a.attisdropped) AS outdated
      FROM pg_catalog.pg_class r
      JOIN pg_catalog.pg_namespace n ON n.oid = r.relnamespace
      LEFT JOIN pg_catalog.pg_class c
        ON c.relnamespace = r.relnamespace AND c.relname = '{SCOPE_TABLE}' AND c.relkind = 'r'
      LEFT JOIN pg_catalog.pg_trigger t ON t.tgrelid = c.oid AND t.tgname = '{SCOPE_TRIGGER}'
     WHERE r.oid = pg_catalog.to_regclass(:register)
    """
)


def scope_table_outdated(conn: Any, register: Register) -> bool:
    """Whether the scope table still has the first form's indexed ``xact`` column."""
    row = conn.execute(_SCOPE_STATE_SQL, {"register": register.table_sql}).one_or_none()
    return row is not None and bool(row.outdated)


def scope_trigger_problem(conn: Any, register: Register) -> str | None:
    """Why PostgreSQL would not hold lease scope at COMMIT for ``register``, with the fix.

    The scope table must sit beside the register with its deferred constraint trigger,
    enabled.  None when all is well, or when the register is missing (reported on its own).
    """
    row = conn.execute(_SCOPE_STATE_SQL, {"register": register.table_sql}).one_or_none()
    if row is None:
        return None
    fix = (
        "Recreate it with op.create_fence_register() in a migration (idempotent: the register's "
        "rows are kept) or sa_fence.fence_sequence(metadata) and metadata.create_all()."
    )
    why = "so a COMMIT the client sends itself would not be checked against the register"
    trigger = f"the lease scope trigger {SCOPE_TRIGGER} on {row.scope}"
    if not row.has_table:
        return f"the lease scope table {row.scope} is missing, {why}. {fix}"
    if not row.has_trigger:
        return f"{trigger} is missing, {why}. {fix}"
    always = f"Fix: ALTER TABLE {row.scope} ENABLE ALWAYS TRIGGER {SCOPE_TRIGGER}; or {fix}"
    if row.enabled == "D":
        return f"{trigger} is disabled, {why}. {always}"
    if not (row.deferrable and row.deferred):
        return (
            f"{trigger} is not DEFERRABLE INITIALLY DEFERRED, so it would check at the first "
            f"write, not at COMMIT. Fix: DROP TRIGGER {SCOPE_TRIGGER} ON {row.scope}; then {fix}"
        )
    mode = {"O": "origin or local", "R": "replica"}.get(row.enabled)
    return mode and (
        f"{trigger} fires only while session_replication_role is {mode}, so a COMMIT "
        f"of a session in another mode would not be checked against the register. {always}"
    )
