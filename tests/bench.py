"""What fencing costs: a fenced ORM update + commit next to a plain one.

Run with ``make bench`` (or ``python -m tests.bench [--pg URL] [--redis URL]
[--rounds N] [--strict]``).  Not a test: pytest does not collect it, and the
suite asserts nothing about time.

It creates its own database (dropped at the end, also on error) holding three
tables of the same shape (``id``, ``payload``, ``counter`` and a bigint
column), and times one operation on each, "load the rows, change a column,
commit", for 1 row and for 1000 rows:

* ``plain``: a plain ``sessionmaker``, no sa-fence;
* ``fenced``: ``sa_fence.install(sessionmaker(...))`` with a lease bound to
  every session (the table uses the ``Fenced`` mixin);
* ``version_id_col``: SQLAlchemy's own optimistic check, for comparison.

The three run interleaved op by op (plain, fenced, version_id_col, plain,
...), round after round, each round in a rotated order, so that drift
(caches, autovacuum, checkpoints, table bloat, other load) hits them alike.
It prints median per-op times and fenced/plain ratios next to the target
(fenced within 1.05x of plain), then counts the statements one flush of 1000
rows sends (on the benchmark's own engine).  PASS/MISS is printed per
target; the exit status is 0 unless ``--strict`` is given and a target is
missed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import redis
import sqlalchemy as sa
from sqlalchemy import BigInteger, Integer, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import sa_fence

DEFAULT_PG = os.environ.get("SA_FENCE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
DEFAULT_REDIS = os.environ.get("SA_FENCE_TEST_REDIS", "redis://127.0.0.1:6379/0")
TARGET = 1.05  # fenced / plain, per-op median
N_ROWS = 1000
SIZES = (1, N_ROWS)
# Operations per variant per round: many cheap 1-row ops, a few 1000-row ones.
OPS_PER_ROUND = {1: 40, N_ROWS: 5}
VARIANTS = ("plain", "fenced", "version_id_col")


class Base(DeclarativeBase):
    pass


sa_fence.fence_sequence(Base.metadata)


class PlainItem(Base):
    __tablename__ = "plain_items"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    payload: Mapped[str] = mapped_column(String(200))
    counter: Mapped[int] = mapped_column(Integer)
    # the same bigint the other two tables carry, here without any meaning
    fence: Mapped[int] = mapped_column(BigInteger, server_default=sa.text("0"))


class FencedItem(sa_fence.Fenced, Base):
    __tablename__ = "fenced_items"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    payload: Mapped[str] = mapped_column(String(200))
    counter: Mapped[int] = mapped_column(Integer)


class VersionedItem(Base):
    __tablename__ = "versioned_items"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    payload: Mapped[str] = mapped_column(String(200))
    counter: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(BigInteger, nullable=False)

    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012 (SQLAlchemy's own API)


Item = PlainItem | FencedItem | VersionedItem
MODELS: dict[str, type[Item]] = {
    "plain": PlainItem,
    "fenced": FencedItem,
    "version_id_col": VersionedItem,
}


# ------------------------------------------------------------------ database


def admin_dsn(server: sa.URL) -> str:
    url = server.set(database="postgres", drivername="postgresql")
    return url.render_as_string(hide_password=False)


@contextmanager
def temporary_database(server: sa.URL) -> Iterator[sa.URL]:
    """A database of our own, dropped afterwards (also when the benchmark fails)."""
    name = f"sa_fence_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn(server), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server.set(database=name)
    finally:
        with psycopg.connect(admin_dsn(server), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def create_rows(engine: sa.Engine, fencer: sa_fence.Fencer) -> None:
    Base.metadata.create_all(engine)
    rows = [{"id": i, "payload": f"row {i}", "counter": 0} for i in range(1, N_ROWS + 1)]
    with engine.begin() as conn:
        conn.execute(sa.insert(PlainItem), rows)
        conn.execute(sa.insert(VersionedItem), [{**r, "version": 1} for r in rows])
    seeding = sa_fence.install(sessionmaker(engine))
    with fencer.lease("bench:seed", 60) as lease, seeding() as session:
        lease.bind(session)
        session.add_all(FencedItem(**r) for r in rows)
        session.commit()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE"))


# ---------------------------------------------------------------- operations


@dataclass
class Bench:
    engine: sa.Engine
    lease: sa_fence.Lease
    plain: sessionmaker[Session]
    fenced: sessionmaker[Session]
    serial: int = 0  # makes every write change its rows
    times: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    round_medians: dict[tuple[int, str], list[float]] = field(default_factory=dict)

    def session(self, variant: str) -> Session:
        if variant == "fenced":
            return self.lease.bind(self.fenced())
        return self.plain()

    def update(
        self, variant: str, n: int, before_commit: Callable[[Session], None] | None = None
    ) -> None:
        """One op: load ``n`` rows, change a column on each, commit."""
        model = MODELS[variant]
        self.serial += 1
        items: list[Item]
        with self.session(variant) as session:
            if n == 1:
                one = 1 + self.serial % N_ROWS  # a different row each time
                items = list(session.scalars(select(model).where(model.id == one)))
            else:
                items = list(session.scalars(select(model).where(model.id <= n)))
            for item in items:
                item.payload = f"value {self.serial}"
            if before_commit is not None:
                before_commit(session)
            session.commit()

    def timed_round(self, n: int, order: list[str]) -> None:
        """Time ``OPS_PER_ROUND[n]`` ops per variant, alternating op by op."""
        gc.collect()
        per_op: dict[str, list[float]] = {variant: [] for variant in order}
        for _ in range(OPS_PER_ROUND[n]):
            for variant in order:
                start = time.perf_counter()
                self.update(variant, n)
                per_op[variant].append(time.perf_counter() - start)
        for variant, times in per_op.items():
            self.times.setdefault((n, variant), []).extend(times)
            self.round_medians.setdefault((n, variant), []).append(statistics.median(times))


@dataclass
class FlushCount:
    statements: int = 0
    updates: int = 0  # cursor executions of an UPDATE (an executemany counts once)
    update_param_sets: int = 0
    sql: str = ""


def count_flush(bench: Bench, variant: str, n: int) -> FlushCount:
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


# -------------------------------------------------------------------- report


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms" if seconds < 0.1 else f"{seconds * 1e3:8.1f} ms"


def report(bench: Bench, counts: dict[str, FlushCount], rounds: int) -> bool:
    """Print the tables; True when every target is met."""
    all_met = True
    print()
    print(
        f"{'load + change + commit':<24}{'plain':>12}{'fenced':>12}{'version_id_col':>16}"
        f"{'fenced/plain':>14}   {'per-round range':<17}{'target':<9}result"
    )
    for n in SIZES:
        med = {v: statistics.median(bench.times[(n, v)]) for v in VARIANTS}
        ratio = med["fenced"] / med["plain"]
        per_round = [
            f / p
            for f, p in zip(
                bench.round_medians[(n, "fenced")], bench.round_medians[(n, "plain")], strict=True
            )
        ]
        met = ratio <= TARGET
        all_met &= met
        label = "1 row" if n == 1 else f"{n} rows"
        spread = f"{min(per_round):.3f}-{max(per_round):.3f}x"
        print(
            f"{label:<24}{fmt_time(med['plain']):>12}{fmt_time(med['fenced']):>12}"
            f"{fmt_time(med['version_id_col']):>16}{ratio:>13.3f}x   {spread:<17}"
            f"<={TARGET:.2f}x  {'PASS' if met else 'MISS'}"
        )
    for n in SIZES:
        ratio = statistics.median(bench.times[(n, "version_id_col")]) / statistics.median(
            bench.times[(n, "plain")]
        )
        label = "1 row" if n == 1 else f"{n} rows"
        print(f"  version_id_col/plain, {label}: {ratio:.3f}x (no target; for comparison)")
    print(
        f"\n  medians of {rounds} interleaved rounds x {OPS_PER_ROUND[1]} ops (1 row) / "
        f"x {OPS_PER_ROUND[N_ROWS]} ops ({N_ROWS} rows) per variant; "
        "per-round range = min-max of the per-round fenced/plain median ratios"
    )

    print(f"\nstatements sent by one flush of {N_ROWS} changed rows")
    print(f"{'':<36}{'plain':>8}{'fenced':>8}{'version_id_col':>16}")
    for label, attr in (
        ("all statements", "statements"),
        ("UPDATE cursor executions", "updates"),
        ("UPDATE parameter sets", "update_param_sets"),
    ):
        values = [getattr(counts[v], attr) for v in VARIANTS]
        print(f"{label:<36}{values[0]:>8}{values[1]:>8}{values[2]:>16}")
    same = counts["fenced"].updates == counts["plain"].updates
    print(
        f"  fenced sends {'the same number of' if same else 'MORE'} UPDATE executions as plain "
        f"({counts['fenced'].updates} vs {counts['plain'].updates}; one executemany each); "
        f"version_id_col sends {counts['version_id_col'].updates}, one per row."
    )
    print(f"  fenced UPDATE: {counts['fenced'].sql}")
    all_met &= same
    return all_met


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench",
        description="Time a fenced ORM update + commit next to a plain one (sa-fence).",
    )
    parser.add_argument(
        "--pg", default=DEFAULT_PG, help="SQLAlchemy URL of the PostgreSQL server (no database)"
    )
    parser.add_argument("--redis", default=DEFAULT_REDIS, help="Redis URL")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    server = sa.make_url(args.pg)
    client = redis.Redis.from_url(args.redis)
    started = time.perf_counter()
    with temporary_database(server) as url:
        engine = sa.create_engine(url)
        try:
            fencer = sa_fence.Fencer(
                client, engine, key_prefix=f"sa_fence_bench:{uuid.uuid4().hex}:"
            )
            create_rows(engine, fencer)
            with fencer.lease("bench", ttl=3600) as lease:
                bench = Bench(
                    engine,
                    lease,
                    plain=sessionmaker(engine),
                    fenced=sa_fence.install(sessionmaker(engine)),
                )
                with engine.connect() as conn:
                    version = conn.execute(sa.text("SHOW server_version")).scalar_one()
                print(
                    f"sa-fence bench: PostgreSQL {version} at {server.host}:{server.port}, "
                    f"SQLAlchemy {sa.__version__}, psycopg {psycopg.__version__}, "
                    f"Python {sys.version.split()[0]}; {args.rounds} rounds"
                )
                for n in SIZES:  # warm-up (pool, caches, compiled statements), not counted
                    bench.timed_round(n, list(VARIANTS))
                bench.times.clear()
                bench.round_medians.clear()
                counts = {v: count_flush(bench, v, N_ROWS) for v in VARIANTS}
                for r in range(args.rounds):
                    order = list(VARIANTS[r % 3 :] + VARIANTS[: r % 3])  # rotate the order
                    for n in SIZES:
                        bench.timed_round(n, order)
                met = report(bench, counts, args.rounds)
        finally:
            engine.dispose()
            client.close()
    print(
        f"\n{'all targets met' if met else 'target missed'} ({time.perf_counter() - started:.0f} s)"
    )
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
