"""Auto-renewal on real Redis: it keeps a lease alive, notices the loss at once,
tells the holder, stops on release and leaves no thread behind.

Timing tests sleep at least twice the TTL; they wait for events rather than
racing a sleep against the renewer.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.lease.lifecycle import add_loss_hook
from sa_fence.lease.sync import Deadlines
from sa_fence.testing import expire
from tests._async_fixtures import expire as end
from tests._async_fixtures import no_renewal_tasks_left, renewal_tasks
from tests._fronts import entered, front, io, is_async
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE, Job

__all__ = ["front"]  # the fixture, imported for the tests below

TTL = 0.5


def renewer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sa-fence-renewer"]


def wait_for_no_renewer(timeout: float = 5.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while renewer_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return renewer_threads()


async def until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Wait (on the event loop, so that an async renewer runs) until ``condition()``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def gone(front: Any, client: redis.Redis, lease: Any) -> None:
    """End the lease in Redis now (owner-checked); its holder still believes it holds it."""
    if is_async(front):
        end(client, lease)
    else:
        expire(lease)  # sa_fence.testing's seam


async def renewers_left(front: Any) -> list[Any]:
    """The front end's renewers still running: the thread, or the lease's tasks."""
    if is_async(front):
        return await no_renewal_tasks_left()
    return wait_for_no_renewer()


async def test_a_renewed_lease_outlives_its_ttl_and_is_still_ours(
    front: Any, redis_client: redis.Redis
) -> None:
    async with entered(front.acquire("job:1", TTL, renew=True)) as lease:
        assert len(renewal_tasks() if is_async(front) else renewer_threads()) == 1
        await asyncio.sleep(4 * TTL)
        assert redis_client.get(lease.key) == f"{lease.owner}:{lease.token}".encode()
        assert not lease.lost
        lease.check()
        assert lease.remaining() > 0
    assert await renewers_left(front) == []


async def test_without_renewal_the_same_lease_has_expired_and_another_owner_can_take_it(
    front: Any, redis_client: redis.Redis
) -> None:
    """The pair of the test above."""
    lease = await io(front.acquire("job:1", TTL))
    await asyncio.sleep(4 * TTL)
    assert redis_client.get(lease.key) is None
    async with entered(front.acquire("job:1", 5)) as other:
        assert other.token > lease.token
    assert await io(lease.release()) is False


async def test_renewal_that_finds_another_owner_marks_the_lease_lost_and_tells_once(
    front: Any,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    redis_client: redis.Redis,
) -> None:
    told: list[Any] = []
    lease = await io(front.acquire("job:1", TTL, renew=True, on_lost=told.append))
    session = lease.bind(make_session())
    session.add(Job(id=1, result="A"))
    gone(front, redis_client, lease)  # the key is gone (e.g. Redis failed over)
    other = await io(front.acquire("job:1", 30))
    await until(lambda: told, 4 * TTL, "on_lost")
    assert told == [lease]
    assert lease.lost
    with pytest.raises(sa_fence.LeaseLostError, match="no longer ours"):
        lease.check()
    with pytest.raises(sa_fence.LeaseLostError, match="no longer ours"):
        session.commit()  # refused before any SQL: A's INSERT would have succeeded
    session.rollback()
    session.close()
    await asyncio.sleep(2 * TTL)
    assert told == [lease]  # once
    assert redis_client.get(other.key) == f"{other.owner}:{other.token}".encode()  # B untouched
    assert await renewers_left(front) == []  # the renewer stopped with its only lease
    assert await io(lease.release()) is False
    await io(other.release())
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 0


async def test_an_on_lost_callback_or_loss_hook_that_raises_is_logged_and_the_rest_still_run(
    front: Any, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """``on_lost`` and the loss hooks after it (``@fenced``'s cancel) are code of their own:
    one that raises is logged, the others still run, and the caller gets the LeaseLostError,
    not their exception."""
    ran: list[str] = []

    def callback(lease: Any) -> None:
        ran.append("on_lost")
        raise RuntimeError("the user's callback failed")

    def failing_hook() -> None:
        ran.append("failing hook")
        raise RuntimeError("a hook failed")

    lease = await io(front.acquire("job:1", 30, on_lost=callback))
    add_loss_hook(lease, failing_hook)
    add_loss_hook(lease, lambda: ran.append("next hook"))
    gone(front, redis_client, lease)
    with caplog.at_level(logging.ERROR), pytest.raises(sa_fence.LeaseLostError):
        await io(lease.extend())
    assert lease.lost
    assert ran == ["on_lost", "failing hook", "next hook"]
    assert "on_lost callback of lease 'job:1' raised" in caplog.text
    assert "loss hook of lease 'job:1' raised" in caplog.text
    assert "the user's callback failed" in caplog.text  # the traceback is logged


async def test_a_renewal_that_cannot_be_stopped_is_logged_and_the_loss_still_told(
    front: Any,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopping the renewal is the first step of a loss: should it fail, the loss is still
    counted, logged and told (on_lost, the loss hooks), and the caller still gets the
    LeaseLostError rather than that failure."""
    ran: list[str] = []
    lease = await io(
        front.acquire("job:1", 30, renew=True, on_lost=lambda _: ran.append("on_lost"))
    )
    add_loss_hook(lease, lambda: ran.append("hook"))
    stop = lease._stop_renewal

    def failing_stop() -> None:
        stop()  # (stopped all the same, so nothing outlives the test)
        raise RuntimeError("no running event loop")

    monkeypatch.setattr(lease, "_stop_renewal", failing_stop)
    gone(front, redis_client, lease)
    with caplog.at_level(logging.ERROR), pytest.raises(sa_fence.LeaseLostError):
        await io(lease.extend())
    assert ran == ["on_lost", "hook"]
    assert "could not stop the renewal of lease 'job:1'" in caplog.text
    monkeypatch.undo()
    assert await io(lease.release()) is False
    assert await renewers_left(front) == []


async def test_an_async_def_as_on_lost_is_refused_before_anything_is_written(
    front: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    """on_lost is called, not awaited: an async def given as one would never run (its
    coroutine dropped with a RuntimeWarning), so it is refused, naming what to pass."""

    async def handler(lease: Any) -> None: ...

    class Handler:
        async def __call__(self, lease: Any) -> None: ...

        async def method(self, lease: Any) -> None: ...

    for on_lost in (handler, functools.partial(handler), Handler(), Handler().method):
        with pytest.raises(TypeError, match=r"on_lost must be a plain callable.*asyncio\.Event"):
            await io(front.acquire("job:1", 30, renew=True, on_lost=on_lost))
        with pytest.raises(TypeError, match="on_lost must be a plain callable"):
            async with entered(front.acquire("job:1", 30, on_lost=on_lost)):
                pass
        with pytest.raises(TypeError, match="on_lost must be a plain callable"):
            sa_fence.fenced("job:{job_id}", ttl=30, on_lost=on_lost)
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []
    async with entered(front.acquire("job:1", 30, on_lost=lambda lease: None)) as lease:
        assert lease.token > 0  # a plain callable still is one


async def test_without_the_lost_check_the_flush_of_a_lost_lease_writes(
    front: Any,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above: the fence alone cannot stop this INSERT (no
    newer holder wrote the row), so only the lost check keeps it out."""
    lease_type = sa_fence.AsyncLease if is_async(front) else sa_fence.Lease
    monkeypatch.setattr(lease_type, "check", lambda self, for_write=False: None)
    told: list[Any] = []
    lease = await io(front.acquire("job:1", TTL, renew=True, on_lost=told.append))
    session = lease.bind(make_session())
    session.add(Job(id=1, result="A"))
    gone(front, redis_client, lease)
    await until(lambda: told, 4 * TTL, "on_lost")
    session.commit()
    session.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 1


async def test_renewal_stops_on_release_and_never_touches_the_next_owner(
    front: Any, redis_client: redis.Redis
) -> None:
    told: list[Any] = []
    lease = await io(front.acquire("job:1", TTL, renew=True, on_lost=told.append))
    assert await io(lease.release()) is True
    assert await renewers_left(front) == []
    other = await io(front.acquire("job:1", TTL))  # not renewed: it must expire on its own
    await asyncio.sleep(3 * TTL)
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


def test_releasing_the_last_renewed_lease_ends_the_renewer_at_once(
    fencer: sa_fence.Fencer,
) -> None:
    """The release cancels the lease's pending renewal, so the thread exits then, not at
    the renewal it would have sent 20 s later."""
    assert wait_for_no_renewer() == []
    lease = fencer.acquire("job:1", 30, renew=True)
    assert len(renewer_threads()) == 1
    time.sleep(0.2)  # the thread is asleep now, waiting for the renewal due in 20 s
    assert lease.release()
    assert wait_for_no_renewer(timeout=2.0) == []


def test_a_lease_due_before_the_one_the_renewer_waits_for_is_renewed_in_time(
    fencer: sa_fence.Fencer, redis_client: redis.Redis
) -> None:
    """The new, earlier deadline wakes the renewer thread from its wait for a later one."""
    slow = fencer.acquire("job:slow", 30, renew=True)  # renewed in 20 s
    time.sleep(0.2)  # the thread is asleep now, waiting for it
    fast = fencer.acquire("job:fast", TTL, renew=True)
    time.sleep(3 * TTL)
    assert not fast.lost
    assert redis_client.pttl(fast.key) > 0
    assert fast.release()
    assert slow.release()
    assert wait_for_no_renewer() == []


def test_an_action_that_raises_does_not_stall_the_deadlines_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One failing action is logged; the thread goes on to the next entry."""
    deadlines = Deadlines("sa-fence-test-deadlines")
    ran = threading.Event()

    def fail() -> None:
        raise RuntimeError("boom")

    now = time.monotonic()
    deadlines.add(now, fail)
    deadlines.add(now + 0.05, ran.set)
    assert ran.wait(5.0)
    assert "a scheduled sa-fence-test-deadlines action failed" in caplog.text


def test_a_cancelled_deadline_does_not_run_while_others_are_pending() -> None:
    """Cancelled entries stay in the heap (a cancel is O(1)) and are skipped when due."""
    deadlines = Deadlines("sa-fence-test-deadlines")
    ran: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    cancelled = deadlines.add(now + 0.05, ran.append, "cancelled")
    deadlines.add(now + 0.2, done.set)  # keeps the heap from being cleared
    deadlines.cancel(cancelled)
    assert done.wait(5.0)
    assert ran == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_with_no_renewals_of_its_parents_leases(
    fencer: sa_fence.Fencer,
) -> None:
    """The parent renews its leases; a child renewing them too would extend (and, once the
    parent released one, report lost) leases that are not its own."""
    lease = fencer.acquire("job:fork", 30, renew=True)
    try:
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once, no test machinery
            os._exit(len(fencer._renewals._live) + 10 * len(fencer._renewals._heap))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert len(fencer._renewals._live) == 1  # the parent's renewal is still scheduled
    finally:
        assert lease.release()


def test_a_renewal_the_acl_refuses_loses_the_lease_at_once_naming_the_acl(
    engine: sa.Engine, key_prefix: str
) -> None:
    """A set-up mistake (an ACL user without PEXPIRE) is not an outage: no resend passes it.
    It was resent until the lease's validity ran out, then lost "paused, or Redis did not
    answer"."""
    from tests._redis_server import private_redis
    from tests.models import SEQUENCE

    with private_redis() as server:
        admin = server.client(socket_timeout=2)
        admin.execute_command(
            "ACL", "SETUSER", "no_pexpire", "on", ">pw", "~*", "+@all", "-pexpire"
        )
        user = redis.Redis(port=server.port, username="no_pexpire", password="pw", socket_timeout=2)
        fencer = sa_fence.Fencer(user, engine, sequence=SEQUENCE, key_prefix=key_prefix)
        lost = threading.Event()
        reasons: list[str | None] = []

        def on_lost(lease: sa_fence.Lease) -> None:
            reasons.append(lease.lost_reason)
            lost.set()

        lease = fencer.acquire("job:acl", 3, renew=True, on_lost=on_lost)  # renewed at 2 s
        assert lost.wait(10)
        assert lease.lost
        assert reasons[0] is not None
        assert "could not be renewed" in reasons[0]
        assert "ACL" in reasons[0]  # (not "paused, or Redis did not answer")
        user.close()
        admin.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_leaving_the_parents_lease_block_does_not_release_it(
    fencer: sa_fence.Fencer, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A raw os.fork() inside `with fencer.acquire(...)`: the child runs the block's exit too,
    and its RELEASE (the owner is the parent's) deleted the parent's live lease."""
    with fencer.acquire("job:fork", 30) as lease:
        pid = os.fork()
        if pid == 0:  # the child: leave the block as the parent will, then exit at once
            try:
                released = lease.release()
            except BaseException:
                os._exit(3)
            os._exit(0 if released is False and lease.released else 2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert redis_client.get(key_prefix + "job:fork") is not None  # still the parent's
        assert not lease.released
    assert redis_client.get(key_prefix + "job:fork") is None  # the parent released it


def test_a_release_while_a_renewal_is_sent_schedules_no_next_renewal(
    fencer: sa_fence.Fencer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release lands after the renewal's answer, before its next one is scheduled
    (here due 30 s later): nothing is scheduled, so the thread exits then."""
    from sa_fence.lease import lifecycle

    renew = lifecycle.renew
    released = threading.Event()

    def renew_then_release(lease: Any) -> float | None:
        at = renew(lease)
        if released.is_set():
            return at
        assert at is not None
        assert lease.release()
        released.set()
        return time.monotonic() + 30

    monkeypatch.setattr(lifecycle, "renew", renew_then_release)
    assert wait_for_no_renewer() == []
    lease = fencer.acquire("job:1", TTL, renew=True)
    assert released.wait(10)
    assert lease.released
    assert wait_for_no_renewer() == []


def test_a_thousand_renewed_leases_share_one_thread_and_leave_none_behind(
    redis_client: redis.Redis, engine: sa.Engine, key_prefix: str
) -> None:
    """Sized by work, not by the machine's speed: the TTL leaves one thread time to send
    a thousand renewals on a loaded machine, and the test waits for every lease to be
    renewed and to outlive its TTL (bounded), rather than for a fixed time."""
    ttl = 6  # renewed every 2 s: 500 renewals a second, with 4 s of slack each
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    assert wait_for_no_renewer() == []
    before = threading.active_count()
    leases = [fencer.acquire(f"job:{i}", ttl, renew=True) for i in range(1000)]
    granted = time.monotonic()  # every SET of the leases was sent before this
    first_valid = [lease._state.valid_until for lease in leases]
    assert len(renewer_threads()) == 1
    assert threading.active_count() == before + 1
    deadline = granted + 120  # a bound for a loaded machine, never a wait in itself
    while time.monotonic() < granted + ttl or any(
        lease._state.valid_until <= valid for lease, valid in zip(leases, first_valid, strict=True)
    ):  # until every lease fell due and was renewed, and each is older than its TTL
        assert time.monotonic() < deadline, "the renewer did not renew every lease"
        assert not any(lease.lost for lease in leases)
        time.sleep(0.05)
    assert not any(lease.lost for lease in leases)
    # renewed in Redis: without renewal every key would be gone, each set over a TTL ago
    pipe = redis_client.pipeline(transaction=False)
    for lease in leases:
        pipe.pttl(lease.key)
    assert min(pipe.execute()) > 0
    assert all(lease.release() for lease in leases)
    assert wait_for_no_renewer() == []
    assert threading.active_count() == before
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []


def test_renewing_on_a_client_without_socket_timeout_warns_once_and_a_bounded_client_not(
    engine: sa.Engine, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A renewer on a client whose calls wait without bound runs on_lost late when Redis stops
    answering: the first renewed acquire says so (once per Fencer); one with a socket_timeout,
    or a lease that is not renewed, logs nothing."""
    unbounded = redis.Redis.from_url(REDIS_URL)  # socket_timeout None: redis-py's default
    bounded = redis.Redis.from_url(REDIS_URL, socket_timeout=1)
    try:
        with caplog.at_level("WARNING", logger="sa_fence"):
            for client, renews in ((bounded, True), (unbounded, False)):
                fencer = sa_fence.Fencer(client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
                fencer.acquire("job:1", 5, renew=renews).release()
            assert "without socket_timeout" not in caplog.text
            fencer = sa_fence.Fencer(unbounded, engine, sequence=SEQUENCE, key_prefix=key_prefix)
            for _ in range(2):
                fencer.acquire("job:1", 5, renew=True).release()
        assert caplog.text.count("renewed leases on a Redis client without socket_timeout") == 1
    finally:
        unbounded.close()
        bounded.close()


@pytest.mark.parametrize("release_first", [True, False], ids=["release-first", "extend-first"])
def test_a_renewal_answered_after_the_release_neither_loses_nor_renews_the_lease(
    fencer: sa_fence.Fencer, monkeypatch: pytest.MonkeyPatch, release_first: bool
) -> None:
    """The release lands while a renewal EXTEND is on its way.  Redis ran the release
    first: the EXTEND finds the key gone ("not ours"); or the EXTEND first: it extended a
    key the release then deleted.  Either answer is about a lease the holder already gave
    back, so it is ignored: no ``on_lost``, no loss logged, no next renewal scheduled."""
    from sa_fence.lease import lifecycle

    lost: list[Any] = []
    lease = fencer.acquire("job:1", 30, on_lost=lost.append)
    lease._state.renewing = True  # as renew=True sets it, with no renewer thread to race
    extend = fencer._extend

    def release_meanwhile(*, keys: list[str], args: list[Any]) -> Any:
        if release_first:
            assert lease.release()
        reply = extend(keys=keys, args=args)
        if not release_first:
            assert lease.release()
        return reply

    monkeypatch.setattr(fencer, "_extend", release_meanwhile)
    assert lifecycle.renew(lease) is None  # None: no next renewal
    assert lost == []
    assert lease.released
    assert not lease.lost
