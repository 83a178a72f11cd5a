"""Installed sessions keep the user's engine as their own (issue 18).

``session.bind``, ``session.get_bind()``, ``binds={...}``,
``AsyncSession.get_bind()`` and ``async_scoped_session`` behave as without
sa-fence, the user's engine listeners keep firing, and the fencing still
happens: the hook is routed per connection, never through a swapped bind.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
)
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
import sa_fence.testing
from sa_fence.orm import flush as _flush
from sa_fence.orm import session_state, statements
from sa_fence.scope import arming
from tests._async_fixtures import expire
from tests._sql import seed
from tests.models import Audit, Job


def row(engine: sa.Engine, job_id: int) -> tuple[object, ...] | None:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT result, fence FROM jobs WHERE id = :id"), {"id": job_id}
        ).one_or_none()
    return None if found is None else tuple(found)


@pytest.fixture
def user_statements(engine: sa.Engine) -> Iterator[list[str]]:
    """What a listener the user put on their own engine sees."""
    seen: list[str] = []

    def before_cursor_execute(conn, cursor, statement, parameters, context, executemany):
        seen.append(statement.split(None, 1)[0].upper())

    sa.event.listen(engine, "before_cursor_execute", before_cursor_execute)
    yield seen
    sa.event.remove(engine, "before_cursor_execute", before_cursor_execute)


def stale_write(
    fencer: sa_fence.Fencer, make: sessionmaker[Session] | type[Session], engine: sa.Engine
) -> tuple[sa_fence.Lease, Session]:
    """A holder whose lease ran out loads job 1 and changes it; a newer holder writes it."""
    old = fencer.acquire("job:1", 5)
    session = old.bind(make())
    session.get_one(Job, 1).result = "stale"
    sa_fence.testing.expire(old)
    with fencer.acquire("job:1", 5) as newer, newer.bind(make()) as other:
        other.get_one(Job, 1).result = "newer"
        other.commit()
    return newer, session


def test_a_bound_session_keeps_the_users_engine_and_still_refuses_a_stale_write(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    user_statements: list[str],
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    newer, session = stale_write(fencer, make_session, engine)
    assert session.bind is engine
    assert session.get_bind() is engine
    assert session.get_bind(Job) is engine
    assert session.connection().engine is engine
    assert {engine: "keyed on the engine"}[session.get_bind()] == "keyed on the engine"
    del user_statements[:]
    with pytest.raises(sa_fence.StaleTokenError):
        session.commit()
    session.close()
    assert "UPDATE" in user_statements  # the user's engine listener saw the fenced flush
    assert row(engine, 1) == ("newer", newer.token)


def test_without_routing_the_connection_through_the_hook_the_stale_write_commits(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above: the per-connection routing is what fences.

    PostgreSQL's own lease-scope check at COMMIT (the arm sent with BEGIN) is
    a second line that would still refuse the transaction, so it is switched
    off too: what is left is what the routing alone prevents.
    """
    seed(fencer, make_session, Job(id=1, result="initial"))
    monkeypatch.setattr(_flush, "hook_connection", lambda connection: None)
    monkeypatch.setattr(statements, "hook_connection", lambda connection: None)
    monkeypatch.setattr(arming, "_arm", lambda conn, lease: None)
    _newer, session = stale_write(fencer, make_session, engine)
    session.commit()  # nothing compared the token, nothing checked the register
    session.close()
    assert row(engine, 1)[0] == "stale"  # type: ignore[index]


def test_binds_maps_to_the_users_engine_work_and_are_fenced(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    maker = sa_fence.install(sessionmaker(bind=engine, binds={Job: engine, Audit: engine}))
    with maker() as session:
        assert session.get_bind(Job) is engine
        session.add(Audit(message="bound to the engine in binds="))
        session.commit()
    newer, session = stale_write(fencer, maker, engine)
    assert session.connection(bind_arguments={"mapper": Job}).engine is engine
    with pytest.raises(sa_fence.StaleTokenError):
        session.commit()
    session.close()
    assert row(engine, 1) == ("newer", newer.token)


class AuditedConnection(sa.Connection):
    """A Connection subclass of the user's (``Engine._connection_cls``)."""

    def audited(self) -> str:
        return "audited"


def test_a_connection_subclass_of_the_users_is_fenced_and_keeps_its_class(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    own = sa.create_engine(engine.url, poolclass=sa.pool.NullPool)
    own._connection_cls = AuditedConnection  # type: ignore[misc]
    try:
        maker = sa_fence.install(sessionmaker(own))
        newer, session = stale_write(fencer, maker, own)
        conn = session.connection()
        assert isinstance(conn, statements.FencedConnection)
        assert isinstance(conn, AuditedConnection)
        assert conn.audited() == "audited"
        with pytest.raises(sa_fence.StaleTokenError):
            session.commit()
        session.close()
        assert row(engine, 1) == ("newer", newer.token)
        with own.connect() as plain:  # its class itself is left alone
            assert type(plain) is AuditedConnection
    finally:
        own.dispose()


def test_the_user_engines_connections_of_other_sessions_are_not_routed(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with make_session() as fenced, Session(engine) as plain:
        fenced_conn, plain_conn = fenced.connection(), plain.connection()
        assert isinstance(fenced_conn, statements.FencedConnection)
        assert not isinstance(plain_conn, statements.FencedConnection)
        assert not sa.event.contains(engine, "commit", arming.check_scope_and_commit)
        plain.add(Job(id=5, result="a plain session is not fenced"))
        plain.commit()  # the documented limit: no hook, written as is
    assert row(engine, 5) == ("a plain session is not fenced", 0)


def test_the_users_listener_on_the_sessions_own_connection_keeps_firing(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seen: list[str] = []
    with engine.connect() as conn:
        sa.event.listen(conn, "before_execute", lambda c, e, m, p, o: seen.append(type(e).__name__))
        with fencer.acquire("job:7", 5) as lease, lease.bind(make_session(bind=conn)) as session:
            assert session.connection() is conn
            session.add(Job(id=7, result="through the user's connection"))
            session.commit()
    assert "Insert" in seen
    assert row(engine, 7) == ("through the user's connection", lease.token)


def test_a_listener_added_to_the_engine_after_the_session_began_fires_too(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seen: list[str] = []

    def before_execute(conn, clauseelement, multiparams, params, execution_options):
        seen.append(type(clauseelement).__name__)

    with fencer.acquire("job:6", 5) as lease, lease.bind(make_session()) as session:
        assert isinstance(session.connection(), statements.FencedConnection)
        sa.event.listen(engine, "before_execute", before_execute)
        try:
            session.add(Job(id=6, result="seen"))
            session.commit()
        finally:
            sa.event.remove(engine, "before_execute", before_execute)
    assert "Insert" in seen
    assert row(engine, 6) == ("seen", lease.token)


# ---------------------------------------------------------------- asyncio


async def test_an_async_session_keeps_the_users_async_engine(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    async_engine: AsyncEngine,
    engine: sa.Engine,
) -> None:
    async with make_async_session() as session:
        assert session.bind is async_engine
        assert session.get_bind() is async_engine.sync_engine
        assert (await session.connection()).engine is async_engine
        async with afencer.acquire("job:8", 5) as lease:
            lease.bind(session)
            session.add(Job(id=8, result="async"))
            await session.commit()
    assert row(engine, 8) == ("async", lease.token)


async def test_an_async_scoped_session_finds_its_bind(
    afencer: sa_fence.AsyncFencer, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    scoped = sa_fence.install(
        async_scoped_session(
            async_sessionmaker(async_engine, expire_on_commit=False),
            scopefunc=asyncio.current_task,
        )
    )
    try:
        assert scoped.get_bind() is async_engine.sync_engine
        async with afencer.acquire("job:9", 5) as lease:
            lease.bind(scoped())
            scoped.add(Job(id=9, result="scoped"))
            await scoped.commit()
        assert (await scoped.connection()).engine is async_engine
    finally:
        await scoped.remove()
    assert row(engine, 9) == ("scoped", lease.token)


async def test_binding_an_async_scoped_session_fences_the_current_tasks_session(
    afencer: sa_fence.AsyncFencer, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    """``lease.bind(registry)`` unwraps twice: the registry's current AsyncSession, then
    its sync session; anything else that is not a session is refused by name."""
    scoped = sa_fence.install(
        async_scoped_session(
            async_sessionmaker(async_engine, expire_on_commit=False),
            scopefunc=asyncio.current_task,
        )
    )
    try:
        async with afencer.acquire("job:10", 5) as lease:
            assert lease.bind(scoped) is scoped
            assert session_state.bound_lease(scoped().sync_session) is lease
            scoped.add(Job(id=10, result="scoped"))
            await scoped.commit()
            with pytest.raises(TypeError, match=r"takes a sqlalchemy Session or .*, got async_"):
                lease.bind(async_sessionmaker(async_engine))  # type: ignore[arg-type]
    finally:
        await scoped.remove()
    assert row(engine, 10) == ("scoped", lease.token)


# ------------------------------------------------- several sessions, one Connection


def test_sessions_sharing_a_connection_with_no_lease_anywhere_work_as_in_sqlalchemy(
    make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """SQLAlchemy's own pattern (its VersionOnPostUpdateTest): Session(bind=s1.connection())."""
    with make_session() as s1:
        s1.add(Audit(id=1, message="first"))
        s1.flush()
        s2 = sa_fence.install(Session(bind=s1.connection()))
        s2.add(Audit(id=2, message="second"))
        s2.flush()
        assert s2.connection() is s1.connection()
        s2.close()
        s3 = make_session(bind=s1.connection())  # through the installed sessionmaker too
        assert s3.get_one(Audit, 2).message == "second"
        s3.close()
        s1.get_one(Audit, 1).message = "first, changed after the others closed"
        s1.commit()
    with engine.connect() as conn:
        assert conn.scalars(sa.select(Audit.message).order_by(Audit.id)).all() == [
            "first, changed after the others closed",
            "second",
        ]


def test_sessions_sharing_a_connection_with_the_same_lease_are_fenced(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with fencer.acquire("job:1", 5) as lease, lease.bind(make_session()) as s1:
        s1.add(Job(id=1, result="s1"))
        s1.flush()
        s2 = lease.bind(make_session(bind=s1.connection()))
        s2.add(Job(id=2, result="s2"))
        s2.flush()
        s2.close()
        s1.commit()
    assert row(engine, 1) == ("s1", lease.token)
    assert row(engine, 2) == ("s2", lease.token)


def test_sql_that_goes_on_is_refused_from_either_session_sharing_a_connection(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """The refusal of SQL that ends the transaction and goes on holds on a shared
    connection too, whichever of its sessions sends it (lease-scope.md)."""
    with fencer.acquire("job:1", 5) as lease, lease.bind(make_session()) as s1:
        s1.add(Job(id=1, result="s1"))
        s1.flush()
        s2 = lease.bind(make_session(bind=s1.connection()))
        for session in (s2, s1):
            with pytest.raises(sa_fence.FencingConfigError, match="Nothing was sent"):
                session.execute(sa.text("COMMIT; BEGIN"))
        s2.close()
        s1.rollback()
    assert row(engine, 1) is None  # a COMMIT sent would have committed it


@pytest.mark.parametrize("second", ["no lease", "another lease"])
def test_a_second_session_on_a_bound_sessions_connection_with_another_token_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine, second: str
) -> None:
    with fencer.acquire("job:1", 5) as lease, fencer.acquire("job:2", 5) as other:
        s1 = lease.bind(make_session())
        s1.add(Job(id=1, result="s1"))
        s1.flush()
        s2 = make_session(bind=s1.connection())
        if second == "another lease":
            other.bind(s2)
        with pytest.raises(sa_fence.FencingConfigError, match="different leases bound"):
            s2.connection()
        s2.close()
        s1.rollback()
        s1.close()
    assert row(engine, 1) is None


@pytest.mark.parametrize("guarded", [True, False], ids=["refused", "guard-removed"])
def test_a_refused_second_session_may_not_flush_or_commit_what_it_goes_on_to_write(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    guarded: bool,
) -> None:
    """A caller who catches the refusal and goes on with the second session would write on
    the first one's connection, with the first lease's token and scope: the refusal sticks,
    so that session may not flush or commit until rolled back.  The pair: without that, a
    stale holder's row commits with the first session's transaction."""
    if not guarded:
        monkeypatch.setattr(session_state.SessionState, "fail", lambda self, error: error)
    a, b = fencer.acquire("job:1", 5), fencer.acquire("job:2", 5)
    assert sa_fence.testing.expire(b)
    c = fencer.acquire("job:2", 5)  # B is stale now
    s1 = a.bind(make_session())
    s1.execute(sa.text("SELECT 1"))
    s2 = b.bind(make_session(bind=s1.connection()))
    with pytest.raises(sa_fence.FencingConfigError, match="different leases bound"):
        s2.connection()
    s2.add(Job(id=2, result="B, stale"))
    if guarded:
        with pytest.raises(sa_fence.FenceError, match=r"commit refused.*different leases"):
            s2.commit()
    else:
        s2.commit()  # (joined: the outer transaction, s1's, commits the row)
    s1.commit()
    s2.close()
    s1.close()
    assert (row(engine, 2) is None) is guarded
    a.release()
    c.release()


@pytest.mark.parametrize("guarded", [True, False], ids=["refused", "guard-removed"])
async def test_a_refused_second_async_session_may_not_flush_or_commit_either(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    redis_client: redis.Redis,
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    guarded: bool,
) -> None:
    """The same through AsyncSession, which runs the sync session's ``after_begin``: the
    refusal raised on ``await s2.connection()`` sticks to that session.  The pair: without
    it, the stale holder's row commits with the first session's transaction."""
    if not guarded:
        monkeypatch.setattr(session_state.SessionState, "fail", lambda self, error: error)
    a, b = await afencer.acquire("job:1", 5), await afencer.acquire("job:2", 5)
    assert expire(redis_client, b)
    c = await afencer.acquire("job:2", 5)  # B is stale now
    s1 = a.bind(make_async_session())
    await s1.execute(sa.text("SELECT 1"))
    s2 = b.bind(make_async_session(bind=await s1.connection()))
    with pytest.raises(sa_fence.FencingConfigError, match="different leases bound"):
        await s2.connection()
    s2.add(Job(id=2, result="B, stale"))
    if guarded:
        with pytest.raises(sa_fence.FenceError, match=r"commit refused.*different leases"):
            await s2.commit()
    else:
        await s2.commit()  # (joined: the outer transaction, s1's, commits the row)
    await s1.commit()
    await s2.close()
    await s1.close()
    assert (row(engine, 2) is None) is guarded
    await a.release()
    await c.release()


def test_binding_a_lease_to_one_of_two_unbound_sessions_sharing_a_connection_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with make_session() as s1, fencer.acquire("job:1", 5) as lease:
        s2 = make_session(bind=s1.connection())
        s2.connection()
        with pytest.raises(sa_fence.FencingConfigError, match="different leases bound"):
            lease.bind(s1)
        assert session_state.state_for(s1).lease is None  # nothing was bound
        s2.close()


def test_without_the_check_an_unbound_session_writes_with_another_sessions_token(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the refusals above: their tokens are confused without the check."""
    seed(fencer, make_session, Job(id=1, result="initial"))
    monkeypatch.setattr(_flush, "_refuse_confusable", lambda connection, state, lease: None)
    with make_session() as unbound, fencer.acquire("job:1", 5) as lease:
        conn = unbound.connection()
        bound = lease.bind(make_session(bind=conn))
        bound.connection()  # begins on the shared connection: its state is the active one
        jobs = Job.__table__
        # Core DML on the unbound session's connection: refused as unfenced with the check
        unbound.connection().execute(
            jobs.update().where(jobs.c.id == 1).values(result="written unbound")
        )
        bound.close()
        unbound.commit()
    assert row(engine, 1) == ("written unbound", lease.token)  # another session's token


# ------------------------------------------------------ nothing changes until bound


def test_from_statement_dml_works_on_unfenced_tables_and_is_refused_on_fenced_ones(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    wrapped = sa.select(Audit).from_statement(
        sa.insert(Audit).values(message="through from_statement").returning(Audit)
    )
    fenced = sa.select(Job).from_statement(
        sa.update(Job).where(Job.id == 1).values(result="wrapped").returning(Job)
    )
    with make_session() as session:
        assert session.scalars(wrapped).one().message == "through from_statement"
        with pytest.raises(sa_fence.UnfencedWriteError):
            session.execute(fenced)
    with fencer.acquire("job:1", 5) as lease, lease.bind(make_session()) as session:
        assert session.scalars(wrapped).one().message == "through from_statement"
        with pytest.raises(sa_fence.FencingConfigError, match="from_statement"):
            session.execute(fenced)
    assert row(engine, 1)[0] == "initial"  # type: ignore[index]


def test_without_the_from_statement_refusal_a_bound_write_leaves_the_fence_behind(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above: the wrapped UPDATE neither compares nor writes the token."""
    first = seed(fencer, make_session, Job(id=1, result="initial"))
    monkeypatch.setattr(_flush, "_refuse_from_statement", lambda table: None)
    with fencer.acquire("job:1", 5) as lease, lease.bind(make_session()) as session:
        session.execute(
            sa.select(Job).from_statement(
                sa.update(Job).where(Job.id == 1).values(result="unfenced").returning(Job)
            )
        )
        session.commit()
    assert lease.token > first
    assert row(engine, 1) == ("unfenced", first)  # the row still shows the old holder's token


@pytest.fixture
def sqlite_connection() -> Iterator[sa.Connection]:
    sqlite = sa.create_engine("sqlite://")
    with sqlite.connect() as conn:
        conn.execute(sa.text("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)"))
        conn.commit()
        yield conn
    sqlite.dispose()


def test_an_installed_session_works_on_any_connection_until_a_lease_is_bound(
    fencer: sa_fence.Fencer, sqlite_connection: sa.Connection
) -> None:
    with sa_fence.install(Session(bind=sqlite_connection)) as session:
        session.execute(sa.text("INSERT INTO notes (body) VALUES ('as without sa-fence')"))
        session.commit()
        assert session.scalar(sa.text("SELECT body FROM notes")) == "as without sa-fence"
        session.connection()  # a transaction on SQLite is under way
        with (
            fencer.acquire("notes", 5) as lease,
            pytest.raises(sa_fence.FencingConfigError, match="needs PostgreSQL"),
        ):
            lease.bind(session)
        session.rollback()
        with fencer.acquire("notes", 5) as lease:
            lease.bind(session)  # no transaction yet: refused when one begins
            with pytest.raises(sa_fence.FencingConfigError, match="needs PostgreSQL"):
                session.execute(sa.text("INSERT INTO notes (body) VALUES ('fenced')"))


def test_without_the_dialect_check_a_lease_on_sqlite_fails_obscurely_in_the_database(
    fencer: sa_fence.Fencer, sqlite_connection: sa.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair of the test above: nothing clear says the lease cannot fence there."""
    monkeypatch.setattr(_flush, "check_dialect", lambda dialect: None)
    with (
        sa_fence.install(Session(bind=sqlite_connection)) as session,
        fencer.acquire("n", 5) as lease,
    ):
        lease.bind(session)
        # the first PostgreSQL-only statement fails: the arm of the transaction
        # (an INSERT into the scope table), sent on the DBAPI connection
        with pytest.raises((sa.exc.OperationalError, sqlite3.OperationalError)):
            session.execute(sa.text("INSERT INTO notes (body) VALUES ('fenced')"))


def test_an_engine_made_per_request_is_collected_after_its_fenced_sessions(
    engine: sa.Engine,
) -> None:
    """The routing keeps per engine only events that hold no reference to the engine."""
    import gc
    import weakref

    made = []
    for _ in range(3):
        per_request = engine.execution_options(isolation_level="REPEATABLE READ")
        with sa_fence.install(Session(bind=per_request)) as session:
            assert isinstance(session.connection(), statements.FencedConnection)
            assert session.get_bind() is per_request
        made.append(weakref.ref(per_request))
        del per_request, session
    gc.collect()
    assert [ref() for ref in made] == [None, None, None]


def test_fence_connection_on_a_sessions_connection_needs_the_sessions_lease(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with fencer.acquire("job:3", 5) as lease:
        with make_session() as unbound:
            conn = unbound.connection()
            with (
                pytest.raises(sa_fence.FencingConfigError, match="no lease"),
                sa_fence.fence_connection(conn, lease),
            ):
                pytest.fail("entered")
            unbound.rollback()
        with lease.bind(make_session()) as bound:
            with sa_fence.fence_connection(bound.connection(), lease) as conn:
                conn.execute(Job.__table__.insert().values(id=3, result="same lease"))
            bound.commit()
    assert row(engine, 3) == ("same lease", lease.token)


def test_without_the_check_fence_connection_lends_its_token_to_an_unbound_session(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above: the unbound session's write commits with the block's token."""
    monkeypatch.setattr(_flush, "_refuse_confusable", lambda connection, state, lease: None)
    with fencer.acquire("job:3", 5) as lease, make_session() as unbound:
        with sa_fence.fence_connection(unbound.connection(), lease):
            unbound.connection().execute(Job.__table__.insert().values(id=3, result="unbound"))
        unbound.commit()
    assert row(engine, 3) == ("unbound", lease.token)
