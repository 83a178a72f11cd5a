"""``sa-fence check`` and ``sa-fence repair-sequence``: a live database's fencing set-up.

``check`` looks for what would let a stale write through, or refuse every
writer, and says how to fix each finding:

* the token sequence is missing, not ``bigint``, ``CACHE > 1``, ``CYCLE``,
  or has a non-positive increment;
* the lease register (``sa_fence_leases`` in the sequence's schema) is
  missing, has the wrong shape, or draws its tokens from no sequence or
  from another one than ``--sequence``; a function beside it (the commit
  check, the scope trigger's, grant, withdraw, prune) is missing, not
  SECURITY DEFINER or not sa-fence's, its unique token index is missing, or
  its scope table is of an earlier form (``op.create_fence_register()``
  mends them all);
* the connecting role (run the check as your workers' role) lacks a right
  the workers need (EXECUTE on the grant and withdraw functions, SELECT on
  the register and the sequence, INSERT on the scope table), or has one
  they must not: a write on the register (a stale holder could write its
  token back) or UPDATE, DELETE or TRUNCATE on the scope table.  A
  *warning*, never counted as a problem, when no REVOKE can take such a
  write away (a superuser, the table's owner: the role migrations run as);
* the database holds more than one register (two sequences fencing the
  same rows: neither register fences out the other's holders);
* a fenced table lacks its fence column, its guard is disabled, or its guard
  is not the one this sa-fence creates (a trigger not firing before each
  INSERT, UPDATE and DELETE, or skipped by ordinary writers: ENABLE REPLICA,
  UPDATE OF some columns, a WHEN condition, a partition's copy disabled; a
  function reading another sequence than ``--sequence``, from another version
  or edited by hand); this role may not read it (its fences are unknown);
  partitions are checked through their partitioned table, whose guard
  PostgreSQL clones onto them; a table with no guard at all (a ``create_all``
  database) is *advice*, a finding only under ``--strict``: bound sessions are fenced
  without it, writers outside sa-fence are not;
* the sequence is behind ``max(fence)`` of a fenced table or ``max(token)``
  of its register (after a restore from backup, or a promoted logical
  replica: logical replication does not carry sequence values).  Its next
  tokens would then be refused by every row they are compared with, or,
  worse, equal a token already written; a grant whose token is not past the
  name's register token is refused (the register only moves forward).

Every read names the sequence and the register schema-qualified
(:func:`~sa_fence.db.register.pinned_register`), so a table of the register's
name earlier on the search_path changes nothing of what is reported.

Rows whose fence is NULL ("never fenced": any token may write them) are
counted in a ``note`` line, not a finding, with the backfill that makes the
column ``NOT NULL``.

Fenced tables are the ones in ``--metadata`` (models marked ``Fenced`` or
with ``fence_column()``); without it, every table that has a column named
``--column`` (default ``fence``) or a guard trigger.

``repair-sequence`` moves the sequence past the largest fence and the
largest registered token, plus a margin (it never moves it backwards).  It
refuses, before asking, a target past 2**63-1 (fences no lease was granted)
and a role that may not read every fenced table or move the sequence.
With ``--after-failover`` (a promoted asynchronous replica, a point-in-time
or backup restore: the newest grants may be lost) it also moves past the
sequence's own last value, since tokens the lost primary handed out after
the last one that reached this server are known to no surviving row, and it
fences out every lease granted before: each name of the register gets a new
token, so no holder from before the failover can commit again.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import sqlalchemy as sa

from .._failures import POOLER_DOC
from ..db.fitness import (
    REGISTER_COLUMNS_SQL,
    SEQUENCE_SHOWN,
    register_problems,
    sequence_problem,
    token_sequences_sql,
)
from ..db.guard import (
    GUARD_STATE_SQL,
    TRIGGER_NAME,
    guard_made_with,
    outdated,
    qualified,
    same_sequence,
)
from ..db.register import (
    CHECK_FUNCTION,
    FUNCTIONS,
    GRANT_FUNCTION,
    REGISTER_TABLE,
    WITHDRAW_FUNCTION,
    Register,
    pinned_register,
    register_objects_outdated,
)
from ..db.tokens import DEFAULT_SEQUENCE, behind_pooler, setup_problem
from ..orm.create_guard import PARTITION_ROOT_SQL
from ..orm.model import fence_column_of

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

#: The largest value a token sequence (bigint) can hand out.
BIGINT_MAX = 2**63 - 1
#: ``repair-sequence``'s default ``--margin`` (its CLI default too)
DEFAULT_MARGIN = 1000  # (repair-sequence's default, cli.DEFAULT_MARGIN: cli loads this lazily)


@dataclass(frozen=True)
class FencedTable:
    schema: str | None
    name: str
    column: str

    @property
    def display(self) -> str:
        return f"{self.schema}.{self.name}" if self.schema else self.name

    @property
    def quoted(self) -> str:
        return qualified(self.name, self.schema)


@dataclass
class Finding:
    """One problem a person can act on: what is wrong and how to fix it."""

    subject: str
    problem: str
    fix: str


@dataclass
class Report:
    sequence: str
    findings: list[Finding] = field(default_factory=list)
    #: what would make the set-up stronger but lets no stale lease commit (a
    #: table with no guard: only writers outside sa-fence go unfenced); findings
    #: under ``sa-fence check --strict``
    advice: list[Finding] = field(default_factory=list)
    #: what would let a stale holder through if the workers connected as the role this check
    #: connected as, but no REVOKE can change (a superuser, an owner: the role migrations run
    #: as, typically); never counted as problems, not even under ``--strict``
    warnings: list[Finding] = field(default_factory=list)
    ok: list[str] = field(default_factory=list)
    #: facts worth knowing that are not problems (e.g. rows never fenced)
    notes: list[str] = field(default_factory=list)
    #: the sequence's last handed-out value (None: missing; 0: none handed out yet)
    last_value: int | None = None
    #: table display name -> max(fence) (None for an empty table)
    max_fences: dict[str, int | None] = field(default_factory=dict)
    #: table display name -> rows whose fence is NULL (only nullable fence columns)
    null_fences: dict[str, int] = field(default_factory=dict)
    #: max(token) of the sequence's lease register (None: no register, or empty)
    max_register_token: int | None = None
    #: the sequence exists (last_value is None also when this role cannot read it)
    sequence_found: bool = False
    #: guarded table's OID -> what its guard lacks (each guard is checked once)
    guards: dict[Any, list[str]] = field(default_factory=dict)
    #: fenced tables this role may not read (their fences are unknown)
    unreadable: list[str] = field(default_factory=list)
    #: table display name -> SQL that lists its rows with a fence past ``{last}`` (a format field)
    rows_past: dict[str, str] = field(default_factory=dict)

    @property
    def register(self) -> str:
        return Register(self.sequence).table_display

    @property
    def max_fence(self) -> int:
        return max([m for m in self.max_fences.values() if m is not None], default=0)


def load_metadata(spec: str, app_dir: str = ".") -> sa.MetaData:
    """``module:attribute.path`` -> a MetaData (or a declarative base's metadata).

    ``app_dir`` (default: the current folder) is put first on ``sys.path``
    for the import, as Alembic's ``prepend_sys_path = .`` does, so the
    command works from the project folder where ``alembic`` works.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"--metadata must look like 'package.module:Base.metadata', got {spec!r}")
    folder = os.path.abspath(app_dir)
    if not os.path.isdir(folder):
        raise ValueError(f"--app-dir {app_dir!r} is not a folder")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".", 1)[0]
        if exc.name is None or top != exc.name.split(".", 1)[0]:
            # the module was found; something it imports was not
            raise ValueError(f"--metadata: importing {module_name!r} failed: {exc}") from None
        raise ValueError(
            f"--metadata: cannot import {module_name!r}: no module {exc.name!r} in {folder} "
            f"or on the import path. Run sa-fence from the folder that holds {top}/ (or "
            f"{top}.py), as for alembic, or pass --app-dir <that folder>, or add it to "
            "PYTHONPATH."
        ) from None
    except Exception as exc:  # the user's module raised while being imported
        raise ValueError(
            f"--metadata: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"--metadata: {module_name}:{attr_path} has no {part!r}") from None
    metadata = getattr(target, "metadata", target)
    if not isinstance(metadata, sa.MetaData):
        raise ValueError(
            f"--metadata: {spec!r} is a {type(target).__name__}, not a MetaData or a "
            "declarative base"
        )
    return metadata


#: The rights the current role needs (docs/topologies.md, "PostgreSQL role"): EXECUTE on the
#: grant and withdraw functions (the only way it moves the register: they run as their owner),
#: SELECT on the register (a refused commit's error names the newer token; ``sa-fence status``),
#: SELECT or USAGE on the sequence (a guard reads how far it has gone) and INSERT on the scope
#: table (the arm).  Not EXECUTE on the check function: a bound session's COMMIT is checked by
#: the scope trigger, which PostgreSQL runs without it; only a raw writer's hand-sent check
#: calls the function.  NULL where the object is missing (reported on its own).
_REGISTER_RIGHTS_SQL = sa.text(
    """
    SELECT has_function_privilege(to_regprocedure(:grant_function), 'EXECUTE') AS can_grant,
           has_function_privilege(to_regprocedure(:withdraw_function), 'EXECUTE')
               AS can_withdraw,
           has_table_privilege(to_regclass(:register), 'SELECT') AS can_select,
           has_sequence_privilege(to_regclass(:sequence), 'SELECT, USAGE') AS can_read_sequence,
           has_table_privilege(to_regclass(:scope), 'INSERT') AS can_arm
    """
)

#: The writes the register's and the scope table's rows must be safe from: the workers' role
#: has none of them on the register, and only INSERT (its arm) on the scope table.
_REGISTER_WRITES = ("INSERT", "UPDATE", "DELETE", "TRUNCATE")
_SCOPE_WRITES = ("UPDATE", "DELETE", "TRUNCATE")

#: Which of ``:rights`` the current role holds on table ``:table`` (INSERT and UPDATE on any
#: column count: UPDATE (token) is enough to write a token back), whether it is a superuser or
#: the table's owner (or inherits the owner's rights), and the roles the rights come from:
#: itself, a role it inherits from, or PUBLIC (NULL), as a REVOKE must name them.  No row
#: when the table is missing.
_WRITES_SQL = sa.text(
    """
    SELECT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) AS superuser,
           pg_catalog.pg_has_role(c.relowner, 'USAGE') AS owner,
           ARRAY(SELECT w.priv FROM pg_catalog.unnest(CAST(:rights AS text[]))
                        WITH ORDINALITY AS w(priv, pos)
                  WHERE CASE WHEN w.priv IN ('INSERT', 'UPDATE')
                             THEN pg_catalog.has_any_column_privilege(c.oid, w.priv)
                             ELSE pg_catalog.has_table_privilege(c.oid, w.priv) END
                  ORDER BY w.pos) AS writes,
           ARRAY(SELECT DISTINCT CASE WHEN a.grantee = 0 THEN NULL
                                      ELSE pg_catalog.pg_get_userbyid(a.grantee) END
                   FROM (SELECT (pg_catalog.aclexplode(c.relacl)).*
                         UNION ALL
                         SELECT (pg_catalog.aclexplode(t.attacl)).*
                           FROM pg_catalog.pg_attribute t
                          WHERE t.attrelid = c.oid AND t.attacl IS NOT NULL) AS a
                  WHERE a.privilege_type = ANY (CAST(:rights AS text[]))
                    AND a.grantee <> c.relowner
                    AND (a.grantee = 0 OR pg_catalog.pg_has_role(a.grantee, 'USAGE'))
                  ORDER BY 1 NULLS FIRST) AS grantees
      FROM pg_catalog.pg_class c
     WHERE c.oid = to_regclass(:table)
    """
)


_DISCOVER_SQL = sa.text(
    """
    SELECT n.nspname AS schema, c.relname AS name
      FROM pg_catalog.pg_class c
      JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
     WHERE c.relkind IN ('r', 'p')
       -- a partition is fenced by its partitioned table's guard, which PostgreSQL clones
       -- onto it; it is checked (and its fences read) through that table
       AND NOT c.relispartition
       AND n.nspname NOT IN ('pg_catalog', 'information_schema')
       AND n.nspname NOT LIKE 'pg\\_%'
       AND (EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                     WHERE a.attrelid = c.oid AND a.attname = :column
                       AND a.attnum > 0 AND NOT a.attisdropped)
            OR EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t
                        WHERE t.tgrelid = c.oid AND t.tgname = :trigger
                          AND NOT t.tgisinternal))
     ORDER BY 1, 2
    """
)


def fenced_tables(
    conn: sa.Connection, metadata: sa.MetaData | None, column: str
) -> list[FencedTable]:
    if metadata is not None:
        found = []
        for table in metadata.sorted_tables:
            fence = fence_column_of(table)
            if fence is not None:
                found.append(FencedTable(table.schema, table.name, fence.name))
        return found
    default_schema = conn.dialect.default_schema_name
    return [
        FencedTable(None if row.schema == default_schema else row.schema, row.name, column)
        for row in conn.execute(_DISCOVER_SQL, {"column": column, "trigger": TRIGGER_NAME})
    ]


_GUARD_STATE_SQL = sa.text(GUARD_STATE_SQL)

_TABLE_SQL = sa.text(
    """
    SELECT to_regclass(:table) IS NOT NULL AS present,
           EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid = to_regclass(:table) AND a.attname = :column
                      AND a.attnum > 0 AND NOT a.attisdropped) AS has_column,
           coalesce((SELECT a.attnotnull FROM pg_catalog.pg_attribute a
                      WHERE a.attrelid = to_regclass(:table) AND a.attname = :column
                        AND a.attnum > 0 AND NOT a.attisdropped), false) AS not_null,
           coalesce(has_table_privilege(to_regclass(:table), 'SELECT'), true) AS readable,
           current_user AS role
    """
)

#: The partitions of partitioned table ``:table`` (every level) whose copy of the guard
#: (cloned by PostgreSQL from the table's own) does not fire for ordinary writers.
_PARTITION_GUARDS_SQL = sa.text(
    f"""
    WITH RECURSIVE parts(relid) AS (
        SELECT i.inhrelid FROM pg_catalog.pg_inherits i WHERE i.inhparent = to_regclass(:table)
        UNION ALL
        SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN parts ON i.inhparent = parts.relid
    )
    SELECT parts.relid::regclass::text AS partition, t.tgenabled AS firing
      FROM parts JOIN pg_catalog.pg_trigger t
        ON t.tgrelid = parts.relid AND t.tgname = '{TRIGGER_NAME}'
     WHERE t.tgenabled NOT IN ('O', 'A')
     ORDER BY 1
    """
)

#: Every lease register in the database, whatever its schema, and the sequence its
#: token default draws from (REGISTER_SEQUENCE_SQL by OID: no name lookup, so a
#: schema this role may not use is no error).
_REGISTERS_SQL = sa.text(
    "SELECT c.oid::regclass::text AS shown, (SELECT t.oid::regclass::text "
    "FROM pg_catalog.pg_class t WHERE t.relkind = 'S' AND t.oid IN "
    + token_sequences_sql("c.oid")
    + " ORDER BY 1 LIMIT 1) AS sequence "
    "FROM pg_catalog.pg_class c WHERE c.relname = :name AND c.relkind IN ('r', 'p') ORDER BY 1"
)


def _last_value(conn: sa.Connection, quoted: str, row: Any) -> int | None:
    """The last value the sequence handed out (start - increment when none yet).

    None when this role may not read it (neither SELECT nor USAGE: the
    register's rights finding says so).  ``pg_sequence_last_value`` needs
    either right, where ``SELECT last_value FROM seq`` would need SELECT.
    """
    value = conn.execute(
        sa.text(
            "SELECT CASE WHEN has_sequence_privilege(CAST(:seq AS regclass), 'SELECT, USAGE') "
            "THEN 1 END AS readable, "
            "has_sequence_privilege(CAST(:seq AS regclass), 'SELECT') AS selectable, "
            "CASE WHEN has_sequence_privilege(CAST(:seq AS regclass), 'SELECT, USAGE') "
            "THEN pg_sequence_last_value(CAST(:seq AS regclass)) END AS last_value"
        ),
        {"seq": quoted},
    ).one()
    if value.readable is None:
        return None
    if value.last_value is None and value.selectable:
        # Not called since a setval(..., false) (or ever): the next nextval
        # returns last_value itself, so the last one handed out is before it.
        last, called = conn.execute(sa.text(f"SELECT last_value, is_called FROM {quoted}")).one()
        return int(last) if called else int(last) - int(row.seqincrement)
    if value.last_value is None:
        return int(row.seqstart) - int(row.seqincrement)
    return int(value.last_value)


def _check_register(conn: sa.Connection, report: Report, *, sequence_ok: bool) -> None:
    """The lease register of ``report.sequence``: presence, shape, sequence, functions, rights.

    Reads go to the schema-qualified names (``register``); messages and fixes
    show the names as given (``shown``)."""
    sequence = report.sequence
    shown = Register(sequence)
    register = pinned_register(conn, sequence)
    subject = f"lease register {shown.table_display}"
    before = len(report.findings)
    # the rules a Fencer's check and its grant read too (sa_fence.db.fitness)
    report.findings.extend(
        Finding(p.subject, p.problem, p.fix) for p in register_problems(conn, shown, register)
    )
    columns = {
        row.name for row in conn.execute(REGISTER_COLUMNS_SQL, {"register": register.table_sql})
    }
    if not columns:
        return  # no register: nothing more to read
    rights = conn.execute(
        _REGISTER_RIGHTS_SQL,
        {
            "grant_function": _signature(register, GRANT_FUNCTION),
            "withdraw_function": _signature(register, WITHDRAW_FUNCTION),
            "register": register.table_sql,
            "sequence": register.sequence_sql,
            "scope": register.scope_sql,
        },
    ).one()
    role = conn.execute(sa.text("SELECT current_user")).scalar_one()
    lacking = _lacking_rights(rights, shown, role)
    if lacking:
        fails = list(dict.fromkeys(consequence for _, consequence, _ in lacking))
        report.findings.append(
            Finding(
                f"role {role}",
                "(the role this check connected as: run it as your workers' role) lacks "
                + ", ".join(right for right, _, _ in lacking)
                + ": "
                + " and ".join(filter(None, (", ".join(fails[:-1]), fails[-1])))
                + (" fails" if len(fails) == 1 else " fail")
                + " with permission denied",
                " ".join(grant for _, _, grant in lacking),
            )
        )
    if "token" in columns and rights.can_select:
        max_token = conn.execute(sa.text(f"SELECT max(token) FROM {register.table_sql}")).scalar()
        report.max_register_token = None if max_token is None else int(max_token)
    if len(report.findings) == before and sequence_ok:
        # Anything else a Fencer would refuse (one source of truth: setup_problem).
        problem = setup_problem(conn, sequence)
        if problem is not None:
            report.findings.append(
                Finding(subject, f"a Fencer would refuse it: {problem}", "as the problem says")
            )
    _check_register_objects(conn, report, register, subject)
    _check_register_writes(conn, report, register, shown)
    _check_scope_vacuum(conn, report, register, shown)
    if len(report.findings) == before:
        report.ok.append(
            f"{subject}: tokens from {sequence}, commit check function, rights of role {role}"
        )


#: Whether autovacuum skips the scope table (off for it, off altogether, or blind: without
#: track_counts it never sees the dead rows), and what has piled up in it so far.
_SCOPE_VACUUM_SQL = sa.text(
    """
    SELECT pg_catalog.current_setting('autovacuum') = 'off' AS everywhere,
           pg_catalog.current_setting('track_counts') = 'off' AS blind,
           EXISTS (SELECT 1 FROM pg_catalog.pg_options_to_table(c.reloptions) o
                    WHERE o.option_name = 'autovacuum_enabled'
                      AND lower(o.option_value) IN ('false', 'off', 'no', '0', 'f', 'n'))
               AS for_table,
           coalesce(pg_catalog.pg_stat_get_dead_tuples(c.oid), 0) AS dead,
           pg_catalog.pg_total_relation_size(c.oid) AS bytes,
           pg_catalog.pg_size_pretty(pg_catalog.pg_total_relation_size(c.oid)) AS size
      FROM pg_catalog.pg_class c
     WHERE c.oid = pg_catalog.to_regclass(:scope)
    """
)
#: Where autovacuum is off for the whole server, what makes it worth advice: the dead rows
#: (or, with track_counts off, the size) of a scope table nothing clears.  (A fresh database
#: with autovacuum off, a test server's, is not: nothing has piled up yet.)
SCOPE_DEAD_ROWS_ADVISED = 10_000
SCOPE_BYTES_ADVISED = 8 * 1024 * 1024


def _check_scope_vacuum(
    conn: sa.Connection, report: Report, register: Register, shown: Register
) -> None:
    """Advice when autovacuum does not clear the scope table: every armed transaction leaves
    a dead row there (docs/operations.md, "The scope table").  Off for the table itself: always;
    off for the server: once dead rows have piled up."""
    row = conn.execute(_SCOPE_VACUUM_SQL, {"scope": register.scope_sql}).one_or_none()
    if row is None:
        return
    piled_up = row.dead >= SCOPE_DEAD_ROWS_ADVISED or row.bytes >= SCOPE_BYTES_ADVISED
    if not (row.for_table or ((row.everywhere or row.blind) and piled_up)):
        return
    why = (
        "autovacuum is off for it"
        if row.for_table
        else f"autovacuum is off on this server, and {row.dead} dead rows wait"
        if row.everywhere
        else "track_counts is off, so autovacuum never sees its dead rows"
    )
    report.advice.append(
        Finding(
            f"lease scope table {shown.scope_display}",
            f"is not vacuumed ({why}; {row.size} now): every armed transaction leaves a dead "
            "row of about 50 bytes there, so it grows by about 5 MB per 100,000 transactions "
            "and arming and its trigger read more pages as it does",
            f"ALTER TABLE {register.scope_sql} RESET (autovacuum_enabled); (or turn autovacuum "
            f"and track_counts on); until then run VACUUM {register.scope_sql}; every few "
            "minutes",
        )
    )


def _signature(register: Register, function: str) -> str:
    """``function``'s schema-qualified signature beside ``register`` (for to_regprocedure)."""
    return f"{qualified(function, register.schema)}({FUNCTIONS[function]})"


#: The fix of whatever beside the register is not as sa-fence makes it.
REGISTER_OBJECTS_FIX = (
    "op.create_fence_register() in a migration (idempotent; keeps the register's rows)"
)


def _check_register_objects(
    conn: sa.Connection, report: Report, register: Register, subject: str
) -> None:
    """The functions beside the register (present, SECURITY DEFINER, sa-fence's body), its
    token index and the scope table's form: what ``op.create_fence_register()`` mends."""
    # (a missing check function is reported by register_problems, with its consequence)
    reported = f"function {CHECK_FUNCTION}({FUNCTIONS[CHECK_FUNCTION]}) is missing"
    report.findings.extend(
        Finding(subject, f"is not as sa-fence makes it: {item}", REGISTER_OBJECTS_FIX)
        for item in register_objects_outdated(conn, register)
        if item != reported
    )


def _check_register_writes(
    conn: sa.Connection, report: Report, register: Register, shown: Register
) -> None:
    """The connecting role may write the register, or take back or change arms in the scope
    table: only sa-fence's SECURITY DEFINER functions and scope trigger may.  A finding with
    the REVOKE; a warning where no REVOKE takes the rights away (a superuser, an owner)."""
    #: (the table as read, as a REVOKE names it, as said, the rights, what they let it do, and
    #: what comes of that)
    tables = (
        (
            register.table_sql,
            shown.table_sql,
            f"the lease register {shown.table_display}",
            _REGISTER_WRITES,
            f"write the lease register {shown.table_display} itself",
            "a stale holder running as it could write its token back and shut the current "
            "holder out",
        ),
        (
            register.scope_sql,
            shown.scope_sql,
            f"the lease scope table {shown.scope_display}",
            _SCOPE_WRITES,
            f"delete or change rows of the lease scope table {shown.scope_display}",
            "the workers' role needs INSERT alone there (its arm); only sa-fence's scope "
            "trigger takes an arm back",
        ),
    )
    role = conn.execute(sa.text("SELECT current_user")).scalar_one()
    unrevokable: list[tuple[str, str, str]] = []  # (why no REVOKE helps, what it can, so what)
    for table, on, named, rights, can, so in tables:
        row = conn.execute(_WRITES_SQL, {"table": table, "rights": list(rights)}).one_or_none()
        if row is None or not row.writes:
            continue
        can = f"{can} ({', '.join(row.writes)})"
        if row.superuser or row.owner:
            unrevokable.append(("is a superuser" if row.superuser else f"owns {named}", can, so))
            continue
        grantees = row.grantees or [role]
        sources = ", ".join("PUBLIC" if g is None else f"role {g}" for g in grantees)
        granted = "" if grantees == [role] else f" (granted to {sources})"
        report.findings.append(
            Finding(
                f"role {role}",
                f"can {can}{granted}: {so}",
                f"REVOKE {', '.join(rights)} ON {on} FROM "
                + ", ".join("PUBLIC" if g is None else _ident(g) for g in grantees)
                + ";",
            )
        )
    if unrevokable:
        whys = " and ".join(dict.fromkeys(why for why, _, _ in unrevokable))
        report.warnings.append(
            Finding(
                f"role {role}",
                f"(the role this check connected as) {whys}: it can "
                + " and ".join(can for _, can, _ in unrevokable)
                + ", and no REVOKE takes that from a superuser or an owner. "
                + unrevokable[0][2][0].upper()
                + unrevokable[0][2][1:]
                + ": harmless for the role migrations run as, not for the role the workers "
                "connect as",
                "run the workers as a role that neither owns the schema nor is a superuser, "
                "with only the grants of docs/topologies.md (PostgreSQL role), and run "
                "sa-fence check as that role",
            )
        )


def _lacking_rights(rights: Any, shown: Register, role: str) -> list[tuple[str, str, str]]:
    """The rights (a row of ``_REGISTER_RIGHTS_SQL``) ``role`` lacks: (right, what fails, GRANT)."""
    table, scope = shown.table_display, shown.scope_display
    schema = f"{shown.schema}." if shown.schema else ""
    grant = f"function {schema}{GRANT_FUNCTION}({FUNCTIONS[GRANT_FUNCTION]})"
    withdraw = f"function {schema}{WITHDRAW_FUNCTION}({FUNCTIONS[WITHDRAW_FUNCTION]})"
    #: (has it, the right, on what as shown, what fails without it, on what in the GRANT)
    needed = (
        (
            rights.can_grant,
            "EXECUTE",
            grant,
            "every grant",
            f"FUNCTION {shown.grant_function_sql}({FUNCTIONS[GRANT_FUNCTION]})",
        ),
        (
            rights.can_withdraw,
            "EXECUTE",
            withdraw,
            "the withdrawal of a token whose grant was never confirmed",
            f"FUNCTION {shown.withdraw_function_sql}({FUNCTIONS[WITHDRAW_FUNCTION]})",
        ),
        (
            rights.can_select,
            "SELECT",
            table,
            "reading the register (a refused commit's newer token, sa-fence status)",
            shown.table_sql,
        ),
        (
            rights.can_read_sequence,
            "SELECT",
            f"sequence {shown.sequence}",
            "every fenced write that raises a row's fence (its guard reads the sequence)",
            f"SEQUENCE {shown.sequence_sql}",
        ),
        (
            rights.can_arm,
            "INSERT",
            scope,
            "every transaction of a bound session",
            shown.scope_sql,
        ),
    )
    return [
        (f"{right} on {on}", fails, f"GRANT {right} ON {target} TO {_ident(role)};")
        for allowed, right, on, fails, target in needed
        if allowed is False
    ]


def _check_registers(conn: sa.Connection, report: Report) -> None:
    """More than one register: two sequences that may fence the same rows."""
    registers = conn.execute(_REGISTERS_SQL, {"name": REGISTER_TABLE}).all()
    if len(registers) < 2:
        return
    described = [f"{r.shown} (tokens from {r.sequence or 'no sequence'})" for r in registers]
    report.findings.append(
        Finding(
            "lease registers",
            f"{len(registers)} in this database: "
            + ", ".join(described)
            + ". Fencers naming different sequences grant and check leases against "
            "different registers: a newer lease of a name granted through one does not "
            "fence out an older holder of the same name granted through the other, so that "
            "stale holder's commit goes through; their row fences also compare tokens of "
            "unrelated sequences",
            "give every Fencer of this database one sequence (sequence=...); once no worker "
            "uses the others, drop their registers (op.drop_fence_register('<sequence>')) and "
            "sequences, then run sa-fence repair-sequence for the one kept",
        )
    )


def _ident(name: str) -> str:
    return qualified(name, None)


def _guard_args(policy: str, sequence: str, *, named: bool = False) -> str:
    """The create_fence_guard() arguments after the table's that remake a guard: ``policy``
    as it was made ("": the default; "unknown": either), on the checked ``sequence`` (``named``:
    said even when it is the default, the guard reading another one)."""
    if policy == "unknown":
        args = ", on_missing_token='reject' or 'unchanged'"
    else:
        args = "" if policy in ("", "reject") else f", on_missing_token={policy!r}"
    return args + ("" if sequence == DEFAULT_SEQUENCE and not named else f", sequence={sequence!r}")


def _guard_fixes(
    table: FencedTable,
    guard_args: str,
    guard_fix: str | None,
    policy: str = "",
    sequence: str = DEFAULT_SEQUENCE,
    *,
    named: bool = False,
) -> str:
    """Both ways to add a guard: without Alembic (a create_all database), and in a migration
    (``guard_fix``; None: without Alembic only)."""
    command = f"sa-fence create-guard --url ... {table.name}" + (
        "" if table.column == "fence" else f" --column {table.column}"
    )
    command += "" if table.schema is None else f" --schema {table.schema}"
    if policy == "unknown":
        command += " --on-missing-token reject|unchanged"
    elif policy not in ("", "reject"):
        command += f" --on-missing-token {policy}"
    command += "" if sequence == DEFAULT_SEQUENCE and not named else f" --sequence {sequence}"
    python = f"{command} (or in Python: sa_fence.create_fence_guard(engine, {guard_args}))"
    return python if guard_fix is None else f"{python}; in an Alembic migration: {guard_fix}"


def check(
    conn: sa.Connection,
    *,
    sequence: str = DEFAULT_SEQUENCE,
    metadata: sa.MetaData | None = None,
    column: str = "fence",
) -> Report:
    """Inspect the database behind ``conn`` (read-only); return what is wrong.

    One ``_check_*`` per part; each adds its lines to the report in this order,
    which is the order the printed report keeps within each kind of line.
    """
    report = Report(sequence)
    _check_pooler(conn, report)
    sequence_ok = _check_sequence(conn, report)
    _check_register(conn, report, sequence_ok=sequence_ok)
    _check_registers(conn, report)
    _check_tables(conn, report, metadata, column)
    _check_sequence_position(report)
    return report


def _check_pooler(conn: sa.Connection, report: Report) -> None:
    """A note when ``conn`` reaches PostgreSQL through a connection pooler."""
    if behind_pooler(conn):
        report.notes.append(
            "this URL reaches PostgreSQL through a connection pooler (PgBouncer?). If it "
            "pools by transaction, create your application's engine with "
            "connect_args={'prepare_threshold': None} (psycopg): a Fencer refuses to "
            f"start without it (see {POOLER_DOC})"
        )


def _check_sequence(conn: sa.Connection, report: Report) -> bool:
    """The token sequence's presence and shape; records its last value.

    Returns whether it exists and is fit."""
    sequence = report.sequence
    pinned = pinned_register(conn, sequence)
    # read by its schema-qualified name: nothing on the search_path stands in
    row, problem = sequence_problem(conn, Register(sequence), pinned)
    if problem is not None:
        report.findings.append(Finding(problem.subject, problem.problem, problem.fix))
    if row is not None:
        if problem is None:
            report.ok.append(f"sequence {sequence}: {SEQUENCE_SHOWN}")
        report.sequence_found = True
        report.last_value = _last_value(conn, pinned.sequence_sql, row)
    return row is not None and problem is None


def _check_tables(
    conn: sa.Connection, report: Report, metadata: sa.MetaData | None, column: str
) -> None:
    """Every fenced table (from ``metadata``, else found by ``column`` or guard)."""
    tables = fenced_tables(conn, metadata, column)
    if not tables:
        report.findings.append(
            Finding(
                "fenced tables",
                "none found"
                + (
                    " in --metadata"
                    if metadata is not None
                    else f" (no table has a {column!r} column or a {TRIGGER_NAME} trigger)"
                ),
                "add fencing with op.add_fence_column(table) and op.create_fence_guard(table), "
                "or point --metadata / --column at your models",
            )
        )
    for table in tables:
        _check_table(conn, report, table)


def _check_table(conn: sa.Connection, report: Report, table: FencedTable) -> None:
    """One fenced table: present, its fence column, its guard, its fences."""
    state = conn.execute(
        _TABLE_SQL,
        {"table": table.quoted, "column": table.column},
    ).one()
    if not state.present:
        report.findings.append(
            Finding(
                f"table {table.display}",
                "is fenced in the models but does not exist in the database",
                "run your migrations (alembic upgrade head)",
            )
        )
        return
    missing = []
    if not state.has_column:
        missing.append(f"has no {table.column!r} column")
        report.findings.append(
            Finding(
                f"table {table.display}",
                f"has no fence column {table.column!r}",
                f"op.add_fence_column({table.name!r}"
                + ("" if table.column == "fence" else f", {table.column!r}")
                + ")",
            )
        )
    root = partition_root(conn, table.name, table.schema)
    if root is not None:
        # its guard is its partitioned table's (PostgreSQL clones it onto every partition)
        report.notes.append(
            f"table {table.display}: a partition of {root}, fenced by the guard of {root} "
            "(PostgreSQL clones it onto every partition), checked as that table's"
        )
        schema, name = conn.execute(_NAMES_SQL, {"table": root}).one()
        shown = None if schema == conn.dialect.default_schema_name else schema
        missing.extend(_check_guard(conn, report, FencedTable(shown, name, table.column)))
    else:
        missing.extend(_check_guard(conn, report, table))
    if state.has_column and not state.readable:
        missing.append("cannot be read")
        report.unreadable.append(table.display)
        report.findings.append(
            Finding(
                f"table {table.display}",
                f"cannot be read by role {state.role} (no SELECT): its fences are unknown, "
                "so whether the sequence is behind them is not checked (and repair-sequence "
                "refuses to run)",
                f"run the check as a role that may read every fenced table, or: GRANT SELECT "
                f"ON {table.quoted} TO {_ident(state.role)};",
            )
        )
    elif state.has_column:
        _read_fences(conn, report, table, not_null=state.not_null)
    if not missing:
        report.ok.append(f"table {table.display}: column {table.column}, guard {TRIGGER_NAME}")


_ROOT_SQL = sa.text("SELECT " + PARTITION_ROOT_SQL)


def partition_root(conn: sa.Connection, table: str, schema: str | None) -> str | None:
    """The partitioned table whose guard PostgreSQL clones onto partition ``table`` (None: no
    partition), named as PostgreSQL shows it on the search_path."""
    root = conn.execute(_ROOT_SQL, {"table": qualified(table, schema)}).scalar()
    return None if root is None else str(root)


_NAMES_SQL = sa.text(
    "SELECT n.nspname, c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
    "ON n.oid = c.relnamespace WHERE c.oid = to_regclass(:table)"
)


def _check_guard(conn: sa.Connection, report: Report, table: FencedTable) -> list[str]:
    """``table``'s guard trigger: absent, disabled or outdated; returns what is missing.

    Once per table (a partitioned table's is checked for each partition --metadata names)."""
    key = conn.execute(sa.text("SELECT to_regclass(:t)::oid"), {"t": table.quoted}).scalar()
    if key in report.guards:
        return report.guards[key]
    report.guards[key] = found = _guard_findings(conn, report, table)
    return found


def _guard_findings(conn: sa.Connection, report: Report, table: FencedTable) -> list[str]:
    guard = conn.execute(_GUARD_STATE_SQL, {"table": table.quoted}).one_or_none()
    absent = guard is None
    if guard is not None and not guard.enabled:
        guard = None  # a disabled guard refuses nothing
    made_with = None if guard is None else guard_made_with(guard.source)
    other_sequence = made_with is not None and not same_sequence(
        made_with[1], report.sequence, conn.dialect.default_schema_name
    )
    policy = "" if guard is None else "unknown" if made_with is None else made_with[0]
    guard_args = (
        repr(table.name)
        + ("" if table.column == "fence" else f", {table.column!r}")
        + ("" if table.schema is None else f", schema={table.schema!r}")
        + _guard_args(policy, report.sequence, named=other_sequence)
    )
    guard_fix = f"op.create_fence_guard({guard_args})"
    if guard is None:
        # never made (a create_all database): advice, unless --strict; a guard
        # someone disabled is a problem
        (report.advice if absent else report.findings).append(
            Finding(
                f"table {table.display}",
                f"has no enabled guard trigger {TRIGGER_NAME}: writers outside fenced "
                "sessions (raw SQL, psql, other services) are not fenced",
                _guard_fixes(table, guard_args, guard_fix, policy, report.sequence),
            )
        )
        return ["has no guard"]
    why = outdated(
        guard.source,
        guard.complete,
        table.name,
        table.column,
        schema=table.schema,
        default_schema=conn.dialect.default_schema_name,
        sequence=report.sequence,
        firing=guard.firing,
        on_columns=guard.on_columns,
        conditional=guard.conditional,
    )
    why.extend(_partition_guards(conn, table))
    if not why:
        return []
    fix = f"{guard_fix} (recreates it); without Alembic: " + _guard_fixes(
        table, guard_args, None, policy, report.sequence, named=other_sequence
    )
    if other_sequence:
        assert made_with is not None
        fix += (
            f". If your Fencers do draw their tokens from {made_with[1]}, check with "
            f"--sequence {made_with[1]} instead"
        )
    report.findings.append(
        Finding(
            f"table {table.display}",
            f"has a guard trigger {TRIGGER_NAME} that is not the one this "
            f"sa-fence creates: {'; '.join(why)}",
            fix,
        )
    )
    return ["has an outdated guard"]


def _partition_guards(conn: sa.Connection, table: FencedTable) -> list[str]:
    """Why the guard's copies on ``table``'s partitions do not fence their writers."""
    states = {"D": "disabled", "R": "ENABLE REPLICA (fires in replica mode only)"}
    return [
        f"its copy on partition {row.partition} is {states.get(row.firing, row.firing)}, "
        "so writes to that partition are not fenced"
        for row in conn.execute(_PARTITION_GUARDS_SQL, {"table": table.quoted})
    ]


def _read_fences(
    conn: sa.Connection, report: Report, table: FencedTable, *, not_null: bool
) -> None:
    """``table``'s largest fence, and a note on its rows with a NULL fence."""
    fence = qualified(table.column, None)
    nulls = "0" if not_null else f"count(*) FILTER (WHERE {fence} IS NULL)"
    max_fence, null_count = conn.execute(
        sa.text(f"SELECT max({fence}), {nulls} FROM {table.quoted}")
    ).one()
    report.max_fences[table.display] = None if max_fence is None else int(max_fence)
    report.rows_past[table.display] = (
        f"SELECT * FROM {table.quoted} WHERE {fence} > {{last}} ORDER BY {fence} DESC"
    )
    if null_count:
        report.null_fences[table.display] = int(null_count)
        report.notes.append(
            f"table {table.display}: {null_count} row(s) with a NULL {table.column} "
            "(never fenced: any lease may write them, and the first fenced write sets "
            "the fence). To make the column NOT NULL: UPDATE "
            f"{table.quoted} SET {fence} = 0 WHERE {fence} IS NULL; ALTER TABLE "
            f"{table.quoted} ALTER COLUMN {fence} SET NOT NULL;"
        )


def _check_sequence_position(report: Report) -> None:
    """The sequence's last value against the fences and register tokens read before."""
    if report.last_value is None:
        return
    sequence = report.sequence
    last = report.last_value
    behind = [
        f"max(fence) of {n} is {m}"
        for n, m in sorted(report.max_fences.items())
        if m is not None and m > last
    ]
    consequences = []
    if behind:
        consequences.append(
            "New tokens would be refused on those rows (or equal a token already written)"
        )
    if report.max_register_token is not None and report.max_register_token > last:
        behind.append(
            f"max(token) of the lease register {report.register} is {report.max_register_token}"
        )
        consequences.append(
            ("and a" if consequences else "A")
            + " new grant would draw a token at or below one already granted: such a "
            "grant is refused (the register only moves forward)"
        )
    if behind:
        target = max(report.max_fence, report.max_register_token or 0)
        fix = (
            f"stop the workers, then: sa-fence repair-sequence --url ... (moves it to "
            f"{target} + margin)"
        )
        if target > BIGINT_MAX - DEFAULT_MARGIN:
            fix = _past_any_token(report, BIGINT_MAX - DEFAULT_MARGIN)
        report.findings.append(
            Finding(
                f"sequence {sequence}",
                f"is behind the rows: its last value is {last} but "
                + ", ".join(behind)
                + ". "
                + ", ".join(consequences)
                + ". This happens after a restore from backup or a promoted logical "
                "replica.",
                fix,
            )
        )
    else:
        report.ok.append(
            f"sequence {sequence}: last value {last} is at or past "
            f"max(fence) {report.max_fence} of every fenced table"
            + (
                f" and max(token) {report.max_register_token} of the lease register"
                if report.max_register_token is not None
                else ""
            )
        )


def _past_any_token(report: Report, limit: int) -> str:
    """What to do about fences (or register tokens) past ``limit``, too close to the end of a
    bigint sequence for repair-sequence to move it past them."""
    last = report.last_value or 0
    found = [
        f"{report.rows_past[name].format(last=last)};"
        for name, fence in sorted(report.max_fences.items())
        if fence is not None and fence > limit and name in report.rows_past
    ]
    if (report.max_register_token or 0) > limit:
        found.append(f"SELECT * FROM {Register(report.sequence).table_sql} WHERE token > {last};")
    return (
        "these fences are past any token the sequence can issue once moved past them (a "
        f"bigint sequence ends at {BIGINT_MAX}): no lease was granted them (they were set by "
        "hand, or loaded with the guard disabled), and no later lease holder could write "
        "those rows. Find them"
        + (": " + " ".join(found) if found else "")
        + " and set each fence back to a token the sequence has issued (with the guard "
        f"disabled: ALTER TABLE ... DISABLE TRIGGER {TRIGGER_NAME}; then ENABLE it again), "
        "then run sa-fence repair-sequence"
    )


def print_report(report: Report, shown_url: str, out: TextIO, *, strict: bool = False) -> int:
    """Print ``report``; ``shown_url`` is the URL with its password hidden (hidden_password).

    ``strict``: advice counts as problems (exit status 1).  Warnings never do: they are about
    the role this check connected as, which may be the migrations' rather than the workers'.
    """
    print(f"sa-fence check: {shown_url}", file=out)
    for line in report.ok:
        print(f"  ok       {line}", file=out)
    for line in report.notes:
        print(f"  note     {line}", file=out)
    findings = report.findings + (report.advice if strict else [])
    for finding in findings:
        print(f"  PROBLEM  {finding.subject} {finding.problem}", file=out)
        print(f"           fix: {finding.fix}", file=out)
    advice = [] if strict else report.advice
    for finding in advice:
        print(f"  advice   {finding.subject} {finding.problem}", file=out)
        print(f"           fix: {finding.fix}", file=out)
    for finding in report.warnings:
        print(f"  warning  {finding.subject} {finding.problem}", file=out)
        print(f"           fix: {finding.fix}", file=out)
    tail = (
        f" {len(advice)} piece(s) of advice (--strict counts them as problems)." if advice else ""
    )
    if report.warnings:
        tail += (
            f" {len(report.warnings)} warning(s) about the role this check connected as "
            "(not counted as problems)."
        )
    if findings:
        print(f"{len(findings)} problem(s) found.{tail}", file=out)
        return EXIT_FINDINGS
    print(f"No problems found.{tail}", file=out)
    return EXIT_OK


@dataclass
class RepairPlan:
    sequence: str
    last_value: int
    max_fence: int
    #: max(token) of the sequence's lease register (0: none, or no register)
    max_register_token: int
    target: int
    #: after a failover or restore: past the last value too, and fence out the register
    after_failover: bool = False
    #: names in the register (each gets a new token when after_failover)
    register_names: int = 0

    @property
    def needed(self) -> bool:
        return self.target > self.last_value or (self.after_failover and self.register_names > 0)


def plan_repair(
    conn: sa.Connection,
    *,
    sequence: str = DEFAULT_SEQUENCE,
    metadata: sa.MetaData | None = None,
    column: str = "fence",
    margin: int,
    after_failover: bool = False,
) -> RepairPlan:
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be a whole number >= 0, got {margin!r}")
    report = check(conn, sequence=sequence, metadata=metadata, column=column)
    if report.sequence_found and report.last_value is None:
        raise LookupError(
            f"this role may not read sequence {sequence}: run repair-sequence as its owner"
        )
    if report.last_value is None:
        raise LookupError(
            f"sequence {sequence} does not exist; create it first "
            "(op.create_fence_sequence() in a migration)"
        )
    # never move a sequence that cannot be a token sequence (a table's serial, say)
    _, unfit = sequence_problem(conn, Register(sequence), pinned_register(conn, sequence))
    if unfit is not None:
        raise LookupError(
            f"{unfit.subject}: {unfit.problem}. It is not a token sequence sa-fence could "
            f"issue tokens from, so repair-sequence leaves it alone (fix: {unfit.fix}; or name "
            "the token sequence with --sequence). Nothing was changed."
        )
    if report.unreadable:
        role = conn.execute(sa.text("SELECT current_user")).scalar_one()
        raise LookupError(
            f"role {role} may not read table(s) {', '.join(report.unreadable)} (no SELECT): "
            "their fences are unknown, so how far to move the sequence is unknown. Run "
            "repair-sequence as a role that may read every fenced table and move the "
            "sequence (its owner, or the role your migrations run as). Nothing was changed."
        )
    # After a failover or a restore the register can be ahead of the rows.
    max_register_token = report.max_register_token or 0
    base = max(report.max_fence, max_register_token)
    names = 0
    if after_failover:
        # A promoted asynchronous replica (or a restore) has lost the newest
        # grants: the lost primary handed out tokens past this sequence's last
        # value that no surviving row or register entry carries.
        base = max(base, report.last_value)
        names = _register_names(conn, sequence)
    if base + margin > BIGINT_MAX:
        past = _past_any_token(report, BIGINT_MAX - margin)
        smaller = (
            f" (a --margin of at most {BIGINT_MAX - base} fits, but leaves the sequence that "
            "few tokens from its end)"
            if base < BIGINT_MAX
            else ""
        )
        raise LookupError(
            f"cannot move sequence {sequence} to {base} + margin {margin}: that is past "
            f"{BIGINT_MAX}, the largest value a bigint sequence holds{smaller}. The largest "
            f"fence is {report.max_fence}, the largest registered token {max_register_token}"
            + (f", the sequence's last value {report.last_value}" if after_failover else "")
            + f"; {past}. Nothing was changed."
        )
    _refuse_without_rights(conn, sequence, after_failover and names > 0)
    return RepairPlan(
        sequence,
        report.last_value,
        report.max_fence,
        max_register_token,
        base + margin,
        after_failover=after_failover,
        register_names=names,
    )


def _refuse_without_rights(conn: sa.Connection, sequence: str, fence_out: bool) -> None:
    """Refuse, before asking, a repair this role could not carry out: setval needs UPDATE on
    the sequence; fencing out the register, UPDATE on it (and USAGE, for nextval)."""
    pinned = pinned_register(conn, sequence)
    rights = conn.execute(
        sa.text(
            "SELECT current_user AS role, has_sequence_privilege(to_regclass(:seq), 'UPDATE') "
            "AS can_set, has_sequence_privilege(to_regclass(:seq), 'USAGE') AS can_draw, "
            "coalesce(has_table_privilege(to_regclass(:register), 'UPDATE'), true) AS can_update"
        ),
        {"seq": pinned.sequence_sql, "register": pinned.table_sql},
    ).one()
    shown, role = Register(sequence), _ident(rights.role)
    grants = [] if rights.can_set else [f"GRANT UPDATE ON SEQUENCE {shown.sequence_sql} TO {role};"]
    if fence_out and not rights.can_draw:
        grants.append(f"GRANT USAGE ON SEQUENCE {shown.sequence_sql} TO {role};")
    if fence_out and not rights.can_update:
        grants.append(f"GRANT UPDATE ON {shown.table_sql} TO {role};")
    if grants:
        raise LookupError(
            f"role {rights.role} may not move sequence {sequence}"
            + (" or give the register's names new tokens" if fence_out else "")
            + ": run repair-sequence as the sequence's owner (the role your migrations run "
            "as), or: " + " ".join(grants) + " Nothing was changed."
        )


def _register_names(conn: sa.Connection, sequence: str) -> int:
    table = pinned_register(conn, sequence).table_sql
    if conn.execute(sa.text("SELECT to_regclass(:t)"), {"t": table}).scalar() is None:
        return 0
    return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def apply_repair(conn: sa.Connection, plan: RepairPlan) -> int:
    """``setval`` the sequence to ``plan.target`` (never backwards); returns its new value.

    With ``plan.after_failover`` every name of the register then gets a new
    token drawn past it (see :func:`fence_out_register`), in the same
    transaction.
    """
    quoted = pinned_register(conn, plan.sequence).sequence_sql
    value = conn.execute(
        sa.text(
            "SELECT setval(CAST(:seq AS regclass), greatest(:target, "
            f"(SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM {quoted})"
            "))"
        ),
        {"seq": quoted, "target": plan.target},
    ).scalar_one()
    if plan.after_failover:
        fence_out_register(conn, plan.sequence)
    return int(value)


def fence_out_register(conn: sa.Connection, sequence: str) -> int:
    """Give every name of the register a new token from ``sequence`` (the register's
    own repair); returns how many names.

    After a failover that lost grants, the register holds an older token for a
    name again: the holder of that token (whose lease a lost grant had ended)
    would pass the commit check once more.  A new token for every name fences
    out every lease granted before; ``previous`` is cleared so that no
    withdrawal can bring an old token back.  The next grant of a name simply
    replaces its token, as always.
    """
    register = pinned_register(conn, sequence)
    if conn.execute(sa.text("SELECT to_regclass(:t)"), {"t": register.table_sql}).scalar() is None:
        return 0
    result = conn.execute(
        sa.text(
            f"UPDATE {register.table_sql} SET token = nextval(CAST(:seq AS regclass)), "
            "previous = NULL, granted_at = clock_timestamp()"
        ),
        {"seq": register.sequence_sql},
    )
    return int(result.rowcount)


def run_check(
    url: str,
    sequence: str,
    metadata_spec: str | None,
    column: str,
    out: TextIO,
    err: TextIO,
    *,
    app_dir: str = ".",
    strict: bool = False,
) -> int:
    return with_connection(
        url,
        metadata_spec,
        err,
        lambda conn, md: print_report(
            check(conn, sequence=sequence, metadata=md, column=column),
            hidden_password(url),
            out,
            strict=strict,
        ),
        app_dir=app_dir,
        command="sa-fence check",
    )


def run_repair(
    url: str,
    sequence: str,
    metadata_spec: str | None,
    column: str,
    margin: int,
    yes: bool,
    confirm: Callable[[str], str],
    out: TextIO,
    err: TextIO,
    *,
    app_dir: str = ".",
    after_failover: bool = False,
) -> int:
    def go(conn: sa.Connection, md: sa.MetaData | None) -> int:
        try:
            plan = plan_repair(
                conn,
                sequence=sequence,
                metadata=md,
                column=column,
                margin=margin,
                after_failover=after_failover,
            )
        except LookupError as exc:
            print(f"sa-fence repair-sequence: {exc}", file=err)
            return EXIT_FINDINGS
        conn.rollback()
        _print_plan(plan, margin, out)
        if not plan.needed:
            print(
                f"Nothing to do: the sequence is already at or past {plan.target} "
                "(it is never moved backwards).",
                file=out,
            )
            return EXIT_OK
        fence_out = plan.after_failover and plan.register_names > 0
        if not yes:
            try:
                answer = confirm(
                    f"Move {sequence} from {plan.last_value} to {plan.target}"
                    + (
                        f" and fence out the {plan.register_names} lease name(s) of the register"
                        if fence_out
                        else ""
                    )
                    + "? Stop the workers first. [y/N] "
                )
            except EOFError:  # no answer (stdin closed: a script, CI): no
                print(
                    "\nAborted: no answer (end of input); nothing changed. Run with --yes to "
                    "move the sequence without asking.",
                    file=out,
                )
                return EXIT_FINDINGS
            if answer.strip().lower() not in ("y", "yes"):
                print("Aborted: nothing changed.", file=out)
                return EXIT_FINDINGS
        with conn.begin():
            value = apply_repair(conn, plan)
            now = _last_value_now(conn, sequence)
        _print_moved(sequence, value, now if fence_out else None, out)
        return EXIT_OK

    return with_connection(
        url, metadata_spec, err, go, app_dir=app_dir, command="sa-fence repair-sequence"
    )


def _print_plan(plan: RepairPlan, margin: int, out: TextIO) -> None:
    """What repair-sequence read, before it asks."""
    print(
        f"sequence {plan.sequence}: last value {plan.last_value}; largest fence "
        f"{plan.max_fence}; largest registered token {plan.max_register_token} "
        f"({Register(plan.sequence).table_display}); margin {margin}",
        file=out,
    )
    if plan.after_failover:
        print(
            f"after a failover: past the last value too (tokens the lost primary handed "
            f"out are on no surviving row); {plan.register_names} lease name(s) in the "
            "register to fence out",
            file=out,
        )


def _print_moved(sequence: str, value: int, fenced_out_to: int | None, out: TextIO) -> None:
    """What repair-sequence did; ``fenced_out_to``: the last token given to a register name."""
    if fenced_out_to is not None:
        print(
            f"Moved {sequence} to {value}; every lease name of the register now holds a "
            f"new token ({value + 1} to {fenced_out_to}), so no lease granted before can "
            f"commit; the next token is {fenced_out_to + 1}.",
            file=out,
        )
    else:
        print(f"Moved {sequence} to {value}; the next token is {value + 1}.", file=out)


def _last_value_now(conn: sa.Connection, sequence: str) -> int:
    quoted = pinned_register(conn, sequence).sequence_sql
    return int(conn.execute(sa.text(f"SELECT last_value FROM {quoted}")).scalar_one())


def hidden_password(url: str) -> str:
    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


def with_connection(
    url: str,
    metadata_spec: str | None,
    err: TextIO,
    body: Callable[[sa.Connection, sa.MetaData | None], int],
    *,
    app_dir: str = ".",
    command: str = "sa-fence",
) -> int:
    """Connect to ``url`` and run ``body``; returns its exit status, or the tools' own for a
    bad URL or metadata (2), an unreachable database (3), or a statement the server refused
    (1: one line naming the statement and the server's message, no traceback)."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        print(
            f"{command}: --url {url!r} is not a SQLAlchemy URL; expected e.g. "
            "postgresql+psycopg://user@host:5432/dbname",
            file=err,
        )
        return EXIT_USAGE
    if parsed.get_backend_name() != "postgresql" or not parsed.database:
        print(
            f"{command}: --url must name a PostgreSQL database, e.g. "
            f"postgresql+psycopg://user@host:5432/dbname (got {hidden_password(url)})",
            file=err,
        )
        return EXIT_USAGE
    if parsed.drivername == "postgresql":  # (SQLAlchemy's default driver: psycopg2)
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif parsed.drivername != "postgresql+psycopg":
        print(
            f"{command}: the tools connect with psycopg 3: use postgresql+psycopg://... (got "
            f"driver {parsed.get_driver_name()!r} in {hidden_password(url)})",
            file=err,
        )
        return EXIT_USAGE
    metadata = None
    if metadata_spec:
        try:
            metadata = load_metadata(metadata_spec, app_dir)
        except ValueError as exc:
            print(f"{command}: {exc}", file=err)
            return EXIT_USAGE
    # never prepared statements: the tools must work behind a transaction pooler too
    connect_args = {"prepare_threshold": None} if parsed.get_driver_name() == "psycopg" else {}
    engine = sa.create_engine(parsed, poolclass=sa.pool.NullPool, connect_args=connect_args)
    try:
        try:
            conn = engine.connect()
        except sa.exc.OperationalError as exc:
            print(
                f"{command}: cannot connect to {hidden_password(url)}: {_first_line(exc)}",
                file=err,
            )
            return EXIT_UNREACHABLE
        with conn:
            try:
                return body(conn, metadata)
            except sa.exc.DBAPIError as exc:
                print(f"{command}: {refused(exc)}", file=err)
                return EXIT_UNREACHABLE if exc.connection_invalidated else EXIT_FINDINGS
    finally:
        engine.dispose()


#: SQLSTATE insufficient_privilege ("permission denied for ...")
_NO_PRIVILEGE = "42501"


def refused(exc: sa.exc.DBAPIError, doing: str | None = None, fix: str | None = None) -> str:
    """One line for a statement the server refused: what was being done (``doing``, else the
    statement's start), the server's message, and the fix (``fix``; for a missing right, run
    as a role that has it)."""
    if doing is None:
        first = (exc.statement or "").strip().splitlines() or ["a statement"]
        doing = "running " + (first[0] if len(first[0]) <= 80 else first[0][:77] + "...")
    line = f"{doing} failed: {_first_line(exc)}"
    if fix is None and getattr(exc.orig, "sqlstate", None) == _NO_PRIVILEGE:
        fix = (
            "run the command as a role with the rights it needs (the owner of the objects, "
            "or the role your migrations run as), or GRANT them to this one"
        )
    return line + (f". Fix: {fix}" if fix else "")


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0]
