"""sa-fence through PgBouncer in transaction pooling mode (Debian's pgbouncer 1.18).

What has to work through it: the fenced flush, the token presented to a
guard trigger (``set_config(..., true)``: transaction-local, so it travels
with the transaction), the commit check sent with ``COMMIT`` in one
simple-query message, and the held token connection (autocommit).  What
does not work is psycopg's prepared statements: a transaction pooler before
1.21 hands them to other clients' server connections.  sa-fence refuses that
set-up with the fix (``prepare_threshold=None``), and the pair shows the
failure the refusal prevents.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import sessionmaker

import sa_fence
import sa_fence.testing
from sa_fence.cli import main as cli
from sa_fence.db import guard as _guard
from sa_fence.db import tokens as _tokens
from tests._fresh_db import fresh_database, url_of
from tests.conftest import PG_SERVER
from tests.models import SEQUENCE, Base, Job
from tests.topologies._servers import PgBouncer, pgbouncer

pytestmark = pytest.mark.slow

#: What docs/topologies.md tells PgBouncer users to pass (psycopg 3).
NO_PREPARE = {"prepare_threshold": None}


@pytest.fixture(scope="module")
def bouncer() -> Iterator[PgBouncer]:
    url = sa.make_url(PG_SERVER)
    user = url.username or "postgres"
    with pgbouncer(url.host or "127.0.0.1", url.port or 5432, [user]) as server:
        yield server


@pytest.fixture
def database() -> Iterator[sa.Engine]:
    """A fresh database (direct connection) with the models and a guard on jobs."""
    with fresh_database("pgbouncer") as direct:
        Base.metadata.create_all(direct)
        with direct.begin() as conn:
            for statement in _guard.create_guard_sql("jobs", sequence=SEQUENCE):
                conn.execute(sa.text(statement))
        yield direct


def through(bouncer: PgBouncer, direct: sa.Engine, **kwargs: Any) -> sa.Engine:
    return sa.create_engine(direct.url.set(host="127.0.0.1", port=bouncer.port), **kwargs)


def test_every_part_of_fencing_works_through_transaction_pooling(
    bouncer: PgBouncer, database: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    engine = through(bouncer, database, connect_args=NO_PREPARE, pool_size=4)
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    make_session = sa_fence.install(sessionmaker(engine))
    with fencer.acquire("seed", 30) as seed, make_session() as session:
        seed.bind(session)
        session.add_all([Job(id=1, result="0"), Job(id=2, result="initial")])
        session.commit()
    # Four workers, two server connections: each transaction (flush, guard,
    # commit check) and each token draw lands on whichever server is free.
    errors: list[BaseException] = []
    committed = [0]

    def worker() -> None:
        try:
            for _ in range(10):
                with (
                    fencer.acquire("job:1", 10, blocking=True, timeout=20) as lease,
                    make_session() as session,
                ):
                    lease.bind(session)
                    job = session.get(Job, 1)
                    assert job is not None
                    job.result = str(int(job.result or "0") + 1)
                    session.commit()
                    committed[0] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    with database.connect() as conn:
        assert conn.execute(sa.text("SELECT result FROM jobs WHERE id = 1")).scalar() == "40"
    assert committed[0] == 40  # nothing lost, nothing doubled

    # The commit check (lease scope) refuses a stale holder's commit.
    stale = fencer.acquire("job:1", 10)
    session = stale.bind(make_session())
    session.get(Job, 2).result = "stale"  # a row the newer holder never writes
    sa_fence.testing.expire(stale)
    with fencer.acquire("job:1", 10) as newer, make_session() as other:
        newer.bind(other)
        other.get(Job, 1).result = "newer"
        other.commit()
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session.commit()
    session.close()
    assert refused.value.statement == "COMMIT"

    # PostgreSQL holds lease scope at COMMIT through the pooler too: the arm
    # travels in each transaction's BEGIN message to whichever server
    # connection the transaction lands on, and the scope table is permanent,
    # so a COMMIT the client sends itself is refused for a stale holder.
    stale = fencer.acquire("job:1", 10)
    with make_session() as session:
        stale.bind(session)
        session.execute(sa.text("INSERT INTO audit (id, message) VALUES (99, 'stale, raw COMMIT')"))
        sa_fence.testing.expire(stale)
        with fencer.acquire("job:1", 10), pytest.raises(sa_fence.StaleTokenError):
            session.execute(sa.text("COMMIT"))
        session.rollback()
    with database.connect() as conn:
        notes = conn.execute(sa.text("SELECT count(*) FROM audit WHERE message LIKE 'stale%'"))
        assert notes.scalar_one() == 0

    # The guard is live through PgBouncer: a write that presents no token is refused.
    with pytest.raises(sa.exc.DBAPIError, match="sa-fence"), engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET result = 'unfenced' WHERE id = 2"))
    with database.connect() as conn:
        assert conn.execute(sa.text("SELECT result FROM jobs WHERE id = 2")).scalar() == "initial"
    fencer.close()
    engine.dispose()


async def test_the_async_fencer_works_through_transaction_pooling(
    bouncer: PgBouncer, database: sa.Engine, key_prefix: str
) -> None:
    import redis.asyncio as aioredis

    from tests.conftest import REDIS_URL

    engine = create_async_engine(
        database.url.set(drivername="postgresql+psycopg_async", port=bouncer.port),
        connect_args=NO_PREPARE,
    )
    client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
    fencer = sa_fence.AsyncFencer(client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    tokens = []
    for _ in range(12):  # past psycopg's prepare threshold of 5
        async with fencer.acquire("job:1", 10) as lease:
            tokens.append(lease.token)
    assert tokens == sorted(tokens)
    await fencer.close()
    await client.aclose()
    await engine.dispose()


def test_psycopg_preparing_statements_behind_pgbouncer_is_refused_at_set_up(
    bouncer: PgBouncer, database: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    engine = through(bouncer, database)  # psycopg's default: prepare after 5 runs
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    with pytest.raises(sa_fence.FencingConfigError, match="prepare_threshold") as refused:
        fencer.acquire("job:1", 5)
    assert "connection pooler" in str(refused.value)
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []  # nothing written
    engine.dispose()


def test_without_the_set_up_refusal_prepared_token_draws_break_behind_pgbouncer(
    bouncer: PgBouncer,
    database: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above: two fencers' held token connections prepare
    the token statement under the same name on the server connection PgBouncer
    hands them in turn, and a draw fails (classified as the same set-up
    mistake, with the same fix)."""
    monkeypatch.setattr(_tokens, "pooler_problem", lambda conn: None)
    engine = through(bouncer, database)
    fencers = [
        sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
        for _ in range(2)
    ]

    def draw_in_turn() -> None:
        for n in range(12):
            for fencer in fencers:
                fencer.acquire(f"job:{n}", 5).release()

    with pytest.raises(sa_fence.FencingConfigError, match="prepare_threshold") as refused:
        draw_in_turn()
    assert "prepared statement" in str(refused.value)
    for fencer in fencers:
        fencer.close()
    engine.dispose()


def test_check_runs_through_pgbouncer_and_says_the_url_reaches_a_pooler(
    bouncer: PgBouncer, database: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sa-fence check`` prepares nothing, so it works behind a transaction
    pooler, and it tells what a Fencer on that URL needs (its pair: a direct
    URL gets no note, tests/cli/test_check.py)."""
    with database.begin() as conn:  # every fenced table guarded: nothing else to report
        for statement in _guard.create_guard_sql("cells", sequence=SEQUENCE):
            conn.execute(sa.text(statement))
    engine = through(bouncer, database)
    status = cli.main(["check", "--url", url_of(engine)])
    out, err = capsys.readouterr()
    engine.dispose()
    assert err == ""
    assert status == 0, out
    assert "through a connection pooler" in out
    assert "prepare_threshold" in out
