"""PostgreSQL crashes at chosen points, on a private cluster (docs/reliability.md).

Each crash is ``pg_ctl stop -m immediate``: the postmaster gets SIGQUIT and
every server process ends at once, with no checkpoint and no flush of the WAL
still in shared memory (the signal is sent straight to the postmaster, so it
lands within a millisecond of the test's last statement).  The cluster then
restarts through crash recovery.  Points chosen:

* right after a grant, and right after the grant that makes the sequence
  write WAL again (it logs 32 values ahead, so only such a grant can lose
  anything): every token granted after the restart must be larger than every
  token granted before it, and the register must still hold each grant the
  holder was told about.  The pair tests run the same rounds with the draw
  left uncommitted, and with ``synchronous_commit = off``: both hand tokens
  out again, so these tests fail if the draw stops committing durably;
* mid-commit (the session's server process frozen with SIGSTOP while its
  ``COMMIT``, which runs lease scope's check, is in flight): nothing of the unit of work is
  committed;
* mid-acquire (the token connection's server process frozen while the grant
  statement is in flight): the acquire fails with LeaseBackendError and
  leaves nothing in Redis;
* right after a grant that committed without waiting for the WAL flush
  (the statement found its token's WAL record already flushed), with every
  server process that could flush the WAL on its own frozen: the crash
  loses the grant, never the token; the name's previous holder may commit
  until the new holder commits anything, never after; the pair forces the
  grant to skip the flush although the record covering its token is not
  flushed (another transaction wrote it and aborted), and sees the token
  handed out again and the old holder's commit accepted after the new
  holder's;
* with the application's pool full of connections from before the crash
  (no ``pool_pre_ping``): the first acquire after the restart succeeds, on
  the held token connection path, the pooled path and the asyncio path; the
  pairs show the same acquire failing without the one retry.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from unittest import mock

import psycopg
import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import sessionmaker

import sa_fence
from sa_fence.db import register as _register
from sa_fence.db.tokens import TokenSource
from sa_fence.testing import expire
from tests._pg_cluster import PgCluster, private_cluster, wait_for_signal
from tests._tools import wait_for
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE, Audit, Base, Job

pytestmark = pytest.mark.slow

DB = "fence"
#: Rounds of "grant up to the WAL-writing grant, crash, restart" per test.
ROUNDS = 3
#: The pair tests stop at the first round that hands a token out again.
MAX_BROKEN_ROUNDS = 10


@pytest.fixture(scope="module")
def cluster() -> Iterator[PgCluster]:
    # no timed checkpoint or autovacuum commit between a test's steps: each
    # would flush WAL the test means to leave unflushed
    with private_cluster("crash", checkpoint_timeout="1d", autovacuum=False) as pg:
        pg.create_database(DB)
        engine = sa.create_engine(pg.url(DB), poolclass=sa.pool.NullPool)
        Base.metadata.create_all(engine)
        engine.dispose()
        yield pg


@pytest.fixture
def pg(cluster: PgCluster) -> PgCluster:
    """The cluster, running, with empty tables (the sequence is never reset)."""
    if not cluster.running():
        cluster.start()
    with cluster.connect(DB) as conn:
        conn.execute("TRUNCATE audit, cells, jobs")
        conn.execute("DELETE FROM sa_fence_leases")
    return cluster


@pytest.fixture
def app_engine(pg: PgCluster) -> Iterator[sa.Engine]:
    """The application's engine: a plain pool, no pool_pre_ping (the common default)."""
    engine = sa.create_engine(pg.url(DB))
    yield engine
    engine.dispose()


def make_fencer(client: redis.Redis, engine: sa.Engine, key_prefix: str) -> sa_fence.Fencer:
    return sa_fence.Fencer(client, engine, sequence=SEQUENCE, key_prefix=key_prefix)


@pytest.fixture
def fencer(
    redis_client: redis.Redis, app_engine: sa.Engine, key_prefix: str
) -> Iterator[sa_fence.Fencer]:
    fencer = make_fencer(redis_client, app_engine, key_prefix)
    yield fencer
    fencer.close()


# ------------------------------------------------------------------ helpers


def next_token_after_restart(pg: PgCluster) -> int:
    """The token the sequence hands out next, read without drawing it."""
    last, called = pg.sql(f"SELECT last_value, is_called FROM {SEQUENCE}", DB)[0]
    return int(last) + 1 if called else int(last)


def values_before_wal(pg: PgCluster) -> int:
    """How many more values the sequence hands out before it writes WAL again."""
    return int(pg.sql(f"SELECT log_cnt FROM {SEQUENCE}", DB)[0][0])


def register(pg: PgCluster) -> dict[str, int]:
    rows = pg.sql("SELECT name, token FROM sa_fence_leases", DB)
    return {name: int(token) for name, token in rows}


def reissued_after_crashes(
    pg: PgCluster, fencer: sa_fence.Fencer, rounds: int, *, stop_at_first: bool = False
) -> tuple[list[int], dict[str, int]]:
    """Grant, crash within ~1 ms of the last grant, restart: the tokens handed out again.

    Each round grants a few leases, then exactly as many as take the sequence
    to its next WAL record, so that the last grant before the crash is the one
    whose loss would matter.  Returns the tokens granted before a crash that
    the restarted sequence would hand out again, and every acknowledged grant
    (name -> token).
    """
    reissued: list[int] = []
    acknowledged: dict[str, int] = {}
    for round_no in range(rounds):
        before = []
        for i in range(3):  # the first grant after a restart always writes WAL
            name = f"r{round_no}:warm:{i}"
            acknowledged[name] = fencer.acquire(name, 30).token
            before.append(acknowledged[name])
        for i in range(values_before_wal(pg) + 1):
            name = f"r{round_no}:{i}"
            acknowledged[name] = fencer.acquire(name, 30).token
            before.append(acknowledged[name])
        pg.crash()  # within ~1 ms of the grant that made the sequence write WAL
        pg.start()
        first_after = next_token_after_restart(pg)
        reissued += [token for token in before if token >= first_after]
        if stop_at_first and reissued:
            break
    return reissued, acknowledged


# --------------------------------------------- durability of the token draw


def test_every_token_granted_after_a_crash_is_larger_than_every_token_granted_before(
    pg: PgCluster, fencer: sa_fence.Fencer
) -> None:
    reissued, acknowledged = reissued_after_crashes(pg, fencer, ROUNDS)
    assert reissued == []
    assert len(acknowledged) > ROUNDS * 32  # each round reached a WAL-writing grant
    # no grant the holders were told about was forgotten, none invented
    assert register(pg) == acknowledged
    newest = fencer.acquire("after the crashes", 30)
    assert newest.token > max(acknowledged.values())


def test_the_crash_rounds_see_tokens_handed_out_again_when_the_draw_is_never_committed(
    pg: PgCluster, fencer: sa_fence.Fencer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair of the test above: the grant statement run in a transaction that
    is never committed (as a draw with no commit of its own would be)."""
    fencer.acquire("check first", 30)  # the set-up check runs before the change
    open_transaction: list[psycopg.Connection[Any]] = []

    def draw_uncommitted(self: TokenSource, dbapi_conn: Any, params: dict[str, Any]) -> Any:
        if not open_transaction or open_transaction[0].broken or open_transaction[0].closed:
            open_transaction[:] = [psycopg.connect(pg.dsn(DB), autocommit=False)]
        with open_transaction[0].cursor() as cursor:
            # an earlier grant in this open transaction may have set
            # synchronous_commit off for it (its flush skipped): not the server's
            cursor.execute("SELECT set_config('synchronous_commit', 'on', true)")
            cursor.execute(self.register.grant_sql, params)
            return cursor.fetchone()

    monkeypatch.setattr(TokenSource, "_draw", draw_uncommitted)
    try:
        reissued, _ = reissued_after_crashes(pg, fencer, MAX_BROKEN_ROUNDS, stop_at_first=True)
    finally:
        for conn in open_transaction:
            conn.close()
    assert reissued, "a draw that never commits survived every crash"


def test_the_crash_rounds_see_tokens_handed_out_again_with_synchronous_commit_off(
    pg: PgCluster, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other pair: the same statement, committed, with ``synchronous_commit =
    off`` on the token connection (sa-fence refuses it; the refusal is bypassed)."""
    monkeypatch.setattr(TokenSource, "check", lambda self: setattr(self, "checked", True))
    monkeypatch.setattr(TokenSource, "granted", lambda self, row, name: int(row[0]))
    engine = sa.create_engine(pg.url(DB), connect_args={"options": "-c synchronous_commit=off"})
    fencer = make_fencer(redis_client, engine, key_prefix)
    try:
        reissued, _ = reissued_after_crashes(pg, fencer, MAX_BROKEN_ROUNDS, stop_at_first=True)
    finally:
        fencer.close()
        engine.dispose()
    assert reissued, "asynchronous commits survived every crash"


# ------------------------------------- grants that skip the WAL flush, crashed

#: The server processes that write or flush WAL on their own (a dirty buffer
#: written out first flushes the WAL up to its page).  Frozen, they leave every
#: WAL record a test makes in shared memory until a commit flushes it.  (The
#: cluster runs no autovacuum, whose commits would flush it too.)
FLUSHERS = ("walwriter", "background writer", "checkpointer")

#: The grant statement's test of "the token's WAL record is flushed" (its guard).
FLUSHED_GUARD = (
    "                 AND pg_catalog.pg_current_wal_flush_lsn()\n"
    "                     OPERATOR(pg_catalog.>=) pg_catalog.pg_current_wal_insert_lsn()\n"
)


def freeze_flushers(pg: PgCluster) -> list[int]:
    """SIGSTOP every background process that could flush WAL; their pids."""
    names = ", ".join(f"'{name}'" for name in FLUSHERS)
    rows = pg.sql(
        "SELECT pid, backend_type FROM pg_stat_activity "
        f"WHERE backend_type IN ({names}) OR backend_type LIKE 'autovacuum%'"
    )
    assert sorted(kind for _, kind in rows) == sorted(FLUSHERS), rows
    pids = [int(pid) for pid, _ in rows]
    for pid in pids:
        _freeze(pid)
    for pid in pids:
        wait_for(lambda pid=pid: _stopped(pid), 10, f"server process {pid} stopped")
    return pids


def crash_frozen(pg: PgCluster, frozen: list[int], engine: sa.Engine) -> None:
    """Crash the cluster (each frozen process dies on SIGCONT, SIGQUIT pending)
    and restart it; ``engine``'s pool of dead connections is emptied."""
    postmaster = pg.begin_crash()
    for pid in frozen:
        wait_for_signal(pid, signal.SIGQUIT)
        os.kill(pid, signal.SIGCONT)
    pg.wait_gone(postmaster)
    pg.start()
    engine.dispose()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def commit_under(engine: sa.Engine, lease: sa_fence.Lease, message: str) -> bool:
    """One unit of work in lease scope; True if committed, False if refused as stale."""
    make_session = sa_fence.install(sessionmaker(engine))
    with make_session() as session:
        lease.bind(session)
        session.add(Audit(message=message))
        try:
            session.commit()
        except sa_fence.StaleTokenError:
            return False
    return True


def refusal_under(engine: sa.Engine, lease: sa_fence.Lease) -> sa_fence.StaleTokenError:
    """The StaleTokenError of one unit of work under ``lease`` (it must be refused)."""
    make_session = sa_fence.install(sessionmaker(engine))
    with make_session() as session:
        lease.bind(session)
        session.add(Audit(message="refused"))
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            session.commit()
    return refused.value


def messages(pg: PgCluster) -> list[str]:
    return [message for (message,) in pg.sql("SELECT message FROM audit ORDER BY id", DB)]


def test_a_grant_skips_the_wal_flush_when_its_token_is_already_durable(
    pg: PgCluster, fencer: sa_fence.Fencer, app_engine: sa.Engine
) -> None:
    first = fencer.acquire("job:1", 30)
    while values_before_wal(pg) < 2:  # the next draw must not write WAL
        fencer.acquire("filler", 30).release()
    assert commit_under(app_engine, first, "flushes the WAL")
    second = fencer.acquire("job:2", 30)
    assert fencer._tokens.last_flushed is False
    fencer._tokens.skip_flush = False
    third = fencer.acquire("job:3", 30)
    assert fencer._tokens.last_flushed is True
    assert first.token < second.token < third.token
    pg.sql("CHECKPOINT", DB)  # the next draw writes WAL: its commit waits for the flush
    fencer._tokens.skip_flush = True
    fencer.acquire("job:4", 30)
    assert fencer._tokens.last_flushed is True


def lost_grant(pg: PgCluster, fencer: sa_fence.Fencer, engine: sa.Engine) -> Any:
    """Holder A committed; A's lease ends; B is granted without a WAL flush;
    everything that could flush the WAL on its own is frozen.  (A, B, frozen)."""
    a = fencer.acquire("job:1", 30)
    while values_before_wal(pg) < 2:
        fencer.acquire("filler", 30).release()
    assert commit_under(engine, a, "A before the grant")  # flushes everything before it
    frozen = freeze_flushers(pg)
    assert expire(a)  # A pauses past its TTL (its Lease object still holds the token)
    b = fencer.acquire("job:1", 30)
    assert fencer._tokens.last_flushed is False, "the grant waited for the flush"
    return a, b, frozen


def test_a_crash_that_loses_a_grant_lets_the_old_holder_commit_until_the_new_one_commits(
    pg: PgCluster, fencer: sa_fence.Fencer, app_engine: sa.Engine
) -> None:
    a, b, frozen = lost_grant(pg, fencer, app_engine)
    crash_frozen(pg, frozen, app_engine)

    # the grant is lost, its token is not: the register holds A's token again
    assert register(pg)["job:1"] == a.token
    assert next_token_after_restart(pg) > b.token
    # B's commits are refused, naming the crash (not a newer grant: issue 49); A commits,
    # as if just before B's grant
    refused = refusal_under(app_engine, b)
    assert refused.newest_token == a.token < b.token
    assert "a newer lease" not in str(refused)
    assert (
        f"the lease register holds an older token of that name ({a.token}), so this lease's "
        "grant is gone: lost in a PostgreSQL crash"
    ) in str(refused)
    assert commit_under(app_engine, a, "A after the crash")
    # the name granted again: a new token, and from its first commit on A is refused
    assert expire(b)
    c = fencer.acquire("job:1", 30)
    assert c.token > b.token
    assert commit_under(app_engine, c, "C")
    assert not commit_under(app_engine, a, "A after C")
    assert not commit_under(app_engine, b, "B after C")
    assert messages(pg) == ["A before the grant", "A after the crash", "C"]


def test_a_lost_first_grant_is_refused_naming_the_crash(
    pg: PgCluster, fencer: sa_fence.Fencer, app_engine: sa.Engine
) -> None:
    """Issue 49: a name's first grant, lost in a crash, leaves no register row; the
    refusal listed every cause of a missing row but the crash."""
    warm = fencer.acquire("warm", 30)
    while values_before_wal(pg) < 2:
        fencer.acquire("filler", 30).release()
    assert commit_under(app_engine, warm, "flushes everything before it")
    frozen = freeze_flushers(pg)
    first = fencer.acquire("job:first", 30)  # the name's first grant
    flushed = fencer._tokens.last_flushed
    crash_frozen(pg, frozen, app_engine)
    assert flushed is False, "the grant waited for the flush"
    assert "job:first" not in register(pg)

    refused = refusal_under(app_engine, first)
    assert (refused.statement, refused.newest_token) == ("COMMIT", None)
    assert "its first grant lost in a PostgreSQL crash before the WAL was flushed" in str(refused)


def test_once_the_new_holder_commits_a_crash_keeps_its_grant_and_the_old_holder_is_refused(
    pg: PgCluster, fencer: sa_fence.Fencer, app_engine: sa.Engine
) -> None:
    a, b, frozen = lost_grant(pg, fencer, app_engine)
    assert commit_under(app_engine, b, "B")  # its commit flushes the WAL up to the grant
    crash_frozen(pg, frozen, app_engine)

    assert register(pg)["job:1"] == b.token
    assert not commit_under(app_engine, a, "A after the crash")
    assert commit_under(app_engine, b, "B after the crash")
    assert fencer.acquire("job:2", 30).token > b.token
    assert messages(pg) == ["A before the grant", "B", "B after the crash"]


def grant_over_an_unflushed_record(pg: PgCluster, fencer: sa_fence.Fencer) -> Any:
    """B granted while the WAL record covering its token is not flushed: another
    transaction's nextval wrote it (32 values ahead) and that transaction
    aborted, which flushes nothing.  Background flushers frozen.  (B, frozen)."""
    fencer.acquire("warm", 30).release()  # set-up check and token connection done
    pg.sql("CHECKPOINT", DB)  # the next nextval writes WAL (its page predates the redo point)
    frozen = freeze_flushers(pg)
    with psycopg.connect(pg.dsn(DB), autocommit=False) as other:
        other.execute(f"SELECT nextval('{SEQUENCE}')")
        assert values_before_wal(pg) == 32  # it wrote the record covering the next 32
        other.rollback()
    b = fencer.acquire("job:1", 30)
    assert values_before_wal(pg) == 31  # B's own draw wrote no WAL
    return b, frozen


def test_a_grant_whose_token_is_covered_by_an_unflushed_record_waits_for_the_flush(
    pg: PgCluster, fencer: sa_fence.Fencer, app_engine: sa.Engine
) -> None:
    b, frozen = grant_over_an_unflushed_record(pg, fencer)
    flushed = fencer._tokens.last_flushed
    crash_frozen(pg, frozen, app_engine)

    assert next_token_after_restart(pg) > b.token  # the token is never handed out again
    assert register(pg)["job:1"] == b.token  # the grant survived: it waited for the flush
    assert flushed is True
    assert expire(b)
    c = fencer.acquire("job:1", 30)
    assert c.token > b.token
    assert commit_under(app_engine, c, "C")
    assert not commit_under(app_engine, b, "B after C")
    assert messages(pg) == ["C"]


def test_the_pair_forced_to_skip_the_flush_hands_the_token_out_again_and_accepts_the_old_holder(
    pg: PgCluster,
    redis_client: redis.Redis,
    app_engine: sa.Engine,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above, with the guard taken out of the grant statement:
    the grant skips the flush whenever ``skip_flush`` is on, as a rule "skip it
    when this nextval wrote no WAL" would (B's draw wrote none)."""
    ddl = _register._GRANT_FUNCTION
    assert FLUSHED_GUARD in ddl, "the guard is no longer in the grant function"
    own = _register.Register(SEQUENCE)
    with mock.patch.object(_register, "_GRANT_FUNCTION", ddl.replace(FLUSHED_GUARD, "")):
        unguarded = _register.check_function_sql(own)
    with app_engine.begin() as conn:
        conn.execute(sa.text(unguarded))
    fencer = make_fencer(redis_client, app_engine, key_prefix)
    try:
        b, frozen = grant_over_an_unflushed_record(pg, fencer)
        assert fencer._tokens.last_flushed is False
        crash_frozen(pg, frozen, app_engine)

        assert "job:1" not in register(pg)  # the grant is lost
        assert next_token_after_restart(pg) <= b.token  # ... and so is its token
        while next_token_after_restart(pg) < b.token:
            fencer.acquire("filler", 30).release()
        assert expire(b)
        c = fencer.acquire("job:1", 30)
        assert c.token == b.token  # two holders of job:1 with one token
        assert commit_under(app_engine, c, "C")
        assert commit_under(app_engine, b, "B after C")  # the stale holder is accepted
        assert messages(pg) == ["C", "B after C"]
    finally:
        fencer.close()
        with app_engine.begin() as conn:  # sa-fence's own grant again, for the next tests
            conn.execute(sa.text(_register.check_function_sql(own)))


# ----------------------------------------------------- crashes mid-operation


def test_acknowledged_fenced_commits_survive_a_crash_and_the_register_and_rows_agree(
    pg: PgCluster, fencer: sa_fence.Fencer, app_engine: sa.Engine
) -> None:
    make_session = sa_fence.install(sessionmaker(app_engine))
    tokens = {}
    for job_id in (1, 2):
        lease = fencer.acquire(f"job:{job_id}", 30)
        with make_session() as session:
            lease.bind(session)
            session.add(Job(id=job_id, result=f"written under {lease.token}"))
            session.flush()
            session.add(Audit(job_id=job_id, message="same unit of work"))
            session.commit()
        tokens[job_id] = lease.token
    held_pid = fencer._tokens._held.info.backend_pid
    pg.crash()  # right after the acknowledged commit
    pg.start()

    rows = dict(pg.sql("SELECT id, fence FROM jobs", DB))
    assert rows == tokens
    assert pg.sql("SELECT count(*) FROM audit", DB) == [(2,)]
    assert register(pg) == {f"job:{job_id}": token for job_id, token in tokens.items()}

    # The fencer reconnects on its own: no error, a new held token connection.
    newer = fencer.acquire("job:3", 30)
    assert newer.token > max(tokens.values())
    again = fencer.acquire("job:4", 30)
    assert fencer._tokens._held is not None
    assert fencer._tokens._held.info.backend_pid != held_pid
    assert again.token > newer.token


def _freeze(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def _crash_with_frozen_backend(pg: PgCluster, frozen_pid: int) -> None:
    """Crash while ``frozen_pid`` is stopped mid-statement; it dies on SIGCONT
    (SIGQUIT is pending by then), before it reads another byte."""
    postmaster = pg.begin_crash()
    wait_for_signal(frozen_pid, signal.SIGQUIT)
    os.kill(frozen_pid, signal.SIGCONT)
    pg.wait_gone(postmaster)


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    failures: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, failures


def test_a_crash_mid_commit_commits_nothing_of_the_unit_of_work(
    pg: PgCluster, fencer: sa_fence.Fencer, app_engine: sa.Engine
) -> None:
    make_session = sa_fence.install(sessionmaker(app_engine))
    lease = fencer.acquire("job:1", 30)
    session = lease.bind(make_session())
    session.add(Job(id=1, result="never committed"))
    session.flush()
    session.add(Audit(job_id=1, message="same unit of work"))
    session.flush()
    backend = session.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    _freeze(backend)
    committing, failures = _in_thread(session.commit)  # sends COMMIT (the trigger checks), waits
    time.sleep(0.2)
    assert committing.is_alive()
    _crash_with_frozen_backend(pg, backend)
    committing.join(timeout=60)
    assert not committing.is_alive()
    assert len(failures) == 1, failures
    assert isinstance(failures[0], sa.exc.OperationalError), failures
    session.close()
    pg.start()

    assert pg.sql("SELECT count(*) FROM jobs", DB) == [(0,)]
    assert pg.sql("SELECT count(*) FROM audit", DB) == [(0,)]
    assert register(pg) == {"job:1": lease.token}
    assert fencer.acquire("job:2", 30).token > lease.token


def test_a_crash_while_the_token_draw_is_in_flight_fails_the_acquire_cleanly(
    pg: PgCluster, fencer: sa_fence.Fencer, redis_client: redis.Redis, key_prefix: str
) -> None:
    first = fencer.acquire("job:1", 30)
    held = fencer._tokens._held
    backend = held.info.backend_pid
    _freeze(backend)
    outcome: list[sa_fence.Lease] = []
    drawing, failures = _in_thread(lambda: outcome.append(fencer.acquire("job:2", 30)))
    time.sleep(0.2)
    assert drawing.is_alive()  # waiting for the frozen server process
    _crash_with_frozen_backend(pg, backend)
    drawing.join(timeout=60)
    assert not drawing.is_alive()

    assert outcome == []
    assert len(failures) == 1, failures
    assert isinstance(failures[0], sa_fence.LeaseBackendError), failures
    failure = failures[0]
    assert (failure.backend, failure.operation, failure.name) == ("postgresql", "token", "job:2")
    # sent once, on the held connection, which was lost: it may have run
    assert "sent once); the outcome is unknown" in str(failure)
    # nothing left in Redis: the grant's key was removed (owner-checked)
    assert not redis_client.exists(fencer.key("job:2"))
    assert redis_client.exists(fencer.key("job:1"))

    pg.start()
    granted_before = register(pg)  # whatever reached the register, committed
    later = fencer.acquire("job:2", 30)  # the fencer reconnects on its own
    assert later.token > max([first.token, *granted_before.values()])


# ------------------------- the application's pool still holds dead connections


def _fill_the_pool(engine: sa.Engine, connections: int = 3) -> None:
    """Leave ``connections`` idle connections in the engine's pool."""
    opened = [engine.connect() for _ in range(connections)]
    for conn in opened:
        conn.execute(sa.text("SELECT 1"))
    for conn in opened:
        conn.close()
    assert isinstance(engine.pool, sa.pool.QueuePool)
    assert engine.pool.checkedin() >= connections


@pytest.fixture(params=["held connection", "engine with listeners"])
def path_engine(request: pytest.FixtureRequest, pg: PgCluster) -> Iterator[sa.Engine]:
    """An engine on each token path: the held psycopg connection (no listeners)
    or SQLAlchemy's Connection (an engine with a statement listener)."""
    engine = sa.create_engine(pg.url(DB))
    if request.param == "engine with listeners":
        sa.event.listen(engine, "before_cursor_execute", lambda *args: None)
    yield engine
    engine.dispose()


def test_the_first_acquire_after_a_restart_succeeds_with_a_pool_of_dead_connections(
    pg: PgCluster, path_engine: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    fencer = make_fencer(redis_client, path_engine, key_prefix)
    try:
        before = fencer.acquire("job:1", 30)
        _fill_the_pool(path_engine)
        pg.crash()
        pg.start()
        after = fencer.acquire("job:2", 30)  # no error
        assert after.token > before.token
        # the application's next checkout gets a live connection too
        with path_engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    finally:
        fencer.close()


def test_without_the_retry_the_first_acquire_after_a_restart_fails_on_a_dead_connection(
    pg: PgCluster, path_engine: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The pair of the test above: one attempt only, as before the retry."""
    fencer = make_fencer(redis_client, path_engine, key_prefix)
    fencer._tokens.draw_attempts = 1
    try:
        fencer.acquire("job:1", 30)
        _fill_the_pool(path_engine)
        pg.crash()
        pg.start()
        with pytest.raises(sa_fence.LeaseBackendError) as failed:
            fencer.acquire("job:2", 30)
        assert (failed.value.backend, failed.value.operation) == ("postgresql", "token")
        assert isinstance(failed.value.cause, sa.exc.OperationalError)
        assert "the outcome is unknown" in str(failed.value)
        # the held connection's send, then the pooled one's (listeners: pooled only)
        sends = "sent once" if path_engine._has_events else "sent 2 times"
        assert sends in str(failed.value)
        assert not redis_client.exists(fencer.key("job:2"))
    finally:
        fencer.close()


@pytest_asyncio.fixture
async def crash_async_engine(pg: PgCluster) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(pg.url(DB, driver="postgresql+psycopg_async"))
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest_asyncio.fixture
async def crash_aredis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        yield client
    finally:
        await client.aclose()


async def _fill_the_async_pool(engine: AsyncEngine, connections: int = 3) -> None:
    opened = [await engine.connect() for _ in range(connections)]
    for conn in opened:
        await conn.execute(sa.text("SELECT 1"))
    for conn in opened:
        await conn.close()


@pytest.mark.parametrize("attempts", [2, 1], ids=["with the retry", "without it"])
async def test_the_first_async_acquire_after_a_restart_with_a_pool_of_dead_connections(
    pg: PgCluster,
    crash_async_engine: AsyncEngine,
    crash_aredis: aioredis.Redis,
    key_prefix: str,
    attempts: int,
) -> None:
    fencer = sa_fence.AsyncFencer(
        crash_aredis, crash_async_engine, sequence=SEQUENCE, key_prefix=key_prefix
    )
    fencer._tokens.draw_attempts = attempts
    before = await fencer.acquire("job:1", 30)
    await _fill_the_async_pool(crash_async_engine)
    pg.crash()
    pg.start()
    if attempts == 1:
        with pytest.raises(sa_fence.LeaseBackendError) as failed:
            await fencer.acquire("job:2", 30)
        assert isinstance(failed.value.cause, sa.exc.OperationalError)
        await fencer.close()
        assert not await crash_aredis.exists(fencer.key("job:2"))
    else:
        after = await fencer.acquire("job:2", 30)
        assert after.token > before.token
    await fencer.close()
