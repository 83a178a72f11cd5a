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

import functools
import hashlib
import re
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

from .fitness import SEQUENCE_FIT_SQL, token_sequences_sql
from .guard import LEASE_STALE_SQLSTATE, qualified, quote_literal

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

    @cached_property
    def grant_function_sql(self) -> str:
        return qualified(GRANT_FUNCTION, self.schema)

    @cached_property
    def withdraw_function_sql(self) -> str:
        return qualified(WITHDRAW_FUNCTION, self.schema)

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
        """The grant: a call of the register's grant function (psycopg pyformat: ``%(name)s``)."""
        return (
            "SELECT token, synchronous_commit, drawn, held, flushed, clash FROM "
            f"{self.grant_function_sql}(%(name)s, "
            "CAST(%(sequence)s AS pg_catalog.regclass), %(lock_timeout)s, "
            "CAST(%(skip_flush)s AS pg_catalog.bool))"
        )

    @cached_property
    def grant_text(self) -> Any:
        """:attr:`grant_sql` as a SQLAlchemy ``text()`` (``:name`` binds)."""
        return text(re.sub(r"%\((\w+)\)s", r":\1", self.grant_sql))

    def withdraw_sql(self) -> Any:
        return text(f"SELECT {self.withdraw_function_sql}(:name, :token)")

    def prune_sql(self) -> Any:
        """Delete the rows of ``:names`` still holding ``:tokens``: (rows, bytes) removed."""
        return text(
            f"SELECT removed, bytes FROM {qualified(PRUNE_FUNCTION, self.schema)}("
            "CAST(:names AS pg_catalog.text[]), CAST(:tokens AS pg_catalog.int8[]))"
        )

    def check_call(self) -> str:
        """``SELECT <function>(%s, %s)``: the commit check a raw writer sends, with the lease's
        name and token as parameters (never written into the SQL)."""
        return f"SELECT {self.function_sql}(%s, %s)"


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


#: The scope table's name (same schema): one row per lease a transaction entered scope for,
#: written by the transaction's BEGIN message (the arm): the lease's token, nothing else.
SCOPE_TABLE = "sa_fence_scope"
#: The deferred constraint trigger on it, and its function (same schema).
SCOPE_TRIGGER = "sa_fence_scope_check"
SCOPE_FUNCTION = "sa_fence_scope_check"
#: The functions that alone move the register (SECURITY DEFINER, same schema), with their
#: argument types as ``DROP FUNCTION`` and ``to_regprocedure`` name them.
GRANT_FUNCTION = "sa_fence_grant"
WITHDRAW_FUNCTION = "sa_fence_withdraw"
PRUNE_FUNCTION = "sa_fence_prune"
#: The unique index on the register's token: tokens are unique across names (one sequence),
#: and the commit check finds the register row by the token alone.
TOKEN_INDEX = "sa_fence_leases_token"
#: The lease name's key: the first 8 bytes of the SHA-256 of its UTF-8 bytes, as a bigint.  The
#: arm carries it beside the token, so no text is in the arm and the check still holds a lease
#: to its own name: after a promoted asynchronous standby hands a token out again to another
#: name (docs/reliability.md), the token alone would find that name's row.  The grant stores it
#: (computed in PostgreSQL from the name it was given as a parameter); the client computes it
#: for the arm (:func:`name_key`).  Both hash the same bytes whatever either side's encoding is.
_NAME_KEY = (
    "CAST(CAST('x' OPERATOR(pg_catalog.||) pg_catalog.substr(pg_catalog.encode(pg_catalog.sha256("
    "pg_catalog.convert_to({name}, 'UTF8')), 'hex'), 1, 16) AS pg_catalog.bit(64)) "
    "AS pg_catalog.int8)"
)


@functools.lru_cache(maxsize=4096)  # every transaction of a lease arms with the same key
def name_key(name: str) -> int:
    """The lease name's key, as the register stores it (see ``_NAME_KEY``)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big", signed=True)


#: Every function sa-fence makes beside the register: name -> argument types.
FUNCTIONS: dict[str, str] = {
    CHECK_FUNCTION: "text, bigint",
    SCOPE_FUNCTION: "",
    GRANT_FUNCTION: "text, regclass, text, boolean",
    WITHDRAW_FUNCTION: "text, bigint",
    PRUNE_FUNCTION: "text[], bigint[]",
}
#: The functions that write the register: EXECUTE is revoked from PUBLIC and granted to the
#: workers' role (docs/topologies.md), which needs no INSERT, UPDATE or DELETE on the register.
WRITING_FUNCTIONS = (GRANT_FUNCTION, WITHDRAW_FUNCTION, PRUNE_FUNCTION)
#: Where the DDL below names sa-fence's schema; replaced inside PostgreSQL by the schema itself
#: (quoted), so no name is ever found through search_path.
_S = "@sa_fence_schema@"
#: Where it names the register as a string literal (for a regclass cast).
_R = "@sa_fence_register@"

# The register check of the commit check function and the scope trigger: every name in it is
# qualified, operators and types too.  The arm carries the token alone: tokens are unique across
# names (one sequence, and the register's unique index), so the row that still holds the token
# is the lease's own, and a newer grant of the name has replaced it.  FOR SHARE holds a newer
# grant back until this transaction ends; a grant in progress is waited for, and once it has
# committed the row no longer holds the token (PostgreSQL re-reads it), so the commit is refused.
_CHECK_BODY = """\
    SELECT r.granted_at INTO granted
      FROM @sa_fence_schema@.sa_fence_leases r
     WHERE r.token OPERATOR(pg_catalog.=) lease_token
       AND r.name_key OPERATOR(pg_catalog.=) lease_key FOR SHARE;
    IF NOT FOUND THEN
        -- (the failure path only) the grant that replaced the token, when it was the last one
        SELECT r.token, r.granted_at INTO newest, granted
          FROM @sa_fence_schema@.sa_fence_leases r
         WHERE r.previous OPERATOR(pg_catalog.=) lease_token
           AND r.name_key OPERATOR(pg_catalog.=) lease_key;
        RAISE EXCEPTION 'sa-fence: the lease of token % is stale: the register no longer holds '
                        'that token (a newer lease of its name was granted)', lease_token
            USING ERRCODE = '{sqlstate}',
                  DETAIL = CAST(pg_catalog.jsonb_build_object(
                      'token', lease_token, 'newest', newest, 'granted_at', granted)
                                AS pg_catalog.text),
                  HINT = 'A newer lease of this name was granted; nothing of this '
                         'transaction was committed.  Roll back and re-read.';
    END IF;"""

# SECURITY DEFINER: FOR SHARE needs UPDATE on the register, which the workers' role does not
# have (docs/topologies.md).  For a raw writer: SELECT <schema>.sa_fence_check_lease(<token>)
# before COMMIT, in the same transaction.
_CHECK_FUNCTION = """\
CREATE OR REPLACE FUNCTION @sa_fence_schema@.sa_fence_check_lease(
    lease_name pg_catalog.text, lease_token pg_catalog.int8)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $sa_fence$
-- sa-fence commit check (lease-scoped fencing), for raw writers: call it
-- before COMMIT, in the same transaction.  A transaction commits only while the
-- register still holds its lease's token; the share lock taken here holds a
-- newer grant back until that COMMIT ends.  (Sessions bound through sa-fence
-- are checked by the scope trigger at COMMIT, whatever sends it.)
-- Generated by sa_fence; recreate it with op.create_fence_register().
DECLARE
    lease_key pg_catalog.int8 := {name_key};
    newest pg_catalog.int8;
    granted pg_catalog.timestamptz;
BEGIN
{body}
END
$sa_fence$"""

# SECURITY DEFINER (the FOR SHARE, and the DELETE of the arm: the workers' role may only INSERT
# its arm, never take it back).  No SET clause, unlike the functions below: it runs at every
# COMMIT, and a SET clause makes each call save and restore the setting; every name, type and
# operator in the body is schema-qualified, so no search_path can change what it reads.
_SCOPE_FUNCTION = """\
CREATE OR REPLACE FUNCTION @sa_fence_schema@.sa_fence_scope_check()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $sa_fence$
-- sa-fence lease scope, run by PostgreSQL at COMMIT and PREPARE TRANSACTION
-- (a deferred constraint trigger): a transaction that entered lease scope
-- (a row in sa_fence_scope) commits only while the register still holds its
-- lease's token, whichever call or statement sent the COMMIT.
-- Generated by sa_fence; recreate it with op.create_fence_register().
DECLARE
    lease_token pg_catalog.int8 := NEW.token;
    lease_key pg_catalog.int8 := NEW.name_key;
    newest pg_catalog.int8;
    granted pg_catalog.timestamptz;
BEGIN
{body}
    DELETE FROM @sa_fence_schema@.sa_fence_scope WHERE ctid OPERATOR(pg_catalog.=) NEW.ctid;
    RETURN NULL;
END
$sa_fence$"""

# The grant: one statement, autocommit; the only way the workers' role advances the register.
# `drawn` has a row only when the sequence is fit (sa_fence.db.fitness) and is the one the
# register's token default draws from; it draws the one token (a CTE with a volatile function
# is evaluated once).  The upsert only advances the register (docs/guarantees.md, "The register
# only moves forward"): a drawn token not above the name's (the sequence was set back) updates
# nothing, nor does a drawn token another name holds (`clash`), and the row comes back with
# `token` NULL beside the drawn and the held token, for the refusal.  `previous` keeps the
# replaced token for a withdrawal.  synchronous_commit is read before `commit_mode` may change
# it, to refuse 'off' (docs/reliability.md).  `commit_mode` skips the commit's WAL flush only
# when the flush position has reached the WAL insert position read after the draw, so the
# record that makes the token durable is on disk, and never with synchronous standbys
# (docs/guarantees.md, "A PostgreSQL crash", says why that is enough); with them, 'local' is
# raised to 'on' for the grant, which then waits for the standbys as the docs promise.  The
# settings it makes are transaction-local and outlive the function (only search_path is
# restored at its end).  A LANGUAGE sql function: one statement, one snapshot, as before it
# became a function.
_GRANT_FUNCTION = """\
CREATE OR REPLACE FUNCTION @sa_fence_schema@.sa_fence_grant(
    grant_name pg_catalog.text, grant_sequence pg_catalog.regclass,
    grant_lock_timeout pg_catalog.text, grant_skip_flush pg_catalog.bool)
RETURNS TABLE (token pg_catalog.int8, synchronous_commit pg_catalog.text,
               drawn pg_catalog.int8, held pg_catalog.int8, flushed pg_catalog.bool,
               clash pg_catalog.bool)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $sa_fence$
-- sa-fence grant: draws a token and advances the lease register.
-- Generated by sa_fence; recreate it with op.create_fence_register().
WITH drawn AS (
    SELECT pg_catalog.nextval(s.seqrelid) AS token,
           pg_catalog.current_setting('synchronous_commit') AS synchronous_commit
      FROM pg_catalog.pg_sequence s
     WHERE s.seqrelid OPERATOR(pg_catalog.=) grant_sequence
       AND {sequence_fit}
       AND s.seqrelid IN {token_sequences}
       AND pg_catalog.set_config('lock_timeout', grant_lock_timeout, true) IS NOT NULL
), commit_mode AS (
    SELECT drawn.token,
           CASE WHEN grant_skip_flush
                 AND drawn.synchronous_commit OPERATOR(pg_catalog.<>) 'off'
                 AND pg_catalog.current_setting('synchronous_standby_names')
                     OPERATOR(pg_catalog.=) ''
                 AND pg_catalog.pg_current_wal_flush_lsn()
                     OPERATOR(pg_catalog.>=) pg_catalog.pg_current_wal_insert_lsn()
                THEN pg_catalog.set_config('synchronous_commit', 'off', true) IS NULL
                WHEN drawn.synchronous_commit OPERATOR(pg_catalog.=) 'local'
                 AND pg_catalog.current_setting('synchronous_standby_names')
                     OPERATOR(pg_catalog.<>) ''
                THEN pg_catalog.set_config('synchronous_commit', 'on', true) IS NOT NULL
                ELSE true END AS flushed
      FROM drawn
), granted AS (
    INSERT INTO @sa_fence_schema@.sa_fence_leases AS r (name, token, granted_at, name_key)
    SELECT grant_name, m.token, pg_catalog.clock_timestamp(), {grant_key} FROM commit_mode m
     WHERE NOT EXISTS (SELECT FROM @sa_fence_schema@.sa_fence_leases o
                        WHERE o.token OPERATOR(pg_catalog.=) m.token)
    ON CONFLICT (name) DO UPDATE
       SET token = EXCLUDED.token, granted_at = EXCLUDED.granted_at, previous = r.token,
           name_key = EXCLUDED.name_key
     WHERE r.token OPERATOR(pg_catalog.<) EXCLUDED.token
    RETURNING r.token
)
SELECT (SELECT g.token FROM granted g),
       drawn.synchronous_commit,
       drawn.token,
       (SELECT o.token FROM @sa_fence_schema@.sa_fence_leases o
         WHERE o.name OPERATOR(pg_catalog.=) grant_name),
       (SELECT m.flushed FROM commit_mode m),
       EXISTS (SELECT FROM @sa_fence_schema@.sa_fence_leases o
                WHERE o.token OPERATOR(pg_catalog.=) drawn.token
                  AND o.name OPERATOR(pg_catalog.<>) grant_name)
  FROM drawn
$sa_fence$"""

# A grant lost before its confirm gives its token back (compare-and-set: only while the
# register still holds it, and only to the token it replaced).
_WITHDRAW_FUNCTION = """\
CREATE OR REPLACE FUNCTION @sa_fence_schema@.sa_fence_withdraw(
    withdraw_name pg_catalog.text, withdraw_token pg_catalog.int8)
RETURNS void LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $sa_fence$
-- sa-fence withdraw: gives back a granted token its lease never confirmed.
-- Generated by sa_fence; recreate it with op.create_fence_register().
UPDATE @sa_fence_schema@.sa_fence_leases
   SET token = previous, previous = NULL
 WHERE name OPERATOR(pg_catalog.=) withdraw_name
   AND token OPERATOR(pg_catalog.=) withdraw_token
   AND previous IS NOT NULL
$sa_fence$"""

# Pruning (sa_fence.db.prune): compare-and-delete of (name, token) pairs no lease holds; a row
# locked right now (a grant, a commit check) is skipped.  Returns the rows and bytes removed.
_PRUNE_FUNCTION = """\
CREATE OR REPLACE FUNCTION @sa_fence_schema@.sa_fence_prune(
    prune_names pg_catalog.text[], prune_tokens pg_catalog.int8[])
RETURNS TABLE (removed pg_catalog.int8, bytes pg_catalog.int8)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $sa_fence$
-- sa-fence prune: deletes register rows of names no lease holds.
-- Generated by sa_fence; recreate it with op.create_fence_register().
WITH unused AS (
    SELECT r.name
      FROM @sa_fence_schema@.sa_fence_leases r,
           ROWS FROM (pg_catalog.unnest(prune_names), pg_catalog.unnest(prune_tokens))
               AS d(name, token)
     WHERE r.name OPERATOR(pg_catalog.=) d.name AND r.token OPERATOR(pg_catalog.=) d.token
       FOR UPDATE OF r SKIP LOCKED
), gone AS (
    DELETE FROM @sa_fence_schema@.sa_fence_leases r USING unused u
     WHERE r.name OPERATOR(pg_catalog.=) u.name
    RETURNING pg_catalog.pg_column_size(r.*) AS size
)
SELECT pg_catalog.count(*), CAST(COALESCE(pg_catalog.sum(size), 0) AS pg_catalog.int8)
  FROM gone
$sa_fence$"""

# No index: each row lives from the arm to its own trigger, which deletes it by ctid.
_SCOPE_TABLE = """\
CREATE UNLOGGED TABLE IF NOT EXISTS @sa_fence_schema@.sa_fence_scope (
    token bigint NOT NULL,
    name_key bigint NOT NULL
)"""

# The key columns, added to a scope table and a register of the forms before them (a scope row
# of before never matches a register row: its key is 0).  Sent only when missing: an ALTER
# TABLE of the scope table waits for every armed transaction.
_SCOPE_KEY = (
    "ALTER TABLE @sa_fence_schema@.sa_fence_scope ADD COLUMN name_key bigint NOT NULL DEFAULT 0; "
    "ALTER TABLE @sa_fence_schema@.sa_fence_scope ALTER COLUMN name_key DROP DEFAULT"
)
_REGISTER_KEY = "ALTER TABLE @sa_fence_schema@.sa_fence_leases ADD COLUMN name_key bigint"

_TOKEN_INDEX = """\
CREATE UNIQUE INDEX IF NOT EXISTS sa_fence_leases_token
    ON @sa_fence_schema@.sa_fence_leases (token)"""

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

#: Columns of earlier forms of the scope table: ``xact`` (indexed, the first form's) and
#: ``name`` (the arm carried the lease name as text before it carried the token alone).
_OUTDATED_SCOPE_COLUMNS = ("xact", "name")


# The schema is the register's or (unqualified) current_schema(), resolved once
# inside PostgreSQL and written quoted into every statement.  One plain
# statement, so Alembic's offline (--sql) mode can emit it too.
def _has_column(table: str, column: str) -> str:
    """PL/pgSQL: whether sa-fence's ``table`` in schema ``s`` has ``column`` (an expression)."""
    return (
        "EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = pg_catalog.to_regclass("
        f"pg_catalog.quote_ident(s) || '.{table}') AND attname = {column} AND NOT attisdropped)"
    )


_DO_BLOCK = f"""\
DO $sa_fence_do$
DECLARE s text := coalesce({{schema}}, pg_catalog.current_schema()); e "char"; c text;
BEGIN
{{run}}
    IF NOT {_has_column(SCOPE_TABLE, "'name_key'")} THEN
        {{scope_key}}
    END IF;
{{after_key}}
    FOREACH c IN ARRAY ARRAY[{{outdated}}] LOOP
        IF {_has_column(SCOPE_TABLE, "c")} THEN
            EXECUTE pg_catalog.format('ALTER TABLE %I.sa_fence_scope DROP COLUMN %I', s, c);
        END IF;
    END LOOP;
    SELECT tgenabled INTO e FROM pg_catalog.pg_trigger WHERE tgname = 'sa_fence_scope_check'
       AND tgrelid = pg_catalog.to_regclass(pg_catalog.quote_ident(s) || '.sa_fence_scope');
    IF e IS NULL THEN {{trigger}} END IF;
    IF e IS DISTINCT FROM 'A' THEN {{always}} END IF;
    IF pg_catalog.to_regclass(pg_catalog.quote_ident(s) || '.sa_fence_leases') IS NOT NULL THEN
        IF NOT {_has_column(REGISTER_TABLE, "'name_key'")} THEN
            {{register_key}}
        END IF;
{{on_register}}
    END IF;
END
$sa_fence_do$"""


def _execute(sql: str) -> str:
    return (
        f"EXECUTE pg_catalog.replace(pg_catalog.replace($sa_fence_ddl${sql}$sa_fence_ddl$, "
        f"'{_S}', pg_catalog.quote_ident(s)), '{_R}', "
        "pg_catalog.quote_literal(pg_catalog.quote_ident(s) || '.sa_fence_leases'));"
    )


def grant_function_sql() -> str:
    """The grant function's DDL, with the sequence rules of :mod:`sa_fence.db.fitness`."""
    return _GRANT_FUNCTION.format(
        grant_key=_NAME_KEY.format(name="grant_name"),
        sequence_fit=SEQUENCE_FIT_SQL,
        token_sequences=token_sequences_sql(f"CAST({_R} AS pg_catalog.regclass)"),
    )


def function_definitions() -> dict[str, str]:
    """Each function's ``CREATE OR REPLACE`` statement, as sa-fence makes it (with the schema
    placeholder): what ``sa-fence check`` compares the database's definitions with."""
    body = _CHECK_BODY.format(sqlstate=LEASE_STALE_SQLSTATE)
    return {
        CHECK_FUNCTION: _CHECK_FUNCTION.format(
            body=body, name_key=_NAME_KEY.format(name="lease_name")
        ),
        SCOPE_FUNCTION: _SCOPE_FUNCTION.format(body=body),
        GRANT_FUNCTION: grant_function_sql(),
        WITHDRAW_FUNCTION: _WITHDRAW_FUNCTION,
        PRUNE_FUNCTION: _PRUNE_FUNCTION,
    }


def check_function_sql(register: Register) -> str:
    """The functions, the scope table and its deferred trigger and the register's token index
    (idempotent; the register must exist)."""
    functions = function_definitions()
    run = (
        f"DROP FUNCTION IF EXISTS {_S}.{CHECK_FUNCTION}(bigint)",  # (a token-only form, unreleased)
        _SCOPE_TABLE,
    )
    after_key = (functions[SCOPE_FUNCTION],)
    # The register's index, and the LANGUAGE sql functions (PostgreSQL checks their bodies at
    # CREATE, so they need the register): only where the register is (a schema_translate_map
    # may have created it in another schema than the one this DDL names).
    on_register = [
        _TOKEN_INDEX,
        functions[CHECK_FUNCTION],
        functions[GRANT_FUNCTION],
        functions[WITHDRAW_FUNCTION],
        functions[PRUNE_FUNCTION],
        *(
            f"REVOKE EXECUTE ON FUNCTION {_S}.{name}({FUNCTIONS[name]}) FROM PUBLIC"
            for name in WRITING_FUNCTIONS
        ),
    ]
    return _DO_BLOCK.format(
        schema=quote_literal(register.schema) if register.schema else "NULL",
        run="\n".join(f"    {_execute(sql)}" for sql in run),
        scope_key=_execute(_SCOPE_KEY),
        after_key="\n".join(f"    {_execute(sql)}" for sql in after_key),
        register_key=_execute(_REGISTER_KEY),
        outdated=", ".join(f"'{column}'" for column in _OUTDATED_SCOPE_COLUMNS),
        trigger=_execute(_SCOPE_TRIGGER),
        always=_execute(_SCOPE_TRIGGER_ALWAYS),
        on_register="\n".join(f"        {_execute(sql)}" for sql in on_register),
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
        "    previous bigint,\n"
        "    name_key bigint\n"
        ")",
        check_function_sql(register),
    ]


def drop_functions_sql(register: Register) -> list[str]:
    """Drop every function of :data:`FUNCTIONS` (the scope table's trigger must be gone)."""
    return [
        f"DROP FUNCTION IF EXISTS {qualified(name, register.schema)}({args})"
        for name, args in FUNCTIONS.items()
    ]


def drop_register_sql(sequence: str) -> list[str]:
    """Drop the scope table (its trigger with it), the functions, then the register."""
    register = Register(sequence)
    return [
        f"DROP TABLE IF EXISTS {register.scope_sql}",
        *drop_functions_sql(register),
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
        Column("name_key", BigInteger, nullable=True),
        Index(TOKEN_INDEX, "token", unique=True),
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
        Column("token", BigInteger, nullable=False),
        Column("name_key", BigInteger, nullable=False),
        schema=sequence.schema,
        prefixes=["UNLOGGED"],
        info={"sa_fence.scope": True},
    )
    table.add_is_dependent_on(scope)
    for target, when, sql in (
        (table, "after_create", check_function_sql(register)),
        (scope, "after_drop", ";\n".join(drop_functions_sql(register))),
    ):
        ddl = DDL(sql.replace("%", "%%"))  # type: ignore[no-untyped-call]  # (DDL() formats)
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
                      AND a.attname = ANY (CAST(:outdated AS text[])) AND NOT a.attisdropped)
               AS outdated,
           pg_catalog.to_regclass(pg_catalog.quote_ident(n.nspname) || '.{TOKEN_INDEX}')
               IS NOT NULL AS has_token_index,
           EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a WHERE a.attrelid = r.oid
                      AND a.attname = 'name_key' AND NOT a.attisdropped) AS register_keyed,
           EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid
                      AND a.attname = 'name_key' AND NOT a.attisdropped) AS scope_keyed
      FROM pg_catalog.pg_class r
      JOIN pg_catalog.pg_namespace n ON n.oid = r.relnamespace
      LEFT JOIN pg_catalog.pg_class c
        ON c.relnamespace = r.relnamespace AND c.relname = '{SCOPE_TABLE}' AND c.relkind = 'r'
      LEFT JOIN pg_catalog.pg_trigger t ON t.tgrelid = c.oid AND t.tgname = '{SCOPE_TRIGGER}'
     WHERE r.oid = pg_catalog.to_regclass(:register)
    """
)


#: Each function of :data:`FUNCTIONS` beside the register: present, SECURITY DEFINER, and
#: whether its body is sa-fence's (the expected body is written out inside PostgreSQL, as the
#: DDL's schema placeholders are).
_FUNCTIONS_STATE_SQL = text(
    """
    SELECT f.name, p.oid IS NOT NULL AS present, p.prosecdef AS definer,
           p.prosrc = pg_catalog.replace(pg_catalog.replace(f.body,
               '@sa_fence_schema@', pg_catalog.quote_ident(n.nspname)),
               '@sa_fence_register@',
               pg_catalog.quote_literal(pg_catalog.quote_ident(n.nspname) || '.sa_fence_leases'))
               AS same
      FROM pg_catalog.pg_class r
      JOIN pg_catalog.pg_namespace n ON n.oid = r.relnamespace
     CROSS JOIN ROWS FROM (pg_catalog.unnest(CAST(:names AS text[])),
                           pg_catalog.unnest(CAST(:args AS text[])),
                           pg_catalog.unnest(CAST(:bodies AS text[]))) AS f(name, args, body)
      LEFT JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(
                pg_catalog.quote_ident(n.nspname) || '.' || f.name || '(' || f.args || ')')
     WHERE r.oid = pg_catalog.to_regclass(:register)
     ORDER BY f.name
    """
)


def _body(ddl: str) -> str:
    """The dollar-quoted body of a ``CREATE FUNCTION`` statement (what ``prosrc`` holds)."""
    return ddl.split("$sa_fence$")[1]


def register_objects_outdated(conn: Any, register: Register) -> list[str]:
    """What beside ``register`` is not as sa-fence makes it: a function missing, not
    SECURITY DEFINER or with a body that is not sa-fence's (edited by hand, or made by an
    earlier release), the register's token index missing, or a scope table of an earlier
    form.  Each is one phrase; ``op.create_fence_register()`` mends all of them.  Empty
    when all is well or when the register is missing (reported on its own)."""
    state = conn.execute(
        _SCOPE_STATE_SQL,
        {"register": register.table_sql, "outdated": list(_OUTDATED_SCOPE_COLUMNS)},
    ).one_or_none()
    if state is None:
        return []
    found = []
    if state.outdated:
        found.append(f"the lease scope table {state.scope} has the columns of an earlier form")
    if not state.has_token_index:
        found.append(f"the register's unique index {TOKEN_INDEX} on token is missing")
    if not state.register_keyed:
        found.append("the register has no name_key column (each lease name's key)")
    if state.has_table and not state.scope_keyed:
        found.append(f"the lease scope table {state.scope} has no name_key column")
    definitions = function_definitions()
    rows = conn.execute(
        _FUNCTIONS_STATE_SQL,
        {
            "register": register.table_sql,
            "names": list(definitions),
            "args": [FUNCTIONS[name] for name in definitions],
            "bodies": [_body(ddl) for ddl in definitions.values()],
        },
    )
    for row in rows:
        shown = f"function {row.name}({FUNCTIONS[row.name]})"
        if not row.present:
            found.append(f"{shown} is missing")
        elif not row.definer:
            found.append(f"{shown} is not SECURITY DEFINER")
        elif not row.same:
            found.append(
                f"{shown} has a body that is not sa-fence's (edited by hand, or made by an "
                "earlier release)"
            )
    return found


def scope_trigger_problem(conn: Any, register: Register) -> str | None:
    """Why PostgreSQL would not hold lease scope at COMMIT for ``register``, with the fix.

    The scope table must sit beside the register with its deferred constraint trigger,
    enabled.  None when all is well, or when the register is missing (reported on its own).
    """
    row = conn.execute(
        _SCOPE_STATE_SQL,
        {"register": register.table_sql, "outdated": list(_OUTDATED_SCOPE_COLUMNS)},
    ).one_or_none()
    if row is None:
        return None
    fix = (
        "Recreate it with op.create_fence_register() in a migration (idempotent: the register's "
        "rows are kept) or sa_fence.fence_schema(metadata) and metadata.create_all()."
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
