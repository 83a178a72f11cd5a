"""The lease register on the real servers: grants advance it, commits are checked against it."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.scope import arming
from sa_fence.testing import expire
from tests.db.test_token_connection import held_fencer
from tests.models import Audit, Job


def register_row(engine: sa.Engine, name: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT token, previous, granted_at FROM sa_fence_leases WHERE name = :n"),
            {"n": name},
        ).one_or_none()


def keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*"))


def test_each_grant_advances_the_register_to_its_token(
    fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    with fencer.acquire("job:1", 5) as first:
        row = register_row(engine, "job:1")
        assert row.token == first.token
        assert row.granted_at is not None
    with fencer.acquire("job:1", 5) as second:
        row = register_row(engine, "job:1")
        assert (row.token, row.previous) == (second.token, first.token)
    assert second.token > first.token


@pytest.fixture
def committing_holder(engine: sa.Engine, fencer: sa_fence.Fencer) -> Any:
    """A transaction of the name's current holder stuck between its commit check and COMMIT."""
    lease = fencer.acquire("job:1", 0.2)
    dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(dsn)
    conn.execute("SELECT pg_current_xact_id()")  # it wrote something: it has an xid
    conn.execute(fencer._tokens.register.check_call(), ("job:1", lease.token))  # holds the row
    yield conn
    conn.rollback()
    conn.close()


def test_a_grant_waits_a_bounded_time_for_a_committing_holder_and_says_what_it_waited_for(
    engine: sa.Engine,
    committing_holder: psycopg.Connection,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    with held_fencer(engine, redis_client, key_prefix) as (waiting, held):
        waiting._tokens.lock_timeout_ms = 300
        time.sleep(0.4)  # the holder's lease (TTL 200 ms) runs out in Redis
        started = time.monotonic()
        with pytest.raises(sa_fence.LeaseBackendError, match="waited 300 ms for the lease reg"):
            waiting.acquire("job:1", 5)
        assert time.monotonic() - started < 3
        # refused, not lost: the statement is not sent again elsewhere, the connection is kept
        assert waiting._tokens._held is held
        assert keys(redis_client, key_prefix) == []  # nothing left behind in Redis
        committing_holder.rollback()  # the holder's commit ends
        waiting.acquire("job:1", 5).release()  # and the name can be granted again


def test_a_grant_cancelled_by_statement_timeout_says_so_not_that_postgresql_is_down(
    engine: sa.Engine,
    committing_holder: psycopg.Connection,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    timed = sa.create_engine(engine.url, connect_args={"options": "-c statement_timeout=300"})
    try:
        waiting = sa_fence.Fencer(redis_client, timed, key_prefix=key_prefix)
        time.sleep(0.4)  # the holder's lease (TTL 200 ms) runs out in Redis
        with pytest.raises(sa_fence.LeaseBackendError, match="statement was cancelled") as err:
            waiting.acquire("job:1", 5)
        assert "could not be reached" not in str(err.value)
        assert keys(redis_client, key_prefix) == []  # nothing left behind in Redis
        waiting.close()
    finally:
        timed.dispose()


def test_a_paused_holders_open_transaction_does_not_hold_back_a_newer_grant(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """The register row is locked only between the commit check and COMMIT, which
    travel in one message: a holder paused mid-transaction blocks no grant."""
    a = fencer.acquire("job:1", 5)
    session_a = a.bind(make_session())
    session_a.add(Job(id=1, result="A"))
    session_a.flush()  # A's transaction is open and has written
    expire(a)  # A pauses past its TTL
    started = time.monotonic()
    b = fencer.acquire("job:1", 5)
    assert time.monotonic() - started < 1
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert refused.value.statement == "COMMIT"
    assert (refused.value.token, refused.value.newest_token) == (a.token, b.token)
    assert refused.value.lease_name == "job:1"
    assert "nothing of this transaction was committed" in str(refused.value).lower()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 0
    b.release()


def test_a_refused_commit_leaves_the_pooled_connection_usable(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    a = fencer.acquire("job:1", 5)
    with make_session() as session:
        a.bind(session)
        session.add(Job(id=1, result="A"))
        session.flush()
        expire(a)
        fencer.acquire("job:1", 5)
        with pytest.raises(sa_fence.StaleTokenError):
            session.commit()
    for _ in range(3):  # the pool hands the same connection out again: it must be clean
        with make_session() as session:
            assert session.execute(sa.text("SELECT 1")).scalar_one() == 1


def test_a_lease_name_with_a_nul_character_is_refused_before_anything_is_written(
    fencer: sa_fence.Fencer, redis_client: redis.Redis, key_prefix: str
) -> None:
    with pytest.raises(ValueError, match="NUL"):
        fencer.acquire("job\x001", 5)
    assert keys(redis_client, key_prefix) == []


def test_a_lease_name_with_quotes_and_backslashes_is_checked_at_commit(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    name = "job:'1'\\; DROP TABLE jobs; --"
    with fencer.acquire(name, 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Job(id=1, result="ok"))
        session.commit()
    assert register_row(engine, name).token == lease.token
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT result FROM jobs")).scalar_one() == "ok"


def test_a_two_phase_session_is_refused_for_fenced_work(
    fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    maker = sa_fence.install(sessionmaker(engine, twophase=True))
    with fencer.acquire("job:1", 5) as lease, maker() as session:
        lease.bind(session)
        session.add(Job(id=1))
        with pytest.raises(sa_fence.FencingConfigError, match="two-phase"):
            session.flush()


@pytest.mark.parametrize(
    "error",
    [
        sa_fence.StaleTokenError(token=5, lease_name="job:1", statement="COMMIT", newest_token=7),
        sa_fence.StaleTokenError(
            token=5,
            table="jobs",
            statement="UPDATE",
            primary_keys=[(1,)],
            current_fences=[7],
            lease_name="job:1",
        ),
        sa_fence.LeaseNotAcquiredError("job:1", 7, waited=0.5),
        sa_fence.LeaseBackendError(
            backend="redis", operation="acquire", name="job:1", cause=ConnectionError("down")
        ),
        sa_fence.LeaseLostError("gone"),
        sa_fence.FencingConfigError("bad"),
        sa_fence.UnfencedWriteError("no lease"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_error_survives_pickling_with_its_class_attributes_and_message(
    error: Exception,
) -> None:
    """Errors cross process boundaries (multiprocessing, Celery's result backend)."""
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    attributes = {k: v for k, v in vars(error).items() if k != "cause"}
    assert {k: v for k, v in vars(copy).items() if k != "cause"} == attributes
    if hasattr(error, "cause"):
        assert repr(copy.cause) == repr(error.cause)


@pytest.mark.parametrize(
    "error",
    [
        sa_fence.StaleTokenError(token=5, lease_name="job:1", statement="COMMIT", newest_token=7),
        sa_fence.LeaseBackendError(
            backend="redis", operation="acquire", name="job:1", cause=ConnectionError("down")
        ),
        sa_fence.LeaseLostError("gone"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_pickled_error_keeps_its_notes_and_what_a_handler_set_on_it(error: Exception) -> None:
    """A task framework's handler adds a note or an attribute before the error crosses
    to the caller's process: both arrive."""
    import pickle

    error.add_note("while processing job 1")
    error.retry_after = 30  # type: ignore[attr-defined]
    copy = pickle.loads(pickle.dumps(error))
    assert copy.__notes__ == ["while processing job 1"]
    assert copy.retry_after == 30  # type: ignore[attr-defined]


def stale_commit_through(
    fencer: sa_fence.Fencer, url: sa.URL, engine: sa.Engine
) -> sa_fence.StaleTokenError | None:
    """A's session reaches the database through ``url``; B is granted; A commits."""
    other = sa.create_engine(url)
    try:
        maker = sa_fence.install(sessionmaker(other))
        a = fencer.acquire("job:1", 5)
        with maker() as session:
            a.bind(session)
            session.add(Job(id=1, result="A"))
            session.flush()
            expire(a)
            fencer.acquire("job:1", 5)
            try:
                session.commit()
            except sa_fence.StaleTokenError as exc:
                return exc
        return None
    finally:
        other.dispose()


def test_lease_scope_holds_when_the_session_reaches_the_database_by_another_url(
    fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    """localhost vs 127.0.0.1 (or a socket, a pooler): the same database all the same."""
    other_url = engine.url.set(host="localhost")
    assert stale_commit_through(fencer, other_url, engine) is not None
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 0


def test_comparing_urls_alone_would_let_the_stale_commit_through(
    fencer: sa_fence.Fencer, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair of the test above: without the database identity, scope is skipped."""

    monkeypatch.setattr(arming, "_read_database_id", lambda conn: ("elsewhere",))
    fencer.check()  # the fencer knows its own database's identity
    assert stale_commit_through(fencer, engine.url.set(host="localhost"), engine) is None


@pytest.mark.parametrize("via", ["released savepoint", "exec_driver_sql"])
def test_a_stale_holders_writes_the_statement_hook_does_not_see_are_refused_at_commit(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine, via: str
) -> None:
    """Lease scope is the transaction's: what a released SAVEPOINT wrote is the
    root transaction's, and exec_driver_sql passes no statement hook; the root
    COMMIT is what the register check guards."""
    a = fencer.acquire("job:1", 5)
    with make_session() as session:
        a.bind(session)
        if via == "released savepoint":
            with session.begin_nested():
                session.add(Audit(id=1, message="A, in a savepoint"))
        else:
            session.connection().exec_driver_sql(
                "INSERT INTO audit (id, message) VALUES (3, 'A, raw driver SQL')"
            )
        expire(a)
        fencer.acquire("job:1", 5)
        with pytest.raises(sa_fence.StaleTokenError, match="commit refused"):
            session.commit()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM audit")).scalar_one() == 0


async def test_a_stale_async_sessions_insert_into_an_unfenced_table_is_refused_at_commit(
    afencer: sa_fence.AsyncFencer,
    make_async_session: Any,
    engine: sa.Engine,
    redis_client: redis.Redis,
) -> None:
    """asyncio: the AsyncSession's COMMIT carries the same register check."""
    a = await afencer.acquire("job:1", 5)
    async with make_async_session() as session:
        a.bind(session)
        session.add(Audit(id=2, message="A, after B's grant"))
        await session.flush()
        redis_client.delete(a.key)  # A's lease runs out while it is paused
        b = await afencer.acquire("job:1", 5)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            await session.commit()
    assert (refused.value.statement, refused.value.newest_token) == ("COMMIT", b.token)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM audit")).scalar_one() == 0
    await b.release()


def test_fence_schema_given_the_same_metadata_twice_declares_the_register_once() -> None:
    """Two model modules that each call ``fence_schema(Base.metadata)`` share one register
    (and one scope table): the second call finds them instead of declaring them again."""
    metadata = sa.MetaData()
    sa_fence.fence_schema(metadata)
    sa_fence.fence_schema(metadata)
    assert sorted(metadata.tables) == ["sa_fence_leases", "sa_fence_scope"]
