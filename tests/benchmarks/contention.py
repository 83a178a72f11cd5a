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
finished (stalled ones included); both contenders stall equally.  Each
contender runs ``REPEATS`` times, alternating with the other (A B B A A B),
and its run of median wall time is reported (with the most stale writes any
of its runs accepted).  Target:
sa-fence's jobs/s within 5% of redis-py Lock's.  Each contender's phases are
timed (wall time per call, summed over the threads): acquire (granted or
not), the job's write + commit, release, and for sa-fence the grant inside
its acquire (the token statement, a durable commit on the server); a miss is
explained from them.
"""

from __future__ import annotations

import dataclasses
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
from sa_fence.cli.bench import Progress

from .common import Config, Target

STALL_EVERY = 10  # every 10th job stalls its first holder
#: sa-fence's jobs/s may be at most this many percent below redis-py Lock's.
TARGET_SHORTFALL = 5.0
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
    phases: dict[str, tuple[int, float]]  # phase -> (calls, seconds summed over threads)

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
        self.phases: dict[str, tuple[int, float]] = {}

    def timed(self, phase: str, started: float) -> None:
        """One call of ``phase`` that began at ``started`` (perf_counter) ended now."""
        took = time.perf_counter() - started
        with self.lock:
            calls, seconds = self.phases.get(phase, (0, 0.0))
            self.phases[phase] = (calls + 1, seconds + took)

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

# The phases timed.
GRANTED = "acquire, granted"
BUSY = "acquire, not granted"
GRANT = "  of which the grant"  # sa-fence: the token statement inside the acquire
WRITE = "write + commit"
RELEASE = "release"


def _time_grants(fencer: sa_fence.Fencer, run: _Run) -> Callable[[], None]:
    """Times sa-fence's token statement inside each acquire (GRANT); returns the undo.

    A profile seam of this benchmark only: it wraps the fencer's token source
    on the instance, and does nothing when that internal is not there."""
    tokens = getattr(fencer, "_tokens", None)
    draw = getattr(tokens, "next_token", None)
    if draw is None:
        return lambda: None

    def next_token(name: str) -> int:
        started = time.perf_counter()
        try:
            return int(draw(name))
        finally:
            run.timed(GRANT, started)

    tokens.next_token = next_token  # type: ignore[union-attr]
    return lambda: delattr(tokens, "next_token")


def _redis_lock_job(client: redis.Redis, plain: sessionmaker[Session], prefix: str) -> Worker:
    def job_step(run: _Run, wid: int, job: int) -> None:
        if job in run.done:  # done since this pass began: no lock taken for it
            return
        lock = client.lock(f"{prefix}redis-py:job:{job}", timeout=run.ttl)
        started = time.perf_counter()
        if not lock.acquire(blocking=False):
            run.timed(BUSY, started)
            return
        run.timed(GRANTED, started)
        ticket = run.next_ticket()
        try:
            if job in run.done:
                return
            if not run.work(job):
                return
            started = time.perf_counter()
            with plain() as session:
                row = session.get(PlainJob, job)
                assert row is not None
                row.writer, row.ticket = f"worker {wid}", ticket
                session.commit()
            run.timed(WRITE, started)
            run.mark_done(job)
        finally:
            started = time.perf_counter()
            try:
                lock.release()
            except redis.exceptions.LockError:
                run.count("lost_at_release")
            run.timed(RELEASE, started)

    return job_step


def _sa_fence_job(fencer: sa_fence.Fencer, fenced: sessionmaker[Session]) -> Worker:
    def job_step(run: _Run, wid: int, job: int) -> None:
        if job in run.done:  # done since this pass began: no lease taken for it
            return
        started = time.perf_counter()
        try:
            lease = fencer.acquire(f"job:{job}", run.ttl)
        except (sa_fence.LeaseNotAcquiredError, sa_fence.LeaseLostError):
            # busy; or, on a loaded machine, the grant outlasted the TTL
            run.timed(BUSY, started)
            return
        run.timed(GRANTED, started)
        ticket = run.next_ticket()
        try:
            if job in run.done:
                return
            if not run.work(job):
                return
            started = time.perf_counter()
            try:
                with lease.bind(fenced()) as session:
                    row = session.get(FencedJob, job)
                    assert row is not None
                    row.writer, row.ticket = f"worker {wid}", ticket
                    session.commit()
            except sa_fence.StaleTokenError:
                run.count("refused")
                return
            finally:
                run.timed(WRITE, started)
            run.mark_done(job)
        finally:
            started = time.perf_counter()
            if not lease.release():
                run.count("lost_at_release")
            run.timed(RELEASE, started)

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


#: Runs of each contender, alternating A B B A ... (the median run is reported).
REPEATS = 3


def _reset(engine: sa.Engine, jobs: int) -> None:
    """Every job row not done (ticket 0), no stale write recorded."""
    with engine.begin() as conn:
        for model in (PlainJob, FencedJob):
            conn.execute(sa.delete(model))
            conn.execute(sa.insert(model), [{"id": i} for i in range(1, jobs + 1)])
        conn.execute(sa.text("TRUNCATE contention_stale"))


def _median_run(runs: list[ContentionResult]) -> ContentionResult:
    """The run of median wall time, with the most stale writes any run accepted."""
    middle = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    return dataclasses.replace(middle, stale_accepted=max(r.stale_accepted for r in runs))


def run(
    engine: sa.Engine,
    client: redis.Redis,
    fencer: sa_fence.Fencer,
    config: Config,
    progress: Progress,
) -> list[ContentionResult]:
    workers, jobs = (4, 20) if config.quick else (config.workers, config.jobs)
    ttl = 0.1 if config.quick else 0.25
    repeats = 1 if config.quick else REPEATS
    cfg = Config(jobs=jobs, workers=workers)
    Base.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(STALE_LOG)
    plain = sessionmaker(engine)
    fenced = sa_fence.install(sessionmaker(engine))
    prefix = fencer.key_prefix
    contenders: list[tuple[str, Worker, str]] = [
        ("redis-py Lock", _redis_lock_job(client, plain, prefix), PlainJob.__tablename__),
        ("sa-fence", _sa_fence_job(fencer, fenced), FencedJob.__tablename__),
    ]
    runs: dict[str, list[ContentionResult]] = {name: [] for name, _, _ in contenders}
    progress.start(f"contention: {workers} workers x {jobs} jobs", repeats * len(contenders))
    quiet = logging.getLogger("sa_fence")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # expected "lease had already expired at release"
    try:
        for repeat in range(repeats):
            for name, step, table in contenders[:: 1 if repeat % 2 == 0 else -1]:
                _reset(engine, jobs)
                state = _Run(cfg, ttl)
                undo = _time_grants(fencer, state) if name == "sa-fence" else (lambda: None)
                try:
                    seconds = _drive(state, step, workers)
                finally:
                    undo()
                with engine.connect() as conn:
                    stale = conn.execute(
                        sa.text("SELECT count(*) FROM contention_stale WHERE tbl = :t"),
                        {"t": table},
                    ).scalar_one()
                runs[name].append(
                    ContentionResult(
                        name,
                        jobs,
                        seconds,
                        len(state.stalled),
                        int(stale),
                        state.refused,
                        state.lost_at_release,
                        dict(state.phases),
                    )
                )
                progress.step()
    finally:
        quiet.setLevel(level)
        progress.finish()
    return [_median_run(runs[name]) for name, _, _ in contenders]


def report(results: list[ContentionResult], config: Config) -> list[Target]:
    if not results:
        return []
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
    print("where the workers' time goes: calls, wall time per call, summed over the threads")
    print(f"  {'phase':<26}" + "".join(f"{r.contender:>28}" for r in results))
    for phase in (GRANTED, GRANT, BUSY, WRITE, RELEASE):
        cells = []
        for r in results:
            calls, seconds = r.phases.get(phase, (0, 0.0))
            cells.append(
                f"{calls:>6} x {seconds / calls * 1e3:6.2f} ms = {seconds:5.2f} s" if calls else "-"
            )
        print(f"  {phase:<26}" + "".join(f"{c:>28}" for c in cells))
    return _targets(results)


def _per_call(result: ContentionResult, phase: str) -> float:
    calls, seconds = result.phases.get(phase, (0, 0.0))
    return seconds / calls if calls else 0.0


def _targets(results: list[ContentionResult]) -> list[Target]:
    by = {r.contender: r for r in results}
    ours, peer = by.get("sa-fence"), by.get("redis-py Lock")
    if ours is None or peer is None:
        return []
    shortfall = (1 - ours.throughput / peer.throughput) * 100
    grant, acquired = _per_call(ours, GRANT), _per_call(ours, GRANTED)
    why = (
        f"per job, sa-fence's granted acquire took {acquired * 1e3:.2f} ms against "
        f"redis-py Lock's {_per_call(peer, GRANTED) * 1e3:.2f} ms; of it the grant "
        f"{grant * 1e3:.2f} ms (the token statement: the register row's durable commit, "
        "a WAL flush the server makes for every lease; redis-py issues no token) and "
        f"{(acquired - grant) * 1e3:.2f} ms for the rest: the lease protocol's two Redis "
        "scripts (ACQUIRE, then CONFIRM once the token is recorded: one round trip more "
        "than SET NX) and sa-fence's own Python, the workers sharing the GIL. The fenced "
        "write + commit took "
        f"{_per_call(ours, WRITE) * 1e3:.2f} ms against "
        f"{_per_call(peer, WRITE) * 1e3:.2f} ms (the register check at COMMIT), the "
        f"release {_per_call(ours, RELEASE) * 1e3:.2f} ms against "
        f"{_per_call(peer, RELEASE) * 1e3:.2f} ms. Telemetry (no SDK here) is within "
        "1-2% of no-ops (telemetry benchmark). See docs/benchmarks.md"
    )
    return [
        Target(
            "contention jobs/s, sa-fence below redis-py",
            shortfall,
            TARGET_SHORTFALL,
            "% of redis-py Lock's",
            why_missed=why,
            decimals=1,
        )
    ]
