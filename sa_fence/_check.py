"""``sa-fence check`` and ``sa-fence repair-sequence``: a live database's fencing set-up.

``check`` looks for what would let a stale write through, or refuse every
writer, and says how to fix each finding:

* the token sequence is missing, not ``bigint``, ``CACHE > 1``, ``CYCLE``,
  or has a non-positive increment;
* a fenced table lacks its fence column or its guard trigger;
* the sequence is behind ``max(fence)`` of a fenced table (after a restore
  from backup, or a promoted logical replica: logical replication does not
  carry sequence values).  Its next tokens would then be refused by every
  row they are compared with, or, worse, equal a token already written.

Fenced tables are the ones in ``--metadata`` (models marked ``Fenced`` or
with ``fence_column()``); without it, every table that has a column named
``--column`` (default ``fence``) or a guard trigger.

``repair-sequence`` moves the sequence past the largest fence plus a margin
(it never moves it backwards).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import sqlalchemy as sa

from ._guard import TRIGGER_NAME, qualified
from ._model import fence_column_of
from ._tokens import DEFAULT_SEQUENCE, SEQUENCE_SQL, sequence_problems

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


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
    ok: list[str] = field(default_factory=list)
    #: the sequence's last handed-out value (None: missing; 0: none handed out yet)
    last_value: int | None = None
    #: table display name -> max(fence) (None for an empty table)
    max_fences: dict[str, int | None] = field(default_factory=dict)

    @property
    def max_fence(self) -> int:
        return max([m for m in self.max_fences.values() if m is not None], default=0)


def load_metadata(spec: str) -> sa.MetaData:
    """``module:attribute.path`` -> a MetaData (or a declarative base's metadata)."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"--metadata must look like 'package.module:Base.metadata', got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--metadata: cannot import {module_name!r}: {exc}") from None
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


def _split_sequence(sequence: str) -> tuple[str | None, str]:
    schema, _, name = sequence.rpartition(".")
    return (schema or None), name


_DISCOVER_SQL = sa.text(
    """
    SELECT n.nspname AS schema, c.relname AS name
      FROM pg_catalog.pg_class c
      JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
     WHERE c.relkind IN ('r', 'p')
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


_TABLE_SQL = sa.text(
    """
    SELECT to_regclass(:table) IS NOT NULL AS present,
           EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid = to_regclass(:table) AND a.attname = :column
                      AND a.attnum > 0 AND NOT a.attisdropped) AS has_column,
           EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t
                    WHERE t.tgrelid = to_regclass(:table) AND t.tgname = :trigger
                      AND NOT t.tgisinternal AND t.tgenabled <> 'D') AS has_guard
    """
)


def _last_value(conn: sa.Connection, quoted: str) -> int:
    """The last value the sequence handed out (start - increment when none yet)."""
    row = conn.execute(sa.text(f"SELECT last_value, is_called FROM {quoted}")).one()
    return int(row.last_value) if row.is_called else int(row.last_value) - 1


def check(
    conn: sa.Connection,
    *,
    sequence: str = DEFAULT_SEQUENCE,
    metadata: sa.MetaData | None = None,
    column: str = "fence",
) -> Report:
    """Inspect the database behind ``conn`` (read-only); return what is wrong."""
    report = Report(sequence)
    seq_schema, seq_name = _split_sequence(sequence)
    seq_quoted = qualified(seq_name, seq_schema)
    row = conn.execute(SEQUENCE_SQL, {"name": seq_quoted}).one_or_none()
    if row is None:
        report.findings.append(
            Finding(
                f"sequence {sequence}",
                "does not exist, so no lease can get a token",
                "in a migration: op.create_fence_sequence("
                + ("" if sequence == DEFAULT_SEQUENCE else repr(sequence))
                + f"); or in SQL: CREATE SEQUENCE {seq_quoted} AS bigint CACHE 1 NO CYCLE;",
            )
        )
    else:
        problems = sequence_problems(row)
        if problems:
            report.findings.append(
                Finding(
                    f"sequence {sequence}",
                    "; ".join(problems),
                    f"ALTER SEQUENCE {seq_quoted} AS bigint CACHE 1 NO CYCLE INCREMENT BY 1; "
                    "(in a migration: op.alter_fence_sequence(...))",
                )
            )
        else:
            report.ok.append(f"sequence {sequence}: bigint, CACHE 1, NO CYCLE")
        report.last_value = _last_value(conn, seq_quoted)

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
        state = conn.execute(
            _TABLE_SQL,
            {"table": table.quoted, "column": table.column, "trigger": TRIGGER_NAME},
        ).one()
        if not state.present:
            report.findings.append(
                Finding(
                    f"table {table.display}",
                    "is fenced in the models but does not exist in the database",
                    "run your migrations (alembic upgrade head)",
                )
            )
            continue
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
        if not state.has_guard:
            missing.append("has no guard")
            report.findings.append(
                Finding(
                    f"table {table.display}",
                    f"has no enabled guard trigger {TRIGGER_NAME}: writers outside fenced "
                    "sessions (raw SQL, psql, other services) are not fenced",
                    f"op.create_fence_guard({table.name!r}"
                    + ("" if table.column == "fence" else f", {table.column!r}")
                    + ")",
                )
            )
        if state.has_column:
            max_fence = conn.execute(
                sa.text(f"SELECT max({qualified(table.column, None)}) FROM {table.quoted}")
            ).scalar_one()
            report.max_fences[table.display] = None if max_fence is None else int(max_fence)
        if not missing:
            report.ok.append(f"table {table.display}: column {table.column}, guard {TRIGGER_NAME}")

    if report.last_value is not None:
        behind = {
            name: m
            for name, m in report.max_fences.items()
            if m is not None and m > report.last_value
        }
        if behind:
            worst = max(behind, key=lambda n: behind[n] or 0)
            report.findings.append(
                Finding(
                    f"sequence {sequence}",
                    f"is behind the rows: its last value is {report.last_value} but "
                    + ", ".join(f"max(fence) of {n} is {m}" for n, m in sorted(behind.items()))
                    + ". New tokens would be refused on those rows (or equal a token "
                    "already written). This happens after a restore from backup or a "
                    "promoted logical replica.",
                    f"stop the workers, then: sa-fence repair-sequence --url ... (moves it to "
                    f"{behind[worst]} + margin)",
                )
            )
        else:
            report.ok.append(
                f"sequence {sequence}: last value {report.last_value} is at or past "
                f"max(fence) {report.max_fence} of every fenced table"
            )
    return report


def print_report(report: Report, url: str, out: TextIO) -> int:
    print(f"sa-fence check: {url}", file=out)
    for line in report.ok:
        print(f"  ok       {line}", file=out)
    for finding in report.findings:
        print(f"  PROBLEM  {finding.subject} {finding.problem}", file=out)
        print(f"           fix: {finding.fix}", file=out)
    if report.findings:
        print(f"{len(report.findings)} problem(s) found.", file=out)
        return EXIT_FINDINGS
    print("No problems found.", file=out)
    return EXIT_OK


@dataclass
class RepairPlan:
    sequence: str
    last_value: int
    max_fence: int
    target: int

    @property
    def needed(self) -> bool:
        return self.target > self.last_value


def plan_repair(
    conn: sa.Connection,
    *,
    sequence: str = DEFAULT_SEQUENCE,
    metadata: sa.MetaData | None = None,
    column: str = "fence",
    margin: int,
) -> RepairPlan:
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be a whole number >= 0, got {margin!r}")
    report = check(conn, sequence=sequence, metadata=metadata, column=column)
    if report.last_value is None:
        raise LookupError(
            f"sequence {sequence} does not exist; create it first "
            "(op.create_fence_sequence() in a migration)"
        )
    target = report.max_fence + margin
    return RepairPlan(sequence, report.last_value, report.max_fence, target)


def apply_repair(conn: sa.Connection, plan: RepairPlan) -> int:
    """``setval`` the sequence to ``plan.target`` (never backwards); returns its new value."""
    schema, name = _split_sequence(plan.sequence)
    quoted = qualified(name, schema)
    value = conn.execute(
        sa.text(
            "SELECT setval(CAST(:seq AS regclass), greatest(:target, "
            f"(SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM {quoted})"
            "))"
        ),
        {"seq": quoted, "target": plan.target},
    ).scalar_one()
    return int(value)


def run_check(
    url: str, sequence: str, metadata_spec: str | None, column: str, out: TextIO, err: TextIO
) -> int:
    return _with_connection(
        url,
        metadata_spec,
        err,
        lambda conn, md: print_report(
            check(conn, sequence=sequence, metadata=md, column=column), _shown(url), out
        ),
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
) -> int:
    def go(conn: sa.Connection, md: sa.MetaData | None) -> int:
        try:
            plan = plan_repair(conn, sequence=sequence, metadata=md, column=column, margin=margin)
        except LookupError as exc:
            print(f"sa-fence repair-sequence: {exc}", file=err)
            return EXIT_FINDINGS
        conn.rollback()
        print(
            f"sequence {sequence}: last value {plan.last_value}; largest fence "
            f"{plan.max_fence}; margin {margin}",
            file=out,
        )
        if not plan.needed:
            print(
                f"Nothing to do: the sequence is already at or past {plan.target} "
                "(it is never moved backwards).",
                file=out,
            )
            return EXIT_OK
        if not yes:
            answer = confirm(
                f"Move {sequence} from {plan.last_value} to {plan.target}? Stop the "
                "workers first. [y/N] "
            )
            if answer.strip().lower() not in ("y", "yes"):
                print("Aborted: nothing changed.", file=out)
                return EXIT_FINDINGS
        with conn.begin():
            value = apply_repair(conn, plan)
        print(f"Moved {sequence} to {value}; the next token is {value + 1}.", file=out)
        return EXIT_OK

    return _with_connection(url, metadata_spec, err, go)


def _shown(url: str) -> str:
    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


def _with_connection(
    url: str,
    metadata_spec: str | None,
    err: TextIO,
    body: Callable[[sa.Connection, sa.MetaData | None], int],
) -> int:
    command = "sa-fence"
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
            f"postgresql+psycopg://user@host:5432/dbname (got {_shown(url)})",
            file=err,
        )
        return EXIT_USAGE
    metadata = None
    if metadata_spec:
        try:
            metadata = load_metadata(metadata_spec)
        except ValueError as exc:
            print(f"{command}: {exc}", file=err)
            return EXIT_USAGE
    engine = sa.create_engine(parsed, poolclass=sa.pool.NullPool)
    try:
        try:
            conn = engine.connect()
        except sa.exc.OperationalError as exc:
            print(
                f"{command}: cannot connect to {_shown(url)}: {_first_line(exc)}",
                file=err,
            )
            return EXIT_UNREACHABLE
        with conn:
            return body(conn, metadata)
    finally:
        engine.dispose()


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0]
