"""Guard: what the database-side guard trigger costs the statements it checks.

Two tables of the same shape (``id``, ``payload``, ``fence``), one with the
guard (``sa_fence.db.guard.create_guard_sql``, policy ``"reject"``, the
benchmark's own sequence) and one without, written through one autocommit
psycopg connection, interleaved op by op, the order rotated every round:

* insert ``n`` rows in one ``INSERT ... SELECT`` (their fence a token the
  sequence has handed out: the guard reads the sequence for every row);
* update ``n`` rows presenting a token inside the statement, as the fenced
  flush does (``fence <= set_config('sa_fence.token', ...)``);
* delete ``n`` rows the same way (the rows are put back untimed before each);
* one row inserted, and one row updated, each in its own autocommit
  statement: what a single write pays.

Printed: the median per op, guarded over plain (with the range of the
per-round ratios), and the server time the guard adds per row.  No target:
the guard is the price of fencing writers outside sa-fence, paid only on the
tables that have one (docs/migrations.md quotes these figures).
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

import psycopg
import sqlalchemy as sa

from sa_fence.cli.bench import (
    Op,
    Progress,
    Timing,
    fmt_time,
    interleave,
    psycopg_conninfo,
    ratio_range,
)
from sa_fence.db import guard as _guard

from .common import Config, Target

SEQUENCE = "bench_guard_seq"
TABLES = {"guarded": "bench_guard_on", "plain": "bench_guard_off"}
TOKEN = 5  # handed out by SEQUENCE before the timing starts


@dataclass
class GuardResult:
    rows: int
    #: op label -> contender -> timing
    timings: dict[str, dict[str, Timing]]


def _schema(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    conn.execute(f"CREATE SEQUENCE {SEQUENCE} AS bigint CACHE 1 NO CYCLE")
    conn.execute(f"SELECT setval('{SEQUENCE}', {TOKEN})")
    for table in TABLES.values():
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, payload text, fence bigint)")
    for statement in _guard.create_guard_sql(TABLES["guarded"], sequence=SEQUENCE):
        conn.execute(statement)  # type: ignore[arg-type]


def run(url: sa.URL, config: Config, progress: Progress) -> GuardResult:
    rows = config.rows
    present = f"CAST(set_config('sa_fence.token', '{TOKEN}', true) AS bigint)"
    ids = itertools.count(10 * rows)
    with psycopg.connect(psycopg_conninfo(url), autocommit=True) as conn:
        _schema(conn)

        def execute(sql: str) -> None:
            conn.execute(sql)  # type: ignore[arg-type]

        def refill(table: str) -> None:
            execute(f"TRUNCATE {table}")
            execute(f"INSERT INTO {table} SELECT g, 'x', {TOKEN} FROM generate_series(1, {rows}) g")

        groups = {
            f"insert {rows} rows": {
                name: Op(
                    run=lambda t=table: execute(
                        f"INSERT INTO {t} SELECT g, 'x', {TOKEN} FROM generate_series(1, {rows}) g"
                    ),
                    prepare=lambda t=table: execute(f"TRUNCATE {t}"),
                )
                for name, table in TABLES.items()
            },
            f"update {rows} rows": {
                name: Op(
                    run=lambda t=table: execute(
                        f"UPDATE {t} SET payload = md5(random()::text) "
                        f"WHERE coalesce(fence, 0) <= {present}"
                    ),
                )
                for name, table in TABLES.items()
            },
            f"delete {rows} rows": {
                name: Op(
                    run=lambda t=table: execute(
                        f"DELETE FROM {t} WHERE coalesce(fence, 0) <= {present}"
                    ),
                    prepare=lambda t=table: refill(t),
                )
                for name, table in TABLES.items()
            },
            "insert 1 row": {
                name: Op(
                    run=lambda t=table: execute(
                        f"INSERT INTO {t} VALUES ({next(ids)}, 'x', {TOKEN})"
                    )
                )
                for name, table in TABLES.items()
            },
            "update 1 row": {
                name: Op(
                    run=lambda t=table: execute(
                        f"UPDATE {t} SET payload = md5(random()::text) "
                        f"WHERE id = 1 AND coalesce(fence, 0) <= {present}"
                    ),
                )
                for name, table in TABLES.items()
            },
        }
        timings: dict[str, dict[str, Timing]] = {}
        for label, group in groups.items():
            for table in TABLES.values():
                refill(table)
            per_round = 2 if config.quick else (5 if "rows" in label and rows > 1 else 50)
            timings[label] = interleave(
                group,
                rounds=config.rounds,
                per_round=per_round,
                progress=progress,
                label=f"guard: {label}",
            )
    return GuardResult(rows, timings)


def report(result: GuardResult) -> list[Target]:
    print(
        "\nguard trigger (BEFORE INSERT OR UPDATE OR DELETE, policy reject) vs no trigger: "
        "median per op"
    )
    print(f"  {'op':<20}{'guarded':>12}{'plain':>12}{'ratio':>10}{'range':>16}{'per row':>13}")
    for label, timing in result.timings.items():
        guarded, plain = timing["guarded"], timing["plain"]
        low, high = ratio_range(guarded, plain)
        n = result.rows if "rows" in label else 1
        per_row = (statistics.median(guarded.samples) - statistics.median(plain.samples)) / n
        print(
            f"  {label:<20}{fmt_time(guarded.median):>12}{fmt_time(plain.median):>12}"
            f"{guarded.median / plain.median:>9.3f}x{f'{low:.2f}-{high:.2f}x':>16}"
            f"{per_row * 1e6:>+10.2f} us"
        )
    return []
