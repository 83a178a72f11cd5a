"""Lease scope between transactions: when SQLAlchemy has no transaction open on a Connection.

Two paths, probed on the real servers:

1. ``fence_connection()`` on an ``AsyncConnection`` (entered through ``run_sync``, as
   docs/asyncio.md says): after ``await conn.commit()`` and before the next statement, a
   statement sent on the psycopg ``AsyncConnection`` itself begins a transaction of the
   driver's.  psycopg's async connection has no BEGIN step of its own (``_start_query`` is
   the generator both connection classes drive), so sa-fence's step on the driver instance
   arms that transaction with the Connection's lease, as in sync code: a stale holder's
   commit is refused, however it is sent, and the current holder's lands.

2. A ``Session`` joined to an external transaction of a ``Connection`` (SQLAlchemy's
   recipe, in the default ``conservative_savepoint`` mode and in ``create_savepoint``).
   The outer transaction is checked when it commits, and so is anything written on the
   Connection before then; the session's next transaction is armed again.  Once both the
   session's transaction and the outer one have ended, the Connection is the caller's again
   (docs/lease-scope.md): its own transactions are not the session's and are not armed
   (``fence_connection()`` fences them); the last tests pin that boundary.

A holder is made stale as elsewhere: its lease runs out in Redis behind its back and the
name is granted again, so the register holds a newer token.
"""

from __future__ import annotations

import contextlib
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.util import await_only

import sa_fence
from sa_fence.testing import expire
from tests import _scope_fixtures
from tests.models_scope import OWN_ARMS, Outbox
from tests.scope.test_scope_trigger import _async_scope, outbox

# The scope database and its fixtures (module-scoped: a database of this module's own).
scope_engine = _scope_fixtures.scope_engine
_empty_tables = _scope_fixtures.empty_tables
fencer = _scope_fixtures.fencer
make_session = _scope_fixtures.make_session

HOLDERS = ["stale", "current"]


def _new_name() -> str:
    return f"job:{uuid.uuid4().hex[:8]}"


def _is_stale_commit(error: BaseException) -> bool:
    """The scope trigger's refusal of a COMMIT: sa-fence's error through SQLAlchemy, the
    driver's (SQLSTATE SF003) below it."""
    if isinstance(error, sa_fence.StaleTokenError):
        return True
    return isinstance(error, psycopg.Error) and error.sqlstate == "SF003"


# ------------------------------------- 1. fence_connection() on an AsyncConnection


async def _supersede(client: Any, fencer: sa_fence.AsyncFencer, a: Any) -> Any:
    """A's lease runs out behind its back (A does not notice) and the name is granted again."""
    assert await client.eval("return redis.call('del', KEYS[1])", 1, a.key)
    return await fencer.acquire(a.name, 5)


@contextlib.asynccontextmanager
async def _fenced(aconn: AsyncConnection, lease: Any) -> AsyncIterator[AsyncConnection]:
    """``fence_connection()`` around plain async code: entered and left through ``run_sync``
    (entering presents the token, a statement, which needs SQLAlchemy's greenlet)."""
    block = contextlib.ExitStack()
    await aconn.run_sync(lambda conn: block.enter_context(sa_fence.fence_connection(conn, lease)))
    try:
        yield aconn
    finally:
        await aconn.run_sync(lambda _conn: block.close())


async def _driver_of(aconn: AsyncConnection) -> Any:
    """The psycopg ``AsyncConnection`` under ``aconn``."""
    return (await aconn.get_raw_connection()).driver_connection


async def _own_arms(driver: Any) -> int:
    """The arms the driver's open transaction wrote (its rows of sa_fence_scope)."""
    row = await (await driver.execute(f"SELECT count(*) FROM {OWN_ARMS}")).fetchone()
    return int(row[0])


async def _send_execute(driver: Any) -> None:
    await driver.execute("INSERT INTO outbox VALUES (2, 'raw, between')")


async def _send_cursor(driver: Any) -> None:
    async with driver.cursor() as cursor:
        await cursor.execute("INSERT INTO outbox VALUES (%s, %s)", (2, "raw, between"))


async def _send_executemany(driver: Any) -> None:
    async with driver.cursor() as cursor:  # (psycopg pipelines it: BEGIN and the arm queued)
        await cursor.executemany("INSERT INTO outbox VALUES (%s, %s)", [(2, "raw, between")])


async def _send_pipeline(driver: Any) -> None:
    async with driver.pipeline():
        await driver.execute("INSERT INTO outbox VALUES (2, 'raw, between')")


async def _send_copy(driver: Any) -> None:
    async with driver.cursor() as cursor, cursor.copy("COPY outbox FROM STDIN") as copy:
        await copy.write_row((2, "raw, between"))


#: Every way to send a statement on the psycopg AsyncConnection itself.
ASYNC_DRIVER_SENDS: dict[str, Callable[[Any], Any]] = {
    "driver.execute()": _send_execute,
    "driver.cursor().execute()": _send_cursor,
    "driver.cursor().executemany()": _send_executemany,
    "driver.pipeline()": _send_pipeline,
    "driver.cursor().copy()": _send_copy,
}


def test_psycopgs_async_connection_begins_through_the_step_sa_fence_arms() -> None:
    """sa-fence replaces ``_start_query`` on the driver instance; psycopg's AsyncConnection
    defines none of its own (the generator is shared with the sync class), so the async
    driver's BEGIN runs the same armed step (the tests below show it on the server)."""
    assert "_start_query" not in vars(psycopg.AsyncConnection)
    assert psycopg.AsyncConnection._start_query is psycopg.Connection._start_query


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("send", ASYNC_DRIVER_SENDS)
async def test_async_a_raw_driver_transaction_between_a_fenced_connections_transactions_is_armed(
    send: str, holder: str, scope_engine: sa.Engine, key_prefix: str
) -> None:
    """After ``await conn.commit()``, SQLAlchemy has no transaction open: a statement on
    the psycopg AsyncConnection begins one, and its BEGIN carries the Connection's arm."""
    async with _async_scope(scope_engine, key_prefix) as (aengine, client, fencer, _make):
        a = await fencer.acquire(_new_name(), 5)
        b = None
        async with aengine.connect() as aconn, _fenced(aconn, a):
            await aconn.execute(sa.insert(Outbox).values(id=1, message="through SQLAlchemy"))
            await aconn.commit()
            driver = await _driver_of(aconn)
            assert "_start_query" in vars(driver)  # the armed step, on this instance
            assert not aconn.in_transaction()
            assert driver.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            if holder == "stale":
                b = await _supersede(client, fencer, a)
            await ASYNC_DRIVER_SENDS[send](driver)
            assert await _own_arms(driver) == 1
            if holder == "stale":
                with pytest.raises(psycopg.DatabaseError, match="is stale") as refused:
                    await driver.commit()
                assert refused.value.sqlstate == "SF003"
                await driver.rollback()
            else:
                await driver.commit()
            await aconn.rollback()
        await (b or a).release()
    expected = ["through SQLAlchemy"] + (["raw, between"] if holder == "current" else [])
    assert outbox(scope_engine) == expected


async def _end_through_sqlalchemy(aconn: AsyncConnection, driver: Any) -> None:
    await aconn.execute(sa.insert(Outbox).values(id=3, message="through SQLAlchemy again"))
    await aconn.commit()


async def _end_with_commit_as_sql(aconn: AsyncConnection, driver: Any) -> None:
    await aconn.exec_driver_sql("COMMIT")


async def _end_with_the_driver(aconn: AsyncConnection, driver: Any) -> None:
    await driver.commit()


#: Every way to commit the raw transaction begun between the Connection's transactions.
ASYNC_ENDS: dict[str, Callable[[AsyncConnection, Any], Any]] = {
    "a statement through SQLAlchemy, then AsyncConnection.commit()": _end_through_sqlalchemy,
    'exec_driver_sql("COMMIT")': _end_with_commit_as_sql,
    "driver.commit()": _end_with_the_driver,
}


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("end", ASYNC_ENDS)
async def test_async_the_raw_transaction_between_is_checked_however_it_is_committed(
    end: str, holder: str, scope_engine: sa.Engine, key_prefix: str
) -> None:
    """Through SQLAlchemy (its begin finds the driver's transaction open and sends the arm
    again, apart) the refusal is sa-fence's StaleTokenError; below it, the driver's."""
    async with _async_scope(scope_engine, key_prefix) as (aengine, client, fencer, _make):
        a = await fencer.acquire(_new_name(), 5)
        b = None
        async with aengine.connect() as aconn, _fenced(aconn, a):
            await aconn.execute(sa.insert(Outbox).values(id=1, message="through SQLAlchemy"))
            await aconn.commit()
            if holder == "stale":
                b = await _supersede(client, fencer, a)
            driver = await _driver_of(aconn)
            await _send_execute(driver)
            if holder == "stale":
                with pytest.raises(Exception, match="is stale") as refused:
                    await ASYNC_ENDS[end](aconn, driver)
                assert _is_stale_commit(refused.value)
                if not end.startswith("driver"):
                    assert isinstance(refused.value, sa_fence.StaleTokenError)
                    assert refused.value.token == a.token
                await driver.rollback()
            else:
                await ASYNC_ENDS[end](aconn, driver)
            await aconn.rollback()
        await (b or a).release()
    expected = ["through SQLAlchemy"]
    if holder == "current":
        expected += ["raw, between"] + (["through SQLAlchemy again"] if "SQLAlchemy" in end else [])
    assert outbox(scope_engine) == expected


@pytest.mark.parametrize("ended", ["committed", "rolled back"])
async def test_async_a_raw_transaction_between_is_checked_after_a_rollback_and_after_the_block(
    ended: str, scope_engine: sa.Engine, key_prefix: str
) -> None:
    """Between transactions however SQLAlchemy's ended; and the arm rides the raw
    transaction's BEGIN, so leaving the block before the driver's commit does not take it
    back (the committed case commits after the block)."""
    async with _async_scope(scope_engine, key_prefix) as (aengine, client, fencer, _make):
        a = await fencer.acquire(_new_name(), 5)
        async with aengine.connect() as aconn:
            async with _fenced(aconn, a):
                await aconn.execute(sa.insert(Outbox).values(id=1, message="first"))
                await (aconn.commit() if ended == "committed" else aconn.rollback())
                b = await _supersede(client, fencer, a)
                driver = await _driver_of(aconn)
                await _send_execute(driver)
                if ended == "rolled back":
                    with pytest.raises(psycopg.DatabaseError, match="is stale"):
                        await driver.commit()
            if ended == "committed":
                with pytest.raises(psycopg.DatabaseError, match="is stale"):
                    await driver.commit()
            await driver.rollback()
        await b.release()
    assert outbox(scope_engine) == (["first"] if ended == "committed" else [])


@pytest.mark.parametrize("holder", HOLDERS)
async def test_async_inside_run_sync_a_raw_driver_statement_between_transactions_is_armed(
    holder: str, scope_engine: sa.Engine, key_prefix: str
) -> None:
    """The documented shape (docs/asyncio.md): the whole block inside ``run_sync``, the
    driver's coroutines awaited through SQLAlchemy's greenlet bridge."""
    async with _async_scope(scope_engine, key_prefix) as (aengine, client, fencer, _make):
        a = await fencer.acquire(_new_name(), 5)
        leases = [a]

        def work(conn: sa.Connection) -> None:
            with sa_fence.fence_connection(conn, a):
                conn.execute(sa.insert(Outbox).values(id=1, message="through SQLAlchemy"))
                conn.commit()
                if holder == "stale":
                    leases.append(await_only(_supersede(client, fencer, a)))
                driver = _raw(conn)
                await_only(_send_execute(driver))
                if holder == "stale":
                    with pytest.raises(psycopg.DatabaseError, match="is stale"):
                        await_only(driver.commit())
                    await_only(driver.rollback())
                else:
                    await_only(driver.commit())
                conn.rollback()

        async with aengine.connect() as aconn:
            await aconn.run_sync(work)
        await leases[-1].release()
    expected = ["through SQLAlchemy"] + (["raw, between"] if holder == "current" else [])
    assert outbox(scope_engine) == expected


@pytest.mark.parametrize("start", ["transaction", "autocommit"])
async def test_async_a_raw_begin_of_its_own_between_a_fenced_connections_transactions_is_refused(
    start: str, scope_engine: sa.Engine, key_prefix: str
) -> None:
    """psycopg's own BEGIN (``transaction()``) and autocommit would send no arm: refused."""
    async with _async_scope(scope_engine, key_prefix) as (aengine, _client, fencer, _make):
        a = await fencer.acquire(_new_name(), 5)
        async with aengine.connect() as aconn, _fenced(aconn, a):
            await aconn.execute(sa.insert(Outbox).values(id=1, message="through SQLAlchemy"))
            await aconn.commit()
            driver = await _driver_of(aconn)
            if start == "transaction":
                with pytest.raises(sa_fence.FencingConfigError, match=r"psycopg's transaction\(\)"):
                    driver.transaction()
            else:
                await driver.set_autocommit(True)
                try:
                    with pytest.raises(sa_fence.FencingConfigError, match="AUTOCOMMIT"):
                        await _send_execute(driver)
                finally:
                    await driver.set_autocommit(False)
            await aconn.rollback()
        await a.release()
    assert outbox(scope_engine) == ["through SQLAlchemy"]


# ------------------------------ 2. a Session joined to an external transaction

#: SQLAlchemy's join_transaction_mode values of the recipe (the default joins without a
#: savepoint; its commit leaves the outer transaction open, as create_savepoint's does).
JOIN_MODES: dict[str, dict[str, str]] = {
    "conservative_savepoint (default)": {},
    "create_savepoint": {"join_transaction_mode": "create_savepoint"},
}

#: The ways to commit the external transaction.
OUTER_ENDS: dict[str, Callable[[sa.Connection, sa.RootTransaction], None]] = {
    "trans.commit()": lambda conn, outer: outer.commit(),
    "conn.commit()": lambda conn, outer: conn.commit(),
}


def _raw(conn: sa.Connection) -> Any:
    """The psycopg connection under ``conn``."""
    return conn.connection.driver_connection


def _joined_and_committed(
    conn: sa.Connection, make_session: sessionmaker[Session], lease: Any, mode: str, end: str
) -> Session:
    """The recipe: an outer transaction of ``conn``, a session joined to it with ``lease``
    bound, the session's write committed, then the outer transaction committed."""
    outer = conn.begin()
    session = make_session(bind=conn, **JOIN_MODES[mode])
    lease.bind(session)
    session.add(Outbox(id=1, message="session, first"))
    session.commit()
    OUTER_ENDS[end](conn, outer)
    assert not session.in_transaction()
    assert not conn.in_transaction()
    return session


def _supersede_sync(fencer: sa_fence.Fencer, a: sa_fence.Lease) -> sa_fence.Lease:
    assert expire(a)
    return fencer.acquire(a.name, 5)


def _rollback_everything(conn: sa.Connection, session: Session) -> None:
    """After a refusal: nothing of the attempt stays open (SQLAlchemy's nor the driver's)."""
    session.rollback()
    conn.rollback()
    _raw(conn).rollback()


def _write_on_the_connection(conn: sa.Connection) -> None:
    conn.execute(sa.insert(Outbox).values(id=2, message="on the connection"))
    conn.commit()


def _write_on_the_driver(conn: sa.Connection) -> None:
    driver = _raw(conn)
    driver.execute("INSERT INTO outbox VALUES (2, 'on the connection')")
    driver.commit()


def _write_in_psycopgs_own_transaction(conn: sa.Connection) -> None:
    driver = _raw(conn)
    with driver.transaction():
        driver.execute("INSERT INTO outbox VALUES (2, 'on the connection')")


#: Writes on the Connection itself (not through the session), committed there.
CONNECTION_WRITES: dict[str, Callable[[sa.Connection], None]] = {
    "conn.execute(), conn.commit()": _write_on_the_connection,
    "driver.execute(), driver.commit()": _write_on_the_driver,
    "driver.transaction()": _write_in_psycopgs_own_transaction,
}


@pytest.mark.parametrize("write", CONNECTION_WRITES)
@pytest.mark.parametrize("mode", JOIN_MODES)
def test_once_the_joined_session_and_the_outer_transaction_have_ended_the_connection_is_yours(
    mode: str,
    write: str,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
) -> None:
    """The documented boundary: the session's lease fences the session's transactions (and
    the outer one it joined), not the Connection's own after both ended, which are armed by
    no one (a lease released by then must not refuse them): even a stale holder's write
    there commits. ``fence_connection(conn, lease)`` fences them; the next test shows it."""
    a = fencer.acquire(_new_name(), 5)
    with scope_engine.connect() as conn:
        session = _joined_and_committed(conn, make_session, a, mode, "trans.commit()")
        b = _supersede_sync(fencer, a)
        CONNECTION_WRITES[write](conn)
        session.close()
    b.release()
    assert outbox(scope_engine) == ["session, first", "on the connection"]


@pytest.mark.parametrize("write", [w for w in CONNECTION_WRITES if "transaction()" not in w])
def test_the_connection_you_manage_is_fenced_by_fence_connection_after_the_session(
    write: str,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
) -> None:
    a = fencer.acquire(_new_name(), 5)
    with scope_engine.connect() as conn:
        session = _joined_and_committed(conn, make_session, a, "create_savepoint", "conn.commit()")
        session.close()
        with sa_fence.fence_connection(conn, a):
            b = _supersede_sync(fencer, a)
            with pytest.raises(Exception, match="is stale") as refused:
                CONNECTION_WRITES[write](conn)
            assert _is_stale_commit(refused.value)
            conn.rollback()
            _raw(conn).rollback()
    b.release()
    assert outbox(scope_engine) == ["session, first"]


def _session_begins_its_own(conn: sa.Connection, session: Session) -> None:
    """The Connection has no transaction open: the session begins one and commits it."""
    session.add(Outbox(id=3, message="session, next"))
    session.commit()


def _in_a_new_outer_transaction(conn: sa.Connection, session: Session) -> None:
    outer = conn.begin()
    session.add(Outbox(id=3, message="session, next"))
    session.commit()
    outer.commit()


def _after_a_raw_statement(conn: sa.Connection, session: Session) -> None:
    """The driver's unarmed transaction is open when the session begins: its arm is sent
    apart, and the raw row commits (or not) with the session's."""
    _raw(conn).execute("INSERT INTO outbox VALUES (2, 'raw, before')")
    session.add(Outbox(id=3, message="session, next"))
    session.commit()


#: The joined session's next use, after the external transaction committed.
NEXT_USES: dict[str, Callable[[sa.Connection, Session], None]] = {
    "the session begins its own transaction": _session_begins_its_own,
    "a new outer transaction": _in_a_new_outer_transaction,
    "after a raw driver statement": _after_a_raw_statement,
}


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("use", NEXT_USES)
@pytest.mark.parametrize("end", OUTER_ENDS)
@pytest.mark.parametrize("mode", JOIN_MODES)
def test_a_joined_sessions_next_transaction_after_the_outer_commit_is_armed(
    mode: str,
    end: str,
    use: str,
    holder: str,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
) -> None:
    a = fencer.acquire(_new_name(), 5)
    b = None
    with scope_engine.connect() as conn:
        session = _joined_and_committed(conn, make_session, a, mode, end)
        if holder == "stale":
            b = _supersede_sync(fencer, a)
            with pytest.raises(sa_fence.StaleTokenError) as refused:
                NEXT_USES[use](conn, session)
            assert refused.value.token == a.token
            assert refused.value.newest_token == b.token
            _rollback_everything(conn, session)
        else:
            NEXT_USES[use](conn, session)
        session.close()
    (b or a).release()
    expected = ["session, first"]
    if holder == "current":
        expected += (["raw, before"] if "raw" in use else []) + ["session, next"]
    assert outbox(scope_engine) == expected


#: Writes on the Connection inside the external transaction (left open: the test commits it).
WRITES_IN_THE_OUTER: dict[str, Callable[[sa.Connection], object]] = {
    "conn.execute()": lambda conn: conn.execute(
        sa.insert(Outbox).values(id=2, message="on the connection")
    ),
    "driver.execute()": lambda conn: _raw(conn).execute(
        "INSERT INTO outbox VALUES (2, 'on the connection')"
    ),
}


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("write", WRITES_IN_THE_OUTER)
@pytest.mark.parametrize("mode", JOIN_MODES)
def test_between_a_joined_sessions_commit_and_the_outer_commit_a_write_on_the_connection_is_checked(
    mode: str,
    write: str,
    holder: str,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
) -> None:
    """The session's commit leaves the external transaction open, armed: what is written
    on the Connection next commits with it, only while the lease is the newest."""
    a = fencer.acquire(_new_name(), 5)
    b = None
    with scope_engine.connect() as conn:
        outer = conn.begin()
        session = a.bind(make_session(bind=conn, **JOIN_MODES[mode]))
        session.add(Outbox(id=1, message="session, first"))
        session.commit()
        assert not session.in_transaction()
        WRITES_IN_THE_OUTER[write](conn)
        if holder == "stale":
            b = _supersede_sync(fencer, a)
            with pytest.raises(sa_fence.StaleTokenError) as refused:
                outer.commit()
            assert refused.value.token == a.token
            _rollback_everything(conn, session)
        else:
            outer.commit()
        session.close()
    (b or a).release()
    expected = [] if holder == "stale" else ["session, first", "on the connection"]
    assert outbox(scope_engine) == expected


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("write", [w for w in CONNECTION_WRITES if "transaction()" not in w])
@pytest.mark.parametrize("mode", JOIN_MODES)
def test_while_the_joined_sessions_transaction_is_open_a_write_after_the_outer_commit_is_armed(
    mode: str,
    write: str,
    holder: str,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
) -> None:
    """The external transaction committed under the session's feet (the session flushed,
    did not commit): the Connection is still the session's, so its next transaction, begun
    by SQLAlchemy or by the driver, carries the lease's arm."""
    a = fencer.acquire(_new_name(), 5)
    b = None
    with scope_engine.connect() as conn:
        outer = conn.begin()
        session = a.bind(make_session(bind=conn, **JOIN_MODES[mode]))
        session.add(Outbox(id=1, message="session, first"))
        session.flush()
        outer.commit()
        assert session.in_transaction()
        if holder == "stale":
            b = _supersede_sync(fencer, a)
            with pytest.raises(Exception, match="is stale") as refused:
                CONNECTION_WRITES[write](conn)
            assert _is_stale_commit(refused.value)
            with warnings.catch_warnings():  # (SQLAlchemy: "transaction already deassociated")
                warnings.simplefilter("ignore", sa.exc.SAWarning)
                _rollback_everything(conn, session)
        else:
            CONNECTION_WRITES[write](conn)
        session.close()
    (b or a).release()
    expected = ["session, first"] + (["on the connection"] if holder == "current" else [])
    assert outbox(scope_engine) == expected
