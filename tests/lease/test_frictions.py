"""Frictions a new user met (issue 12), each pinned where behaviour changed.

The CLI's are in tests/cli/test_cli_frictions.py; the integrations' in
tests/integrations/test_recipe*.py.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.lease import protocol as proto
from tests.models import Job

ERRORS = [
    sa_fence.StaleTokenError(
        token=3, table="jobs", primary_keys=[(1,), (2,)], current_fences=[4, None],
        lease_name="job:1",
    ),
    sa_fence.StaleTokenError(token=3, statement="COMMIT", lease_name="job:1", newest_token=4),
    sa_fence.LeaseNotAcquiredError("job:1", 7, waited=0.5),
    sa_fence.LeaseNotAcquiredError("job:2"),
    sa_fence.LeaseBackendError(
        backend="redis", operation="acquire", name="job:1", cause=ConnectionError("down")
    ),
    sa_fence.LeaseBackendError(
        backend="postgresql", operation="token", name="job:1", cause=TimeoutError(),
        detail="waited 5 s for the lease register",
    ),
    sa_fence.LeaseLostError("gone"),
    sa_fence.FencingConfigError("bad"),
    sa_fence.UnfencedWriteError("no lease"),
    sa_fence.FenceError("commit refused"),
]  # fmt: skip


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_is_rebuilt_from_its_json_args_as_celerys_result_backend_does(
    error: sa_fence.FenceError,
) -> None:
    """Celery's JSON result serializer keeps ``args`` only and rebuilds ``cls(*args)``."""
    args = json.loads(json.dumps(list(error.args)))
    copy = type(error)(*args)
    assert str(copy) == str(error)
    assert {k: v for k, v in vars(copy).items() if k != "cause"} == {
        k: v for k, v in vars(error).items() if k != "cause"
    }
    if isinstance(error, sa_fence.LeaseBackendError):
        assert str(copy.cause) == f"{type(error.cause).__name__}: {error.cause}"


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_comes_back_through_celerys_own_json_exception_codec(
    error: sa_fence.FenceError,
) -> None:
    from celery import Celery
    from celery.backends.base import Backend

    backend = Backend(app=Celery(set_as_current=False), serializer="json")
    wire = json.loads(json.dumps(backend.prepare_exception(error)))
    copy = backend.exception_to_python(wire)
    assert type(copy) is type(error)
    assert str(copy) == str(error)


def test_the_keyword_constructors_still_refuse_a_bare_message() -> None:
    with pytest.raises(TypeError, match="takes keyword arguments"):
        sa_fence.StaleTokenError("just a message")  # type: ignore[call-overload]


def test_a_paused_process_is_not_told_that_redis_did_not_answer(
    fencer: sa_fence.Fencer,
) -> None:
    """After SIGCONT the holder notices its validity ran out before the renewer ran."""
    lease = fencer.acquire("job:paused", ttl=5, renew=True)
    try:
        lease._state.valid_until = time.monotonic() - 1  # as if paused past its validity
        with pytest.raises(sa_fence.LeaseLostError) as lost:
            lease.check()
    finally:
        lease.release()
    message = str(lost.value)
    assert "Redis did not answer" not in message
    assert "local validity ran out before a renewal succeeded" in message
    assert "may have been paused" in message
    assert message == proto.renewal_timed_out_message("job:paused", lease.token)


def test_lost_reason_counts_an_overdue_renewal_as_lost_does(fencer: sa_fence.Fencer) -> None:
    """Read first, lost_reason already gives the reason lost would: no order dependence."""
    lease = fencer.acquire("job:overdue", ttl=5, renew=True)
    try:
        lease._state.valid_until = time.monotonic() - 1  # as if paused past its validity
        reason = lease.lost_reason
        assert reason == proto.renewal_timed_out_message("job:overdue", lease.token)
        assert lease.lost
    finally:
        lease.release()


def test_a_lease_never_bound_is_reported_once_per_fencer_at_release(
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = sessionmaker(engine)  # the mistake: no install(), no bind()
    with caplog.at_level(logging.WARNING, logger="sa_fence"):
        with fencer.acquire("job:20", ttl=30), plain() as session:
            session.add(Job(id=20, result="written under no fence"))
            session.commit()
        with fencer.acquire("job:21", ttl=30):
            pass
        with fencer.acquire("job:22", ttl=30) as bound, make_session() as session:
            bound.bind(session)
    warnings = [r.getMessage() for r in caplog.records if "without having been bound" in r.message]
    assert len(warnings) == 1, warnings
    assert "'job:20'" in warnings[0]
    assert "lease.bind(session)" in warnings[0]
    assert "sa_fence.install()" in warnings[0]


def test_a_bound_lease_is_not_reported(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="sa_fence"):
        with fencer.acquire("job:23", ttl=30) as lease, make_session() as session:
            lease.bind(session)
            session.add(Job(id=23, result="fenced"))
            session.commit()
        with (
            fencer.acquire("job:24", ttl=30) as lease,
            sa.create_engine(fencer.engine.url).connect() as conn,
            sa_fence.fence_connection(conn, lease),
        ):
            conn.rollback()
    assert "without having been bound" not in caplog.text


@pytest.mark.parametrize("expire_on_commit", [False, True])
def test_the_object_shows_the_token_its_row_got_after_an_insert_and_an_update(
    fencer: sa_fence.Fencer, engine: sa.Engine, expire_on_commit: bool
) -> None:
    """Not 0 (the server default) nor the old fence: the value the statement wrote."""
    maker = sa_fence.install(sessionmaker(engine, expire_on_commit=expire_on_commit))
    with fencer.acquire("job:25", ttl=30) as lease, maker() as session:
        lease.bind(session)
        job = Job(id=25, result="inserted")
        session.add(job)
        session.commit()
        assert job.fence == lease.token
    with fencer.acquire("job:25", ttl=30) as newer, maker() as session:
        newer.bind(session)
        job = session.get(Job, 25)  # type: ignore[assignment]
        assert job.fence == lease.token
        job.result = "updated"
        session.flush()
        assert job.fence == newer.token
        session.commit()
        assert job.fence == newer.token
