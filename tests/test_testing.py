"""sa_fence.testing lets users reproduce an expired lease without sleeping."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.testing import expire
from tests.models import Job


def test_expire_ends_the_lease_in_redis_but_the_holder_still_believes_it_holds_it(
    fencer: sa_fence.Fencer, redis_client: redis.Redis, key_prefix: str
) -> None:
    lease = fencer.acquire("job:1", 30)
    assert expire(lease) is True
    assert redis_client.get(key_prefix + "job:1") is None
    assert not lease.released
    assert expire(lease) is False
    newer = fencer.acquire("job:1", 30)
    assert expire(lease) is False  # never removes another owner's lease
    assert newer.release() is True


def test_the_docstring_scenario_refuses_the_expired_holders_write(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    with fencer.lease("seed", 30) as seed, make_session() as session:
        seed.bind(session)
        session.add(Job(id=1, result="initial"))
        session.commit()
    a = fencer.acquire("job:1", ttl=30)
    session_a = a.bind(make_session())
    session_a.get(Job, 1).result = "A"
    expire(a)
    with fencer.lease("job:1", ttl=30) as b, make_session() as session_b:
        b.bind(session_b)
        session_b.get(Job, 1).result = "B"
        session_b.commit()
    with pytest.raises(sa_fence.StaleTokenError):
        session_a.commit()
    session_a.close()
