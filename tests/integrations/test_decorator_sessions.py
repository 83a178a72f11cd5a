"""@fenced where frameworks call it (issue 12): session factories and scoped
sessions, a visible signature, a JSON-serializable skip, nested calls on the
same name, and max_hold.  Real PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import pickle
import threading
import time
import uuid
from typing import Any, ClassVar

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
)
from sqlalchemy.orm import Session, scoped_session, sessionmaker

import sa_fence
import sa_fence.testing
from sa_fence.integrations import decorators
from tests._async_fixtures import row as job
from tests.models import SEQUENCE, Job


class RecordingSession(Session):
    """A Session that remembers every instance and whether it was closed."""

    made: ClassVar[list[RecordingSession]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closed = False
        RecordingSession.made.append(self)

    def close(self) -> None:
        self.closed = True
        super().close()


@pytest.fixture
def factory(engine: sa.Engine) -> sessionmaker[Session]:
    RecordingSession.made = []
    return sa_fence.install(sessionmaker(engine, class_=RecordingSession))


def keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*"))


# ------------------------------------------------------------ session factory


def test_a_session_factory_gives_each_call_its_own_session_bound_committed_and_closed(
    fencer: sa_fence.Fencer,
    factory: sessionmaker[Session],
    engine: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=factory)
    def finish(job_id: int, result: str) -> tuple[int, Session]:
        session = sa_fence.current_session()
        session.merge(Job(id=job_id, result=result))
        return sa_fence.current_lease().token, session

    token_1, session_1 = finish(1, "one")
    token_2, session_2 = finish(2, "two")
    assert session_1 is not session_2
    assert RecordingSession.made == [session_1, session_2]
    assert session_1.closed
    assert session_2.closed
    assert job(engine, 1) == ("one", token_1)  # committed, with the lease's token
    assert job(engine, 2) == ("two", token_2)
    assert keys(redis_client, key_prefix) == []  # released
    with pytest.raises(LookupError, match=r"outside a @sa_fence\.fenced call"):
        sa_fence.current_session()


def test_a_factory_session_is_rolled_back_and_closed_when_the_body_raises(
    fencer: sa_fence.Fencer, factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=factory)
    def fail(job_id: int) -> None:
        sa_fence.current_session().merge(Job(id=job_id, result="half"))
        sa_fence.current_session().flush()
        raise RuntimeError("the job failed")

    with pytest.raises(RuntimeError, match="the job failed"):
        fail(3)
    assert job(engine, 3) is None
    assert [s.closed for s in RecordingSession.made] == [True]


def test_a_factory_without_the_hook_is_refused_naming_install_and_writes_nothing(
    fencer: sa_fence.Fencer, engine: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    plain = sessionmaker(engine)  # no sa_fence.install()
    name = f"unhooked:{uuid.uuid4().hex}"

    @sa_fence.fenced(name + ":{job_id}", ttl=30, fencer=fencer, session=plain)
    def finish(job_id: int) -> None:
        sa_fence.current_session().merge(Job(id=job_id, result="unfenced"))

    drawn = last_token(engine)
    with pytest.raises(sa_fence.FencingConfigError, match=r"sa_fence\.install\(\)"):
        finish(4)
    assert job(engine, 4) is None
    assert keys(redis_client, key_prefix) == []
    # refused before the lease: no token drawn, no register row
    assert (last_token(engine), registered(engine, name)) == (drawn, [])


async def test_an_async_factory_without_the_hook_is_refused_before_the_lease_too(
    afencer: sa_fence.AsyncFencer, async_engine: Any, engine: sa.Engine
) -> None:
    """The same order for an async def: the session is checked before the grant."""
    name = f"unhooked-async:{uuid.uuid4().hex}"

    @sa_fence.fenced(name, ttl=30, fencer=afencer, session=async_sessionmaker(async_engine))
    async def finish() -> None:
        raise AssertionError("the body must not run")

    drawn = last_token(engine)
    with pytest.raises(sa_fence.FencingConfigError, match=r"sa_fence\.install\(\)"):
        await finish()
    assert (last_token(engine), registered(engine, name)) == (drawn, [])


def test_a_plain_callable_factory_is_checked_to_return_a_session(
    fencer: sa_fence.Fencer, engine: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    name = f"unchecked:{uuid.uuid4().hex}"

    @sa_fence.fenced(name + ":{job_id}", ttl=30, fencer=fencer, session=lambda: "not a session")
    def finish(job_id: int) -> None:
        raise AssertionError("the body must not run")

    with pytest.raises(TypeError, match="returned a str, not a Session"):
        finish(5)
    assert keys(redis_client, key_prefix) == []
    assert registered(engine, name) == []


def last_token(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT last_value FROM {SEQUENCE}")).scalar_one())


def registered(engine: sa.Engine, prefix: str) -> list[str]:
    """The lease register's names that start with ``prefix``."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT name FROM sa_fence_leases WHERE starts_with(name, :p)"), {"p": prefix}
        )
        return list(rows.scalars())


def test_a_scoped_session_runs_on_its_current_session_and_leaves_it_open(
    fencer: sa_fence.Fencer, factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    registry = scoped_session(factory)

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=registry)
    def finish(job_id: int) -> Session:
        registry.merge(Job(id=job_id, result="scoped"))
        return sa_fence.current_session()

    try:
        used = finish(6)
        assert used is registry()  # this thread's session, not a new one
        assert not used.closed  # the registry owns it
        assert job(engine, 6)[0] == "scoped"  # type: ignore[index]
    finally:
        registry.remove()


@pytest.mark.parametrize("cancel_on_lost", [True, False])
async def test_an_async_scoped_session_keyed_on_the_task_gives_the_body_the_fenced_session(
    make_async_session: async_sessionmaker[AsyncSession],
    afencer: sa_fence.AsyncFencer,
    async_engine: AsyncEngine,
    engine: sa.Engine,
    cancel_on_lost: bool,
) -> None:
    """``async_scoped_session(..., scopefunc=asyncio.current_task)``, as SQLAlchemy suggests:
    the body, run in the caller's task whether or not a loss may cancel it, finds the session
    the call bound and commits in the registry.  (A body run in a task of its own got a second
    session: its writes were never committed and its connection stayed checked out.)"""
    registry = async_scoped_session(make_async_session, scopefunc=asyncio.current_task)

    @sa_fence.fenced(
        "job:{job_id}", ttl=30, fencer=afencer, session=registry, cancel_on_lost=cancel_on_lost
    )
    async def finish(job_id: int) -> bool:
        await registry.merge(Job(id=job_id, result="scoped"))  # the registry, as usual
        return registry() is sa_fence.current_session()

    try:
        assert await finish(8) is True
        assert job(engine, 8)[0] == "scoped"  # type: ignore[index]
        assert len(registry.registry.registry) == 1  # type: ignore[attr-defined]
    finally:
        await registry.remove()
    assert async_engine.sync_engine.pool.checkedout() == 0


def test_a_named_attribute_may_hold_a_sessionmaker(
    fencer: sa_fence.Fencer, factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    class Jobs:
        def __init__(self) -> None:
            self.fencer, self.Session = fencer, factory

        @sa_fence.fenced("job:{job_id}", ttl=30, session="Session")
        def finish(self, job_id: int) -> None:
            sa_fence.current_session().merge(Job(id=job_id, result="by attribute"))

    Jobs().finish(7)
    assert job(engine, 7)[0] == "by attribute"  # type: ignore[index]
    assert RecordingSession.made[0].closed


# ------------------------------------------------------------------ signature


def test_the_wrapped_signature_is_what_inspect_and_getfullargspec_see(
    fencer: sa_fence.Fencer, factory: sessionmaker[Session]
) -> None:
    """Celery's send-time argument check reads inspect.getfullargspec."""

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=factory)
    def finish(job_id: int, result: str = "done", *, force: bool = False) -> None: ...

    @sa_fence.fenced("job:{job_id}", ttl=30)
    async def finish_async(self: Any, job_id: int) -> None: ...

    spec = inspect.getfullargspec(finish)
    assert spec.args == ["job_id", "result"]
    assert spec.defaults == ("done",)
    assert spec.kwonlyargs == ["force"]
    assert spec.varargs is None
    assert spec.varkw is None
    assert str(inspect.signature(finish)) == str(inspect.signature(finish.__wrapped__))  # type: ignore[attr-defined]
    assert inspect.getfullargspec(finish_async).args == ["self", "job_id"]
    assert inspect.iscoroutinefunction(finish_async)
    assert finish.__name__ == "finish"


# ----------------------------------------------------------------------- skip


def test_skipped_serializes_as_json_and_still_compares_equal_after_the_round_trip() -> None:
    assert json.dumps(sa_fence.SKIPPED) == '"sa_fence.SKIPPED"'
    assert json.loads(json.dumps({"result": sa_fence.SKIPPED})) == {"result": sa_fence.SKIPPED}
    assert pickle.loads(pickle.dumps(sa_fence.SKIPPED)) is sa_fence.SKIPPED
    assert repr(sa_fence.SKIPPED) == "sa_fence.SKIPPED"
    assert str(sa_fence.SKIPPED) == "sa_fence.SKIPPED"


# --------------------------------------------------------------- nested calls


class Jobs:
    """Two repository methods on one name: finish() calls record()."""

    def __init__(self, session: Session, fencer: sa_fence.Fencer) -> None:
        self.session, self.fencer = session, fencer
        self.acquired = 0

    @sa_fence.fenced("job:{job_id}", ttl=30)
    def record(self, job_id: int, result: str) -> int:
        self.session.merge(Job(id=job_id, result=result))
        return int(sa_fence.current_lease().token)

    @sa_fence.fenced("job:{job_id}", ttl=30)
    def finish(self, job_id: int, fail_after: bool = False) -> tuple[int, int]:
        outer = sa_fence.current_lease().token
        inner = self.record(job_id, "finished")  # the same name: reuses the lease
        if fail_after:
            raise RuntimeError("failed after the nested call")
        return outer, inner


def count_acquires(fencer: sa_fence.Fencer) -> list[str]:
    calls: list[str] = []
    original = fencer.acquire

    def spy(name: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return original(name, *args, **kwargs)

    fencer.acquire = spy  # type: ignore[method-assign]
    return calls


def test_a_nested_call_on_the_same_name_reuses_the_held_lease_instead_of_waiting_for_itself(
    make_session: sessionmaker[Session],
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    calls = count_acquires(fencer)
    with make_session() as session:
        outer, inner = Jobs(session, fencer).finish(8)
    assert outer == inner
    assert calls == ["job:8"]  # acquired once
    assert job(engine, 8) == ("finished", outer)
    assert keys(redis_client, key_prefix) == []  # the outermost call released it


def test_a_nested_call_on_the_same_session_joins_the_outer_unit_of_work(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    """The nested call does not commit on its own: the outer call's failure undoes it."""
    with make_session() as session, pytest.raises(RuntimeError, match="after the nested"):
        Jobs(session, fencer).finish(9, fail_after=True)
    assert job(engine, 9) is None


def test_a_nested_call_on_its_own_session_commits_that_session(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=make_session)
    def log_step(job_id: int) -> int:
        sa_fence.current_session().merge(Job(id=job_id + 1000, result="step"))
        return int(sa_fence.current_lease().token)

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=make_session)
    def run(job_id: int) -> int:
        token = log_step(job_id)  # its own session: committed when it returns
        raise RuntimeError(f"outer failed after token {token}")

    with pytest.raises(RuntimeError, match="outer failed"):
        run(10)
    assert job(engine, 1010)[0] == "step"  # type: ignore[index]


def test_a_nested_call_on_a_lost_lease_raises_before_its_body_runs(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    ran: list[str] = []

    class Lossy(Jobs):
        @sa_fence.fenced("job:{job_id}", ttl=30)
        def finish(self, job_id: int, fail_after: bool = False) -> tuple[int, int]:
            sa_fence.lease.lifecycle.lose(sa_fence.current_lease(), "lost for the test")
            ran.append("outer")
            return 0, self.record(job_id, "must not run")

        @sa_fence.fenced("job:{job_id}", ttl=30)
        def record(self, job_id: int, result: str) -> int:
            ran.append("nested")  # (a side effect of its own: an e-mail, a file)
            return 0

    with make_session() as session, pytest.raises(sa_fence.LeaseLostError, match="lost for"):
        Lossy(session, fencer).finish(11)
    assert ran == ["outer"]
    assert job(engine, 11) is None


def test_another_thread_does_not_reuse_the_lease_it_meets_contention(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer
) -> None:
    """Reuse is per call stack (a contextvar), never across threads."""
    seen: list[BaseException] = []

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=make_session)
    def inner(job_id: int) -> None: ...

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=make_session)
    def outer(job_id: int) -> None:
        def other() -> None:
            try:
                inner(job_id)
            except BaseException as exc:
                seen.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()

    outer(12)
    assert [type(e) for e in seen] == [sa_fence.LeaseNotAcquiredError]


async def test_a_nested_async_call_on_the_same_name_reuses_the_held_lease(
    make_async_session: async_sessionmaker[AsyncSession],
    afencer: sa_fence.AsyncFencer,
    engine: sa.Engine,
) -> None:
    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=afencer, session=make_async_session)
    async def record(job_id: int) -> int:
        await sa_fence.current_session().merge(Job(id=job_id, result="nested"))
        return int(sa_fence.current_lease().token)

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=afencer, session=make_async_session)
    async def finish(job_id: int) -> tuple[int, int]:
        return sa_fence.current_lease().token, await record(job_id)

    outer, inner = await asyncio.wait_for(finish(13), timeout=10)
    assert outer == inner
    assert job(engine, 13) == ("nested", inner)


# ------------------------------------------- nested calls on another name


class Batches:
    """A batch's call (batch:N) that finishes one of its jobs (job:N) on the same session."""

    def __init__(self, session: Any, fencer: Any) -> None:
        self.session, self.fencer = session, fencer
        self.newer: list[Any] = []

    @sa_fence.fenced("batch:{batch_id}", ttl=30)
    def run(self, batch_id: int, job_id: int, stall: bool = False, fail: bool = False) -> int:
        self.session.add(Job(id=job_id, result="batch"))  # pending: not flushed yet
        if stall:  # paused past its TTL: another worker is granted the batch
            sa_fence.testing.expire(sa_fence.current_lease())
            self.newer.append(self.fencer.acquire(f"batch:{batch_id}", 30))
        self.finish(job_id + 1)
        if fail:
            raise RuntimeError("the batch failed after finishing a job")
        return int(sa_fence.current_lease().token)

    @sa_fence.fenced("job:{job_id}", ttl=30)
    def finish(self, job_id: int) -> int:
        self.session.add(Job(id=job_id, result="job"))
        return int(sa_fence.current_lease().token)


def test_a_nested_call_on_another_name_joins_the_unit_of_work_each_write_under_its_lease(
    make_session: sessionmaker[Session],
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    with make_session() as session:
        batch = Batches(session, fencer).run(1, 30)
        # restored after the outer call
        assert sa_fence.orm.session_state.bound_lease(session) is None
    outer_row, inner_row = job(engine, 30), job(engine, 31)
    assert outer_row == ("batch", batch)  # flushed under the batch's lease before the job's
    assert inner_row is not None
    assert inner_row[0] == "job"
    assert inner_row[1] > batch  # its own lease's token, granted after the batch's
    assert keys(redis_client, key_prefix) == []


def test_a_nested_call_on_another_name_does_not_commit_the_outer_calls_work(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    with make_session() as session, pytest.raises(RuntimeError, match="after finishing"):
        Batches(session, fencer).run(2, 32, fail=True)
    assert (job(engine, 32), job(engine, 33)) == (None, None)


def test_a_stale_outer_calls_pending_write_is_not_committed_under_the_nested_lease(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    """The stale batch holder's write was pending when it called the job's fenced method:
    committing it there checked the job's lease alone, and it landed after the newer grant."""
    with make_session() as session:
        batches = Batches(session, fencer)
        with pytest.raises(sa_fence.StaleTokenError, match=r"lease 'batch:3' .* is stale"):
            batches.run(3, 34, stall=True)
    batches.newer[0].release()
    assert (job(engine, 34), job(engine, 35)) == (None, None)


def test_a_fenced_call_on_a_session_the_caller_bound_joins_the_callers_transaction(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    with fencer.acquire("batch:4", 30) as lease, make_session() as session:
        lease.bind(session)
        session.add(Job(id=36, result="caller"))
        Batches(session, fencer).finish(37)
        assert sa_fence.orm.session_state.bound_lease(session) is lease
        assert (job(engine, 36), job(engine, 37)) == (None, None)  # the caller commits
        session.commit()
    assert job(engine, 36) == ("caller", lease.token)
    assert job(engine, 37)[0] == "job"  # type: ignore[index]


def test_a_fenced_call_on_a_session_whose_bound_lease_was_released_commits_on_its_own(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    """A lease bound earlier and released since (its work committed) is no unit of work to
    join: the call commits, as on a session with no lease bound."""
    with make_session() as session:
        with fencer.acquire("batch:7", 30) as lease:
            lease.bind(session)
            session.add(Job(id=38, result="earlier"))
            session.commit()
        Batches(session, fencer).finish(39)
        assert job(engine, 39) is not None  # committed by the call itself


async def test_an_async_call_joined_on_another_name_is_cancelled_when_its_lease_is_lost(
    make_async_session: async_sessionmaker[AsyncSession], afencer: sa_fence.AsyncFencer
) -> None:
    ran: list[str] = []

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=afencer, session="session")
    async def finish(session: AsyncSession, job_id: int) -> None:
        sa_fence.lease.lifecycle.lose(sa_fence.current_lease(), "lost for the test")
        await asyncio.sleep(5)  # cancelled here (cancel_on_lost, the default)
        ran.append("after the loss")

    @sa_fence.fenced("batch:{batch_id}", ttl=30, fencer=afencer, session="session")
    async def run(session: AsyncSession, batch_id: int) -> None:
        await finish(session, batch_id)

    async with make_async_session() as session:
        with pytest.raises(sa_fence.LeaseLostError, match="lost for the test"):
            await asyncio.wait_for(run(session, 7), timeout=4)
    assert ran == []


async def test_an_async_nested_call_on_another_name_leaves_a_stale_outer_refused(
    make_async_session: async_sessionmaker[AsyncSession],
    afencer: sa_fence.AsyncFencer,
    engine: sa.Engine,
) -> None:
    newer: list[Any] = []

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=afencer, session="session")
    async def finish(session: AsyncSession, job_id: int) -> None:
        session.add(Job(id=job_id, result="job"))
        await session.flush()

    @sa_fence.fenced("batch:{batch_id}", ttl=30, fencer=afencer, session="session")
    async def run(session: AsyncSession, batch_id: int, stall: bool) -> None:
        session.add(Job(id=batch_id + 100, result="batch"))
        if stall:
            await sa_fence.testing.expire(sa_fence.current_lease())
            newer.append(await afencer.acquire(f"batch:{batch_id}", 30))
        await finish(session, batch_id + 200)

    async with make_async_session() as session:
        await run(session, 5, stall=False)
    assert (job(engine, 105)[0], job(engine, 205)[0]) == ("batch", "job")  # type: ignore[index]
    async with make_async_session() as session:
        with pytest.raises(sa_fence.StaleTokenError, match=r"lease 'batch:6'"):
            await run(session, 6, stall=True)
    await newer[0].release()
    assert (job(engine, 106), job(engine, 206)) == (None, None)


# ------------------------------------------------------------------- max_hold


def test_max_hold_stops_renewal_and_the_call_rolls_back_with_lease_lost(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    lost: list[Any] = []
    seen: dict[str, Any] = {}

    @sa_fence.fenced(
        "job:{job_id}", ttl=0.3, renew=True, max_hold=0.6, on_lost=lost.append,
        fencer=fencer, session=make_session,
    )  # fmt: skip
    def hang(job_id: int) -> None:
        lease = sa_fence.current_lease()
        sa_fence.current_session().merge(Job(id=job_id, result="by a hung worker"))
        sa_fence.current_session().flush()  # written before max_hold: still not committed
        time.sleep(1.3)  # past max_hold + ttl: no renewal after max_hold
        seen["key left in Redis"] = redis_client.exists(lease.key)
        seen["lost"] = lease.lost

    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="sa_fence"),
        pytest.raises(sa_fence.LeaseLostError, match=r"reached its max_hold of 0\.6 s"),
    ):
        hang(14)
    assert time.monotonic() - started < 5
    assert seen == {"key left in Redis": 0, "lost": True}
    assert len(lost) == 1
    assert job(engine, 14) is None  # rolled back, not committed
    assert "max_hold" in caplog.text


async def test_a_max_hold_timer_ends_with_its_call(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    make_async_session: async_sessionmaker[AsyncSession],
    afencer: sa_fence.AsyncFencer,
) -> None:
    """A call that returns before its max_hold cancels the timer: a worker making many
    calls with an hour's cap does not pile up an hour of timers (or the lease objects
    they keep alive)."""

    @sa_fence.fenced(
        "job:{job_id}", ttl=30, renew=True, max_hold=3600, fencer=fencer, session=make_session
    )
    def quick(job_id: int) -> None: ...

    @sa_fence.fenced(
        "job:{job_id}",
        ttl=30,
        renew=True,
        max_hold=3600,
        fencer=afencer,
        session=make_async_session,
    )
    async def quick_async(job_id: int) -> None: ...

    pending = decorators._hold_limits._live
    before, timers = len(pending), len(asyncio.get_running_loop()._scheduled)  # type: ignore[attr-defined]
    for job_id in range(3):
        quick(job_id)
        await quick_async(job_id)
    assert len(pending) == before
    assert len(asyncio.get_running_loop()._scheduled) <= timers  # type: ignore[attr-defined]


def test_without_max_hold_the_same_hung_call_is_renewed_and_commits(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    redis_client: redis.Redis,
) -> None:
    """The pair of the test above: renewal alone keeps the lease for ever."""
    seen: dict[str, Any] = {}

    @sa_fence.fenced("job:{job_id}", ttl=0.3, renew=True, fencer=fencer, session=make_session)
    def hang(job_id: int) -> None:
        sa_fence.current_session().merge(Job(id=job_id, result="renewed"))
        time.sleep(1.3)
        seen["key left in Redis"] = redis_client.exists(sa_fence.current_lease().key)

    hang(15)
    assert seen == {"key left in Redis": 1}
    assert job(engine, 15)[0] == "renewed"  # type: ignore[index]


async def test_max_hold_cancels_an_async_body_and_raises_lease_lost(
    make_async_session: async_sessionmaker[AsyncSession],
    afencer: sa_fence.AsyncFencer,
    engine: sa.Engine,
) -> None:
    reached: list[str] = []

    @sa_fence.fenced(
        "job:{job_id}", ttl=0.3, renew=True, max_hold=0.5, fencer=afencer,
        session=make_async_session,
    )  # fmt: skip
    async def hang(job_id: int) -> None:
        await sa_fence.current_session().merge(Job(id=job_id, result="async hung"))
        await asyncio.sleep(10)
        reached.append("end")

    started = time.monotonic()
    with pytest.raises(sa_fence.LeaseLostError, match="max_hold"):
        await hang(16)
    assert time.monotonic() - started < 3
    assert reached == []
    assert job(engine, 16) is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_hold": 60}, ValueError, "needs renew=True"),
        ({"max_hold": 5, "renew": True}, ValueError, "shorter than ttl"),
        ({"max_hold": -1, "renew": True}, ValueError, "max_hold must be a finite number"),
        ({"max_hold": "1h", "renew": True}, TypeError, "max_hold must be a number"),
        ({"session": 42}, TypeError, "session must be a Session, a scoped_session, a session"),
    ],
)
def test_bad_max_hold_or_session_is_refused_at_decoration_time(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        sa_fence.fenced("job:{job_id}", ttl=10, **kwargs)


def test_an_async_def_given_a_sync_sessionmaker_is_refused_at_decoration_time(
    factory: sessionmaker[Session],
) -> None:
    async def finish(job_id: int) -> None: ...

    with pytest.raises(TypeError, match="needs session=<an AsyncSession"):
        sa_fence.fenced("job:{job_id}", ttl=10, fencer="fencer", session=factory)(finish)


async def test_an_async_session_factory_opens_and_closes_one_session_per_call(
    make_async_session: async_sessionmaker[AsyncSession],
    afencer: sa_fence.AsyncFencer,
    engine: sa.Engine,
) -> None:
    opened: list[AsyncSession] = []

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=afencer, session=make_async_session)
    async def finish(job_id: int) -> None:
        session = sa_fence.current_session()
        opened.append(session)
        await session.merge(Job(id=job_id, result="async factory"))

    await finish(17)
    await finish(18)
    assert len({id(s) for s in opened}) == 2
    assert all(s.sync_session.get_transaction() is None for s in opened)  # closed
    assert job(engine, 17)[0] == job(engine, 18)[0] == "async factory"  # type: ignore[index]
