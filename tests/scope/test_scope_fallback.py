"""Lease scope without psycopg's BEGIN hook: every test of test_scope_trigger.py again.

sa-fence writes a transaction's arm in psycopg's own BEGIN message, through
psycopg internals it checks at import (``arming.PSYCOPG_BEGIN_HOOK``).  A
psycopg release that changes them turns the hook off, and every arm becomes
a statement of its own, sent when the transaction enters lease scope and
again first thing in a transaction begun after a COMMIT sent as SQL.  That
path would otherwise meet users untested: here the whole lease-scope suite
runs on it, with two tests swapped for their fallback versions.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence import Lease
from sa_fence.db.register import name_key
from sa_fence.orm import statements
from sa_fence.scope import arming
from sa_fence.testing import expire
from tests import _scope_fixtures
from tests.models_scope import OWN_ARMS, Outbox
from tests.scope.test_scope_trigger import *  # noqa: F403 (the suite, collected again here)
from tests.scope.test_scope_trigger import (
    _async_scope,
    _async_write_then_superseded_is_refused,
    outbox,
    test_a_cursor_class_set_on_the_driver_is_checked_too,
    test_a_raw_begin_of_its_own_between_a_fenced_connections_transactions_is_refused,
    test_a_raw_driver_transaction_between_a_fenced_connections_transactions_is_armed,
    test_a_rollback_to_that_would_need_the_arm_again_is_refused_through_stream_or_copy,
    test_async_an_interrupted_arm_after_a_rollback_to_closes_the_driver_connection,
    test_async_driver_sql_that_goes_on_is_refused_and_a_rollback_to_is_armed_again,
    test_async_psycopgs_own_transaction_in_lease_scope_is_refused,
    test_driver_sql_that_ends_the_transaction_and_goes_on_is_refused_before_it_is_sent,
    test_driver_sql_that_goes_on_between_a_fenced_connections_transactions_is_refused,
    test_psycopgs_own_begin_in_lease_scope_is_refused_and_the_session_goes_on,
    test_the_arm_travels_in_psycopgs_begin_message,
    test_without_the_arm_a_raw_commit_of_a_stale_holder_goes_through,
    test_without_the_arm_between_transactions_a_stale_raw_commit_goes_through,
    test_without_the_refusal_a_stale_holder_set_to_autocommit_commits,
    test_without_the_refusal_psycopgs_own_transaction_commits_a_stale_holders_row,
)

_empty_tables = _scope_fixtures.empty_tables  # (autouse, and private: not in the star)

# They pin the hook itself: the fallback versions are below.
del test_the_arm_travels_in_psycopgs_begin_message
del test_without_the_arm_a_raw_commit_of_a_stale_holder_goes_through
# Without the hook, each arm is a statement of its own: in autocommit it commits at once,
# checked, before the write it precedes, so a stale holder's arm fails there; the pair
# shows the hole of the hook, whose BEGIN carries the arm and autocommit sends none.
del test_without_the_refusal_a_stale_holder_set_to_autocommit_commits
# The refusal of psycopg's own BEGIN (transaction(), tpc_begin()) is installed with the
# hook, and so is the arm of a raw driver statement between a fenced Connection's
# transactions; without it, a transaction psycopg begins below SQLAlchemy is not armed
# (documented).
del test_a_raw_begin_of_its_own_between_a_fenced_connections_transactions_is_refused
del test_a_raw_driver_transaction_between_a_fenced_connections_transactions_is_armed
del test_without_the_arm_between_transactions_a_stale_raw_commit_goes_through
del test_async_psycopgs_own_transaction_in_lease_scope_is_refused
del test_psycopgs_own_begin_in_lease_scope_is_refused_and_the_session_goes_on
del test_without_the_refusal_psycopgs_own_transaction_commits_a_stale_holders_row
# So is the check of the driver's own cursors (their class is swapped with the hook): without
# it, SQL sent on a cursor of the driver connection is not read, and a transaction psycopg
# begins after a COMMIT sent there is not armed (documented).
del test_a_cursor_class_set_on_the_driver_is_checked_too
del test_async_an_interrupted_arm_after_a_rollback_to_closes_the_driver_connection
del test_a_rollback_to_that_would_need_the_arm_again_is_refused_through_stream_or_copy
del test_async_driver_sql_that_goes_on_is_refused_and_a_rollback_to_is_armed_again
del test_driver_sql_that_ends_the_transaction_and_goes_on_is_refused_before_it_is_sent
del test_driver_sql_that_goes_on_between_a_fenced_connections_transactions_is_refused


@pytest.fixture(autouse=True)
def _without_the_begin_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arming, "PSYCOPG_BEGIN_HOOK", False)


def test_every_arm_is_a_statement_of_its_own(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    a = fencer.acquire("job:fallback", 5)
    try:
        with make_session() as session:
            a.bind(session)
            session.execute(sa.text("SELECT 1"))
            driver = session.connection().connection.driver_connection
            assert "_start_query" not in vars(driver)  # psycopg's BEGIN, as it is
            sent = session.execute(sa.text(f"SELECT token, name_key FROM {OWN_ARMS}")).all()
            assert [tuple(r) for r in sent] == [(a.token, name_key(a.name))]
    finally:
        a.release()


#: The outbox table with a key SQLAlchemy draws before the INSERT (a pre-executed default:
#: ``SELECT nextval(...)`` runs before the INSERT's own statement is sent).
_preexecuted = sa.Table(
    "outbox",
    sa.MetaData(),
    sa.Column("id", sa.Integer, sa.Sequence("outbox_fallback_id"), primary_key=True),
    sa.Column("message", sa.String),
    implicit_returning=False,
)


def _with_a_preexecuted_key(session: Session) -> None:
    with session.get_bind().begin() as other:  # (a connection of its own)
        other.execute(sa.text("CREATE SEQUENCE IF NOT EXISTS outbox_fallback_id"))
    session.execute(sa.insert(_preexecuted).values(message="stale"))


def _superseded_after_a_commit_sent_as_sql(fencer: sa_fence.Fencer, session: Session) -> Lease:
    """Bind a lease to ``session``, commit with ``text("COMMIT")`` while it is current
    (SQLAlchemy does not see that transaction end), then let it run out: the newer lease
    of its name, returned, makes the session's later writes stale."""
    a = fencer.acquire(f"job:{uuid.uuid4().hex[:8]}", 5)
    a.bind(session)
    session.execute(sa.text("SELECT 1"))
    session.execute(sa.text("COMMIT"))  # current: committed
    assert expire(a)
    return fencer.acquire(a.name, 5)


def _commit(session: Session, *, refused: bool) -> None:
    if refused:
        with pytest.raises(sa_fence.StaleTokenError):
            session.commit()
    else:
        session.commit()


#: Ways a stale holder's write after ``text("COMMIT")`` can be sent.
LATER_WRITES = {
    "pre-executed default": _with_a_preexecuted_key,
    "orm flush": lambda session: session.add(Outbox(id=1, message="stale")),
    "orm flush, two rows": lambda session: session.add_all(
        [Outbox(id=1, message="stale"), Outbox(id=2, message="stale")]
    ),
    "core executemany": lambda session: session.execute(
        sa.insert(Outbox), [{"id": 1, "message": "stale"}, {"id": 2, "message": "stale"}]
    ),
    "core insertmanyvalues": lambda session: session.execute(
        sa.insert(Outbox).returning(Outbox.id),
        [{"id": 1, "message": "stale"}, {"id": 2, "message": "stale"}],
    ),
    "text": lambda session: session.execute(
        sa.text("INSERT INTO outbox (id, message) VALUES (1, 'stale')")
    ),
    "driver sql": lambda session: session.connection().exec_driver_sql(
        "INSERT INTO outbox (id, message) VALUES (1, 'stale')"
    ),
}


@pytest.mark.parametrize("write", LATER_WRITES.values(), ids=LATER_WRITES.keys())
@pytest.mark.parametrize("rearm", [True, False], ids=["rearmed", "guard-removed"])
def test_a_transaction_begun_after_a_commit_sent_as_sql_is_armed_again(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    write: Callable[[Session], object],
    rearm: bool,
) -> None:
    """The holder commits with ``text("COMMIT")`` while current (SQLAlchemy does not
    see it end), then its lease runs out; its next write begins a new transaction,
    which the fallback arms again first: the commit is refused.  Without the re-arm
    the stale write commits (the pair's other half)."""
    if not rearm:
        monkeypatch.setattr(arming, "_rearm_if_ended", lambda conn, scope: None)
    with make_session() as session:
        b = _superseded_after_a_commit_sent_as_sql(fencer, session)
        write(session)
        _commit(session, refused=rearm)
    rows = outbox(scope_engine)
    if rearm:
        assert rows == []
    else:
        assert rows
        assert set(rows) == {"stale"}
    b.release()


@pytest.mark.parametrize("kept", [True, False], ids=["rearmed", "guard-removed"])
def test_a_transaction_begun_by_a_sequence_after_a_commit_sent_as_sql_is_armed(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    kept: bool,
) -> None:
    """``session.scalar(Sequence(...))`` runs through the Connection's own step for
    defaults, which sends its ``nextval`` on a cursor, past the statement steps; sa-fence
    re-arms there too.  Without it the sequence begins the transaction unarmed, the
    later write finds it begun (nothing to re-arm), and the stale holder's row commits
    (the pair's other half)."""
    if not kept:  # SQLAlchemy's own step instead of sa-fence's override
        monkeypatch.setattr(
            statements.FencedConnection, "_execute_default", sa.Connection._execute_default
        )
    with scope_engine.begin() as conn:
        conn.execute(sa.text("CREATE SEQUENCE IF NOT EXISTS outbox_fallback_id"))
    with make_session() as session:
        b = _superseded_after_a_commit_sent_as_sql(fencer, session)
        assert session.scalar(sa.Sequence("outbox_fallback_id")) is not None
        session.add(Outbox(id=1, message="stale"))
        _commit(session, refused=kept)
    assert outbox(scope_engine) == ([] if kept else ["stale"])
    b.release()


async def test_async_a_lease_bound_before_the_first_statement_needs_no_event_loop(
    scope_engine: sa.Engine, key_prefix: str
) -> None:
    """As with the hook: bound after ``await session.connection()`` (begun, nothing sent), the
    arm waits for the first statement instead of needing the event loop in ``bind()``; the
    transaction is armed all the same."""
    async with _async_scope(scope_engine, key_prefix) as (_aengine, client, fencer, make):
        a = await fencer.acquire(f"job:{uuid.uuid4().hex[:8]}", 5)
        async with make() as session:
            await session.connection()
            a.bind(session)  # (no FencingConfigError: nothing to send yet)
            b = await _async_write_then_superseded_is_refused(session, client, fencer, a)
        assert outbox(scope_engine) == []
        await b.release()


def test_driver_sql_that_leaves_scope_is_refused_before_even_an_arm_is_sent(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """On this path the arm of a transaction not yet begun goes before its first statement;
    refused driver SQL sends neither (its error says nothing was sent).  (A ``text()`` is
    armed for before SQLAlchemy compiles it, so its transaction may begin, armed.)"""
    a = fencer.acquire(f"job:{uuid.uuid4().hex[:8]}", 5)
    with make_session() as session:
        a.bind(session)
        session.execute(sa.text("SELECT 1"))
        session.execute(sa.text("COMMIT"))  # the next statement would begin a transaction
        driver = session.connection().connection.driver_connection
        with pytest.raises(sa_fence.FencingConfigError, match="Nothing was sent"):
            session.connection().exec_driver_sql("COMMIT; BEGIN")
        assert driver.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    a.release()
