"""A grant that timed out waiting for the register row names who holds it (issue 46 item 6).

A commit check holds its share lock on the lease's register row until its transaction ends,
so a transaction that ran the check early (``SET CONSTRAINTS ALL IMMEDIATE``) or was prepared
after it holds every newer grant of the name back.  The grant's LeaseBackendError, and
``sa-fence status``, name that backend (pid, state, since when) or that prepared transaction
(gid, owner, database), read after the wait (sa_fence.db.blockers).  Real servers, no mocks.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.cli import main as cli
from sa_fence.testing import expire
from tests._async_fixtures import expire as expire_async
from tests._pg_cluster import private_cluster
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE, Base, Job

#: The grants' lock_timeout here: short, the tests wait for it to run out.
WAIT_MS = 200


def new_name() -> str:
    return f"job:{uuid.uuid4().hex[:8]}"


def refused_grant(fencer: sa_fence.Fencer, name: str) -> str:
    """The message of the grant of ``name`` that waited WAIT_MS for the register row."""
    fencer._tokens.lock_timeout_ms = WAIT_MS
    with pytest.raises(sa_fence.LeaseBackendError) as refused:
        fencer.acquire(name, 5)
    message = str(refused.value)
    assert f"waited {WAIT_MS} ms for the lease register row of {name!r}" in message
    return message


@contextmanager
def checked_early(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], name: str, job_id: int
) -> Iterator[tuple[sa_fence.Lease, Session, int]]:
    """A bound session whose open transaction ran its commit check (SET CONSTRAINTS ALL
    IMMEDIATE), so it holds the register row of ``name`` until it ends; its lease has run
    out in Redis.  Yields (lease, session, backend pid); committed at the end."""
    lease = fencer.acquire(name, 30)
    with make_session() as session:
        lease.bind(session)
        session.add(Job(id=job_id, result="early"))
        session.flush()
        session.execute(sa.text("SET CONSTRAINTS ALL IMMEDIATE"))  # the check runs now
        pid = session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        assert expire(lease)  # the next grant of the name may go ahead, as far as Redis knows
        yield lease, session, pid
        session.commit()  # still the register's token: no grant went through


def test_a_grant_held_back_by_a_transaction_that_ran_its_check_early_names_its_backend(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    name = new_name()
    with checked_early(fencer, make_session, name, 1) as (_, _, pid):
        message = refused_grant(fencer, name)
    assert f"It is held by backend pid {pid} (idle in transaction, its transaction began" in message
    assert "Nothing was granted" in message
    fencer.acquire(name, 5).release()  # its transaction ended: the name is granted again


async def test_an_async_grant_held_back_names_the_backend_too(
    afencer: sa_fence.AsyncFencer,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    redis_client: redis.Redis,
) -> None:
    """The lookup runs in the AsyncFencer's greenlet, through its AsyncEngine's driver."""
    name = new_name()
    with checked_early(fencer, make_session, name, 2) as (_, _, pid):
        afencer._tokens.lock_timeout_ms = WAIT_MS
        with pytest.raises(sa_fence.LeaseBackendError) as refused:
            await afencer.acquire(name, 5)
    assert f"waited {WAIT_MS} ms" in str(refused.value)
    assert f"It is held by backend pid {pid} (" in str(refused.value)
    lease = await afencer.acquire(name, 5)
    assert expire_async(redis_client, lease)


def test_status_lists_the_register_rows_held_and_by_whom(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    key_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = new_name()
    url = engine.url.render_as_string(hide_password=False)
    base = ["status", "--sequence", SEQUENCE, "--url", url, "--redis", REDIS_URL]
    base += ["--key-prefix", key_prefix]
    with checked_early(fencer, make_session, name, 3) as (_, _, pid):
        shown = {}
        for args in ([name], [], ["--json", name]):
            assert cli.main([*base, *args]) == 0
            shown[len(args)], _ = capsys.readouterr()
    for out in shown[1], shown[0]:  # the name asked for; every name of the register
        assert "register rows held by a transaction" in out
        assert f"  {name}: backend pid {pid} (idle in transaction" in out
    (row,) = json.loads(shown[2])
    (blocker,) = row["blocked_by"]
    assert (blocker["name"], blocker["pid"], blocker["gid"]) == (name, pid, None)
    assert blocker["state"] == "idle in transaction"
    assert blocker["since"].endswith("+00:00")
    assert f"its transaction began {blocker['since']}, xid {blocker['xid']}" in shown[1]
    # once the transaction has ended, nothing is listed
    assert cli.main([*base, name]) == 0
    assert "register rows held" not in capsys.readouterr().out


def test_when_no_transaction_is_named_on_the_row_the_error_says_it_could_not_tell(
    fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    """A new name's grant waits for an uncommitted INSERT of the same name: no row is
    visible to read a holder from.  The error says so, and is still the grant's error."""
    name = new_name()
    fencer.acquire(new_name(), 5).release()  # checked: the grant of `name` goes straight on
    dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn) as inserting:
        inserting.execute(
            "INSERT INTO sa_fence_leases (name, token) VALUES (%s, %s)", [name, 2**62]
        )
        message = refused_grant(fencer, name)
        inserting.rollback()
    assert "sa-fence could not tell which backend holds it" in message
    assert "Nothing was granted" in message


@pytest.mark.slow  # a private cluster: the shared server has max_prepared_transactions = 0
def test_a_grant_held_back_by_a_prepared_transaction_names_its_gid(
    redis_client: redis.Redis, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with private_cluster("blockers", max_prepared_transactions=2) as cluster:
        url = cluster.create_database("blockers")
        engine = sa.create_engine(url)
        fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
        try:
            Base.metadata.create_all(engine)
            name = new_name()
            lease = fencer.acquire(name, 30)
            with sa_fence.install(sessionmaker(engine))() as session:
                lease.bind(session)
                session.add(Job(id=1, result="prepared"))
                session.flush()
                session.execute(sa.text("PREPARE TRANSACTION 'sa_fence_blocker'"))
            assert expire(lease)
            try:
                message = refused_grant(fencer, name)
                shown = url.render_as_string(hide_password=False)
                assert cli.main(
                    ["status", "--sequence", SEQUENCE, "--url", shown, "--redis", REDIS_URL,
                     "--key-prefix", key_prefix, name]
                ) == 0  # fmt: skip
                out = capsys.readouterr().out
            finally:
                cluster.sql("ROLLBACK PREPARED 'sa_fence_blocker'", "blockers")
            assert "It is held by prepared transaction 'sa_fence_blocker' (xid " in message
            assert "by 'postgres' in database 'blockers'" in message
            assert f"  {name}: prepared transaction 'sa_fence_blocker' (" in out
            fencer.acquire(name, 5).release()
        finally:
            fencer.close()
            engine.dispose()
