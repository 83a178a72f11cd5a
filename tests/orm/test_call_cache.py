"""The caches that keep sa-fence's own calls per fenced transaction down (issue 21), and
what invalidates each of them.

* A Connection's driver connection (``arming.driver_of``) is read once per DBAPI
  connection and kept with it: a reconnect after an invalidation, or another pool
  checkout, is another DBAPI connection, and the driver is read anew.
* A lease remembers the engine it was last armed through and that engine's scope
  table (``arming.ScopeMark._scoped``): another engine is checked again (another database is
  outside lease scope).
* A transaction's arms live on the driver as an immutable tuple, built by a cached
  function, and travel in its BEGIN.

Each test fails when its cache is not invalidated (the mutants named in each docstring
were applied by hand and seen to fail).
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from psycopg.pq import TransactionStatus
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.scope import arming
from sa_fence.testing import expire
from tests import _scope_fixtures
from tests._fresh_db import fresh_database
from tests.models_scope import Job, Outbox

scope_engine = _scope_fixtures.scope_engine
_empty_tables = _scope_fixtures.empty_tables
fencer = _scope_fixtures.fencer
make_session = _scope_fixtures.make_session

jobs = Job.__table__


def outbox(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT id, message FROM outbox"))]


def test_after_a_reconnect_the_driver_is_read_anew_so_autocommit_is_still_refused(
    fencer: sa_fence.Fencer, scope_engine: sa.Engine
) -> None:
    """Mutant: ``_driver`` keeps the first driver whatever the DBAPI connection (its
    identity check dropped): the check reads the invalidated connection, which is not in
    autocommit mode, and the insert commits on its own outside lease scope."""
    with fencer.acquire("job:1", 5) as lease, scope_engine.connect() as conn:
        with sa_fence.fence_connection(conn, lease):
            conn.execute(jobs.insert().values(id=1, result="in scope"))
            conn.commit()
        first = conn.connection.dbapi_connection
        conn.invalidate()  # the next use reconnects: another DBAPI connection
        conn.execution_options(isolation_level="AUTOCOMMIT")
        assert conn.connection.dbapi_connection is not first
        with (
            pytest.raises(sa_fence.FencingConfigError, match="AUTOCOMMIT"),
            sa_fence.fence_connection(conn, lease),
        ):
            conn.execute(jobs.insert().values(id=2, result="autocommitted"))
    with scope_engine.connect() as check:
        assert check.execute(sa.text("SELECT id FROM jobs ORDER BY id")).scalars().all() == [1]


def test_a_reconnected_connections_transaction_is_still_held_to_its_lease(
    fencer: sa_fence.Fencer, scope_engine: sa.Engine
) -> None:
    """A stale holder's transaction on the reconnected connection is still refused at
    COMMIT. (Not that mutant's pair: with the identity check dropped, the arm still
    reaches this transaction, sent as a statement of its own because the invalidated
    driver is not idle; the test above is its pair.)"""
    a = fencer.acquire("job:1", 5)
    with scope_engine.connect() as conn:
        with sa_fence.fence_connection(conn, a):
            conn.execute(jobs.insert().values(id=1, result="A"))
            conn.commit()
        conn.invalidate()
        expire(a)
        b = fencer.acquire("job:1", 5)
        with sa_fence.fence_connection(conn, a):
            conn.execute(Outbox.__table__.insert().values(id=1, message="A, stale"))
            with pytest.raises(sa_fence.StaleTokenError):
                conn.commit()
            conn.rollback()
    assert outbox(scope_engine) == []
    b.release()


def test_one_connection_many_transactions_reads_the_driver_once(
    fencer: sa_fence.Fencer, scope_engine: sa.Engine
) -> None:
    """The cache is kept while the DBAPI connection is the same (what it is for)."""
    with (
        fencer.acquire("job:1", 5) as lease,
        scope_engine.connect() as conn,
        sa_fence.fence_connection(conn, lease),
    ):
        for n in range(3):
            conn.execute(jobs.insert().values(id=n, result="x"))
            conn.commit()
            dbapi_conn, driver = conn.__dict__[arming._DRIVER]
            assert dbapi_conn is conn.connection.dbapi_connection
            assert driver is conn.connection.driver_connection


def test_a_lease_armed_through_one_engine_is_checked_again_on_another_databases_engine(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """Mutant: the lease's remembered engine not compared (``known[0] is conn.engine``
    dropped): its scope table is taken for another database's engine, whose transaction
    then fails on an arm of a table it does not have, instead of running outside lease
    scope (docs/lease-scope.md)."""
    with fencer.acquire("job:1", 5) as lease:
        with lease.bind(make_session()) as session:
            session.add(Outbox(id=1, message="armed here"))
            session.commit()  # armed through the register's engine: remembered
        with fresh_database("callcache") as other, other.connect() as conn:
            with sa_fence.fence_connection(conn, lease):
                assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
                conn.commit()
            assert conn.execute(sa.text("SELECT to_regclass('sa_fence_scope')")).scalar() is None


def test_two_leases_armed_before_begin_travel_in_one_begin_and_each_is_checked(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """The arms tuple gets a row per lease (``_with_arm``): the commit is refused when
    the second lease bound, not the first, is the stale one. Mutant: ``_with_arm`` keeps
    only the last row (or the first): one of the two orders commits."""
    for stale_first in (True, False):
        a, c = fencer.acquire("job:1", 5), fencer.acquire("job:2", 5)
        session = a.bind(make_session())
        driver = session.connection().connection.driver_connection  # after_begin: a armed
        assert driver.info.transaction_status == TransactionStatus.IDLE  # nothing sent yet
        c.bind(session)  # bound before the first statement: its arm joins the BEGIN's
        session.add(Outbox(id=1, message="two leases"))
        stale = a if stale_first else c
        expire(stale)
        newer = fencer.acquire(stale.name, 5)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            session.commit()
        assert refused.value.lease_name == stale.name
        session.close()
        assert outbox(scope_engine) == []
        for lease in (a, c, newer):
            lease.release()
