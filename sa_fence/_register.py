"""The lease register: the database's memory of the newest token per lease name.

The row fence refuses a stale write only to a row a newer holder has already
written; the register closes the rest (INSERTs, association and subclass
tables, the database's own cascades): a transaction of a session bound to a
lease commits only while the register still holds that lease's token.  The
tables' columns and triggers are drawn in docs/architecture.md ("The
tables"); the guarantees in docs/guarantees.md and docs/lease-scope.md.

* **Grant** (:meth:`Register.grant_sql`): one autocommit statement draws the
  token from the sequence the register's ``token`` default names (checked
  fit, :mod:`sa_fence._fitness`), moves the register forward only, and
  commits without waiting for a WAL flush when the WAL record that makes the
  token durable is already flushed (docs/guarantees.md, "A PostgreSQL
  crash").  ``lock_timeout`` bounds the wait for a committing holder's share
  lock on the register row.
* **Withdraw** (:meth:`Register.withdraw_sql`): a grant whose lease was lost
  before its token was confirmed in Redis puts the register back to the token
  before it (compare-and-set on ours), so a holder granted in between is not
  fenced out.
* **Lease scope** (:func:`check_function_sql`): a transaction in scope writes
  one row to the UNLOGGED ``sa_fence_scope`` in its BEGIN message (the arm);
  a deferred constraint trigger checks, at COMMIT or PREPARE TRANSACTION
  whoever sends it, that the register still holds the token (else SQLSTATE
  :data:`LEASE_STALE_SQLSTATE`), under a share lock held to the end, so a
  newer grant comes either before the check or after the commit.  Everything
  is schema-qualified with a pinned ``search_path``: nothing on a caller's
  search path can stand in for the register.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from sqlalchemy import (
    DDL,
    BigInteger,
    Column,
    Index,
    MetaData,
    Sequence,
    Table,
    Text,
    event,
    text,
)
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

    @cached_property
    def scope_sql(self) -> str:
        return qualified(SCOPE_TABLE, self.schema)

    @cached_property
    def scope_display(self) -> str:
        return f"{self.schema}.{SCOPE_TABLE}" if self.schema else SCOPE_TABLE

    def grant_sql(self) -> str:
        """The draw-and-register statement (psycopg pyformat: ``%(name)s``)."""
        return self._grant_sql

    def grant_text(self) -> Any:
        """:meth:`grant_sql` as a SQLAlchemy ``text()`` (``:name`` binds)."""
        return self._grant_text

    # Built once per register (a grant is on the lease cycle's hot path).
    @cached_property
    def _grant_sql(self) -> str:
        return _GRANT_SQL.format(
            register=self.table_sql,
            sequence_fit=SEQUENCE_FIT_SQL,
            token_sequences=token_sequences_sql("CAST(%(register)s AS pg_catalog.regclass)"),
        )

    @cached_property
    def _grant_text(self) -> Any:
        return text(
            self._grant_sql.replace("%(name)s", ":name")
            .replace("%(sequence)s", ":sequence")
            .replace("%(register)s", ":register")
            .replace("%(lock_timeout)s", ":lock_timeout")
            .replace("%(skip_flush)s", ":skip_flush")
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
    """The register of ``sequence`` with every name schema-qualified
    (docs/guarantees.md, "Nothing on the search path stands in for sa-fence's
    objects"): an unqualified sequence name is resolved once, here, by
    :data:`SEQUENCE_SCHEMA_SQL`; every statement after
    names the sequence and the register by that schema.  ``conn``: a SQLAlchemy
    ``Connection``."""
    register = Register(sequence)
    if register.schema is not None:
        return register
    schema = conn.execute(SEQUENCE_SCHEMA_SQL, {"name": split_name(sequence)[1]}).scalar()
    return register.pinned(schema)


# One statement, autocommit.  `drawn` has a row only when the sequence is fit
# (the rules of sa_fence._fitness) and is the one the register's
# token default draws from; it then draws the one token (a CTE with a volatile
# function is evaluated once).  The upsert advances the register only forward
# (docs/guarantees.md, "The register only moves forward"): a drawn token not
# greater than the name's register token (the sequence was set back: setval, a
# restore, a promoted replica) updates
# nothing, and the row comes back with `token` NULL beside the drawn token and
# the register's, for the refusal.  `previous` keeps the replaced token for a
# withdrawal.  synchronous_commit is read (before `commit_mode` may change it
# for this transaction) to refuse 'off' (docs/reliability.md).  The register
# and sequence arrive schema-qualified (Register.pinned): nothing on the
# search_path (a temporary table, another schema) can stand in for them.
#
# `commit_mode`: the grant's commit skips the WAL flush (synchronous_commit
# off for this transaction alone) only when the WAL record that makes the
# drawn token durable is already flushed (docs/guarantees.md, "A PostgreSQL
# crash").  nextval logs 32 values ahead; the record covering this token was
# written by this nextval or an earlier one, in either case before this
# nextval read the sequence page (the writer holds the page's lock while it
# inserts the record), so it ends at or before the WAL insert position read
# after the draw.  `commit_mode` reads from `drawn` (so after the nextval) and
# the upsert reads from `commit_mode` (so before the upsert's own WAL): when
# the flush position has reached that insert position, the covering record is
# on disk and a crash cannot set the sequence back below the token; only the
# register advance can be lost, and the holder's first commit flushes it.
# Otherwise (the draw logged, or the record written by another transaction
# is not flushed yet: aborted, or still committing) the commit flushes as
# usual.  With synchronous standbys (synchronous_standby_names set) the grant
# always waits for them: a standby's copy of the record is not known here.
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


#: The scope table's name (same schema): one row per lease a transaction
#: entered scope for, written by the transaction's BEGIN message (the arm).
SCOPE_TABLE = "sa_fence_scope"
#: The deferred constraint trigger on it, and its function (same schema).
SCOPE_TRIGGER = "sa_fence_scope_check"
SCOPE_FUNCTION = "sa_fence_scope_check"
#: Where the DDL below names sa-fence's schema; replaced inside PostgreSQL by
#: the schema itself (quoted), so no name is ever found through search_path.
_S = "@sa_fence_schema@"

# The register check, shared by the commit check function and the scope
# trigger.  `lease_name` / `lease_token` are the lease's; everything it
# names is schema-qualified and the functions pin search_path.
_CHECK_BODY = """\
    SELECT r.token, r.granted_at INTO newest, granted
      FROM @sa_fence_schema@.sa_fence_leases r WHERE r.name = lease_name FOR SHARE;
    IF newest IS DISTINCT FROM lease_token THEN
        RAISE EXCEPTION 'sa-fence: lease % (token %) is stale: the register holds token %',
            pg_catalog.quote_literal(lease_name), lease_token,
            coalesce(newest::text, 'none')
            USING ERRCODE = '{sqlstate}',
                  DETAIL = pg_catalog.jsonb_build_object(
                      'name', lease_name, 'token', lease_token, 'newest', newest,
                      'granted_at', granted)::text,
                  HINT = 'A newer lease of this name was granted; nothing of this '
                         'transaction was committed.  Roll back and re-read.';
    END IF;"""

_CHECK_FUNCTION = """\
CREATE OR REPLACE FUNCTION @sa_fence_schema@.sa_fence_check_lease(
    lease_name text, lease_token bigint)
RETURNS void LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $sa_fence$
-- sa-fence commit check (lease-scoped fencing), for raw writers: call it
-- before COMMIT, in the same message.  A transaction commits only while the
-- register still holds its lease's token; the share lock taken here holds a
-- newer grant back until that COMMIT ends.  (Sessions bound through sa-fence
-- are checked by the scope trigger at COMMIT, whatever sends it.)
-- Generated by sa_fence; recreate it with op.create_fence_register().
DECLARE
    newest bigint;
    granted timestamptz;
BEGIN
{body}
END
$sa_fence$"""

_SCOPE_FUNCTION = """\
CREATE OR REPLACE FUNCTION @sa_fence_schema@.sa_fence_scope_check()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $sa_fence$
-- sa-fence lease scope, run by PostgreSQL at COMMIT and PREPARE TRANSACTION
-- (a deferred constraint trigger): a transaction that entered lease scope
-- (a row in sa_fence_scope) commits only while the register still holds its
-- lease's token, whichever call or statement sent the COMMIT.
-- Generated by sa_fence; recreate it with op.create_fence_register().
DECLARE
    lease_name text := NEW.name;
    lease_token bigint := NEW.token;
    newest bigint;
    granted timestamptz;
BEGIN
{body}
    DELETE FROM @sa_fence_schema@.sa_fence_scope
     WHERE xact = pg_catalog.pg_current_xact_id()::text::bigint;
    RETURN NULL;
END
$sa_fence$"""

_SCOPE_TABLE = """\
CREATE UNLOGGED TABLE IF NOT EXISTS @sa_fence_schema@.sa_fence_scope (
    xact bigint NOT NULL DEFAULT pg_catalog.pg_current_xact_id()::text::bigint,
    name text NOT NULL,
    token bigint NOT NULL
)"""

_SCOPE_INDEX = (
    "CREATE INDEX IF NOT EXISTS sa_fence_scope_xact ON @sa_fence_schema@.sa_fence_scope (xact)"
)

_SCOPE_TRIGGER = """\
CREATE CONSTRAINT TRIGGER sa_fence_scope_check
AFTER INSERT ON @sa_fence_schema@.sa_fence_scope
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
EXECUTE FUNCTION @sa_fence_schema@.sa_fence_scope_check()"""


def _in_schema(register: Register, statements: list[str], *, trigger: str) -> str:
    """One ``DO`` block running ``statements`` in the register's schema.

    The schema is the register's, or (unqualified) the schema its table was
    created in, ``current_schema()``, resolved once inside PostgreSQL and
    written into every statement quoted: the functions it creates name
    their objects schema-qualified (a ``TEMP TABLE sa_fence_leases`` or
    another schema on the caller's search_path cannot stand in).  Works in
    Alembic's offline (``--sql``) mode too: it is one plain statement.
    """
    schema = quote_literal(register.schema) if register.schema else "NULL"
    run = "\n".join(
        f"    EXECUTE pg_catalog.replace($sa_fence_ddl${sql}$sa_fence_ddl$, "
        f"'{_S}', pg_catalog.quote_ident(s));"
        for sql in statements
    )
    return (
        "DO $sa_fence_do$\n"
        f"DECLARE s text := coalesce({schema}, pg_catalog.current_schema());\n"
        "BEGIN\n"
        f"{run}\n"
        "    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger\n"
        "                    WHERE tgrelid = pg_catalog.to_regclass(\n"
        f"                          pg_catalog.quote_ident(s) || '.{SCOPE_TABLE}')\n"
        f"                      AND tgname = '{SCOPE_TRIGGER}') THEN\n"
        f"        EXECUTE pg_catalog.replace($sa_fence_ddl${trigger}$sa_fence_ddl$, "
        f"'{_S}', pg_catalog.quote_ident(s));\n"
        "    END IF;\n"
        "END\n"
        "$sa_fence_do$"
    )


def check_function_sql(register: Register) -> str:
    """The commit check function, the scope table and its deferred trigger (idempotent)."""
    body = _CHECK_BODY.format(sqlstate=LEASE_STALE_SQLSTATE)
    return _in_schema(
        register,
        [
            _CHECK_FUNCTION.format(body=body),
            _SCOPE_TABLE,
            _SCOPE_INDEX,
            _SCOPE_FUNCTION.format(body=body),
        ],
        trigger=_SCOPE_TRIGGER,
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


def drop_scope_sql(register: Register) -> list[str]:
    """Drop the scope table (and its trigger), its function and the check function."""
    return [
        f"DROP TABLE IF EXISTS {register.scope_sql}",
        f"DROP FUNCTION IF EXISTS {qualified(SCOPE_FUNCTION, register.schema)}()",
        f"DROP FUNCTION IF EXISTS {register.function_sql}(text, bigint)",
    ]


def drop_register_sql(sequence: str) -> list[str]:
    register = Register(sequence)
    return [*drop_scope_sql(register), f"DROP TABLE IF EXISTS {register.table_sql}"]


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
    # The scope table is declared too, so that autogenerate finds in the metadata
    # every table create_all() made (else each run logs "Detected removed table
    # 'sa_fence_scope'").  It is created first; the register's DDL after it
    # (CREATE ... IF NOT EXISTS) then adds the functions and the scope trigger.
    # Dropped in the reverse order: the register (its check function), then the
    # scope table (its trigger with it), then the scope function.
    scope = Table(
        SCOPE_TABLE,
        metadata,
        Column(
            "xact",
            BigInteger,
            nullable=False,
            server_default=text("pg_catalog.pg_current_xact_id()::text::bigint"),
        ),
        Column("name", Text, nullable=False),
        Column("token", BigInteger, nullable=False),
        Index("sa_fence_scope_xact", "xact"),
        schema=sequence.schema,
        prefixes=["UNLOGGED"],
        info={"sa_fence.scope": True},
    )
    table.add_is_dependent_on(scope)
    function = check_function_sql(register).replace("%", "%%")  # DDL() formats with %
    create = DDL(function)  # type: ignore[no-untyped-call]
    event.listen(table, "after_create", create.execute_if(dialect="postgresql"))
    drop_check = DDL(f"DROP FUNCTION IF EXISTS {register.function_sql}(text, bigint)")  # type: ignore[no-untyped-call]
    event.listen(table, "before_drop", drop_check.execute_if(dialect="postgresql"))
    drop_scope = DDL(  # type: ignore[no-untyped-call]
        f"DROP FUNCTION IF EXISTS {qualified(SCOPE_FUNCTION, register.schema)}()"
    )
    event.listen(scope, "after_drop", drop_scope.execute_if(dialect="postgresql"))
    return table


#: The rights the current role needs on the register (SELECT, INSERT, UPDATE)
#: and on the scope table (INSERT: the arm; SELECT, DELETE: the trigger's
#: clean-up, which runs as the committing role).
REGISTER_RIGHTS_SQL = text(
    """
    SELECT has_table_privilege(to_regclass(:register), 'SELECT') AS can_select,
           has_table_privilege(to_regclass(:register), 'INSERT') AS can_insert,
           has_table_privilege(to_regclass(:register), 'UPDATE') AS can_update,
           has_sequence_privilege(to_regclass(:sequence), 'USAGE') AS can_draw,
           has_function_privilege(to_regprocedure(:function || '(text, bigint)'), 'EXECUTE')
               AS can_check,
           has_table_privilege(to_regclass(:scope), 'INSERT') AS can_arm,
           has_table_privilege(to_regclass(:scope), 'SELECT') AS can_read_scope,
           has_table_privilege(to_regclass(:scope), 'DELETE') AS can_disarm
    """
)


#: The schema-qualified, quoted schema of the scope table an unqualified
#: register uses: the first schema on the search path holding one, never
#: the session's temporary schema (so a TEMP TABLE cannot stand in).
SCOPE_SCHEMA_SQL = f"""\
SELECT pg_catalog.quote_ident(n.nspname)
  FROM pg_catalog.unnest(pg_catalog.current_schemas(false)) WITH ORDINALITY AS p(nsp, i)
  JOIN pg_catalog.pg_namespace n ON n.nspname = p.nsp
  JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid
 WHERE c.relname = '{SCOPE_TABLE}' AND c.relkind = 'r'
   AND n.oid <> pg_catalog.pg_my_temp_schema()
 ORDER BY p.i LIMIT 1"""


#: The scope table beside the register and its trigger, as the catalog has them.
_SCOPE_STATE_SQL = text(
    f"""
    SELECT c.oid IS NOT NULL AS has_table,
           pg_catalog.quote_ident(n.nspname) || '.{SCOPE_TABLE}' AS scope,
           t.oid IS NOT NULL AS has_trigger, t.tgenabled AS enabled,
           t.tgdeferrable AS deferrable, t.tginitdeferred AS deferred
      FROM pg_catalog.pg_class r
      JOIN pg_catalog.pg_namespace n ON n.oid = r.relnamespace
      LEFT JOIN pg_catalog.pg_class c
        ON c.relnamespace = r.relnamespace AND c.relname = '{SCOPE_TABLE}' AND c.relkind = 'r'
      LEFT JOIN pg_catalog.pg_trigger t ON t.tgrelid = c.oid AND t.tgname = '{SCOPE_TRIGGER}'
     WHERE r.oid = pg_catalog.to_regclass(:register)
    """
)


def scope_trigger_problem(conn: Any, register: Register) -> str | None:
    """Why PostgreSQL would not hold lease scope at COMMIT for ``register``, with the fix.

    The scope table ``sa_fence_scope`` must sit beside the register with its
    deferred constraint trigger, enabled.  None when all is well (or when the
    register itself is missing: that is reported on its own).
    """
    row = conn.execute(_SCOPE_STATE_SQL, {"register": register.table_sql}).one_or_none()
    if row is None:
        return None
    fix = (
        "Recreate it with op.create_fence_register() in a migration (idempotent: the "
        "register's rows are kept) or sa_fence.fence_sequence(metadata) and "
        "metadata.create_all()."
    )
    why = "so a COMMIT the client sends itself would not be checked against the register"
    if not row.has_table:
        return f"the lease scope table {row.scope} is missing, {why}. {fix}"
    if not row.has_trigger:
        return f"the lease scope trigger {SCOPE_TRIGGER} on {row.scope} is missing, {why}. {fix}"
    if row.enabled == "D":
        return (
            f"the lease scope trigger {SCOPE_TRIGGER} on {row.scope} is disabled, {why}. "
            f"Fix: ALTER TABLE {row.scope} ENABLE TRIGGER {SCOPE_TRIGGER};"
        )
    if not (row.deferrable and row.deferred):
        return (
            f"the lease scope trigger {SCOPE_TRIGGER} on {row.scope} is not DEFERRABLE "
            f"INITIALLY DEFERRED, so it would check at the first write, not at COMMIT. "
            f"Fix: DROP TRIGGER {SCOPE_TRIGGER} ON {row.scope}; then {fix}"
        )
    return None
