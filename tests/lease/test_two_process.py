"""The lost-lease double write, with worker A in a real process frozen by SIGSTOP.

Worker A (a child process, tests/_worker_lease.py) takes lease ``job:1``
with a TTL a loaded machine can acquire within, loads job 1 and reports it is
holding the lease.  The test freezes A with SIGSTOP until the lease has expired
in Redis, so it expires while A cannot run; the test itself then acts as worker
B: takes the lease (a larger token), writes and commits.  Then it resumes A and
lets it write.

Fenced, A's write is refused (StaleTokenError) and B's row stands; the same
story with A using a plain session shows A's write going through, so the
flush hook, not the lease, is what protects the row.

Synchronisation is by pipes only (A cannot write before it is told to); the
pause is no fixed sleep either: the test waits (bounded by twice the TTL) until
Redis reports A's lease gone, so it races nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa

import sa_fence
from tests._worker_lease import JOB_ID, LEASE_NAME, STARTUP_TIMEOUT, LeaseWorker
from tests.conftest import REDIS_URL
from tests.models import Audit, Job

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

pytestmark = pytest.mark.slow

#: A's TTL: its acquire, bind and load must fit in it (a fresh process on a loaded
#: machine); the pause lasts only until it has run out in Redis
TTL = 3.0
PAUSE = 2 * TTL  # the bound on that wait


def _insert_job(make_session: sessionmaker[Session]) -> None:
    with make_session() as session, sa_fence.unfenced(session):
        session.add(Job(id=JOB_ID, result=None))
        session.commit()


def _start_a(database_url: sa.URL, key_prefix: str, *, fenced: bool) -> LeaseWorker:
    return LeaseWorker.start(
        db=database_url.render_as_string(hide_password=False),
        redis=REDIS_URL,
        prefix=key_prefix,
        ttl=TTL,
        result="A",
        fenced=fenced,
    )


def _pause_a_past_its_ttl(a: LeaseWorker, fencer: sa_fence.Fencer) -> int:
    """A takes the lease and loads the row; freeze it until the lease has expired."""
    holding = a.expect("holding", timeout=STARTUP_TIMEOUT)
    assert holding["result"] is None
    a.stop()
    deadline = time.monotonic() + PAUSE
    while fencer.redis.exists(fencer.key(LEASE_NAME)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not fencer.redis.exists(fencer.key(LEASE_NAME)), "A's lease should have expired"
    return int(holding["token"])


def _b_takes_over_and_writes(fencer: sa_fence.Fencer, make_session: sessionmaker[Session]) -> int:
    with fencer.acquire(LEASE_NAME, ttl=30) as lease, make_session() as session:
        lease.bind(session)
        session.get_one(Job, JOB_ID).result = "B"
        session.commit()
        return lease.token


def _row(engine: sa.Engine) -> tuple[str | None, int, list[str]]:
    with engine.connect() as conn:
        result, fence = conn.execute(sa.select(Job.result, Job.fence).where(Job.id == JOB_ID)).one()
        audit = list(conn.scalars(sa.select(Audit.message).order_by(Audit.id)))
    return result, fence, audit


def test_a_worker_paused_past_its_ttl_by_sigstop_has_its_late_write_refused(
    database_url: sa.URL,
    key_prefix: str,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
) -> None:
    _insert_job(make_session)
    with _start_a(database_url, key_prefix, fenced=True) as a:
        token_a = _pause_a_past_its_ttl(a, fencer)
        token_b = _b_takes_over_and_writes(fencer, make_session)
        assert token_b > token_a

        a.resume()
        a.send("write")
        refused = a.expect("stale", "committed")
        assert refused["event"] == "stale", "A's late write went through"
        assert refused["table"] == "jobs"
        assert refused["statement"] == "UPDATE"
        assert refused["token"] == token_a
        assert refused["lease_name"] == LEASE_NAME
        assert refused["primary_keys"] == [[JOB_ID]]
        assert refused["current_fences"] == [token_b]
        assert f"token {token_a} of lease 'job:1' is stale" in refused["message"]
        assert f"row(s) 1 (fence {token_b})" in refused["message"]
        assert a.expect("done")["released"] is False  # the lease was B's, then nobody's
        assert a.wait() == 0, a.stderr()

    # B's value and fence stand; A's unit of work (its audit row too) left nothing
    assert _row(engine) == ("B", token_b, [])


def test_without_the_flush_hook_the_same_paused_worker_overwrites_the_newer_holders_row(
    database_url: sa.URL,
    key_prefix: str,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
) -> None:
    _insert_job(make_session)
    with _start_a(database_url, key_prefix, fenced=False) as a:
        token_a = _pause_a_past_its_ttl(a, fencer)
        token_b = _b_takes_over_and_writes(fencer, make_session)
        assert token_b > token_a

        a.resume()
        a.send("write")
        assert a.expect("stale", "committed")["event"] == "committed"
        assert a.expect("done")["released"] is False
        assert a.wait() == 0, a.stderr()

    # the double write: A's stale result replaced B's, under B's fence
    assert _row(engine) == ("A", token_b, ["A wrote job 1"])
