"""Contention: workers whose lease expires mid-job, redis-py Lock alone vs sa-fence.

``workers`` threads share ``jobs`` job rows.  Each worker scans the jobs that
are not done yet, takes a job's lock without blocking (skipping it when
held), does the job (a 2 ms sleep) and writes its result (``writer``,
``ticket``) to the job's row, then releases.  Every 10th job stalls its
first holder *inside* the critical section for twice the TTL, so its lock
expires, another worker takes the job over and writes, and the stalled
worker then wakes up and writes too: deterministic induced stalls.  (A stall
sleeps 2x TTL, then, if the takeover has not written yet, waits for it, at
most 2x TTL more; at most half the workers stall at once, so that others
are free to take over.)

``ticket`` is drawn by the harness right after each successful acquire
(a process-wide counter, so it follows grant order; redis-py issues none).
A trigger on the job table records every committed UPDATE that lowers the
ticket: that is a **stale write accepted**, an older holder overwriting a
newer holder's result, counted by the database itself.

* ``redis-py Lock``: the lock alone, plain sessions: stale writes go through.
* ``sa-fence``: leases plus fenced sessions: the stale write is refused with
  ``StaleTokenError`` (counted as a refusal) and nothing of it commits.

Throughput is jobs done per second of wall time, until every worker has
finished (stalled ones included); both contenders stall equally.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
import sqlalchemy as sa
from sqlalchemy import BigInteger, String
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import sa_fence
from sa_fence.tools.bench import Progress

from .common import Config

STALL_EVERY = 10  # every 10th job stalls its first holder
WORK_SECONDS = 0.002


class Base(DeclarativeBase):
    pass


class PlainJob(Base):
    __tablename__ = "contention_plain"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    writer: Mapped[str | None] = mapped_column(String(40))
    ticket: Mapped[int] = mapped_column(BigInteger, server_default=sa.text("0"))


class FencedJob(sa_fence.Fenced, Base):
    __tablename__ = "contention_fenced"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    writer: Mapped[str | None] = mapped_column(String(40))
    ticket: Mapped[int] = mapped_column(BigInteger, server_default=sa.text("0"))


STALE_LOG = """
CREATE TABLE IF NOT EXISTS contention_stale (
    tbl text, job_id int, old_ticket bigint, new_ticket bigint, writer text
);
CREATE OR REPLACE FUNCTION contention_note_stale() RETURNS trigger AS $$
BEGIN
  IF NEW.ticket < OLD.ticket THEN
    INSERT INTO contention_stale VALUES (TG_TABLE_NAME, OLD.id, OLD.ticket, NEW.ticket, NEW.writer);
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE OR REPLACE TRIGGER contention_plain_stale BEFORE UPDATE ON contention_plain
  FOR EACH ROW EXECUTE FUNCTION contention_note_stale();
CREATE OR REPLACE TRIGGER contention_fenced_stale BEFORE UPDATE ON contention_fenced
  FOR EACH ROW EXECUTE FUNCTION contention_note_stale();
"""


@dataclass
class ContentionResult:
    contender: str
    jobs: int
    seconds: float
    stalls: int
    stale_accepted: int
    refused: int
    lost_at_release: int

    @property
    def throughput(self) -> float:
        return self.jobs / self.seconds


class _Run:
    """One contender's run: shared state of its worker threads."""

    def __init__(self, config: Config, ttl: float) -> None:
        self.n_jobs = config.jobs
        self.ttl = ttl
        self.done: set[int] = set()
        self.stalled: set[int] = set()
        self.stalling = 0  # workers stalled right now
        self.max_stalling = max(1, config.workers // 2)
        self.lock = threading.Lock()
        self.tickets = itertools.count(1)
        self.refused = 0
        self.lost_at_release = 0
        self.errors: list[BaseException] = []

    def next_ticket(self) -> int:
        with self.lock:
            return next(self.tickets)

    def stall_decision(self, job: int) -> str:
        """ "stall" the first holder of every 10th job; "defer" (put the job back) while
        half the workers are stalled already, so that others are free to take over."""
        with self.lock:
            if job % STALL_EVERY or job in self.stalled:
                return "work"
            if self.stalling >= self.max_stalling:
                return "defer"
            self.stalled.add(job)
            self.stalling += 1
            return "stall"

    def pending(self, start: int) -> list[int]:
        with self.lock:
            order = [(start + i) % self.n_jobs + 1 for i in range(self.n_jobs)]
            return [j for j in order if j not in self.done]

    def mark_done(self, job: int) -> None:
        with self.lock:
            self.done.add(job)

    def count(self, what: str) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + 1)

    def work(self, job: int) -> bool:
        """Do the job (False: deferred, release the lock and leave it for later)."""
        decision = self.stall_decision(job)
        if decision == "defer":
            return False
        time.sleep(WORK_SECONDS)
        if decision == "stall":
            time.sleep(2 * self.ttl)  # the lease expires here; another worker takes over
            deadline = time.monotonic() + 2 * self.ttl
            while job not in self.done and time.monotonic() < deadline:
                time.sleep(0.005)  # a longer pause still, until the takeover has written
            with self.lock:
                self.stalling -= 1
        return True


Worker = Callable[[_Run, int, int], None]  # (run, worker id, job) -> None


def _redis_lock_job(client: redis.Redis, plain: sessionmaker[Session], prefix: str) -> Worker:
    def job_step(run: _Run, wid: int, job: int) -> None:
        lock = client.lock(f"{prefix}redis-py:job:{job}", timeout=run.ttl)
        if not lock.acquire(blocking=False):
            return
        ticket = run.next_ticket()
        try:
            if job in run.done:
                return
            if not run.work(job):
                return
            with plain() as session:
                row = session.get(PlainJob, job)
                assert row is not None
                row.writer, row.ticket = f"worker {wid}", ticket
                session.commit()
            run.mark_done(job)
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                run.count("lost_at_release")

    return job_step


def _sa_fence_job(fencer: sa_fence.Fencer, fenced: sessionmaker[Session]) -> Worker:
    def job_step(run: _Run, wid: int, job: int) -> None:
        try:
            lease = fencer.acquire(f"job:{job}", run.ttl)
        except sa_fence.LeaseNotAcquiredError:
            return
        ticket = run.next_ticket()
        try:
            if job in run.done:
                return
            if not run.work(job):
                return
            try:
                with lease.bind(fenced()) as session:
                    row = session.get(FencedJob, job)
                    assert row is not None
                    row.writer, row.ticket = f"worker {wid}", ticket
                    session.commit()
            except sa_fence.StaleTokenError:
                run.count("refused")
                return
            run.mark_done(job)
        finally:
            if not lease.release():
                run.count("lost_at_release")

    return job_step


def _drive(run: _Run, step: Worker, workers: int) -> float:
    def loop(wid: int) -> None:
        try:
            while pending := run.pending(wid * run.n_jobs // workers):
                for job in pending:
                    step(run, wid, job)
                time.sleep(0.002)
        except BaseException as exc:  # reported after the run
            run.errors.append(exc)

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in range(workers)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    deadline = started + 120  # bounded, whatever happens
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError("contention benchmark did not finish within 120 s")
    if run.errors:
        raise run.errors[0]
    return time.perf_counter() - started


def run(
    engine: sa.Engine,
    client: redis.Redis,
    fencer: sa_fence.Fencer,
    config: Config,
    progress: Progress,
) -> list[ContentionResult]:
    workers, jobs = (4, 20) if config.quick else (config.workers, config.jobs)
    ttl = 0.1 if config.quick else 0.25
    cfg = Config(jobs=jobs, workers=workers)
    Base.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(STALE_LOG)
        for model in (PlainJob, FencedJob):
            conn.execute(sa.delete(model))
            conn.execute(sa.insert(model), [{"id": i} for i in range(1, jobs + 1)])
        conn.execute(sa.text("TRUNCATE contention_stale"))
    plain = sessionmaker(engine)
    fenced = sa_fence.install(sessionmaker(engine))
    prefix = fencer.key_prefix
    contenders: list[tuple[str, Worker, str]] = [
        ("redis-py Lock", _redis_lock_job(client, plain, prefix), PlainJob.__tablename__),
        ("sa-fence", _sa_fence_job(fencer, fenced), FencedJob.__tablename__),
    ]
    results = []
    progress.start(f"contention: {workers} workers x {jobs} jobs", len(contenders))
    quiet = logging.getLogger("sa_fence")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # expected "lease had already expired at release"
    try:
        for name, step, table in contenders:
            state = _Run(cfg, ttl)
            seconds = _drive(state, step, workers)
            with engine.connect() as conn:
                stale = conn.execute(
                    sa.text("SELECT count(*) FROM contention_stale WHERE tbl = :t"), {"t": table}
                ).scalar_one()
            results.append(
                ContentionResult(
                    name,
                    jobs,
                    seconds,
                    len(state.stalled),
                    int(stale),
                    state.refused,
                    state.lost_at_release,
                )
            )
            progress.step()
    finally:
        quiet.setLevel(level)
        progress.finish()
    return results


def report(results: list[ContentionResult], config: Config) -> None:
    if not results:
        return
    r0 = results[0]
    print(
        f"\ncontention: {r0.jobs} jobs, stalls past the TTL induced in {r0.stalls} "
        "(first holder of every 10th job sleeps 2x TTL inside the critical section)"
    )
    print(
        f"{'contender':<16}{'jobs/s':>9}{'wall':>9}{'stale writes accepted':>23}"
        f"{'refused (StaleTokenError)':>27}{'lock lost at release':>22}"
    )
    for r in results:
        print(
            f"{r.contender:<16}{r.throughput:>9.1f}{r.seconds:>8.2f}s{r.stale_accepted:>23}"
            f"{r.refused:>27}{r.lost_at_release:>22}"
        )
    print(
        "  stale writes accepted: committed UPDATEs that lowered a job's ticket (an older "
        "holder overwrote a newer holder's result), recorded by a trigger in the database"
    )
