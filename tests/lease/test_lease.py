"""Leases on real Redis with tokens from the real sequence."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import sa_fence
from sa_fence.lease import protocol
from sa_fence.orm import session_state
from tests._fronts import entered, front, io
from tests.models import Job

__all__ = ["front"]  # the fixture, imported for the tests below


def keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*"))


async def warm_up(front: Any) -> None:
    """One grant first: the front end's first draws connect (and, on an AsyncEngine,
    initialise the dialect), which a very short lease should not have to wait for."""
    await io((await io(front.acquire("warm-up", 5))).release())


# Lifecycle tests run against both front ends (tests/_fronts.py).


async def test_a_second_owner_gets_lease_not_acquired_naming_the_holders_token(
    front: Any,
) -> None:
    async with entered(front.acquire("job:1", 5)) as held:
        with pytest.raises(sa_fence.LeaseNotAcquiredError) as contention:
            await io(front.acquire("job:1", 5))
        assert contention.value.name == "job:1"
        assert contention.value.holder_token == held.token
    assert held.released
    await io((await io(front.acquire("job:1", 5))).release())  # free again


async def test_the_lease_stores_a_secret_owner_and_its_token_in_one_key(
    front: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    a = await io(front.acquire("job:1", 5))
    b = await io(front.acquire("job:2", 5))
    assert len(a.owner) == 32
    assert int(a.owner, 16) >= 0
    assert a.owner != b.owner
    assert redis_client.get(key_prefix + "job:1") == f"{a.owner}:{a.token}".encode()
    assert 4000 < redis_client.pttl(key_prefix + "job:1") <= 5000
    await io(a.release())
    await io(b.release())


async def test_tokens_of_successive_grants_strictly_increase(front: Any) -> None:
    tokens = []
    for _ in range(5):
        async with entered(front.acquire("job:1", 5)) as lease:
            tokens.append(lease.token)
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 5


async def test_release_after_expiry_leaves_the_new_owners_lease_alone(
    front: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    await warm_up(front)  # so that the 0.2 s lease is not spent connecting
    a = await io(front.acquire("job:1", 0.2))
    time.sleep(0.5)  # A's TTL runs out
    b = await io(front.acquire("job:1", 5))
    assert await io(a.release()) is False
    assert redis_client.get(key_prefix + "job:1") == f"{b.owner}:{b.token}".encode()
    assert await io(b.release()) is True
    assert redis_client.get(key_prefix + "job:1") is None


async def test_release_is_idempotent(front: Any) -> None:
    lease = await io(front.acquire("job:1", 5))
    assert await io(lease.release()) is True
    assert await io(lease.release()) is False
    assert lease.released


async def test_binding_a_released_lease_is_refused_and_leaves_the_session_unbound(
    front: Any, make_session: Any, engine: sa.Engine
) -> None:
    lease = await io(front.acquire("job:1", 5))
    await io(lease.release())
    with make_session() as session:
        with pytest.raises(sa_fence.LeaseLostError, match=r"was released.*not bound"):
            lease.bind(session)
        assert session_state.bound_lease(session) is None
        session.add(Job(id=1, result="unbound"))  # a session as it was: no lease to write with
        with pytest.raises(sa_fence.UnfencedWriteError):
            session.flush()
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(Job)).scalar_one() == 0


async def test_extend_sets_a_new_ttl_rather_than_adding(
    front: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    async with entered(front.acquire("job:1", 5)) as lease:
        await io(lease.extend(30))
        assert 29000 < redis_client.pttl(key_prefix + "job:1") <= 30000
        await io(lease.extend(2))
        assert redis_client.pttl(key_prefix + "job:1") <= 2000
        await io(lease.extend())  # back to the lease's own ttl
        assert 4000 < redis_client.pttl(key_prefix + "job:1") <= 5000


async def test_extend_after_the_lease_was_lost_raises_and_touches_nothing(
    front: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    await warm_up(front)  # so that the 0.2 s lease is not spent connecting
    a = await io(front.acquire("job:1", 0.2))
    time.sleep(0.5)  # A's TTL runs out
    with pytest.raises(sa_fence.LeaseLostError, match="no longer ours"):
        await io(a.extend(10))
    assert a.lost
    assert redis_client.get(key_prefix + "job:1") is None  # not resurrected
    b = await io(front.acquire("job:1", 5))
    with pytest.raises(sa_fence.LeaseLostError):
        await io(a.extend(10))
    assert 4000 < redis_client.pttl(key_prefix + "job:1") <= 5000  # B's ttl untouched
    await io(b.release())
    with pytest.raises(sa_fence.LeaseLostError, match="released"):
        await io(b.extend())


async def test_the_context_manager_releases_when_the_body_raises(
    front: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    with pytest.raises(RuntimeError):
        async with entered(front.acquire("job:1", 5)):
            raise RuntimeError("work failed")
    assert keys(redis_client, key_prefix) == []
    lease = await io(front.acquire("job:2", 5))
    with pytest.raises(RuntimeError):
        async with entered(lease):
            raise RuntimeError("work failed")
    assert keys(redis_client, key_prefix) == []


async def test_acquire_is_the_one_way_awaited_or_entered(
    front: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    """``acquire()`` is the one call for both uses, on both front ends: its result is the
    lease (awaited, on the asyncio one), and entered with ``with``/``async with`` it releases
    on exit; there is no second context-manager method to learn."""
    assert not hasattr(front, "lease")
    async with entered(front.acquire("job:1", 5, renew=True, fail_fast=False)) as lease:
        assert lease.name == "job:1"
        assert keys(redis_client, key_prefix) == [(key_prefix + "job:1").encode()]
    assert keys(redis_client, key_prefix) == []
    lease = await io(front.acquire("job:2", 5))
    assert lease.token > 0
    await io(lease.release())


async def test_an_async_acquire_runs_once_and_one_never_started_warns(
    afencer: sa_fence.AsyncFencer, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The asyncio ``acquire()`` sends nothing until awaited or entered; a second await
    is refused, and one never started warns as a coroutine never awaited does.  It is a
    coroutine: ``asyncio.create_task`` runs it."""
    pending = afencer.acquire("job:1", 5)
    assert keys(redis_client, key_prefix) == []  # nothing sent yet
    lease = await pending
    with pytest.raises(RuntimeError, match="already awaited"):
        await pending
    await lease.release()
    with pytest.warns(RuntimeWarning, match=r"never awaited nor entered, so no lease was taken"):
        afencer.acquire("job:2", 5).__del__()
    assert keys(redis_client, key_prefix) == []
    task = asyncio.create_task(afencer.acquire("job:3", 5))
    lease = await task
    assert lease.name == "job:3"
    await lease.release()


async def test_the_write_check_leaves_local_validity_to_the_fence_unless_fail_fast(
    front: Any,
) -> None:
    """``check(for_write=True)`` is the flush's check, public: past its local validity
    a plain lease may still write (the fence and the register decide), a
    ``fail_fast`` one may not; a released one never."""
    await warm_up(front)  # so that the 0.2 s leases are not spent connecting
    plain = await io(front.acquire("job:1", 0.2))
    strict = await io(front.acquire("job:2", 0.2, fail_fast=True))
    time.sleep(0.5)  # both past their local validity (over twice the TTL)
    plain.check(for_write=True)  # no error: nothing is known lost
    with pytest.raises(sa_fence.LeaseLostError, match="local validity"):
        plain.check()  # the plain check still counts the clock
    with pytest.raises(sa_fence.LeaseLostError, match="local validity"):
        strict.check(for_write=True)
    assert plain.lost_reason is None
    assert strict.lost_reason is None
    await io(plain.release())
    await io(strict.release())
    with pytest.raises(sa_fence.LeaseLostError, match="released"):
        plain.check(for_write=True)


async def test_lost_reason_is_what_the_lost_lease_raises(front: Any) -> None:
    await warm_up(front)
    lease = await io(front.acquire("job:1", 0.2))
    assert lease.lost_reason is None
    time.sleep(0.5)  # its TTL runs out (over twice the TTL)
    with pytest.raises(sa_fence.LeaseLostError, match="no longer ours"):
        await io(lease.extend(10))
    assert lease.lost
    assert lease.lost_reason is not None
    with pytest.raises(sa_fence.LeaseLostError) as raised:
        lease.check(for_write=True)
    assert str(raised.value) == lease.lost_reason


def expire_between_set_and_token(
    fencer: sa_fence.Fencer, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """A stalls after SET NX (its 200 ms TTL runs out) and B is granted the lease
    before A draws its token: A's token will be larger than the live holder's."""
    seen: dict[str, Any] = {}
    original = fencer._tokens.next_token

    def stalled_next_token(name: str) -> int:
        if "b" not in seen:
            seen["b"] = None
            time.sleep(0.5)
            seen["b"] = fencer.acquire("job:1", 5)
        return original(name)

    monkeypatch.setattr(fencer._tokens, "next_token", stalled_next_token)
    return seen


def test_a_token_drawn_after_the_lease_expired_is_thrown_away(
    fencer: sa_fence.Fencer,
    monkeypatch: pytest.MonkeyPatch,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    seen = expire_between_set_and_token(fencer, monkeypatch)
    with pytest.raises(sa_fence.LeaseLostError, match="thrown away"):
        fencer.acquire("job:1", 0.2)
    b = seen["b"]
    assert redis_client.get(key_prefix + "job:1") == f"{b.owner}:{b.token}".encode()


def register_token(engine: sa.Engine, name: str) -> int | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT token FROM sa_fence_leases WHERE name = :n"), {"n": name}
        ).scalar()


def commit_a_job(lease: sa_fence.Lease, make_session: Any) -> None:
    with make_session() as session:
        lease.bind(session)
        session.add(Job(id=1, result="B"))
        session.commit()


def test_a_withdrawn_grant_leaves_the_live_holder_able_to_commit(
    fencer: sa_fence.Fencer, monkeypatch: pytest.MonkeyPatch, engine: sa.Engine, make_session: Any
) -> None:
    """A's token, drawn after B's grant, reached the register before A learned its
    lease was gone: A withdraws it, so B (the live holder) is not fenced out."""
    seen = expire_between_set_and_token(fencer, monkeypatch)
    with pytest.raises(sa_fence.LeaseLostError, match="thrown away"):
        fencer.acquire("job:1", 0.2)
    b = seen["b"]
    assert register_token(engine, "job:1") == b.token
    commit_a_job(b, make_session)  # not refused
    b.release()


def test_without_the_withdrawal_the_live_holder_is_fenced_out(
    fencer: sa_fence.Fencer, monkeypatch: pytest.MonkeyPatch, engine: sa.Engine, make_session: Any
) -> None:
    """The pair of the test above."""
    seen = expire_between_set_and_token(fencer, monkeypatch)
    monkeypatch.setattr(fencer._tokens, "withdraw", lambda name, token: None)
    with pytest.raises(sa_fence.LeaseLostError, match="thrown away"):
        fencer.acquire("job:1", 0.2)
    b = seen["b"]
    assert register_token(engine, "job:1") != b.token
    with pytest.raises(sa_fence.StaleTokenError, match="commit refused"):
        commit_a_job(b, make_session)
    b.release()


def test_without_the_confirmation_the_expired_holder_gets_a_larger_token_than_the_live_one(
    fencer: sa_fence.Fencer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair of the test above: drop the confirm script and token order breaks."""
    seen = expire_between_set_and_token(fencer, monkeypatch)
    monkeypatch.setattr(fencer, "_confirm", lambda keys, args: 1000)
    a = fencer.acquire("job:1", 0.2)
    assert a.token > seen["b"].token  # A would now fence out the real holder B


@pytest.mark.parametrize(
    ("name", "ttl", "error", "match"),
    [
        ("", 5, ValueError, "lease name must be 1 to"),
        ("x" * 2000, 5, ValueError, "lease name must be 1 to"),
        (42, 5, TypeError, "lease name must be a str"),
        ("job", 0, ValueError, "ttl must be a finite number of seconds"),
        ("job", -1, ValueError, "ttl must be a finite number of seconds"),
        ("job", math.nan, ValueError, "ttl must be a finite number of seconds"),
        ("job", math.inf, ValueError, "ttl must be a finite number of seconds"),
        ("job", "5", TypeError, "ttl must be a number of seconds"),
        ("job", True, TypeError, "ttl must be a number of seconds"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error_and_nothing_written(
    fencer: sa_fence.Fencer,
    redis_client: redis.Redis,
    key_prefix: str,
    name: Any,
    ttl: Any,
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        fencer.acquire(name, ttl)
    assert keys(redis_client, key_prefix) == []


def test_a_sub_millisecond_ttl_rounds_up_to_one_millisecond() -> None:
    assert protocol.ttl_to_ms(0.0001) == 1
    assert protocol.ttl_to_ms(1.5) == 1500


def test_install_takes_effect_on_every_new_sessionmaker_even_at_a_reused_address(
    engine: Any,
) -> None:
    """SQLAlchemy's event registry remembers a collected sessionmaker class by
    its id(); a new one at the same address must still get the hook."""
    import gc

    from sqlalchemy.orm import sessionmaker

    from sa_fence.orm.flush import is_installed

    missing = 0
    for _ in range(25):
        maker = sa_fence.install(sessionmaker(engine))
        with maker() as session:
            missing += not is_installed(session)
        sa_fence.uninstall(maker)
        sa_fence.uninstall(maker)  # idempotent
        with maker() as session:
            missing += is_installed(session)
        sa_fence.install(maker)
        del maker
        gc.collect()
    assert missing == 0
