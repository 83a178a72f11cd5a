"""``sa-fence demo``: the lost-lease double write, played by two real processes.

The story (docs/index.md, "The problem"):

1. An admin inserts job 1 into a fenced ``jobs`` table, in a temporary
   database made for this run.
2. Worker A (a separate Python process) takes the Redis lease ``job:1`` with
   a short TTL, loads the row and starts working.
3. The demo freezes A with ``SIGSTOP`` (a stop-the-world GC pause, swap, a
   frozen VM) until its lease has expired in Redis; A cannot notice.
4. Worker B (another process) takes the lease, with a larger token, writes
   its result, commits and releases.
5. The demo resumes A with ``SIGCONT``.  A still believes it holds the lease
   and writes its result.

Fenced (the default), both workers bind their lease to a session with the
sa-fence flush hook, so A's late UPDATE carries its old token and is
refused with :class:`~sa_fence.StaleTokenError`: B's result survives.  With
``--unfenced`` both workers use a plain ``sessionmaker`` (the lease alone,
as most code does today) and A's write silently replaces B's.

The demo process only orchestrates: it starts each worker as
``python -m sa_fence.cli.demo worker``, sends it its settings as one JSON line
and then one command per line on stdin (``acquire``, ``write``), and reads
one JSON event per line from its stdout.  A can only write after it was
stopped and resumed, because it waits for ``write`` on stdin; every read has
a timeout, and the workers are killed if anything goes wrong (on Linux the
kernel also kills them if the demo process dies).

Exit status: 0 when the story ran as expected (refusal when fenced, double
write with ``--unfenced``), 1 when it went differently, 2 for a bad
argument, 3 when PostgreSQL or Redis cannot be reached.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any, ClassVar, TextIO

import psycopg
import redis as redis_lib
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.orm import Session, sessionmaker

from .. import testing
from ..db.guard import drop_guard_sql
from ..db.tokens import DEFAULT_SEQUENCE
from ..errors import StaleTokenError
from ..lease.protocol import token_from_value
from ..lease.sync import Fencer
from ..orm.flush import install, unfenced
from .demo_models import DemoJob
from .redact import redact_url

DEFAULT_TTL = 1.0
MIN_TTL = 0.1
MAX_TTL = 60.0
LEASE_NAME = "job:1"
JOB_ID = 1

EXIT_OK = 0
EXIT_STORY = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

#: A worker process imports SQLAlchemy, psycopg and redis before it answers.
STARTUP_TIMEOUT = 60.0
#: Any other step: one or two round trips to PostgreSQL or Redis.
STEP_TIMEOUT = 30.0
CONNECT_TIMEOUT = 5

#: The package's parent logger: the demo shows (or keeps) what every module logs.
log = logging.getLogger("sa_fence")


class StoryError(Exception):
    """The story did not go as it should (a worker failed, or the outcome is wrong)."""


# ===================================================================== worker


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this worker when the demo process dies.

    A stopped worker would otherwise outlive a killed demo forever.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - exotic libc
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class Emitter:
    """Writes one JSON event per line to the worker's stdout."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    def __call__(self, event: str, **data: Any) -> None:
        line = json.dumps({"event": event, **data}, default=str)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


class EventLogHandler(logging.Handler):
    """Forwards the library's log records to the demo as ``log`` events."""

    def __init__(self, emit: Emitter) -> None:
        super().__init__(logging.INFO)
        self._emit = emit

    def emit(self, record: logging.LogRecord) -> None:
        self._emit("log", level=record.levelname, message=record.getMessage())


def wait_for(stdin: TextIO, command: str) -> None:
    line = stdin.readline()
    if not line:
        raise SystemExit(1)  # the demo process went away: nothing left to do
    if line.strip() != command:
        raise StoryError(f"expected command {command!r}, got {line.strip()!r}")


#: What a worker does in its session once it holds the lease (the session bound
#: to it when fenced): its reads and writes, ``write``'s commit and the report.
Work = Callable[[Session], None]


def serve(
    stdin: TextIO, stdout: TextIO, prepare: Callable[[dict[str, Any], Emitter, TextIO], Work]
) -> int:
    """A worker's life, the same in both demos: ``ready``, the lease on ``acquire``,
    ``prepare``'s work in a session, the release on ``release``; every failure is
    an ``error`` event.  ``prepare`` reads the settings before anything connects."""
    emit = Emitter(stdout)
    handler = EventLogHandler(emit)
    log.addHandler(handler)
    engine: sa.Engine | None = None
    client: redis_lib.Redis | None = None
    try:
        config = json.loads(stdin.readline() or "{}")
        fenced = bool(config["fenced"])
        work = prepare(config, emit, stdin)
        engine = sa.create_engine(config["pg"])
        client = redis_lib.Redis.from_url(config["redis"], socket_connect_timeout=CONNECT_TIMEOUT)
        fencer = Fencer(client, engine, key_prefix=config["prefix"])
        client.ping()
        fencer.check()
        make_session: sessionmaker[Session] = sessionmaker(engine)
        if fenced:
            install(make_session)
        emit("ready", pid=os.getpid())

        wait_for(stdin, "acquire")
        lease = fencer.acquire(LEASE_NAME, float(config["ttl"]))
        emit("acquired", token=lease.token, ttl=lease.ttl)
        with make_session() as session:
            if fenced:
                lease.bind(session)
            work(session)
        wait_for(stdin, "release")
        emit("released", deleted=lease.release())
        return EXIT_OK
    except Exception as exc:
        emit("error", error=type(exc).__name__, message=str(exc))
        return EXIT_STORY
    finally:
        log.removeHandler(handler)
        if client is not None:
            client.close()
        if engine is not None:
            engine.dispose()


def worker_main(stdin: TextIO, stdout: TextIO) -> int:
    """One worker: acquire on ``acquire``, load, write on ``write``, report, release."""
    return serve(stdin, stdout, _load_and_write)


def _load_and_write(config: dict[str, Any], emit: Emitter, stdin: TextIO) -> Work:
    def work(session: Session) -> None:
        job = session.get_one(DemoJob, JOB_ID)
        emit("loaded", result=job.result, fence=job.fence)

        wait_for(stdin, "write")
        job.result = str(config["result"])
        try:
            session.commit()
        except StaleTokenError as exc:
            session.rollback()
            emit(
                "refused",
                error=type(exc).__name__,
                message=str(exc),
                token=exc.token,
                current_fences=list(exc.current_fences),
            )
        else:
            emit("committed", result=job.result, fence=job.fence)

    return work


def drop_guards(conn: sa.Connection) -> None:
    """--unfenced: the demo tables lose their guard triggers (nothing checks the writers)."""
    for table in ("jobs", "job_steps"):
        for statement in drop_guard_sql(table):
            conn.execute(sa.text(statement))


def _worker_entry(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "worker" or not argv[1].isdigit():
        print(
            "sa_fence.cli.demo is started by `sa-fence demo`; run that instead.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    die_with_parent(int(argv[1]))
    return worker_main(sys.stdin, sys.stdout)


# =============================================================== orchestrator


class Worker:
    """The demo's handle on one worker process: commands in, JSON events out."""

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        timeline: Timeline,
        *,
        module: str = "sa_fence.cli.demo",
        role: str = "worker",
    ) -> None:
        self.name = name
        self._timeline = timeline
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, role, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._read_events, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._read_stderr, args=(self.proc.stderr,), daemon=True),
        ]
        try:
            for thread in self._threads:
                thread.start()
            self.send(json.dumps(config))
        except BaseException:
            self.kill()  # the caller never gets a handle to clean up
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_events(self, pipe: IO[str]) -> None:
        for line in pipe:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "output", "line": line.rstrip("\n")}
            self._events.put(event if isinstance(event, dict) else {"event": "output"})
        self._events.put(None)

    def _read_stderr(self, pipe: IO[str]) -> None:
        for line in pipe:
            self._stderr.append(line.rstrip("\n"))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise StoryError(f"worker {self.name} is gone ({exc}){self._stderr_tail()}") from None

    def expect(self, *wanted: str, timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        """The worker's next event, which must be one of ``wanted`` (log events are shown)."""
        what = " or ".join(repr(w) for w in wanted)
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise StoryError(
                    f"worker {self.name} did not report {what} within {timeout:g} s"
                ) from None
            if event is None:
                try:
                    code: int | str = self.proc.wait(timeout=STEP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    code = "unknown: it closed its stdout but still runs"
                raise StoryError(
                    f"worker {self.name} exited (status {code}) before reporting {what}"
                    + self._stderr_tail()
                )
            kind = event.get("event")
            if kind == "log":
                level = str(event.get("level", "")).lower()
                self._timeline.say(self.name, f"sa_fence logged ({level}): {event.get('message')}")
                continue
            if kind == "output":
                continue
            if kind == "error":
                raise StoryError(
                    f"worker {self.name} failed: {event.get('error')}: {event.get('message')}"
                    + self._stderr_tail()
                )
            if kind not in wanted:
                raise StoryError(f"worker {self.name} reported {event!r}, expected {what}")
            return event

    def stop(self) -> None:
        """SIGSTOP the worker and wait until the kernel reports it stopped."""
        self._signal(testing.pause, "stopped")

    def resume(self) -> None:
        """SIGCONT the worker and wait until the kernel reports it running again."""
        self._signal(testing.resume, "resumed")

    def _signal(self, action: Callable[[subprocess.Popen[Any], float], None], what: str) -> None:
        try:
            action(self.proc, STEP_TIMEOUT)
        except ChildProcessError:
            raise StoryError(
                f"worker {self.name} exited (status {self.proc.returncode}) instead of "
                f"being {what}" + self._stderr_tail()
            ) from None
        except TimeoutError:
            raise StoryError(
                f"worker {self.name} was not {what} within {STEP_TIMEOUT:g} s"
            ) from None

    def finish(self) -> None:
        """Close stdin and require a clean exit."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise StoryError(f"worker {self.name} did not exit") from None
        if code != 0:
            raise StoryError(f"worker {self.name} exited with status {code}{self._stderr_tail()}")

    def kill(self) -> None:
        """Kill the worker if it still runs (SIGKILL ends a stopped process too)."""
        if self.proc.poll() is None:
            self.proc.kill()
            with suppress(subprocess.TimeoutExpired):  # SIGKILL does not fail
                self.proc.wait(timeout=STEP_TIMEOUT)
        for thread in self._threads:  # they reach EOF now that the worker is gone
            if thread.is_alive():
                thread.join(timeout=STEP_TIMEOUT)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                with suppress(OSError):
                    pipe.close()

    def _stderr_tail(self) -> str:
        tail = self._stderr[-15:]
        return ("; its stderr:\n    " + "\n    ".join(tail)) if tail else ""


class Timeline:
    """Prints one line per event: elapsed time, who holds the lease (per Redis), who, what."""

    def __init__(self, out: TextIO, client: redis_lib.Redis, key: str) -> None:
        self.out = out
        self.client = client
        self.key = key
        self.holders: dict[int, str] = {}
        self.t0 = time.monotonic()

    def holder(self) -> str:
        try:
            value = self.client.get(self.key)
        except redis_lib.RedisError:
            return "?"
        if value is None:
            return "nobody"
        token = token_from_value(value)
        if token is None:
            return "(granting)"
        return f"{self.holders.get(token, '?')} (token {token})"

    def header(self) -> None:
        print(f"  {'elapsed':>8}  {'lease holder':<13} {'who':<6} what happened", file=self.out)
        print(f"  {'-' * 8}  {'-' * 13} {'-' * 6} {'-' * 60}", file=self.out)

    def say(self, who: str, text: str) -> None:
        elapsed = time.monotonic() - self.t0
        prefix = f"  {elapsed:>7.2f}s  {self.holder():<13} {who:<6} "
        print(
            textwrap.fill(
                text,
                width=max(100, len(prefix) + 40),
                initial_indent=prefix,
                subsequent_indent=" " * len(prefix),
                break_long_words=False,
                break_on_hyphens=False,
            ),
            file=self.out,
            flush=True,
        )


class _Collecting(logging.Handler):
    """Keeps log records instead of showing them (the set-up's expected warning)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Unreachable(Exception):
    """PostgreSQL or Redis cannot be reached (the message says how to start it)."""


def server_url(pg: str) -> sa.URL:
    try:
        url = sa.make_url(pg)
    except sa.exc.ArgumentError as exc:
        raise ValueError(f"--pg {pg!r} is not a SQLAlchemy database URL ({exc})") from None
    if url.get_backend_name() != "postgresql":
        raise ValueError(
            f"--pg must point at PostgreSQL (tokens come from a sequence in the protected "
            f"database), got a {url.get_backend_name()!r} URL"
        )
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    return url


def _admin_dsn(server: sa.URL) -> str:
    """A libpq DSN for the ``postgres`` maintenance database on the same server."""
    admin = server.set(database="postgres", drivername="postgresql")
    return admin.render_as_string(hide_password=False)


def _shown(server: sa.URL) -> str:
    return server.set(database=None).render_as_string(hide_password=True)


def _reason(exc: BaseException) -> str:
    """An error message on one line, ending in exactly one sentence mark."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if text.endswith((".", "?", "!")) else text + "."


def connect_redis(url: str) -> redis_lib.Redis:
    try:
        client = redis_lib.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=STEP_TIMEOUT
        )
    except ValueError as exc:
        raise ValueError(f"--redis {redact_url(url)!r} is not a Redis URL ({exc})") from None
    try:
        client.ping()
    except redis_lib.RedisError as exc:
        client.close()
        raise Unreachable(
            f"cannot reach Redis at {redact_url(url)}: {_reason(exc)} Start it (`make services`, "
            "or `redis-server --daemonize yes`), or point --redis (or SA_FENCE_DEMO_REDIS) "
            "at a running server."
        ) from None
    return client


def check_postgres(server: sa.URL) -> None:
    try:
        with psycopg.connect(_admin_dsn(server), autocommit=True, connect_timeout=CONNECT_TIMEOUT):
            pass
    except psycopg.Error as exc:
        raise Unreachable(
            f"cannot reach PostgreSQL at {_shown(server)}: {_reason(exc)} Start it (`make "
            "services`, or `pg_ctlcluster <version> main start` / `systemctl start "
            "postgresql`), or point --pg (or SA_FENCE_DEMO_PG) at a running server."
        ) from None


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so the workers, database and keys are cleaned up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(*, pg: str, redis_url: str, ttl: float, fenced: bool, out: TextIO | None = None) -> int:
    """Play the story once; return the exit status (see the module docstring)."""
    return play(Demo, pg=pg, redis_url=redis_url, ttl=ttl, fenced=fenced, out=out)


def play(
    story: type[Demo], *, pg: str, redis_url: str, ttl: float, fenced: bool, out: TextIO | None
) -> int:
    """Play ``story`` once (either demo's): its arguments and servers checked first,
    each failure printed as ``sa-fence demo: ...``; the exit status."""
    out = sys.stdout if out is None else out
    try:
        server = server_url(pg)
        if not MIN_TTL <= ttl <= MAX_TTL:
            raise ValueError(f"--ttl must be between {MIN_TTL:g} and {MAX_TTL:g} s, got {ttl:g}")
        client = connect_redis(redis_url)
    except ValueError as exc:
        print(f"sa-fence demo: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Unreachable as exc:
        print(f"sa-fence demo: error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        check_postgres(server)
        with sigterm_as_exit():
            return story(server, client, redis_url, ttl, fenced, out).play()
    except Unreachable as exc:
        print(f"sa-fence demo: error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except StoryError as exc:
        print(f"sa-fence demo: FAILED, the story went differently: {exc}", file=sys.stderr)
        return EXIT_STORY
    finally:
        client.close()


@dataclass
class Demo:
    server: sa.URL
    client: redis_lib.Redis
    redis_url: str
    ttl: float
    fenced: bool
    out: TextIO
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))
    workers: list[Worker] = field(default_factory=list)
    #: What the workers run: ``python -m MODULE ROLE PID``.
    module: ClassVar[str] = "sa_fence.cli.demo"

    @property
    def database(self) -> str:
        """The temporary database of this run."""
        return f"sa_fence_demo_{self.run_id}"

    @property
    def prefix(self) -> str:
        """The Redis key prefix of this run."""
        return f"sa_fence_demo:{self.run_id}:"

    def echo(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def summary(self, label: str, text: str) -> None:
        """A wrapped ``label  text`` line below the timeline."""
        self.echo(
            textwrap.fill(
                text,
                width=100,
                initial_indent=f"  {label:<12}",
                subsequent_indent=" " * 14,
                break_long_words=False,
                break_on_hyphens=False,
            )
        )

    def intro(self) -> None:
        """The first lines: what the story is, and in which mode it runs."""
        mode = (
            "FENCED: sessions have sa_fence.install(); each worker binds its lease"
            if self.fenced
            else "UNFENCED: plain sessionmaker, the lease alone guards the row"
        )
        self.echo("sa-fence demo: a worker's lease expires while it is paused, then it writes")
        self.summary("mode", f"{mode}")

    def play(self) -> int:
        self.intro()
        self.summary("PostgreSQL", _shown(self.server))
        self.summary("database", f"{self.database} (temporary, dropped at the end)")
        self.summary("Redis", f"{redact_url(self.redis_url)}, keys under {self.prefix!r}")
        self.summary("lease", f"{LEASE_NAME!r}, TTL {self.ttl:g} s")
        self.echo()
        admin_dsn = _admin_dsn(self.server)
        try:
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))
        except psycopg.Error as exc:
            raise StoryError(f"could not create database {self.database}: {exc}") from None
        engine: sa.Engine | None = None
        try:
            engine = sa.create_engine(self.server.set(database=self.database))
            status = self.story(engine)
        finally:
            for worker in self.workers:
                worker.kill()
            if engine is not None:
                engine.dispose()
            cleaned = self.cleanup(admin_dsn)
        return status if cleaned else EXIT_STORY

    def cleanup(self, admin_dsn: str) -> bool:
        ok = True
        try:
            with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as c:
                c.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(self.database)
                    )
                )
            dropped = f"dropped database {self.database}"
        except psycopg.Error as exc:
            ok = False
            dropped = f"COULD NOT drop database {self.database} ({exc})"
            print(
                f'sa-fence demo: warning: drop it by hand: DROP DATABASE "{self.database}" '
                "WITH (FORCE);",
                file=sys.stderr,
            )
        try:
            keys = list(self.client.scan_iter(match=self.prefix + "*", count=100))
            if keys:
                self.client.delete(*keys)
            deleted = f"deleted {len(keys)} leftover Redis key(s) under {self.prefix!r}"
        except redis_lib.RedisError as exc:
            ok = False
            deleted = f"COULD NOT delete Redis keys under {self.prefix!r} ({exc})"
        self.summary("cleanup", f"{dropped}; {deleted}")
        return ok

    def row(self, engine: sa.Engine) -> tuple[str | None, int]:
        with engine.connect() as conn:
            result, fence = conn.execute(
                sa.select(DemoJob.result, DemoJob.fence).where(DemoJob.id == JOB_ID)
            ).one()
        return result, int(fence)

    def row_text(self, engine: sa.Engine) -> str:
        result, fence = self.row(engine)
        return f"job {JOB_ID}: result={result!r}, fence={fence}"

    def story(self, engine: sa.Engine) -> int:
        """The demo's acts in order; the verdict's exit status."""
        t = Timeline(self.out, self.client, self.prefix + LEASE_NAME)
        t.header()
        self.create_tables(engine, t)
        self.insert_job(engine, t)
        a, b = self.start_workers(t)
        token_a = self.a_takes_the_lease(a, t)
        stopped_at = self.a_freezes_past_its_ttl(a, t)
        token_b = self.b_takes_over(b, engine, t)
        written = self.a_wakes_and_writes(a, engine, t, token_a, stopped_at)
        a.finish()
        b.finish()
        return self.verdict(engine, written, token_a, token_b)

    def create_tables(self, engine: sa.Engine, t: Timeline) -> None:
        """The migrations; --unfenced drops the guard triggers again."""
        from .schema import upgrade_demo_schema

        upgrade_demo_schema(engine)
        created = (
            f"the token sequence {DEFAULT_SEQUENCE} (CACHE 1) and the lease register "
            "sa_fence_leases with `alembic upgrade head` (migrations/)"
        )
        if self.fenced:
            t.say(
                "setup",
                f"created the fenced tables jobs and job_steps, their guard triggers, {created}",
            )
            return
        # The lease alone, as most code does: nothing in the database checks
        # the writers, so the tables keep their fence column but lose their
        # guard triggers (whose "unchanged" policy would let these plain
        # UPDATEs through anyway, and would only blur the story).
        with engine.begin() as conn:
            drop_guards(conn)
        t.say(
            "setup",
            f"created the tables jobs and job_steps, {created}; no guard triggers "
            "(--unfenced: nothing in the database checks the writers)",
        )

    def insert_job(self, engine: sa.Engine, t: Timeline) -> None:
        """An admin inserts the job with no lease, inside ``unfenced()``."""
        # The admin's insert logs sa-fence's warning for writes without a lease
        # (the opt-out is meant to be visible); here it is expected, so it is
        # kept off the timeline and said in words instead.
        quiet = _Collecting()
        log.addHandler(quiet)
        propagate, log.propagate = log.propagate, False
        try:
            admin: sessionmaker[Session] = sessionmaker(engine)
            install(admin)
            with admin() as session, unfenced(session):
                session.add(DemoJob(id=JOB_ID, result=None))
                session.commit()
        finally:
            log.removeHandler(quiet)
            log.propagate = propagate
        t.say(
            "setup",
            "an admin inserted the job with no lease, inside sa_fence.unfenced(session), "
            "the opt-out for admin scripts (sa-fence logs a warning for each such write; "
            f"expected here): {self.row_text(engine)}",
        )

    def start_workers(self, t: Timeline) -> tuple[Worker, Worker]:
        """Workers A and B, started and waiting for the demo's go."""
        return self.start_pair(t, "; waiting for the demo's go")

    def worker(
        self, name: str, config: dict[str, Any], t: Timeline, role: str = "worker"
    ) -> Worker:
        """A process of this story's module in ``role``; :meth:`play` kills it at the end."""
        w = Worker(name, config, t, module=self.module, role=role)
        self.workers.append(w)
        return w

    def start_pair(self, t: Timeline, started: str, **config: Any) -> tuple[Worker, Worker]:
        """Workers A and B on this run's servers (and ``config``), both ready."""
        config = {
            "pg": self.server.set(database=self.database).render_as_string(hide_password=False),
            "redis": self.redis_url,
            "prefix": self.prefix,
            "ttl": self.ttl,
            "fenced": self.fenced,
            **config,
        }
        a = self.worker("A", {**config, "result": "A"}, t)
        b = self.worker("B", {**config, "result": "B"}, t)
        for w in (a, b):
            w.expect("ready", timeout=STARTUP_TIMEOUT)
            t.say(w.name, f"worker process started (pid {w.pid}){started}")
        return a, b

    def take_lease(self, w: Worker, t: Timeline) -> int:
        """``w`` acquires the lease; its token, which the timeline shows as ``w``'s."""
        w.send("acquire")
        token = int(w.expect("acquired")["token"])
        t.holders[token] = w.name
        return token

    def _unused(self) -> str:
        return "" if self.fenced else " (its session is not fenced: the token goes unused)"

    def a_takes_the_lease(self, a: Worker, t: Timeline) -> int:
        """A takes the lease and starts working; returns A's token."""
        token_a = self.take_lease(a, t)
        t.say(
            "A",
            f"acquired lease {LEASE_NAME!r} with token {token_a}, TTL {self.ttl:g} s"
            + self._unused(),
        )
        loaded = a.expect("loaded")
        t.say(
            "A",
            f"loaded job {JOB_ID} (result={loaded['result']!r}, fence={loaded['fence']}) "
            "and is working on it",
        )
        return token_a

    def a_freezes_past_its_ttl(self, a: Worker, t: Timeline) -> float:
        """SIGSTOP A until Redis has expired its lease; returns when A was stopped
        (monotonic).  A stays stopped while B takes over (a_wakes_and_writes resumes it)."""
        a.stop()
        stopped_at = time.monotonic()
        t.say(
            "demo",
            f"SIGSTOP A (pid {a.pid}): frozen mid-work, like a long GC pause; it stays "
            "stopped until its lease has expired and B has taken over",
        )
        self.wait_until_expired(stopped_at)
        t.say(
            "redis",
            f"A's lease has expired (TTL {self.ttl:g} s); A is stopped and cannot notice",
        )
        return stopped_at

    def wait_until_expired(self, since: float) -> None:
        """Return once Redis no longer holds the lease (its TTL ran out while A was
        stopped): the moment is shown as it happens, not after a fixed sleep."""
        deadline = since + 2 * self.ttl + 1
        while self.client.exists(self.prefix + LEASE_NAME):
            if time.monotonic() > deadline:
                raise StoryError(
                    f"A's lease still exists in Redis {deadline - since:g} s after A was "
                    f"stopped (TTL {self.ttl:g} s)"
                )
            time.sleep(0.01)

    def b_takes_over(self, b: Worker, engine: sa.Engine, t: Timeline) -> int:
        """B takes the lease over, writes, commits and releases; returns B's token."""
        token_b = self.take_lease(b, t)
        t.say("B", f"acquired lease {LEASE_NAME!r} with token {token_b}{self._unused()}")
        loaded = b.expect("loaded")
        t.say("B", f"loaded job {JOB_ID} (result={loaded['result']!r}, fence={loaded['fence']})")
        b.send("write")
        written = b.expect("committed", "refused")
        if written["event"] != "committed":
            raise StoryError(f"B's write was refused: {written.get('message')}")
        t.say("B", f"wrote result='B' and committed; row now {self.row_text(engine)}")
        b.send("release")
        released = b.expect("released")
        t.say("B", "released the lease" if released["deleted"] else "found its lease gone")
        return token_b

    def a_wakes_and_writes(
        self, a: Worker, engine: sa.Engine, t: Timeline, token_a: int, stopped_at: float
    ) -> dict[str, Any]:
        """SIGCONT A, which still believes it holds the lease: its write and release.

        Returns A's write event (committed or refused)."""
        a.resume()
        paused = time.monotonic() - stopped_at
        t.say(
            "demo",
            f"SIGCONT A after {paused:.2f} s stopped (TTL {self.ttl:g} s); A carries on as if "
            f"it still held the lease with token {token_a}",
        )
        a.send("write")
        how = (
            f"UPDATE jobs ... WHERE id = {JOB_ID} AND fence <= {token_a}"
            if self.fenced
            else f"plain UPDATE jobs ... WHERE id = {JOB_ID}"
        )
        t.say("A", f"writes result='A' and commits ({how})")
        written = a.expect("committed", "refused")
        if written["event"] == "refused":
            t.say("A", f"REFUSED by the fence: {written['error']}: {written['message']}")
        else:
            t.say("A", f"committed; row now {self.row_text(engine)}")
        a.send("release")
        released = a.expect("released")
        t.say(
            "A",
            "released the lease"
            if released["deleted"]
            else "release found the lease no longer A's: nothing deleted",
        )
        return written

    def verdict(
        self, engine: sa.Engine, a_written: dict[str, Any], token_a: int, token_b: int
    ) -> int:
        result, fence = self.row(engine)
        self.echo()
        self.summary("final row", f"job {JOB_ID}: result={result!r}, fence={fence}")
        if token_b <= token_a:
            raise StoryError(f"B's token {token_b} is not larger than A's token {token_a}")
        if self.fenced:
            if a_written["event"] != "refused" or a_written.get("error") != "StaleTokenError":
                raise StoryError(
                    f"A's stale write was NOT refused; the row holds result={result!r}, "
                    f"fence={fence}"
                )
            if (result, fence) != ("B", token_b):
                raise StoryError(
                    f"the row should hold B's result and fence ('B', {token_b}), "
                    f"holds ({result!r}, {fence})"
                )
            self.summary(
                "verdict",
                f"OK: A's stale write (token {token_a}) was refused with "
                f"StaleTokenError; B's result and fence {token_b} survived",
            )
            return EXIT_OK
        if a_written["event"] != "committed" or result != "A":
            raise StoryError(
                f"without fencing A's write should have overwritten B's; A reported "
                f"{a_written['event']!r} and the row holds result={result!r}"
            )
        self.echo("  DOUBLE WRITE: B's result was overwritten by A's stale write")
        self.summary(
            "verdict",
            "this is the failure sa-fence exists to stop: the lease expired "
            "while A was paused, and nothing checked it at write time. Run `sa-fence demo` "
            "(without --unfenced) to see the same write refused.",
        )
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(_worker_entry(sys.argv[1:]))
