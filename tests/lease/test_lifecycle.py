"""Lease lifecycle on real servers: bounded blocking acquire, contention versus
failure, idempotent retries after a lost reply, and local validity."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis
import sqlalchemy as sa
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence._failures import BACKEND_ATTEMPTS, OUTAGE, Backoff, Failure
from sa_fence.lease import lifecycle as _lifecycle
from sa_fence.lease import protocol as proto
from sa_fence.lease import sync as _lease
from tests._fronts import front, io, is_async
from tests._redis_server import free_port
from tests._tcp_proxy import TcpProxy
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE, Job

__all__ = ["front"]  # the fixture, imported for the tests below


def keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*"))


def job_row(engine: sa.Engine, job_id: int) -> tuple[Any, ...] | None:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT result, fence FROM jobs WHERE id = :id"), {"id": job_id}
        ).one_or_none()
    return None if found is None else tuple(found)


class FakeClock:
    """Stands in for the ``time`` module of sa_fence.lease.sync and _lifecycle: sleeping
    advances it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(_lease, "time", fake)
    monkeypatch.setattr(_lifecycle, "time", fake)
    return fake


@pytest.fixture
def front_clock(front: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """``clock`` for both front ends: the async one sleeps through it as well (the
    sync one's ``time.sleep`` is the clock's already)."""
    if is_async(front):
        monkeypatch.setattr(front, "_sleep", clock.sleep)
    return clock


@pytest_asyncio.fixture
async def kin(front: Any) -> AsyncIterator[Callable[..., Any]]:
    """Make a fencer of ``front``'s kind (same prefix and engine unless given) whose
    Redis client connects to ``port`` with no retries of its own."""
    made: list[Any] = []
    db = int(redis.connection.parse_url(REDIS_URL).get("db", 0))

    def make(port: int, engine: Any = None, **client: Any) -> Any:
        engine = front.engine if engine is None else engine
        if is_async(front):
            r: Any = aioredis.Redis(port=port, db=db, retry=AsyncRetry(NoBackoff(), 0), **client)
            made.append(r)
            return sa_fence.AsyncFencer(r, engine, sequence=SEQUENCE, key_prefix=front.key_prefix)
        r = redis.Redis(port=port, db=db, retry=Retry(NoBackoff(), 0), **client)
        return sa_fence.Fencer(r, engine, sequence=SEQUENCE, key_prefix=front.key_prefix)

    yield make
    for r in made:
        await r.aclose()


def down_engine(front: Any, engine: sa.Engine) -> Any:
    """An engine of ``front``'s kind whose PostgreSQL does not answer."""
    url = engine.url.set(port=free_port())
    if is_async(front):
        return create_async_engine(
            url.set(drivername="postgresql+psycopg_async"), poolclass=sa.pool.NullPool
        )
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


# ------------------------------------------------------------ the pure policy


def test_every_backoff_wait_lies_between_zero_and_its_exponential_ceiling() -> None:
    backoff = Backoff(base=0.02, cap=1.0)
    rng = random.Random(7)
    for attempt in range(40):
        ceiling = backoff.ceiling(attempt)
        assert ceiling == min(1.0, 0.02 * 2**attempt)
        for _ in range(50):
            assert 0 <= backoff.delay(attempt, rng.random()) <= ceiling
    # full jitter: the whole range is used, not just its top
    assert backoff.delay(10, 0.0) == 0.0


def test_a_contention_wait_never_goes_past_the_deadline() -> None:
    attempts = proto.AcquireAttempts(deadline=10.0)
    now, waits = 0.0, []
    while (wait := attempts.on_held(now, 0.999)) is not None:
        waits.append(wait)
        now += wait
    assert now == pytest.approx(10.0)
    assert all(w <= proto.CONTENTION_BACKOFF.cap for w in waits)


def test_validity_is_the_ttl_minus_a_drift_allowance_from_the_send_time() -> None:
    assert proto.valid_until(100.0, 10_000) == pytest.approx(100.0 + 10 - 0.102)
    assert proto.valid_until(0.0, 1) < 0.001  # a tiny lease is never valid for long


def _state(valid_until: float = 10.0) -> proto.LeaseState:
    return proto.LeaseState(
        name="job:1", token=5, valid_until=valid_until, fail_fast=True, renewing=True
    )


def test_a_renewal_that_times_out_is_retried_no_later_than_the_validity_then_lost() -> None:
    state = _state(valid_until=10.0)
    kw: dict[str, Any] = {"sent_at": 0, "ttl_ms": 3000, "fraction": 1 / 3, "rand": 0.999}
    step = proto.after_renewal(state, outcome="unknown", now=9.99, failures=50, **kw)
    assert step.lost is None
    assert 9.99 <= step.at <= 10.0
    step = proto.after_renewal(state, outcome="unknown", now=10.0, failures=0, **kw)
    assert step.lost is not None
    assert "could not be renewed" in step.lost


def test_a_renewal_that_finds_another_owner_is_lost_at_once_and_lost_only_once() -> None:
    state = _state()
    kw: dict[str, Any] = {"sent_at": 0, "ttl_ms": 3000, "fraction": 1 / 3, "rand": 0.5}
    step = proto.after_renewal(state, outcome="not-ours", now=1.0, failures=0, **kw)
    assert step.lost is not None
    assert state.mark_lost(step.lost) is True
    assert state.mark_lost(step.lost) is False  # on_lost runs once
    assert state.problem(1.0, for_write=True) == step.lost


def test_a_successful_renewal_moves_the_validity_and_schedules_the_next() -> None:
    state = _state(valid_until=3.0)
    step = proto.after_renewal(
        state,
        outcome="extended",
        now=1.1,
        sent_at=1.0,
        ttl_ms=3000,
        fraction=1 / 3,
        failures=0,
        rand=0.5,
    )
    assert step.lost is None
    assert step.at == pytest.approx(2.0)
    assert state.valid_until == pytest.approx(1.0 + 3.0 - proto.drift(3000))


def test_a_released_lease_is_never_marked_lost() -> None:
    state = _state()
    state.released = True
    assert state.mark_lost("gone") is False
    assert state.problem(0.0, for_write=True) is not None


def test_after_a_lost_acquire_reply_validity_counts_from_the_first_send_that_may_have_set_it() -> (
    None
):
    """A timed-out ACQUIRE may have set the key: the lease then runs from that send, not
    from the resend that was answered; a HELD answer in between proves it set nothing."""
    lost = Failure(OUTAGE, may_have_set=True, text="timeout")
    attempts = proto.AcquireAttempts(deadline=10.0)
    assert attempts.on_failure(lost, sent_at=1.0, now=3.0, rand=0.0) is not None
    assert attempts.on_failure(lost, sent_at=3.1, now=4.0, rand=0.0) is not None
    assert attempts.sent(4.5) == 1.0  # the first send that may have set it
    attempts.on_held(4.6, 0.0)  # another owner holds it: nothing of ours was set
    assert attempts.sent(5.0) == 5.0
    refused = Failure(OUTAGE, may_have_set=False, text="connection refused")
    attempts = proto.AcquireAttempts(deadline=10.0)
    attempts.on_failure(refused, sent_at=1.0, now=1.1, rand=0.0)
    assert attempts.sent(2.0) == 2.0  # a connection never made set nothing


@pytest.mark.parametrize(
    ("first_sent", "now", "deleted"),
    [
        (1.0, 5.0, True),  # sent and found gone within the validity: only our delete
        (1.0, 10.5, False),  # found gone after the validity ran out: it may have expired
        (10.5, 11.0, False),  # sent after the validity ran out
    ],
)
def test_a_release_resent_after_a_lost_reply_counts_a_gone_key_only_within_the_validity(
    first_sent: float, now: float, deleted: bool
) -> None:
    state = _state(valid_until=10.0)
    kw: dict[str, Any] = {"first_sent": first_sent, "now": now}
    assert proto.release_deleted(state, deleted=False, resent=True, **kw) is deleted
    assert proto.release_deleted(state, deleted=False, resent=False, **kw) is False
    assert proto.release_deleted(state, deleted=True, resent=True, **kw) is True


# -------------------------------------------------------- blocking acquire


async def test_a_blocking_acquire_waits_with_bounded_jittered_backoff_and_gives_up_at_its_timeout(
    front: Any, front_clock: FakeClock
) -> None:
    clock = front_clock
    holder = await io(front.acquire("job:1", 30))
    started = clock.now
    with pytest.raises(sa_fence.LeaseNotAcquiredError) as busy:
        await io(front.acquire("job:1", 30, blocking=True, timeout=5))
    assert busy.value.holder_token == holder.token
    assert busy.value.waited == pytest.approx(5.0)
    assert "after waiting 5 s" in str(busy.value)
    assert clock.now - started == pytest.approx(5.0)  # never past the timeout
    assert len(clock.sleeps) > 5  # it retried, rather than sleeping once
    for attempt, slept in enumerate(clock.sleeps):
        assert slept <= proto.CONTENTION_BACKOFF.ceiling(attempt) + 1e-9
    await io(holder.release())


async def test_a_blocking_acquire_without_timeout_waits_at_most_one_ttl(
    front: Any, front_clock: FakeClock
) -> None:
    clock = front_clock
    holder = await io(front.acquire("job:1", 30))
    started = clock.now
    with pytest.raises(sa_fence.LeaseNotAcquiredError):
        await io(front.acquire("job:1", 3, blocking=True))
    assert clock.now - started == pytest.approx(3.0)
    await io(holder.release())


async def test_a_non_blocking_acquire_of_a_held_lease_does_not_wait(
    front: Any, front_clock: FakeClock
) -> None:
    holder = await io(front.acquire("job:1", 30))
    with pytest.raises(sa_fence.LeaseNotAcquiredError) as busy:
        await io(front.acquire("job:1", 30))
    assert front_clock.sleeps == []
    assert busy.value.waited is None
    await io(holder.release())


def test_a_blocking_acquire_gets_the_lease_once_the_holder_lets_go(
    fencer: sa_fence.Fencer,
) -> None:
    holder = fencer.acquire("job:1", 30)
    threading.Timer(0.3, holder.release).start()
    started = time.monotonic()
    with fencer.acquire("job:1", 30, blocking=True, timeout=10) as waiter:
        assert 0.25 < time.monotonic() - started < 5
        assert waiter.token > holder.token


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"blocking": True, "timeout": -1}, ValueError, "timeout must be a finite number"),
        ({"blocking": True, "timeout": math.nan}, ValueError, "timeout must be a finite"),
        ({"blocking": True, "timeout": math.inf}, ValueError, "timeout must be a finite"),
        ({"blocking": True, "timeout": "5"}, TypeError, "timeout must be a number"),
        ({"timeout": 5}, ValueError, "has no effect without blocking=True"),
        ({"blocking": "yes"}, TypeError, "blocking must be True or False"),
        ({"renew": 1}, TypeError, "renew must be True or False"),
        ({"on_lost": "print"}, TypeError, "on_lost must be a callable"),
        ({"fail_fast": "no"}, TypeError, "fail_fast must be True, False or None"),
    ],
)
def test_bad_lifecycle_arguments_are_refused_before_anything_is_written(
    fencer: sa_fence.Fencer,
    redis_client: redis.Redis,
    key_prefix: str,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        fencer.acquire("job:1", 5, **kwargs)
    assert keys(redis_client, key_prefix) == []


@pytest.mark.parametrize("fraction", [0, -0.1, 0.9, 1, math.nan])
def test_a_renew_fraction_out_of_range_is_refused_saying_what_it_means(
    redis_client: redis.Redis, engine: sa.Engine, fraction: float
) -> None:
    with pytest.raises(ValueError, match=r"renew_fraction must be in \(0, 0.75\]"):
        sa_fence.Fencer(redis_client, engine, renew_fraction=fraction)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"renew_fraction": "0.5"}, TypeError, "renew_fraction must be a number"),
        ({"renew_fraction": True}, TypeError, "renew_fraction must be a number"),
        ({"key_prefix": 3}, TypeError, "key_prefix must be a str, got int"),
        # refused when made, not at the first acquire (which sent them to the servers)
        ({"timeout": 3e6}, ValueError, "<= 2147483"),  # PostgreSQL's lock_timeout: int ms
        ({"sequence": "a\x00b"}, ValueError, "control character"),
        ({"sequence": ""}, ValueError, "sequence must be a non-empty string"),
        ({"telemetry": "junk"}, TypeError, "telemetry must be a sa_fence.telemetry.Telemetry"),
        ({"telemetry": sa_fence.telemetry.Telemetry}, TypeError, "telemetry must be"),
    ],
)
def test_bad_fencer_arguments_are_refused_by_type(
    redis_client: redis.Redis,
    engine: sa.Engine,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        sa_fence.Fencer(redis_client, engine, **kwargs)


# ------------------------------------------------------ contention vs failure


async def test_redis_unreachable_is_a_backend_error_not_contention(
    front: Any, kin: Callable[..., Any]
) -> None:
    fencer = kin(free_port(), socket_connect_timeout=0.2)
    started = time.monotonic()
    with pytest.raises(sa_fence.LeaseBackendError) as failed:
        await io(fencer.acquire("job:1", 5, blocking=True, timeout=1))
    assert time.monotonic() - started < 5  # bounded
    assert not isinstance(failed.value, sa_fence.LeaseNotAcquiredError)
    assert isinstance(failed.value, sa_fence.FenceError)
    assert failed.value.backend == "redis"
    assert failed.value.operation == "acquire"
    assert isinstance(failed.value.cause, redis.exceptions.ConnectionError)
    # the message names the cause; the client's chain of connection errors is not
    # printed after it (issue 10: one refused connection printed 127-159 lines)
    assert failed.value.__cause__ is None
    assert failed.value.__suppress_context__
    # redis-py's own words for ECONNREFUSED differ between its sync and asyncio clients
    refused = "Error 111 connecting" if is_async(front) else "Connection refused"
    assert refused in str(failed.value)


async def test_postgresql_failing_at_token_time_is_a_backend_error_and_the_lease_is_released(
    front: Any, kin: Callable[..., Any], redis_client: redis.Redis, engine: sa.Engine
) -> None:
    down = down_engine(front, engine)
    fencer = kin(front_port(), down, socket_timeout=5)
    fencer._tokens.checked = True  # the sequence was fine at start-up; then PG went away
    with pytest.raises(sa_fence.LeaseBackendError) as failed:
        await io(fencer.acquire("job:1", 30))
    assert failed.value.backend == "postgresql"
    assert failed.value.operation == "token"
    assert isinstance(failed.value.cause, sa.exc.OperationalError)
    await io(fencer.close())
    assert keys(redis_client, front.key_prefix) == []  # the granted lease was given back
    await io(down.dispose())


async def test_postgresql_unreachable_at_the_first_acquire_is_a_backend_error_and_nothing_is_set(
    front: Any, kin: Callable[..., Any], redis_client: redis.Redis, engine: sa.Engine
) -> None:
    down = down_engine(front, engine)
    fencer = kin(front_port(), down, socket_timeout=5)
    with pytest.raises(sa_fence.LeaseBackendError) as failed:
        await io(fencer.acquire("job:1", 30))
    assert (failed.value.backend, failed.value.operation) == ("postgresql", "check")
    assert keys(redis_client, front.key_prefix) == []
    await io(down.dispose())


def front_port() -> int:
    return int(redis.connection.parse_url(REDIS_URL).get("port", 6379))


# ---------------------------------------------------- a reply lost on the wire


@pytest.fixture
def proxy() -> Any:
    url = redis.connection.parse_url(REDIS_URL)
    with TcpProxy((url.get("host", "127.0.0.1"), int(url.get("port", 6379)))) as p:
        yield p


def load_scripts(fencer: Any, client: redis.Redis) -> None:
    """Load the scripts first, so the armed request is the EVALSHA that runs
    (not one answered NOSCRIPT and resent by redis-py)."""
    for script in (fencer._acquire, fencer._confirm, fencer._extend, fencer._release):
        client.script_load(script.script)


@pytest.fixture
def proxied(
    proxy: TcpProxy, kin: Callable[..., Any], redis_client: redis.Redis
) -> Callable[[], Any]:
    """Make a fencer of the front end's kind that talks to Redis through ``proxy``."""

    def make() -> Any:
        fencer = kin(proxy.port, socket_timeout=2)
        load_scripts(fencer, redis_client)
        return fencer

    return make


@pytest.mark.slow
@pytest.mark.parametrize("withdraw", [True, False], ids=["withdrawn", "without-the-withdrawal"])
async def test_a_confirm_that_gets_no_answer_withdraws_its_token_from_the_register(
    front: Any,
    kin: Callable[..., Any],
    proxy: TcpProxy,
    fencer: sa_fence.Fencer,
    redis_client: redis.Redis,
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    withdraw: bool,
) -> None:
    """A's key ends and B is granted the name before A draws its (larger) token; then A's
    Redis stops answering, so A's CONFIRM fails with its outcome unknown. The token was
    never handed out: kept in the register, it refused every commit of B, the live holder."""
    from tests.lease.test_confirm_withdraw import LostBeforeConfirm, commit_a_job, register_token

    a = kin(proxy.port, socket_timeout=0.5)
    load_scripts(a, redis_client)

    class HeldAtConfirm(LostBeforeConfirm):
        def end(self, key: str, name: str) -> None:
            super().end(key, name)
            proxy.hold()  # A's connection to Redis: no answer from now on

    seam = HeldAtConfirm(a, fencer, redis_client, taken_over=True, monkeypatch=monkeypatch)
    if not withdraw:
        monkeypatch.setattr(a._tokens, "withdraw", lambda name, token: None)
    with pytest.raises(sa_fence.LeaseBackendError, match="confirm"):
        await io(a.acquire("job:1", 5))
    proxy.heal()
    b = seam.b
    assert b is not None
    if withdraw:
        assert register_token(engine, "job:1") == b.token
        commit_a_job(b, make_session)  # the live holder is not fenced out
    else:  # the pair: the unused token stays, and fences the live holder out
        assert register_token(engine, "job:1") == b.token + 1
        with pytest.raises(sa_fence.StaleTokenError, match="commit refused"):
            commit_a_job(b, make_session)
    b.release()


async def test_an_acquire_whose_reply_was_lost_is_retried_and_recognised_as_ours(
    front: Any,
    proxied: Callable[[], Any],
    proxy: TcpProxy,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    fencer = proxied()
    proxy.drop_reply_to(key_prefix.encode() + b"job:1")
    lease = await io(fencer.acquire("job:1", 30))
    assert proxy.dropped == 1  # Redis executed the first attempt; its reply was lost
    # exactly one owner: this lease, with its token recorded
    assert redis_client.get(key_prefix + "job:1") == f"{lease.owner}:{lease.token}".encode()
    with pytest.raises(sa_fence.LeaseNotAcquiredError):
        await io(front.acquire("job:1", 30))
    assert await io(lease.release()) is True


async def test_without_the_owner_check_a_lost_acquire_reply_turns_into_false_contention(
    front: Any,
    proxied: Callable[[], Any],
    proxy: TcpProxy,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """The pair of the test above: a plain SET NX, resent, finds its own lease
    and reports contention; the lease it holds is never used nor released."""
    fencer = proxied()
    fencer._acquire = fencer.redis.register_script(
        "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end "
        "return redis.call('GET', KEYS[1])"
    )
    load_scripts(fencer, redis_client)
    proxy.drop_reply_to(key_prefix.encode() + b"job:1")
    with pytest.raises(sa_fence.LeaseNotAcquiredError):
        await io(fencer.acquire("job:1", 30))
    stranded = redis_client.get(key_prefix + "job:1")
    assert stranded is not None  # our own lease blocks everyone until it expires
    redis_client.delete(key_prefix + "job:1")


@pytest.mark.parametrize("clean_up", [True, False], ids=["cleaned-up", "without-clean-up"])
async def test_an_acquire_given_up_after_lost_replies_removes_what_it_set(
    clean_up: bool,
    proxied: Callable[[], Any],
    proxy: TcpProxy,
    redis_client: redis.Redis,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every ACQUIRE runs and every reply is lost: the acquire gives up with a
    LeaseBackendError, and the lease Redis granted it (it cannot know) is released
    by owner before the error is raised, so the name is free at once.  The pair
    (``without-clean-up``): the key stays, and nobody gets the name for the TTL."""
    if not clean_up:  # (the async front end runs the shared one in its greenlet)
        monkeypatch.setattr(_lifecycle.FencerCore, "_release_quietly", lambda *args: None)
    fencer = proxied()
    proxy.drop_reply_to(fencer._acquire.sha.encode(), times=None)  # only ACQUIRE's EVALSHA
    with pytest.raises(sa_fence.LeaseBackendError, match="acquire"):
        await io(fencer.acquire("job:1", 30))
    assert proxy.dropped >= BACKEND_ATTEMPTS  # (redis-py may resend within a call too)
    left = redis_client.get(key_prefix + "job:1")
    if clean_up:
        assert left is None
    else:
        assert left is not None
        assert ":" not in left.decode()  # the owner alone: granted, never confirmed
        redis_client.delete(key_prefix + "job:1")


async def test_a_confirm_whose_reply_was_lost_is_retried_and_still_succeeds(
    front: Any,
    proxied: Callable[[], Any],
    proxy: TcpProxy,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    fencer = proxied()
    original = fencer._next_token

    def arm(token: int) -> int:
        proxy.drop_reply_to(f":{token}".encode())  # only CONFIRM carries "<owner>:<token>"
        return token

    async def token_then_arm_async(name: str) -> int:
        return arm(await original(name))

    def token_then_arm(name: str) -> int:
        return arm(original(name))

    fencer._next_token = token_then_arm_async if is_async(front) else token_then_arm
    lease = await io(fencer.acquire("job:1", 30))
    assert proxy.dropped == 1
    assert redis_client.get(key_prefix + "job:1") == f"{lease.owner}:{lease.token}".encode()
    assert await io(lease.release()) is True


async def test_a_release_whose_reply_was_lost_still_reports_that_it_released(
    front: Any,
    proxied: Callable[[], Any],
    proxy: TcpProxy,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    fencer = proxied()
    lease = await io(fencer.acquire("job:1", 30))
    proxy.drop_reply_to(f"{lease.owner}:{lease.token}".encode())
    assert await io(lease.release()) is True
    assert proxy.dropped == 1
    assert redis_client.get(key_prefix + "job:1") is None


async def test_an_extend_whose_reply_was_lost_is_retried_and_extends(
    front: Any,
    proxied: Callable[[], Any],
    proxy: TcpProxy,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    fencer = proxied()
    lease = await io(fencer.acquire("job:1", 5))
    proxy.drop_reply_to(f"{lease.owner}:{lease.token}".encode())
    await io(lease.extend(60))
    assert proxy.dropped == 1
    assert not lease.lost
    assert redis_client.pttl(key_prefix + "job:1") > 50_000
    assert lease.remaining() > 50
    await io(lease.release())


# ------------------------------------------------------------- local validity


async def test_check_and_remaining_follow_the_local_validity_on_the_monotonic_clock(
    front: Any, front_clock: FakeClock
) -> None:
    clock = front_clock
    lease = await io(front.acquire("job:1", 10))
    assert lease.remaining() == pytest.approx(10 - proto.drift(10_000))
    lease.check()
    clock.now += 10
    assert lease.remaining() == 0.0
    with pytest.raises(sa_fence.LeaseLostError, match="outlived its local validity"):
        lease.check()
    assert not lease.lost  # not renewed: nobody has seen it gone
    await io(lease.release())


def _write_after_validity(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], clock: FakeClock, **kw: Any
) -> None:
    with fencer.acquire("seed", 30) as seed, make_session() as session:
        seed.bind(session)
        session.add(Job(id=1, result="initial"))
        session.commit()
    lease = fencer.acquire("job:1", 30, **kw)
    with make_session() as session:
        lease.bind(session)
        session.get(Job, 1).result = "late"
        clock.now += 31  # past the local validity; Redis has not noticed yet
        try:
            session.commit()
        finally:
            session.rollback()
            lease.release()


def test_a_fail_fast_lease_refuses_to_flush_once_its_local_validity_has_passed(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    clock: FakeClock,
) -> None:
    with pytest.raises(sa_fence.LeaseLostError, match="outlived its local validity"):
        _write_after_validity(fencer, make_session, clock, fail_fast=True)
    assert job_row(engine, 1)[0] == "initial"  # type: ignore[index]


def test_a_renewed_lease_past_its_validity_is_refused_at_the_flush_unasked(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    clock: FakeClock,
) -> None:
    """A renewed lease whose renewal never came (its renewer stuck: here, none runs)
    is lost once its local validity passes, noticed by the flush's own check even
    when nobody asked ``lease.lost`` first, and without ``fail_fast``."""
    with fencer.acquire("seed", 30) as seed, make_session() as session:
        seed.bind(session)
        session.add(Job(id=1, result="initial"))
        session.commit()
    lease = fencer.acquire("job:1", 30)
    lease._state.renewing = True  # as renew=True sets it, with no renewer thread to race
    with make_session() as session:
        lease.bind(session)
        session.get(Job, 1).result = "late"
        clock.now += 31  # past the local validity, no renewal answered
        try:
            with pytest.raises(sa_fence.LeaseLostError):
                session.commit()
        finally:
            session.rollback()
            lease.release()
    assert job_row(engine, 1)[0] == "initial"  # type: ignore[index]


def test_without_fail_fast_the_same_late_write_goes_through_as_the_fence_allows_it(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    clock: FakeClock,
) -> None:
    """The pair of the test above: no newer holder wrote, so only the local
    validity check could have stopped this write."""
    _write_after_validity(fencer, make_session, clock, fail_fast=False)
    assert job_row(engine, 1)[0] == "late"  # type: ignore[index]


async def test_the_context_manager_logs_instead_of_raising_when_redis_is_gone_at_release(
    front: Any, caplog: pytest.LogCaptureFixture, redis_client: redis.Redis
) -> None:
    """Leaving the block does not raise over the body's outcome.  A sync lease is marked
    released before its delete is sent; an async one only once Redis answers, so it can
    be released again once Redis is back (both documented on ``release()``)."""
    lease = await io(front.acquire("job:1", 30))
    live, gone = lease.fencer, {"port": free_port(), "socket_connect_timeout": 0.2}
    if is_async(front):
        dead: Any = aioredis.Redis(**gone, retry=AsyncRetry(NoBackoff(), 0))
        lease.fencer = sa_fence.AsyncFencer(dead, front.engine, key_prefix=front.key_prefix)
        leave = lease.__aexit__
    else:
        dead = redis.Redis(**gone, retry=Retry(NoBackoff(), 0))
        lease.fencer = sa_fence.Fencer(dead, front.engine, key_prefix=front.key_prefix)
        leave = lease.__exit__
    try:
        with caplog.at_level(logging.WARNING, logger="sa_fence"):
            await io(leave(None, None, None))
    finally:
        await io(dead.aclose() if is_async(front) else dead.close())
    assert "its TTL will end it" in caplog.text
    lease.fencer = live
    if is_async(front):
        assert not lease.released
        assert await lease.release() is True  # Redis is back: the retry deletes it
    else:
        assert redis_client.pttl(lease.key) > 0  # left to its TTL
        redis_client.delete(lease.key)
    assert lease.released


def test_the_lifecycle_guide_answers_every_checklist_point_and_tabulates_failures() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md").read_text()
    for n in range(1, 7):
        assert f"### {n}. " in text, f"checklist point {n} is not answered"
    assert "## Failure modes" in text
    assert "| Failure | Detected by |" in text
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "@sa_fence.fenced(" in readme  # the decorator is in the README quickstart
