"""Flush: a fenced ORM write next to a plain one and to ``version_id_col``.

Three tables of the same shape (``id``, ``payload``, ``counter`` and a bigint
column), one per contender (:func:`sa_fence._bench.make_schema`):

* ``plain``: a plain ``sessionmaker``, no sa-fence;
* ``fenced``: ``sa_fence.install(sessionmaker(...))`` with a lease bound to
  every session (the table uses the ``Fenced`` mixin);
* ``version_id_col``: SQLAlchemy's own optimistic check, for comparison.

Operations, each timed interleaved op by op (plain, fenced, version_id_col,
plain, ...), the order rotated every round:

* update: load ``n`` rows, change a column on each, commit (n = 1, 10, 100,
  1000; the targets are on 1 and 1000; the plot shows all four);
* delete: load ``n`` rows, delete each, commit (n = 1 and 1000; the rows are
  put back untimed before every op).

Then it counts the statements one flush of 1000 rows sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from sa_fence._bench import FlushBench, Progress, Timing, fmt_time, interleave, ratio_range

from .common import Config, Target

VARIANTS = ("plain", "fenced", "version_id_col")
TARGET = 1.05  # fenced / plain, per-op median
WHY_ONE_ROW = (
    "a constant per transaction, no extra statement (see the counts): SQLAlchemy's event "
    "dispatch once any listener exists on a connection or its engine (~70 us profiled: "
    "_JoinedListener objects per connection for begin/commit/execute) plus sa-fence's "
    "before/after_execute and session events; it is how the token reaches the ORM's own "
    "batched UPDATE. See docs/benchmarks.md"
)
WHY_MANY_ROWS = (
    "the per-transaction constant of the 1-row case, plus noise: the per-round range "
    "shows how far single rounds move on this machine"
)


@dataclass
class FlushResult:
    update: dict[int, dict[str, Timing]] = field(default_factory=dict)
    delete: dict[int, dict[str, Timing]] = field(default_factory=dict)
    counts: dict[str, FlushCount] = field(default_factory=dict)


@dataclass
class FlushCount:
    statements: int = 0
    updates: int = 0  # cursor executions of an UPDATE (an executemany counts once)
    update_param_sets: int = 0
    sql: str = ""


def count_flush(bench: FlushBench, variant: str, n: int) -> FlushCount:
    """The statements the flush of one op sends (counted on the bench's own engine)."""
    counted = FlushCount()
    active = False

    def before_cursor_execute(
        conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        if not active:
            return
        counted.statements += 1
        if statement.lstrip().upper().startswith("UPDATE"):
            counted.updates += 1
            counted.update_param_sets += len(parameters) if executemany else 1
            counted.sql = " ".join(statement.split())

    def flush_counted(session: Session) -> None:
        nonlocal active
        active = True
        try:
            session.flush()
        finally:
            active = False

    sa.event.listen(bench.engine, "before_cursor_execute", before_cursor_execute)
    try:
        bench.update(variant, n, before_commit=flush_counted)
    finally:
        sa.event.remove(bench.engine, "before_cursor_execute", before_cursor_execute)
    return counted


def per_round(n: int, config: Config) -> int:
    if config.quick:
        return 2
    return {1: 40, 10: 20, 100: 10}.get(n, 5)


def run(bench: FlushBench, config: Config, progress: Progress) -> FlushResult:
    result = FlushResult()
    rows = bench.rows
    sizes = sorted({1, 10, 100, rows} if rows >= 100 else {1, rows})
    result.counts = {v: count_flush(bench, v, rows) for v in VARIANTS}
    for n in sizes:
        result.update[n] = interleave(
            bench.ops("update", n, VARIANTS),
            rounds=config.rounds,
            per_round=per_round(n, config),
            progress=progress,
            label=f"flush: update {n} row{'s' if n > 1 else ''}",
        )
    for n in sorted({1, rows}):
        result.delete[n] = interleave(
            bench.ops("delete", n, VARIANTS),
            rounds=config.rounds,
            per_round=per_round(n, config),
            progress=progress,
            label=f"flush: delete {n} row{'s' if n > 1 else ''}",
        )
    return result


def report(result: FlushResult, rows: int) -> list[Target]:
    """Print the tables; return the targets with their outcome."""
    targets: list[Target] = []
    print(
        f"\n{'flush (load + change/delete + commit)':<40}{'plain':>11}{'fenced':>11}"
        f"{'version_id_col':>16}{'fenced/plain':>14}{'per-round range':>18}{'vid/plain':>11}"
    )
    for kind, table in (("update", result.update), ("delete", result.delete)):
        for n, timings in table.items():
            med = {v: timings[v].median for v in VARIANTS}
            ratio = med["fenced"] / med["plain"]
            low, high = ratio_range(timings["fenced"], timings["plain"])
            label = f"{kind} {n} row{'s' if n > 1 else ''}"
            print(
                f"{label:<40}{fmt_time(med['plain']):>11}{fmt_time(med['fenced']):>11}"
                f"{fmt_time(med['version_id_col']):>16}{ratio:>13.3f}x"
                f"{f'{low:.2f}-{high:.2f}x':>18}{med['version_id_col'] / med['plain']:>10.2f}x"
            )
            if kind == "update" and n in (1, rows):
                targets.append(
                    Target(
                        f"fenced update+commit, {label.split(' ', 1)[1]}",
                        ratio,
                        TARGET,
                        "x plain",
                        WHY_ONE_ROW if n == 1 else WHY_MANY_ROWS,
                    )
                )
    counts = result.counts
    print(f"\nstatements sent by one flush of {rows} changed rows")
    print(f"{'':<36}{'plain':>8}{'fenced':>8}{'version_id_col':>16}")
    for label, attr in (
        ("all statements", "statements"),
        ("UPDATE cursor executions", "updates"),
        ("UPDATE parameter sets", "update_param_sets"),
    ):
        values = [getattr(counts[v], attr) for v in VARIANTS]
        print(f"{label:<36}{values[0]:>8}{values[1]:>8}{values[2]:>16}")
    print(f"  fenced UPDATE: {counts['fenced'].sql}")
    return targets


def curve(result: FlushResult) -> dict[str, list[tuple[int, float]]]:
    """Median update+commit time per row count, per contender (for the plot)."""
    return {
        v: [(n, timings[v].median) for n, timings in sorted(result.update.items())]
        for v in VARIANTS
    }
