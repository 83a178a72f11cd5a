"""sa_fence.testing lets users reproduce an expired lease without sleeping."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import redis
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.testing import expire, pause, resume
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
    with fencer.acquire("seed", 30) as seed, make_session() as session:
        seed.bind(session)
        session.add(Job(id=1, result="initial"))
        session.commit()
    a = fencer.acquire("job:1", ttl=30)
    session_a = a.bind(make_session())
    session_a.get(Job, 1).result = "A"
    expire(a)
    with fencer.acquire("job:1", ttl=30) as b, make_session() as session_b:
        b.bind(session_b)
        session_b.get(Job, 1).result = "B"
        session_b.commit()
    with pytest.raises(sa_fence.StaleTokenError):
        session_a.commit()
    session_a.close()


async def test_expire_ends_an_async_lease_when_awaited(
    afencer: sa_fence.AsyncFencer, redis_client: redis.Redis, key_prefix: str
) -> None:
    lease = await afencer.acquire("job:1", 30)
    assert await expire(lease) is True
    assert redis_client.get(key_prefix + "job:1") is None
    assert not lease.released
    assert await expire(lease) is False


def test_the_helpers_refuse_what_they_cannot_act_on_before_acting() -> None:
    """A wrong object, or a timeout that is no positive number, is refused before any signal
    is sent: the child is never left stopped by a call that then raised."""
    for wrong in (None, "job:1"):
        with pytest.raises(TypeError, match=r"expire\(\) takes a lease"):
            expire(wrong)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"subprocess\.Popen"):
        pause(None)  # type: ignore[arg-type]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for timeout in (-1, 0, math.nan, "1", True):
            with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
                pause(child, timeout=timeout)  # type: ignore[arg-type]
            assert _state(child.pid) != "T"  # not stopped
        pause(child)
        assert _state(child.pid) == "T"
        with pytest.raises(ValueError, match="timeout"):
            resume(child, timeout=-1)
        assert _state(child.pid) == "T"  # still stopped: nothing sent
        resume(child)
        assert _state(child.pid) != "T"
    finally:
        child.kill()
        child.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
