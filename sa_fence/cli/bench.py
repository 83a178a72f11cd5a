"""What sa-fence costs on your servers: ``sa-fence bench``.

Two measurements, each against its own baseline, timed interleaved (A B A B
..., the order rotated every round) so that drift (caches, autovacuum,
checkpoints, other load) hits both alike, and reported as medians:

* **lease cycle**: ``Fencer.acquire()`` + ``Lease.release()`` next to the same
  protocol written by hand with raw redis-py and psycopg calls (``SET NX PX``;
  the one statement that draws the token and advances the lease register,
  on an autocommit connection; an owner-checked CONFIRM and an owner-checked
  RELEASE): the floor any durable, lease-scoped fencing lease pays.
* **fenced flush**: "load the rows, change a column, commit" (and "load, delete,
  commit") through a fenced session with a lease bound, next to a plain
  session on an identical table (and, optionally, SQLAlchemy's
  ``version_id_col``).  Lease scope is on: every fenced commit carries the
  register check (:meth:`FlushBench.verify_lease_scope` proves it before
  anything is timed).

Everything it creates lives in one schema of its own,
``sa_fence_bench_<random>`` (three tables, the token sequence, the lease
register and its check function), plus keys in Redis under the same prefix;
all of it is removed at the end, also on error.  The schema keeps the
benchmark's register apart from one the database may already have (a
register belongs to the schema of its sequence).  No package beyond
sa-fence's own dependencies is needed; the project's own ``make bench``
(tests/benchmarks) reuses these functions and adds the peers.
"""

from __future__ import annotations

import gc
import logging
import secrets
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

import psycopg
import redis as redis_lib
import sqlalchemy as sa
from sqlalchemy import BigInteger, Integer, MetaData, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from ..db.register import DEFAULT_GRANT_LOCK_TIMEOUT_MS, SCOPE_TABLE, Register
from ..db.tokens import fence_schema
from ..errors import LeaseBackendError, StaleTokenError
from ..lease.sync import Fencer, Lease
from ..orm.flush import install
from ..orm.model import Fenced
from .redact import redact_url

VARIANTS = ("plain", "fenced", "version_id_col")
#: ids of the rows the delete benchmark deletes and puts back (untimed)
DELETE_BASE = 10_000_000

# ------------------------------------------------------------------ progress


class Progress:
    """A progress line on ``stream``: redrawn in place on a terminal, dots otherwise."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.label = ""
        self.total = 0
        self.done_steps = 0
        self.started = 0.0

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done_steps = label, max(total, 1), 0
        self.started = time.perf_counter()
        if self.enabled:
            self._draw() if self.tty else self._write(f"{label} ")

    def step(self, n: int = 1) -> None:
        self.done_steps = min(self.total, self.done_steps + n)
        if self.enabled:
            self._draw() if self.tty else self._write(".")

    def finish(self) -> None:
        if not self.enabled:
            return
        took = time.perf_counter() - self.started
        if self.tty:
            self._write(f"\r{self.label}: done in {took:.1f} s\x1b[K\n")
        else:
            self._write(f" done in {took:.1f} s\n")

    def _draw(self) -> None:
        width = 30
        filled = width * self.done_steps // self.total
        bar = "#" * filled + "-" * (width - filled)
        pct = 100 * self.done_steps // self.total
        self._write(f"\r{self.label} [{bar}] {pct:3d}%\x1b[K")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


# ------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Per-op wall times of one contender, and the median of each round."""

    samples: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


@dataclass(frozen=True)
class Op:
    """One timed operation; ``prepare`` runs before each, untimed."""

    run: Callable[[], object]
    prepare: Callable[[], object] | None = None


def interleave(
    ops: Mapping[str, Op],
    *,
    rounds: int,
    per_round: int,
    warmup: int = 1,
    progress: Progress | None = None,
    label: str = "",
) -> dict[str, Timing]:
    """Time ``per_round`` ops of every contender per round, alternating op by op.

    Each round starts with a ``gc.collect()`` and rotates the order of the
    contenders; the ``warmup`` rounds (pools, caches, compiled statements,
    prepared statements) are not counted.
    """
    names = list(ops)
    timings = {name: Timing() for name in names}
    if progress is not None:
        progress.start(label, warmup + rounds)
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(warmup + rounds):
            _round(ops, names, r, warmup, per_round, timings)
            if progress is not None:
                progress.step()
    finally:
        if gc_was_enabled:
            gc.enable()
    if progress is not None:
        progress.finish()
    return timings


def _round(
    ops: Mapping[str, Op],
    names: list[str],
    r: int,
    warmup: int,
    per_round: int,
    timings: dict[str, Timing],
) -> None:
    # As timeit does: collect between rounds, never inside a timed op, so that
    # one contender's garbage is not collected on another contender's clock.
    gc.enable()
    gc.collect()
    gc.disable()
    k = r % len(names)
    order = names[k:] + names[:k]
    per_op: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(per_round):
        for name in order:
            op = ops[name]
            if op.prepare is not None:
                op.prepare()
            started = time.perf_counter()
            op.run()
            per_op[name].append(time.perf_counter() - started)
    if r >= warmup:
        for name, times in per_op.items():
            timings[name].samples.extend(times)
            timings[name].round_medians.append(statistics.median(times))


def ratio_range(a: Timing, b: Timing) -> tuple[float, float]:
    """Min and max over rounds of the per-round median ratio a/b."""
    ratios = [x / y for x, y in zip(a.round_medians, b.round_medians, strict=True)]
    return min(ratios), max(ratios)


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:7.1f} us"
    return f"{seconds * 1e3:7.2f} ms"


# ------------------------------------------------------------------- schema


@dataclass
class Schema:
    """The benchmark's own tables, token sequence and lease register.

    All of them live in the database schema named ``prefix`` (unique per
    run), so that the register (``<prefix>.sa_fence_leases``, created by
    ``metadata.create_all()`` with the sequence) never meets one the
    database already has.
    """

    prefix: str
    metadata: MetaData
    models: dict[str, type[Any]]
    sequence: str  # "<prefix>.token_seq"

    @property
    def register(self) -> Register:
        return Register(self.sequence)


def make_schema(prefix: str | None = None) -> Schema:
    """Three tables of one shape: plain, fenced (``Fenced``), ``version_id_col``;
    the token sequence and its lease register (``fence_schema(metadata)``)."""
    prefix = prefix or f"sa_fence_bench_{uuid.uuid4().hex[:10]}"

    class Base(DeclarativeBase):
        metadata = MetaData(schema=prefix)

    class PlainItem(Base):
        __tablename__ = "plain"
        id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
        payload: Mapped[str] = mapped_column(String(200))
        counter: Mapped[int] = mapped_column(Integer)
        # the same bigint the other two tables carry, here without meaning
        fence: Mapped[int] = mapped_column(BigInteger, server_default=sa.text("0"))

    class FencedItem(Fenced, Base):
        __tablename__ = "fenced"
        id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
        payload: Mapped[str] = mapped_column(String(200))
        counter: Mapped[int] = mapped_column(Integer)

    class VersionedItem(Base):
        __tablename__ = "versioned"
        id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
        payload: Mapped[str] = mapped_column(String(200))
        counter: Mapped[int] = mapped_column(Integer)
        version: Mapped[int] = mapped_column(BigInteger, nullable=False)
        __mapper_args__ = {"version_id_col": version}  # noqa: RUF012 (SQLAlchemy API)

    sequence = f"{prefix}.token_seq"
    fence_schema(Base.metadata, sequence)  # also declares the register and its check
    models: dict[str, type[Any]] = {
        "plain": PlainItem,
        "fenced": FencedItem,
        "version_id_col": VersionedItem,
    }
    return Schema(prefix, Base.metadata, models, sequence)


def _rows(ids: Sequence[int], model: type[Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"id": i, "payload": f"row {i}", "counter": 0} for i in ids]
    if "version" in model.__table__.c:
        for row in rows:
            row["version"] = 1
    return rows


# ------------------------------------------------------------- lease cycles

# The floor's own scripts: the minimum an owner-checked lease needs, with
# none of sa-fence's idempotent-retry answers.
# KEYS[1] lease key; ARGV[1] owner; ARGV[2] "<owner>:<token>". 1 if ours, else 0.
_FLOOR_CONFIRM = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
  return 1
end
return 0
"""
# KEYS[1] lease key; ARGV[1] our value. 1 when deleted, else 0.
_FLOOR_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def psycopg_conninfo(url: sa.URL) -> str:
    """A libpq URI for a SQLAlchemy PostgreSQL URL."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def grant_params(
    sequence: str,
    name: str,
    lock_timeout_ms: int = DEFAULT_GRANT_LOCK_TIMEOUT_MS,
    skip_flush: bool = True,
) -> dict[str, Any]:
    """The grant statement's parameters, as ``TokenSource.params(name)`` builds them
    (pass the compared Fencer's lock wait bound: ``fencer.token_source.lock_timeout_ms``)."""
    register = Register(sequence)
    return {
        "name": name,
        "sequence": register.sequence_sql,
        "register": register.table_sql,
        "lock_timeout": f"{lock_timeout_ms}ms",
        "skip_flush": skip_flush,
    }


class HandWritten:
    """The lease protocol written by hand: the floor a fencing lease costs.

    ``SET NX PX`` with a random owner; the token drawn and the lease register
    advanced by the one statement sa-fence sends
    (``Register(sequence).grant_sql``, same parameters), on an autocommit
    psycopg connection, committed (its commit waits for the WAL flush unless
    the token's WAL record is already flushed); an owner-checked CONFIRM that records
    the token; an owner-checked RELEASE.  No retries, no withdrawal, no
    validation beyond the statement's own, no objects.  ``grant_sql`` puts another
    statement of the same parameters in the grant's place (the benchmark's bare floor).
    """

    def __init__(
        self,
        client: redis_lib.Redis | redis_lib.RedisCluster,
        conninfo: str,
        sequence: str,
        key: str,
        name: str = "floor",
        lock_timeout_ms: int = DEFAULT_GRANT_LOCK_TIMEOUT_MS,
        grant_sql: str | None = None,
    ) -> None:
        self.client = client
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.key = key
        self.grant_sql = Register(sequence).grant_sql if grant_sql is None else grant_sql
        self.params = grant_params(sequence, name, lock_timeout_ms)
        self.confirm = client.register_script(_FLOOR_CONFIRM)
        self.release = client.register_script(_FLOOR_RELEASE)

    @classmethod
    def beside(
        cls, fencer: Fencer, url: sa.URL, key: str, grant_sql: str | None = None
    ) -> HandWritten:
        """The floor of ``fencer``'s own cycle: its Redis client, its sequence and its
        grant's bound on the lock wait, on a psycopg connection of its own to ``url``."""
        lock_timeout_ms = fencer.token_source.lock_timeout_ms
        conninfo = psycopg_conninfo(url)
        return cls(
            fencer.redis,
            conninfo,
            fencer.sequence,
            key,
            lock_timeout_ms=lock_timeout_ms,
            grant_sql=grant_sql,
        )

    def cycle(self, ttl_ms: int = 30_000) -> int:
        owner = secrets.token_hex(16)
        if not self.client.set(self.key, owner, nx=True, px=ttl_ms):
            raise RuntimeError(f"{self.key} is held")
        row = self.conn.execute(self.grant_sql, self.params).fetchone()
        if row is None or row[0] is None or row[1] == "off":
            raise RuntimeError(
                "the token sequence is unfit or behind the register, or synchronous_commit is off"
            )
        token = int(row[0])
        value = f"{owner}:{token}"
        if not self.confirm(keys=[self.key], args=[owner, value]):
            raise RuntimeError(f"{self.key} was lost before its token was recorded")
        if not self.release(keys=[self.key], args=[value]):
            raise RuntimeError(f"{self.key} was lost before release")
        return token

    def close(self) -> None:
        self.conn.close()


def sa_fence_cycle(fencer: Fencer, name: str, ttl: float = 30.0) -> Callable[[], object]:
    def cycle() -> object:
        fencer.acquire(name, ttl).release()
        return None

    return cycle


# -------------------------------------------------------------------- flush


@dataclass
class FlushBench:
    """Fenced, plain and ``version_id_col`` sessions over identical tables."""

    engine: sa.Engine
    schema: Schema
    lease: Lease
    rows: int
    plain: sessionmaker[Session] = field(init=False)
    fenced: sessionmaker[Session] = field(init=False)
    serial: int = 0  # makes every write change its rows

    def __post_init__(self) -> None:
        self.plain = sessionmaker(self.engine)
        self.fenced = install(sessionmaker(self.engine))

    def seed(self) -> None:
        """Insert ``rows`` rows per table (the fenced ones through a bound session)."""
        ids = range(1, self.rows + 1)
        with self.engine.begin() as conn:
            for variant in ("plain", "version_id_col"):
                model = self.schema.models[variant]
                conn.execute(sa.insert(model), _rows(ids, model))
        fenced = self.schema.models["fenced"]
        with self.session("fenced") as session:
            session.add_all(fenced(**row) for row in _rows(ids, fenced))
            session.commit()
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in self.schema.metadata.sorted_tables:
                conn.execute(sa.text(f'VACUUM ANALYZE "{table.schema}"."{table.name}"'))

    def verify_lease_scope(self) -> str:
        """Prove that a fenced session's commit goes through the register check.

        Moves the register row of the bench's lease one past its token (as a
        newer grant would), writes one row through a bound session and
        expects the COMMIT to be refused (``StaleTokenError``, statement
        ``COMMIT``), then puts the register back.  Raises RuntimeError when
        the commit went through: the fenced timings would then not include
        lease scope.  Returns the line the reports print.
        """
        register = self.schema.register
        lease = self.lease
        move = sa.text(
            f"UPDATE {register.table_sql} SET token = :to WHERE name = :name AND token = :was"
        )
        with self.engine.begin() as conn:
            moved = conn.execute(
                move, {"to": lease.token + 1, "name": lease.name, "was": lease.token}
            )
        if moved.rowcount != 1:
            raise RuntimeError(f"the register holds no row for lease {lease.name!r}")
        refused = False
        try:
            model = self.schema.models["fenced"]
            with self.session("fenced") as session:
                item = session.get(model, 1)
                assert item is not None
                item.payload = "lease scope probe"
                try:
                    session.commit()
                except StaleTokenError as exc:
                    refused = exc.statement == "COMMIT"
        finally:
            with self.engine.begin() as conn:
                conn.execute(move, {"to": lease.token, "name": lease.name, "was": lease.token + 1})
        if not refused:
            raise RuntimeError(
                "lease scope is off: a fenced commit went through after the register moved "
                "past its lease, so the fenced timings would not include the register check"
            )
        return (
            "lease scope: on: every fenced transaction is armed in its BEGIN message "
            f"(`BEGIN; INSERT INTO {SCOPE_TABLE} ...`) and PostgreSQL's deferred trigger checks "
            "the register at COMMIT (checked: a commit after the register moved past the "
            "lease was refused)"
        )

    def session(self, variant: str) -> Session:
        if variant == "fenced":
            return self.lease.bind(self.fenced())
        return self.plain()

    def update(
        self, variant: str, n: int, before_commit: Callable[[Session], object] | None = None
    ) -> None:
        """Load ``n`` rows, change a column on each, commit."""
        model = self.schema.models[variant]
        self.serial += 1
        with self.session(variant) as session:
            if n == 1:
                one = 1 + self.serial % self.rows  # a different row each time
                items = list(session.scalars(select(model).where(model.id == one)))
            else:
                items = list(session.scalars(select(model).where(model.id <= n)))
            for item in items:
                item.payload = f"value {self.serial}"
            if before_commit is not None:
                before_commit(session)
            session.commit()

    def put_back(self, variant: str, n: int) -> None:
        """Insert the rows :meth:`delete` deletes (untimed)."""
        model = self.schema.models[variant]
        ids = range(DELETE_BASE + 1, DELETE_BASE + n + 1)
        with self.engine.begin() as conn:
            conn.execute(sa.delete(model).where(model.id > DELETE_BASE))
            conn.execute(sa.insert(model), _rows(ids, model))

    def delete(self, variant: str, n: int) -> None:
        """Load ``n`` rows, delete each, commit."""
        model = self.schema.models[variant]
        with self.session(variant) as session:
            for item in session.scalars(select(model).where(model.id > DELETE_BASE)):
                session.delete(item)
            session.commit()

    def ops(self, kind: str, n: int, variants: Sequence[str]) -> dict[str, Op]:
        if kind == "update":
            return {v: Op(run=lambda v=v: self.update(v, n)) for v in variants}  # type: ignore[misc]
        return {
            v: Op(run=lambda v=v: self.delete(v, n), prepare=lambda v=v: self.put_back(v, n))  # type: ignore[misc]
            for v in variants
        }


@contextmanager
def bench_objects(engine: sa.Engine, client: redis_lib.Redis, schema: Schema) -> Iterator[Fencer]:
    """Create the bench's schema (tables, sequence, lease register and its check
    function); drop the schema and delete the Redis keys afterwards."""
    key_prefix = f"{schema.prefix}:"
    quoted = f'"{schema.prefix}"'
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {quoted}"))
    fencer: Fencer | None = None
    quiet = _NeverBoundIsExpected()
    logging.getLogger("sa_fence.lease.sync").addFilter(quiet)  # its logger
    try:
        schema.metadata.create_all(engine)
        fencer = Fencer(client, engine, sequence=schema.sequence, key_prefix=key_prefix)
        yield fencer
    finally:
        try:
            if fencer is not None:
                fencer.close()  # its token connection
            for key in client.scan_iter(match=f"*{schema.prefix}*", count=1000):
                client.delete(key)
        finally:
            logging.getLogger("sa_fence.lease.sync").removeFilter(quiet)
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {quoted} CASCADE"))


class _NeverBoundIsExpected(logging.Filter):
    """Drops sa-fence's "released without having been bound" warning: the lease
    cycles measured here bind nothing on purpose.  Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "without having been bound" not in record.getMessage()


# ---------------------------------------------------------- the CLI's report


@dataclass
class Settings:
    rounds: int = 10
    rows: int = 1000
    lease_per_round: int = 50
    update_per_round: dict[int, int] = field(default_factory=lambda: {1: 40})

    def per_round(self, n: int) -> int:
        if n in self.update_per_round:
            return self.update_per_round[n]
        return max(3, min(40, 5000 // max(n, 1)))


def lease_section(
    fencer: Fencer,
    client: redis_lib.Redis,
    url: sa.URL,
    schema: Schema,
    settings: Settings,
    progress: Progress | None,
    extra: Mapping[str, Op] | None = None,
    label: str = "lease cycle",
) -> dict[str, Timing]:
    """Lease cycles: sa-fence, the hand-written floor, and any ``extra`` contenders."""
    floor = HandWritten.beside(fencer, url, f"{schema.prefix}:floor")
    try:
        ops = {
            "sa-fence": Op(sa_fence_cycle(fencer, "cycle")),
            "hand-written floor": Op(floor.cycle),
            **(extra or {}),
        }
        return interleave(
            ops,
            rounds=settings.rounds,
            per_round=settings.lease_per_round,
            progress=progress,
            label=label,
        )
    finally:
        floor.close()


def run(
    url: str | sa.URL,
    redis_url: str,
    *,
    rounds: int = 10,
    rows: int = 1000,
    out: TextIO | None = None,
    progress: Progress | None = None,
) -> int:
    """``sa-fence bench``: lease cycle and fenced-flush overhead; exit status."""
    out = sys.stdout if out is None else out
    settings = Settings(rounds=rounds, rows=rows)
    engine = sa.create_engine(url)
    client = redis_lib.Redis.from_url(redis_url)
    schema = make_schema()
    try:
        client.ping()  # both reachable before anything is created
        with engine.connect() as conn:
            version = conn.execute(sa.text("SHOW server_version")).scalar_one()
        print(
            f"sa-fence bench: PostgreSQL {version} at {engine.url.host}:{engine.url.port}, "
            f"Redis at {redact_url(redis_url)}; {rounds} rounds",
            file=out,
        )
        with bench_objects(engine, client, schema) as fencer:
            timings = lease_section(fencer, client, engine.url, schema, settings, progress)
            with fencer.acquire("flush", ttl=3600) as lease:
                flush = FlushBench(engine, schema, lease, rows)
                flush.seed()
                scope = flush.verify_lease_scope()
                results = {}
                for n in sorted({1, rows}):
                    results[n] = interleave(
                        flush.ops("update", n, ("plain", "fenced")),
                        rounds=rounds,
                        per_round=settings.per_round(n),
                        progress=progress,
                        label=f"flush, {n} row{'s' if n > 1 else ''}",
                    )
    finally:
        engine.dispose()
        client.close()
    sa_cycle, floor = timings["sa-fence"], timings["hand-written floor"]
    print(
        f"lease cycle (acquire with token + release), median of {len(sa_cycle.samples)}",
        file=out,
    )
    print(f"  sa-fence            {fmt_time(sa_cycle.median)}", file=out)
    print(f"  hand-written floor  {fmt_time(floor.median)}", file=out)
    print(f"  sa-fence / floor    {sa_cycle.median / floor.median:7.3f}x", file=out)
    print("fenced flush (load + change + commit), median", file=out)
    print(f"  {scope}", file=out)
    for n, res in results.items():
        label = f"{n} row{'s' if n > 1 else ''}"
        ratio = res["fenced"].median / res["plain"].median
        print(
            f"  {label:<10} plain {fmt_time(res['plain'].median)}  fenced "
            f"{fmt_time(res['fenced'].median)}  fenced/plain {ratio:6.3f}x",
            file=out,
        )
    return 0


def main(url: str, redis_url: str, *, rounds: int, rows: int, progress: bool = True) -> int:
    """The ``sa-fence bench`` command: 0 done, 3 PostgreSQL or Redis unreachable."""
    try:
        return run(url, redis_url, rounds=rounds, rows=rows, progress=Progress(enabled=progress))
    except sa.exc.OperationalError as exc:
        print(f"sa-fence bench: PostgreSQL unreachable: {exc.orig}", file=sys.stderr)
    except redis_lib.exceptions.ConnectionError as exc:
        shown = redact_url(redis_url)
        print(f"sa-fence bench: Redis unreachable at {shown}: {exc}", file=sys.stderr)
    except LeaseBackendError as exc:
        print(f"sa-fence bench: {exc}", file=sys.stderr)
    return 3
