"""Auto-renewal on real Redis: it keeps a lease alive, notices the loss at once,
tells the holder, stops on release and leaves no thread behind.

Timing tests sleep at least twice the TTL; they wait for events rather than
racing a sleep against the renewer.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.testing import expire
from tests.models import SEQUENCE, Job

TTL = 0.5


def renewer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sa-fence-renewer"]


def wait_for_no_renewer(timeout: float = 5.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while renewer_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return renewer_threads()


def test_a_renewed_lease_outlives_its_ttl_and_is_still_ours(
    fencer: sa_fence.Fencer, redis_client: redis.Redis
) -> None:
    with fencer.lease("job:1", TTL, renew=True) as lease:
        time.sleep(4 * TTL)
        assert redis_client.get(lease.key) == f"{lease.owner}:{lease.token}".encode()
        assert not lease.lost
        lease.check()
        assert lease.remaining() > 0
    assert wait_for_no_renewer() == []


def test_without_renewal_the_same_lease_has_expired_and_another_owner_can_take_it(
    fencer: sa_fence.Fencer, redis_client: redis.Redis
) -> None:
    """The pair of the test above."""
    lease = fencer.acquire("job:1", TTL)
    time.sleep(4 * TTL)
    assert redis_client.get(lease.key) is None
    with fencer.lease("job:1", 5) as other:
        assert other.token > lease.token
    assert lease.release() is False


def test_renewal_that_finds_another_owner_marks_the_lease_lost_and_tells_once(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    redis_client: redis.Redis,
) -> None:
    told: list[sa_fence.Lease] = []
    lost = threading.Event()

    def on_lost(lease: sa_fence.Lease) -> None:
        told.append(lease)
        lost.set()

    lease = fencer.acquire("job:1", TTL, renew=True, on_lost=on_lost)
    session = lease.bind(make_session())
    session.add(Job(id=1, result="A"))
    expire(lease)  # the key is gone (e.g. Redis failed over) and B takes the name
    other = fencer.acquire("job:1", 30)
    assert lost.wait(4 * TTL)
    assert told == [lease]
    assert lease.lost
    with pytest.raises(sa_fence.LeaseLostError, match="no longer ours"):
        lease.check()
    with pytest.raises(sa_fence.LeaseLostError, match="no longer ours"):
        session.commit()  # refused before any SQL: A's INSERT would have succeeded
    session.rollback()
    session.close()
    time.sleep(2 * TTL)
    assert told == [lease]  # once
    assert redis_client.get(other.key) == f"{other.owner}:{other.token}".encode()  # B untouched
    assert wait_for_no_renewer() == []  # the renewer stopped with its only lease
    assert lease.release() is False
    other.release()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 0


def test_without_the_lost_check_the_flush_of_a_lost_lease_writes(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above: the fence alone cannot stop this INSERT (no
    newer holder wrote the row), so only the lost check keeps it out."""
    monkeypatch.setattr(sa_fence.Lease, "_check_for_write", lambda self: None)
    lost = threading.Event()
    lease = fencer.acquire("job:1", TTL, renew=True, on_lost=lambda _: lost.set())
    session = lease.bind(make_session())
    session.add(Job(id=1, result="A"))
    expire(lease)
    assert lost.wait(4 * TTL)
    session.commit()
    session.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 1


def test_renewal_stops_on_release_and_never_touches_the_next_owner(
    fencer: sa_fence.Fencer, redis_client: redis.Redis
) -> None:
    told: list[sa_fence.Lease] = []
    lease = fencer.acquire("job:1", TTL, renew=True, on_lost=told.append)
    assert lease.release() is True
    assert wait_for_no_renewer() == []
    other = fencer.acquire("job:1", TTL)  # not renewed: it must expire on its own
    time.sleep(3 * TTL)
    assert redis_client.get(other.key) is None
    assert told == []  # a released lease is not "lost"
    assert not lease.lost


def test_a_renewed_lease_dropped_without_release_stops_being_renewed(
    fencer: sa_fence.Fencer, redis_client: redis.Redis
) -> None:
    key = fencer.acquire("job:1", TTL, renew=True).key  # the Lease object is dropped
    gc.collect()
    time.sleep(3 * TTL)
    assert redis_client.get(key) is None
    assert wait_for_no_renewer() == []


def test_a_thousand_renewed_leases_share_one_thread_and_leave_none_behind(
    redis_client: redis.Redis, engine: sa.Engine, key_prefix: str
) -> None:
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    assert wait_for_no_renewer() == []
    before = threading.active_count()
    leases = [fencer.acquire(f"job:{i}", 3, renew=True) for i in range(1000)]
    assert len(renewer_threads()) == 1
    assert threading.active_count() == before + 1
    time.sleep(2.0)  # every lease falls due (after 1 s) while we wait
    assert not any(lease.lost for lease in leases)
    # renewed: without renewal the first leases would have under 1 s left
    pipe = redis_client.pipeline(transaction=False)
    for lease in leases:
        pipe.pttl(lease.key)
    assert min(pipe.execute()) > 1500
    assert all(lease.release() for lease in leases)
    assert wait_for_no_renewer() == []
    assert threading.active_count() == before
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []
