"""Redis stops answering mid-job: a private redis-server is paused with SIGSTOP,
then killed.  Renewal must notice, mark the lease lost only once its local
validity has run out, and the bound session must refuse to write."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.lease import protocol as proto
from tests._redis_server import RedisServer, private_redis
from tests._tools import wait_for
from tests.models import SEQUENCE, Job

TTL = 1.5  # renewals fall due every 0.5 s; the client gives up on a call after 0.2 s


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with private_redis() as srv:
        yield srv


def seed_job(fencer: sa_fence.Fencer, make_session: sessionmaker[Session]) -> None:
    with fencer.acquire("seed", 30) as lease, make_session() as session:
        lease.bind(session)
        session.add(Job(id=1, result="initial"))
        session.commit()


def test_redis_paused_then_killed_mid_job_marks_the_lease_lost_and_nothing_is_written(
    server: RedisServer,
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    key_prefix: str,
) -> None:
    fencer = sa_fence.Fencer(server.client(), engine, sequence=SEQUENCE, key_prefix=key_prefix)
    seed_job(fencer, make_session)
    lost_at: list[float] = []
    lost = threading.Event()

    def on_lost(lease: sa_fence.Lease) -> None:
        lost_at.append(time.monotonic())
        lost.set()

    lease = fencer.acquire("job:1", TTL, renew=True, on_lost=on_lost)
    valid_until = lease.acquired_at + TTL - proto.drift(int(TTL * 1000))
    session = lease.bind(make_session())
    session.get(Job, 1).result = "written while Redis was frozen"
    server.pause()  # SIGSTOP: Redis accepts connections but never answers
    # the first renewal (due at 0.5 s) times out after 0.2 s...
    wait_for(lambda: lease._renew_failures >= 1, 2 * TTL, "a timed-out renewal")
    assert not lease.lost  # ...and a timeout alone does not lose a lease still valid
    assert lost.wait(2 * TTL)
    assert lost_at[0] >= valid_until  # lost only once the local validity ran out
    assert lease.lost
    server.kill()  # and then Redis dies altogether
    with pytest.raises(sa_fence.LeaseLostError, match="could not be renewed"):
        session.commit()
    session.rollback()
    session.close()
    with pytest.raises(sa_fence.LeaseBackendError) as failed:
        lease.release()
    assert failed.value.operation == "release"
    with engine.connect() as conn:
        result = conn.execute(sa.text("SELECT result FROM jobs WHERE id = 1")).scalar_one()
    assert result == "initial"
    assert len(lost_at) == 1


def test_a_lease_on_a_redis_that_answers_again_in_time_is_kept(
    server: RedisServer, engine: sa.Engine, key_prefix: str
) -> None:
    """The pair of the test above: a pause shorter than the validity loses nothing."""
    fencer = sa_fence.Fencer(server.client(), engine, sequence=SEQUENCE, key_prefix=key_prefix)
    lease = fencer.acquire("job:1", TTL, renew=True)
    server.pause()
    wait_for(lambda: lease._renew_failures >= 1, 2 * TTL, "a timed-out renewal")
    server.resume()
    time.sleep(2 * TTL)
    assert not lease.lost
    lease.check()
    assert lease.release() is True


def test_the_flush_refuses_a_renewed_lease_past_its_validity_even_if_the_renewer_is_stuck(
    server: RedisServer,
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    key_prefix: str,
) -> None:
    """A client without socket_timeout blocks the renewer for as long as the OS
    waits; the validity check on the local clock does not wait for it."""
    client = server.client(socket_timeout=0.2)
    fencer = sa_fence.Fencer(client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    seed_job(fencer, make_session)
    lease = fencer.acquire("job:1", 0.5, renew=True)
    client.connection_pool.connection_kwargs["socket_timeout"] = None  # renewals now hang
    client.connection_pool.disconnect()
    session = lease.bind(make_session())
    session.get(Job, 1).result = "late"
    server.pause()
    time.sleep(2 * 0.5)
    assert lease.lost  # noticed on the local clock, while the renewer still waits
    with pytest.raises(sa_fence.LeaseLostError):
        session.commit()
    session.rollback()
    session.close()
    server.kill()  # frees the stuck renewer (connection reset)
