"""Side effects (e-mails, webhooks) leave only from current holders.

Each effect is a procrastinate job enqueued with ``sa_fence.side_effect`` in
the bound session's transaction, delivered by a real procrastinate worker
process to real receivers on loopback (an HTTP sink, an SMTP sink) that
count every attempt and deduplicate on the job's idempotency key.

Each behaviour has its pair: the same story without sa-fence (a plain
session enqueueing the same job in its transaction, as procrastinate alone
allows) shows the stale holder's effect delivered, and a task that makes a
new key per attempt shows the retried effect happening twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence import testing
from sa_fence.integrations import side_effects as _side_effects
from tests import _side_effects as q
from tests._fresh_db import fresh_database
from tests.models import Base, Job

LEASE = "job:1"


@pytest.fixture(scope="session")
def conninfo(database_url: sa.URL, engine: sa.Engine) -> str:
    """The run's database as a libpq URI, with procrastinate's schema applied once."""
    dsn = database_url.set(drivername="postgresql").render_as_string(hide_password=False)
    q.apply_schema(dsn)
    return dsn


@pytest.fixture
def app(conninfo: str) -> Iterator[Any]:
    """The queue as the enqueueing code sees it: never opened, jobs use the session's connection."""
    yield q.make_app(conninfo)
    q.clear_queue(conninfo)


@pytest.fixture
def receivers() -> Iterator[tuple[q.HttpSink, q.SmtpSink]]:
    with q.sinks() as both:
        yield both


def _insert_job(make_session: sessionmaker[Session]) -> None:
    with make_session() as session, sa_fence.unfenced(session):
        session.add(Job(id=1, result=None))
        session.commit()


def _result(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return conn.execute(sa.select(Job.result).where(Job.id == 1)).scalar_one()


def _mail(app: Any, smtp: q.SmtpSink, to: str) -> dict[str, Any]:
    return {"host": "127.0.0.1", "port": smtp.port, "to": to, "subject": f"job 1 done by {to}"}


# ------------------------------------------------------- stale holder, current holder


@pytest.mark.slow
@pytest.mark.parametrize(
    "a_writes_the_row",
    [
        # The row fence refuses A's UPDATE at the flush already.
        pytest.param(True, id="with-a-stale-row"),
        # A's transaction holds only the job: lease scope alone refuses it.
        pytest.param(False, id="the-job-alone"),
    ],
)
def test_a_stale_holders_mail_never_leaves_and_the_current_holders_leaves_once(
    app, conninfo, receivers, fencer, make_session, engine, a_writes_the_row
):
    _, smtp = receivers
    _insert_job(make_session)
    a = fencer.acquire(LEASE, ttl=30)
    session_a = make_session()
    a.bind(session_a)
    if a_writes_the_row:
        session_a.get_one(Job, 1).result = "A"
    enqueued_a = sa_fence.side_effect(session_a, app.tasks["send_mail"], **_mail(app, smtp, "a"))
    testing.expire(a)  # A pauses past its TTL

    with fencer.acquire(LEASE, ttl=30) as b, make_session() as session_b:
        b.bind(session_b)
        session_b.get_one(Job, 1).result = "B"
        enqueued_b = sa_fence.side_effect(
            session_b, app.tasks["send_mail"], **_mail(app, smtp, "b")
        )
        session_b.commit()

    with pytest.raises(sa_fence.StaleTokenError):
        session_a.commit()  # A wakes and commits: refused, its job with it
    session_a.rollback()
    session_a.close()

    assert [j["id"] for j in q.jobs(conninfo)] == [enqueued_b.job_id] != [enqueued_a.job_id]
    q.run_worker(conninfo)

    assert _result(engine) == "B"
    assert [m["to"] for _, m in smtp.seen.attempts] == [["b"]]
    assert list(smtp.seen.effects) == [q.message_id(enqueued_b.idempotency_key)]
    assert [j["status"] for j in q.jobs(conninfo)] == ["succeeded"]


@pytest.mark.slow
def test_without_sa_fence_the_stale_holders_mail_is_delivered(
    app, conninfo, receivers, fencer, engine
):
    """The pair: the same story, both jobs enqueued in plain sessions' transactions."""
    _, smtp = receivers
    plain: sessionmaker[Session] = sessionmaker(engine)
    with plain() as session:
        session.execute(sa.insert(Job).values(id=1, result=None, fence=0))
        session.commit()
    a = fencer.acquire(LEASE, ttl=30)
    session_a = plain()
    session_a.get_one(Job, 1).result = "A"
    send = app.tasks["send_mail"]
    send.configure(connection=session_a.connection().connection.driver_connection).defer(
        **_mail(app, smtp, "a"), idempotency_key=f"{LEASE}:{a.token}:1"
    )
    testing.expire(a)
    with fencer.acquire(LEASE, ttl=30) as b, plain() as session_b:
        session_b.get_one(Job, 1).result = "B"
        send.configure(connection=session_b.connection().connection.driver_connection).defer(
            **_mail(app, smtp, "b"), idempotency_key=f"{LEASE}:{b.token}:1"
        )
        session_b.commit()
    session_a.commit()  # nothing checks the lease: A's row and A's job commit
    session_a.close()

    q.run_worker(conninfo)
    assert _result(engine) == "A"
    assert sorted(m["to"][0] for _, m in smtp.seen.attempts) == ["a", "b"]


@pytest.mark.slow
def test_a_job_deferred_outside_the_sessions_transaction_leaves_from_a_stale_holder(
    app, conninfo, receivers, fencer, make_session, engine
):
    """The pair for "in the session's own transaction": procrastinate's own pool.

    A's session is fenced and its row is refused, but a job deferred on a
    connection of its own committed at once, so A's mail goes out anyway.
    """
    _, smtp = receivers
    _insert_job(make_session)
    own_pool = q.make_app(conninfo, sync=True)
    with own_pool.open():
        a = fencer.acquire(LEASE, ttl=30)
        session_a = make_session()
        a.bind(session_a)
        session_a.get_one(Job, 1).result = "A"
        own_pool.tasks["send_mail"].defer(**_mail(app, smtp, "a"), idempotency_key="k")
        testing.expire(a)
        with fencer.acquire(LEASE, ttl=30) as b, make_session() as session_b:
            b.bind(session_b)
            session_b.get_one(Job, 1).result = "B"
            session_b.commit()
        with pytest.raises(sa_fence.StaleTokenError):
            session_a.commit()
        session_a.rollback()
        session_a.close()

    q.run_worker(conninfo)
    assert _result(engine) == "B"
    assert [m["to"] for _, m in smtp.seen.attempts] == [["a"]]


@pytest.mark.slow
def test_a_job_committed_while_current_is_delivered_after_the_lease_is_superseded(
    app, conninfo, receivers, fencer, make_session
):
    http, _ = receivers
    with fencer.acquire(LEASE, ttl=30) as a, make_session() as session:
        a.bind(session)
        enqueued = sa_fence.side_effect(
            session, app.tasks["send_webhook"], url=http.url, body={"by": "A"}
        )
        session.commit()  # A is current: the job commits
    with fencer.acquire(LEASE, ttl=30) as b:  # a newer grant before any worker runs
        assert b.token > a.token
        q.run_worker(conninfo)

    assert http.seen.attempts == [(enqueued.idempotency_key, {"by": "A"})]
    assert enqueued.idempotency_key.startswith(f"{LEASE}:{a.token}:")


# --------------------------------------------------------- at-least-once plus the key


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task", "effects"),
    [
        pytest.param("send_webhook", 1, id="stable-key-deduplicated"),
        pytest.param("send_webhook_unkeyed", 2, id="pair-new-key-per-attempt-doubles"),
    ],
)
def test_a_worker_killed_mid_delivery_is_retried_with_the_same_key(
    app, conninfo, receivers, fencer, make_session, task, effects
):
    http, _ = receivers
    with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
        lease.bind(session)
        enqueued = sa_fence.side_effect(session, app.tasks[task], url=http.url, body={"n": 1})
        session.commit()

    http.hold_first()  # the receiver applies the effect, then keeps the request open
    first = q.start_worker(conninfo)
    try:
        assert http.arrived.wait(q.WORKER_TIMEOUT), "the first worker never delivered"
        time.sleep(0.5)  # the worker would have its answer and mark the job by now
        assert [j["status"] for j in q.jobs(conninfo)] == ["doing"], "the request was not held"
        first.kill()  # SIGKILL mid-delivery: the job stays "doing"
        first.wait(timeout=q.WORKER_TIMEOUT)
    finally:
        q.stop(first)
        http.release()
    assert [j["status"] for j in q.jobs(conninfo)] == ["doing"]

    q.run_worker(conninfo, recover=True)  # a new worker retries the stalled job

    keys = [key for key, _ in http.seen.attempts]
    assert len(keys) == 2
    assert len(http.seen.effects) == effects
    if task == "send_webhook":
        assert keys == [enqueued.idempotency_key] * 2
    assert [j["status"] for j in q.jobs(conninfo)] == ["succeeded"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("failures", "status", "attempts", "effects"),
    [
        pytest.param(1, "succeeded", 2, 1, id="retried-then-delivered"),
        # RetryStrategy(max_attempts=3) retries three times: four attempts in all
        pytest.param(99, "failed", 4, 0, id="dead-letter-after-the-last-retry"),
    ],
)
def test_a_refused_delivery_is_retried_with_the_same_key_then_left_failed(
    app, conninfo, receivers, fencer, make_session, failures, status, attempts, effects
):
    http, _ = receivers
    with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
        lease.bind(session)
        enqueued = sa_fence.side_effect(
            session, app.tasks["send_webhook"], url=http.url, body={"n": 1}
        )
        session.commit()
    http.fail_next(failures)
    q.run_worker(conninfo)

    keys = http.refused + [key for key, _ in http.seen.attempts]
    assert keys == [enqueued.idempotency_key] * attempts
    assert len(http.seen.effects) == effects
    (job,) = q.jobs(conninfo)
    assert (job["status"], job["attempts"]) == (status, attempts)


# ------------------------------------------------------------------- the key


def test_each_effect_has_its_own_key_lease_token_transaction_and_number(
    app, conninfo, fencer, make_session
):
    send = app.tasks["send_webhook"]
    with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
        lease.bind(session)
        one = sa_fence.side_effect(session, send, url="http://x.invalid", body={})
        two = sa_fence.side_effect(session, send, url="http://x.invalid", body={})
        xid = session.execute(sa.text("SELECT txid_current()::text")).scalar_one()
        session.commit()
        three = sa_fence.side_effect(session, send, url="http://x.invalid", body={})
        session.commit()

    assert one.idempotency_key == f"{LEASE}:{lease.token}:{xid}:1"
    assert two.idempotency_key == f"{LEASE}:{lease.token}:{xid}:2"
    _name, token, xid3, n = three.idempotency_key.rsplit(":", 3)
    assert (token, n) == (str(lease.token), "1")
    assert xid3 != xid
    stored = {j["id"]: j["args"]["idempotency_key"] for j in q.jobs(conninfo)}
    assert stored == {e.job_id: e.idempotency_key for e in (one, two, three)}


@pytest.mark.parametrize(
    "sharing",
    [
        # Session(bind=conn) joins the outer transaction: each commit ends only its part.
        pytest.param("joined-commits", id="joined-session-committed-twice"),
        pytest.param("savepoint-commits", id="create-savepoint-session-committed-twice"),
        pytest.param("two-sessions", id="two-sessions-on-one-connection"),
    ],
)
def test_effects_of_one_database_transaction_are_numbered_whatever_sends_them(
    app, conninfo, fencer, make_session, engine, sharing
):
    """The number belongs to the database transaction, not to a session's transaction."""
    send = app.tasks["send_webhook"]
    with fencer.acquire(LEASE, ttl=30) as lease, engine.connect() as conn:
        outer = conn.begin()
        if sharing == "two-sessions":
            first, second = make_session(bind=conn), make_session(bind=conn)
            lease.bind(first)
            lease.bind(second)
            one = sa_fence.side_effect(first, send, url="u", body={"n": 1})
            two = sa_fence.side_effect(second, send, url="u", body={"n": 2})
            first.close()
            second.close()
        else:
            mode = "create_savepoint" if sharing == "savepoint-commits" else "conditional_savepoint"
            with make_session(bind=conn, join_transaction_mode=mode) as session:
                lease.bind(session)
                one = sa_fence.side_effect(session, send, url="u", body={"n": 1})
                session.commit()
                two = sa_fence.side_effect(session, send, url="u", body={"n": 2})
                session.commit()
        xid = conn.execute(sa.text("SELECT txid_current()::text")).scalar_one()
        outer.commit()

    assert one.idempotency_key == f"{LEASE}:{lease.token}:{xid}:1"
    assert two.idempotency_key == f"{LEASE}:{lease.token}:{xid}:2"
    stored = {j["id"]: j["args"]["idempotency_key"] for j in q.jobs(conninfo)}
    assert stored == {e.job_id: e.idempotency_key for e in (one, two)}


@pytest.mark.slow
def test_a_deduplicating_receiver_applies_both_effects_of_a_joined_session(
    app, conninfo, receivers, fencer, make_session, engine
):
    """End to end: a session joined to an outer transaction, committed after each effect."""
    http, _ = receivers
    send = app.tasks["send_webhook"]
    with fencer.acquire(LEASE, ttl=30) as lease, engine.connect() as conn:
        outer = conn.begin()
        with make_session(bind=conn) as session:
            lease.bind(session)
            sa_fence.side_effect(session, send, url=http.url, body={"effect": "charge"})
            session.commit()
            sa_fence.side_effect(session, send, url=http.url, body={"effect": "receipt"})
            session.commit()
        outer.commit()
    q.run_worker(conninfo)
    assert sorted(body["effect"] for body in http.seen.effects.values()) == ["charge", "receipt"]


def test_an_effect_rolled_back_with_its_savepoint_keeps_its_number_spent(
    app, conninfo, fencer, make_session
):
    send = app.tasks["send_webhook"]
    with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
        lease.bind(session)
        nested = session.begin_nested()
        undone = sa_fence.side_effect(session, send, url="u", body={"n": 1})
        nested.rollback()
        kept = sa_fence.side_effect(session, send, url="u", body={"n": 2})
        session.commit()
    assert (undone.idempotency_key[-2:], kept.idempotency_key[-2:]) == (":1", ":2")
    assert undone.idempotency_key[:-2] == kept.idempotency_key[:-2]
    assert [j["id"] for j in q.jobs(conninfo)] == [kept.job_id]


def test_a_scoped_session_enqueues_through_its_current_session(app, conninfo, fencer, engine):
    from sqlalchemy.orm import scoped_session

    scoped = sa_fence.install(scoped_session(sessionmaker(engine)))
    try:
        with fencer.acquire(LEASE, ttl=30) as lease:
            lease.bind(scoped)
            effect = sa_fence.side_effect(
                scoped, app.tasks["send_webhook"], url="http://x.invalid", body={}
            )
            scoped.commit()
    finally:
        scoped.remove()
    assert effect.idempotency_key.startswith(f"{LEASE}:{lease.token}:")
    assert [j["id"] for j in q.jobs(conninfo)] == [effect.job_id]


def test_a_fenced_function_enqueues_in_the_transaction_its_decorator_commits(
    app, conninfo, fencer, make_session
):
    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=make_session)
    def finish(job_id: int) -> sa_fence.SideEffect:
        return sa_fence.side_effect(
            sa_fence.current_session(), app.tasks["send_webhook"], url="u", body={"id": job_id}
        )

    effect = finish(1)
    assert effect.idempotency_key.startswith("job:1:")
    assert [(j["id"], j["status"]) for j in q.jobs(conninfo)] == [(effect.job_id, "todo")]


def test_a_lease_name_is_percent_encoded_into_a_printable_key(app, conninfo, fencer, make_session):
    with fencer.acquire("mail für 7", ttl=30) as lease, make_session() as session:
        lease.bind(session)
        effect = sa_fence.side_effect(
            session, app.tasks["send_webhook"], url="http://x.invalid", body={}
        )
        session.commit()
    assert effect.idempotency_key.startswith(f"mail%20f%C3%BCr%207:{lease.token}:")
    assert effect.idempotency_key.isascii()
    assert effect.idempotency_key.isprintable()


# --------------------------------------------------------------- bad input, no job


def _no_jobs(conninfo: str) -> None:
    assert q.jobs(conninfo) == []


def test_a_session_with_no_lease_bound_is_refused(app, conninfo, make_session):
    with make_session() as session:
        with pytest.raises(sa_fence.UnfencedWriteError, match=r"lease\.bind"):
            sa_fence.side_effect(session, app.tasks["send_webhook"], url="u", body={})
        with sa_fence.unfenced(session), pytest.raises(sa_fence.UnfencedWriteError):
            sa_fence.side_effect(session, app.tasks["send_webhook"], url="u", body={})
        session.commit()
    _no_jobs(conninfo)


def test_a_released_lease_is_refused_before_anything_is_sent(app, conninfo, fencer, make_session):
    with make_session() as session:
        lease = fencer.acquire(LEASE, ttl=30)
        lease.bind(session)
        lease.release()
        with pytest.raises(sa_fence.LeaseLostError):
            sa_fence.side_effect(session, app.tasks["send_webhook"], url="u", body={})
        session.commit()
    _no_jobs(conninfo)


def test_bad_tasks_and_arguments_are_refused(app, conninfo, fencer, make_session):
    @app.task(name="keyless")
    def keyless(url: str) -> None:
        pass

    @app.task(name="positional_key")
    def positional_key(idempotency_key: str, /, url: str) -> None:
        pass

    @app.task(name="catch_all")
    def catch_all(**kwargs: Any) -> None:
        pass

    with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
        lease.bind(session)
        with pytest.raises(TypeError, match="procrastinate task"):
            sa_fence.side_effect(session, keyless.func, url="u")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="no 'idempotency_key' parameter"):
            sa_fence.side_effect(session, keyless, url="u")
        with pytest.raises(TypeError, match="no 'idempotency_key' parameter"):
            sa_fence.side_effect(session, positional_key, url="u")  # cannot take it by name
        with pytest.raises(ValueError, match="do not pass idempotency_key"):
            sa_fence.side_effect(
                session, app.tasks["send_webhook"], url="u", body={}, idempotency_key="k"
            )
        with pytest.raises(TypeError, match="side_effect_async"):
            sa_fence.side_effect(object(), app.tasks["send_webhook"])  # type: ignore[arg-type]
        session.commit()
    _no_jobs(conninfo)
    with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
        lease.bind(session)  # a task taking **kwargs takes the key too
        assert sa_fence.side_effect(session, catch_all, url="u").idempotency_key
        session.rollback()


@pytest.mark.parametrize(
    ("body", "names"),
    [
        pytest.param({"ratio": float("nan")}, r"argument body\['ratio'\] holds nan", id="nan"),
        pytest.param([1, float("-inf")], r"argument body\[1\] holds -inf", id="infinity"),
        pytest.param({"to": "a\x00b"}, r"body\['to'\] holds a NUL character", id="nul"),
        pytest.param({"k\x00": 1}, r"the key 'k\\x00' of argument body holds a NUL", id="nul-key"),
        pytest.param(["\ud800"], r"body\[0\] holds a surrogate code point", id="lone-surrogate"),
    ],
)
def test_a_payload_jsonb_cannot_hold_is_refused_and_the_transaction_stays_usable(
    app, conninfo, fencer, make_session, engine, body, names
):
    """JSON that PostgreSQL's jsonb refuses: named before anything is sent, so the INSERT
    never aborts the holder's transaction and its other writes still commit."""
    _insert_job(make_session)
    with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
        lease.bind(session)
        session.get_one(Job, 1).result = "written"
        session.flush()
        with pytest.raises(ValueError, match=names + ".*Nothing was enqueued"):
            sa_fence.side_effect(session, app.tasks["send_webhook"], url="u", body=body)
        session.commit()
    assert _result(engine) == "written"
    _no_jobs(conninfo)


def test_a_job_already_enqueued_under_its_queueing_lock_leaves_the_transaction_usable(
    app, conninfo, fencer, make_session, engine
):
    """procrastinate's AlreadyEnqueued, caught as callers do: the holder's writes commit."""
    import procrastinate

    @app.task(name="digest", queueing_lock="digest")
    def digest(user: int, idempotency_key: str) -> None:
        pass

    _insert_job(make_session)
    with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
        lease.bind(session)
        queued = sa_fence.side_effect(session, digest, user=1)
        session.commit()
        session.get_one(Job, 1).result = "written"
        session.flush()
        with pytest.raises(procrastinate.exceptions.AlreadyEnqueued):
            sa_fence.side_effect(session, digest, user=1)
        other = sa_fence.side_effect(session, app.tasks["send_webhook"], url="u", body={})
        session.commit()
    assert _result(engine) == "written"
    assert other.idempotency_key.endswith(":2")  # the refused effect's number stays spent
    assert [j["id"] for j in q.jobs(conninfo)] == [queued.job_id, other.job_id]


def _too_long_a_queue(app: Any) -> Any:
    """A task whose jobs PostgreSQL refuses: its queue name is longer than the column."""

    @app.task(name="misqueued", queue="q" * 129)
    def misqueued(idempotency_key: str) -> None:
        pass

    return misqueued


def test_an_enqueue_that_aborts_the_transaction_makes_the_session_refuse_to_commit(
    app, conninfo, fencer, make_session, engine
):
    """Without the refusal, COMMIT ends the aborted transaction as a ROLLBACK and psycopg
    returns from it silently: the holder believes its writes committed."""
    from procrastinate.exceptions import ConnectorException

    _insert_job(make_session)
    with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
        lease.bind(session)
        session.get_one(Job, 1).result = "written"
        session.flush()
        with pytest.raises(ConnectorException) as raised:
            sa_fence.side_effect(session, _too_long_a_queue(app))
        assert "session.rollback()" in "".join(raised.value.__notes__)
        with pytest.raises(sa_fence.FenceError, match=r"could not be enqueued \(StringDataRight"):
            session.commit()
        session.rollback()  # then the session is usable again
        session.get_one(Job, 1).result = "written again"
        session.commit()
    assert _result(engine) == "written again"
    _no_jobs(conninfo)


async def test_async_an_enqueue_that_aborts_the_transaction_refuses_the_commit(
    app, conninfo, afencer, make_async_session, engine
):
    from procrastinate.exceptions import ConnectorException

    async with afencer.acquire(LEASE, ttl=30) as lease, make_async_session() as session:
        lease.bind(session)
        session.add(Job(id=1, result="written"))
        await session.flush()
        with pytest.raises(ConnectorException):
            await sa_fence.side_effect_async(session, _too_long_a_queue(app))
        with pytest.raises(sa_fence.FenceError, match="could not be enqueued"):
            await session.commit()
        await session.rollback()
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(Job)).scalar_one() == 0
    _no_jobs(conninfo)


async def test_sync_side_effect_refuses_an_app_whose_async_connector_is_open(
    app, conninfo, fencer, make_session, engine
):
    """Inside a worker, or an async web app that opened the app at start-up: procrastinate
    would run its async cursor code on the session's sync connection."""
    import asyncio

    _insert_job(make_session)

    def work() -> None:
        with fencer.acquire(LEASE, ttl=30) as lease, make_session() as session:
            lease.bind(session)
            session.get_one(Job, 1).result = "written"
            session.flush()
            with pytest.raises(
                TypeError, match=r"no sync connector.*side_effect_async.*SyncPsycopg"
            ):
                sa_fence.side_effect(session, app.tasks["send_webhook"], url="u", body={})
            session.commit()

    async with app.open_async():
        await asyncio.to_thread(work)
    assert _result(engine) == "written"
    _no_jobs(conninfo)


def test_without_procrastinate_sa_fence_imports_and_side_effect_says_what_to_install():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['procrastinate'] = None\n"
        "import sa_fence\n"
        "try:\n"
        "    sa_fence.side_effect(None, None)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    assert "pip install 'sa-fence[side-effects]'" in run.stdout


def test_a_database_without_the_queues_tables_is_named_and_nothing_commits(
    app, redis_client, key_prefix
):
    with fresh_database("side_effects_noqueue") as other:
        Base.metadata.create_all(other)
        fencer = sa_fence.Fencer(redis_client, other, key_prefix=key_prefix)
        try:
            sessions = sa_fence.install(sessionmaker(other))
            with fencer.acquire(LEASE, ttl=30) as lease, sessions() as session:
                lease.bind(session)
                session.add(Job(id=1, result="written with the effect"))
                session.flush()
                with pytest.raises(sa_fence.FencingConfigError, match="schema --apply"):
                    sa_fence.side_effect(session, app.tasks["send_webhook"], url="u", body={})
                # PostgreSQL aborted the transaction, whose COMMIT would end it as a
                # ROLLBACK, silently: the session refuses it and says to roll back
                with pytest.raises(sa_fence.FenceError, match=r"schema --apply.*rollback\(\)"):
                    session.commit()
                session.rollback()
            with other.connect() as conn:
                assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 0
        finally:
            fencer.close()


def test_a_transaction_outside_lease_scope_is_refused(app, fencer, make_session, monkeypatch):
    """A session writing to another database than the register's: its COMMIT is unchecked.

    The pair: with the scope check switched off, the stale holder's job commits there.
    """
    with fresh_database("side_effects") as other:
        Base.metadata.create_all(other)
        dsn = other.url.set(drivername="postgresql").render_as_string(hide_password=False)
        q.apply_schema(dsn)
        other_sessions = sa_fence.install(sessionmaker(other))
        a = fencer.acquire(LEASE, ttl=30)
        session = other_sessions()
        a.bind(session)
        with pytest.raises(sa_fence.FencingConfigError, match="not lease-scoped"):
            sa_fence.side_effect(session, app.tasks["send_webhook"], url="u", body={})
        session.rollback()
        assert q.jobs(dsn) == []

        monkeypatch.setattr(_side_effects, "_require_scope", lambda conn, lease: None)
        sa_fence.side_effect(session, app.tasks["send_webhook"], url="u", body={})
        testing.expire(a)
        fencer.acquire(LEASE, ttl=30)
        session.commit()  # stale, and nothing refused it
        session.close()
        assert len(q.jobs(dsn)) == 1


# ------------------------------------------------------------------------ asyncio


@pytest.mark.slow
async def test_async_a_stale_holders_webhook_never_leaves(
    app, conninfo, receivers, afencer, make_async_session, redis_client, engine
):
    from tests._async_fixtures import expire

    http, _ = receivers
    send = app.tasks["send_webhook"]
    a = await afencer.acquire(LEASE, ttl=30)
    async with make_async_session() as session_a:
        a.bind(session_a)
        await sa_fence.side_effect_async(session_a, send, url=http.url, body={"by": "A"})
        expire(redis_client, a)
        async with afencer.acquire(LEASE, ttl=30) as b, make_async_session() as session_b:
            b.bind(session_b)
            enqueued_b = await sa_fence.side_effect_async(
                session_b, send, url=http.url, body={"by": "B"}
            )
            await session_b.commit()
        with pytest.raises(sa_fence.StaleTokenError):
            await session_a.commit()
        await session_a.rollback()

        with pytest.raises(TypeError, match="AsyncSession"):
            sa_fence.side_effect(session_a, send, url=http.url, body={})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="side_effect_async"), sessionmaker(engine)() as plain:
        await sa_fence.side_effect_async(plain, send)  # type: ignore[arg-type]

    q.run_worker(conninfo)
    assert http.seen.attempts == [(enqueued_b.idempotency_key, {"by": "B"})]
