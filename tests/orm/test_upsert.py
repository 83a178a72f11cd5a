"""Fenced upserts: ``INSERT ... ON CONFLICT DO UPDATE`` on fenced tables (issue 19, item 11).

The INSERT part writes ``fence = :token``; the DO UPDATE sets ``fence =
:token`` and carries ``coalesce(fence, 0) <= :token`` in its WHERE, so a
stale holder's upsert of a row a newer holder wrote updates nothing and
raises :class:`sa_fence.StaleTokenError` as a flush does.

A "stale holder" here is a lease of another name granted before the newer
holder's: its token is smaller, so the row fence alone must refuse it (lease
scope, which refuses a stale holder of the *same* name at COMMIT, is not in
play).  Each guarantee has its pair: the same statement with the guard
switched off lands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.cli.demo_models import DemoStep
from sa_fence.cli.schema import upgrade_demo_schema
from sa_fence.orm import rewrite as _rewrite
from tests._fresh_db import fresh_database
from tests._sql import recorded_statements
from tests.models import Cell, Job

jobs: Any = Job.__table__


def rows(engine: sa.Engine) -> dict[int, tuple[Any, ...]]:
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT id, result, fence FROM jobs ORDER BY id"))
        return {i: (r, f) for i, r, f in found}


def write_newer(fencer: sa_fence.Fencer, make_session: sessionmaker[Session], *ids: int) -> int:
    """A newer holder (a lease granted after the caller's) writes ``ids``; its token."""
    with fencer.acquire("newer", 5) as lease, make_session() as session:
        lease.bind(session)
        for i in ids:
            session.merge(Job(id=i, result="newer"))
        session.commit()
        return lease.token


@pytest.fixture
def statements(engine: sa.Engine) -> Iterator[list[str]]:
    with recorded_statements(engine) as sent:
        yield sent


# ------------------------------------------------------------------- front ends

#: SQLAlchemy reports an INSERT's row count only when asked to.
COUNTED = {"preserve_rowcount": True}

#: How a test sends a statement: (lease, statement, parameters) -> rowcount,
#: on a bound session or a fenced Core connection; it commits on success.
Send = Callable[[sa_fence.Lease, Any, Any], int]


def _session_sender(make_session: sessionmaker[Session]) -> Send:
    def send(lease: sa_fence.Lease, stmt: Any, params: Any = None) -> int:
        with make_session() as session:
            lease.bind(session)
            try:
                result: Any = session.execute(stmt, params, execution_options=COUNTED)
            except BaseException:
                session.rollback()
                raise
            session.commit()
            return int(result.rowcount)

    return send


def _connection_sender(engine: sa.Engine) -> Send:
    def send(lease: sa_fence.Lease, stmt: Any, params: Any = None) -> int:
        with engine.connect() as conn, sa_fence.fence_connection(conn, lease):
            try:
                result: Any = conn.execute(stmt, params, execution_options=COUNTED)
            except BaseException:
                conn.rollback()
                raise
            conn.commit()
            return int(result.rowcount)

    return send


@pytest.fixture(params=["session-core", "fence_connection", "session-orm"])
def front(
    request: pytest.FixtureRequest, make_session: sessionmaker[Session], engine: sa.Engine
) -> tuple[str, Send, Any]:
    """(name, send, the insert() target): Core in a session, Core in
    fence_connection(), ORM-enabled insert(Job) in a session."""
    if request.param == "fence_connection":
        return request.param, _connection_sender(engine), jobs
    target = Job if request.param == "session-orm" else jobs
    return request.param, _session_sender(make_session), target


def upsert(target: Any, result: str = "upserted", **values: Any) -> Any:
    stmt = insert(target).values(id=values.pop("id", 1), result=result, **values)
    return stmt.on_conflict_do_update(index_elements=["id"], set_={"result": result})


# ------------------------------------------------ the current holder's upserts


def test_the_current_holders_upsert_inserts_then_updates_and_the_row_carries_its_token(
    fencer: sa_fence.Fencer, engine: sa.Engine, front: tuple[str, Send, Any]
) -> None:
    _, send, target = front
    with fencer.acquire("job:1", 5) as lease:
        assert send(lease, upsert(target, "inserted"), None) == 1
        assert rows(engine) == {1: ("inserted", lease.token)}
        assert send(lease, upsert(target, "updated"), None) == 1
    assert rows(engine) == {1: ("updated", lease.token)}


def test_an_upsert_over_an_older_holders_row_takes_it_over(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    older = write_newer(fencer, make_session, 1)  # granted before the lease below
    with fencer.acquire("job:1", 5) as lease:
        _session_sender(make_session)(lease, upsert(jobs, "taken over"), None)
    assert rows(engine) == {1: ("taken over", lease.token)}
    assert lease.token > older


def test_a_returning_upsert_returns_the_row_with_the_token_as_its_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        for result in ("inserted", "updated"):
            stmt = upsert(Job, result).returning(Job.id, Job.result, Job.fence)
            assert session.execute(stmt).all() == [(1, result, lease.token)]
        orm_stmt = upsert(Job, "as entity").returning(Job)
        job = session.scalars(orm_stmt).one()
        assert (job.result, job.fence) == ("as entity", lease.token)
        session.commit()
    assert rows(engine) == {1: ("as entity", lease.token)}


def test_an_upsert_may_set_columns_from_excluded(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with fencer.acquire("job:1", 5) as lease:
        send = _session_sender(make_session)
        for result in ("first", "second"):
            stmt = insert(jobs).values(id=1, result=result, status="s-" + result)
            stmt = stmt.on_conflict_do_update(
                index_elements=[jobs.c.id],
                set_={"result": stmt.excluded.result, jobs.c.status: stmt.excluded.status},
            )
            assert send(lease, stmt, None) == 1
    assert rows(engine) == {1: ("second", lease.token)}


# --------------------------------------------------------- stale holders refused


def test_a_stale_upsert_is_refused_and_the_row_keeps_the_newer_value(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    front: tuple[str, Send, Any],
) -> None:
    _, send, target = front
    stale = fencer.acquire("job:1", 5)  # granted first: the smaller token
    newer = write_newer(fencer, make_session, 1)
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        send(stale, upsert(target, "stale"), None)
    error = refused.value
    assert (error.statement, error.table, error.token) == ("UPSERT", "jobs", stale.token)
    assert (error.primary_keys, error.current_fences) == (((1,),), (newer,))
    assert "UPSERT on table 'jobs' refused" in str(error)
    assert rows(engine) == {1: ("newer", newer)}
    stale.release()


def test_a_stale_returning_upsert_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    stale = fencer.acquire("job:1", 5)
    newer = write_newer(fencer, make_session, 1)
    with make_session() as session:
        stale.bind(session)
        with pytest.raises(sa_fence.StaleTokenError):
            session.execute(upsert(Job, "stale").returning(Job.id)).all()
        with pytest.raises(sa_fence.FenceError, match="rollback"):
            session.commit()  # the session is poisoned until rolled back
    assert rows(engine) == {1: ("newer", newer)}
    stale.release()


@pytest.mark.parametrize(
    "shape", ["executemany", "executemany-returning", "multi-values", "orm-bulk"]
)
def test_a_many_row_upsert_touching_one_newer_row_is_refused_and_commits_nothing(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine, shape: str
) -> None:
    """Every proposed row either inserts or updates, so the row count must equal the
    number of rows proposed: one skipped by the fence makes the whole statement stale."""
    stale = fencer.acquire("job:1", 5)
    newer = write_newer(fencer, make_session, 2)
    proposed = [{"id": i, "result": "stale"} for i in (1, 2, 3)]
    params: Any = None
    stmt: Any
    if shape == "multi-values":
        stmt = insert(jobs).values(proposed)
    else:
        stmt = insert(Job if shape == "orm-bulk" else jobs)
        params = proposed
    stmt = stmt.on_conflict_do_update(index_elements=["id"], set_={"result": stmt.excluded.result})
    if shape == "executemany-returning":  # SQLAlchemy's "insertmanyvalues" batches
        stmt = stmt.returning(jobs.c.id)
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        _session_sender(make_session)(stale, stmt, params)
    assert refused.value.primary_keys == ((2,),)
    assert refused.value.current_fences == (newer,)
    assert rows(engine) == {2: ("newer", newer)}  # rows 1 and 3 were not committed either
    stale.release()


def cell_upsert(value: str) -> Any:
    stmt = insert(Cell).values(sheet="s", pos=1, value=value)
    return stmt.on_conflict_do_update(
        index_elements=[Cell.sheet, Cell.pos], set_={"value": stmt.excluded.value}
    )


def test_a_stale_upsert_on_a_composite_key_names_the_whole_key(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    stale = fencer.acquire("sheet:s", 5)
    with fencer.acquire("newer", 5) as newer:
        _session_sender(make_session)(newer, cell_upsert("newer"), None)
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        _session_sender(make_session)(stale, cell_upsert("stale"), None)
    assert refused.value.primary_keys == (("s", 1),)
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT sheet, pos, value, fence FROM cells")).all()
    assert [tuple(r) for r in found] == [("s", 1, "newer", newer.token)]
    stale.release()


async def test_an_async_sessions_upsert_is_fenced(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
) -> None:
    stale = await afencer.acquire("job:1", 30)
    async with afencer.acquire("newer", 30) as newer, make_async_session() as session:
        newer.bind(session)
        await session.execute(upsert(Job, "newer"))
        await session.execute(upsert(Job, "newer again"))
        await session.commit()
    async with make_async_session() as session:
        stale.bind(session)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            await session.execute(upsert(Job, "stale").returning(Job.id))
        await session.rollback()
    assert refused.value.current_fences == (newer.token,)
    assert rows(engine) == {1: ("newer again", newer.token)}
    await stale.release()


# ------------------------------------------------------ the guard-removal pairs


def without_the_fence_predicate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rewrite, "fence_predicate", lambda col, token: sa.true())


def test_without_the_fence_predicate_the_stale_upsert_lands(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    front: tuple[str, Send, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pair of the stale-upsert refusals: the DO UPDATE's comparison is what refuses."""
    _, send, target = front
    without_the_fence_predicate(monkeypatch)
    stale = fencer.acquire("job:1", 5)
    write_newer(fencer, make_session, 1)
    send(stale, upsert(target, "stale"), None)
    assert rows(engine) == {1: ("stale", stale.token)}  # the newer holder's row overwritten
    stale.release()


def test_without_the_fence_predicate_a_stale_composite_key_upsert_lands(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_the_fence_predicate(monkeypatch)
    stale = fencer.acquire("sheet:s", 5)
    with fencer.acquire("newer", 5) as newer:
        _session_sender(make_session)(newer, cell_upsert("newer"), None)
    _session_sender(make_session)(stale, cell_upsert("stale"), None)
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT value, fence FROM cells")).all()
    assert [tuple(r) for r in found] == [("stale", stale.token)]
    stale.release()


async def test_without_the_fence_predicate_an_async_stale_upsert_lands(
    afencer: sa_fence.AsyncFencer,
    make_async_session: async_sessionmaker[AsyncSession],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_the_fence_predicate(monkeypatch)
    stale = await afencer.acquire("job:1", 30)
    async with afencer.acquire("newer", 30) as newer, make_async_session() as session:
        newer.bind(session)
        await session.execute(upsert(Job, "newer"))
        await session.commit()
    async with make_async_session() as session:
        stale.bind(session)
        await session.execute(upsert(Job, "stale"))
        await session.commit()
    assert rows(engine) == {1: ("stale", stale.token)}
    await stale.release()


def test_without_the_upsert_rewrite_the_stale_upsert_lands_and_keeps_the_newer_fence(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pair: with the DO UPDATE left as the caller wrote it (what refusing upserts
    guarded against, before they were fenced), a stale holder overwrites the row."""
    monkeypatch.setattr(_rewrite, "_fence_upsert", lambda stmt, fence_col: (stmt, None))
    stale = fencer.acquire("job:1", 5)
    newer = write_newer(fencer, make_session, 1)
    _session_sender(make_session)(stale, upsert(jobs, "stale"), None)
    assert rows(engine) == {1: ("stale", newer)}
    stale.release()


def test_without_the_row_count_check_the_stale_upsert_passes_silently(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pair: the predicate alone skips the row; the row count check is what raises."""
    original = _rewrite._fence_upsert
    monkeypatch.setattr(_rewrite, "_fence_upsert", lambda s, c: (original(s, c)[0], None))
    stale = fencer.acquire("job:1", 5)
    newer = write_newer(fencer, make_session, 1)
    assert _session_sender(make_session)(stale, upsert(jobs, "stale"), None) == 0
    assert rows(engine) == {1: ("newer", newer)}
    stale.release()


# ----------------------------------------------------------- what is refused


@pytest.mark.parametrize("key", ["name", "column"])
def test_an_upsert_whose_set_names_the_fence_is_refused_and_nothing_is_sent(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    statements: list[str],
    key: str,
) -> None:
    stmt = insert(jobs).values(id=1, result="x")
    fence_key: Any = "fence" if key == "name" else jobs.c.fence
    stmt = stmt.on_conflict_do_update(index_elements=["id"], set_={fence_key: 0, "result": "y"})
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        statements.clear()
        with pytest.raises(sa_fence.FencingConfigError, match=r"set_=.*sets jobs\.fence itself"):
            session.execute(stmt)
        assert not [s for s in statements if "INSERT" in s]
        session.rollback()
    assert rows(engine) == {}


# ----------------------------------------------- do nothing, and a WHERE of one's own


def test_on_conflict_do_nothing_inserts_with_the_token_and_leaves_a_newer_row_alone(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    front: tuple[str, Send, Any],
) -> None:
    _, send, target = front
    stale = fencer.acquire("job:1", 5)
    newer = write_newer(fencer, make_session, 2)
    stmt = insert(target).values([{"id": 1, "result": "new"}, {"id": 2, "result": "stale"}])
    assert send(stale, stmt.on_conflict_do_nothing(), None) == 1
    assert rows(engine) == {1: ("new", stale.token), 2: ("newer", newer)}
    stale.release()


def test_an_upsert_with_its_own_where_skips_newer_rows_silently_like_a_criteria_update(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """A DO UPDATE ``where=`` may skip rows on purpose, so a short row count proves
    nothing: rows carrying a newer fence are skipped without an error, and
    ``rowcount`` tells how many were written (documented in docs/statements.md)."""
    stale = fencer.acquire("job:1", 5)
    newer = write_newer(fencer, make_session, 1, 2)

    def conditional(target_id: int) -> Any:
        stmt = insert(jobs).values(id=target_id, result="stale")
        return stmt.on_conflict_do_update(
            index_elements=["id"],
            set_={"result": stmt.excluded.result},
            where=jobs.c.result != "skip me",
        )

    send = _session_sender(make_session)
    assert send(stale, conditional(1), None) == 0  # skipped: a newer fence
    assert rows(engine) == {1: ("newer", newer), 2: ("newer", newer)}
    with fencer.acquire("newest", 5) as newest:
        assert send(newest, conditional(2), None) == 1  # the caller's WHERE and the fence pass
    assert rows(engine)[2] == ("stale", newest.token)
    stale.release()


def test_an_insert_from_select_upsert_skips_newer_rows_silently(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """``INSERT ... SELECT`` proposes rows the statement does not count, so it cannot
    tell a skipped row from one never proposed: newer rows are skipped silently."""
    stale = fencer.acquire("job:1", 5)
    newer = write_newer(fencer, make_session, 2)
    source: Any = sa.select(
        sa.literal_column("n").label("id"), sa.literal("from select").label("result")
    ).select_from(sa.text("generate_series(1, 2) AS n"))
    stmt = insert(jobs).from_select(["id", "result"], source)
    stmt = stmt.on_conflict_do_update(index_elements=["id"], set_={"result": stmt.excluded.result})
    assert _session_sender(make_session)(stale, stmt, None) == 1
    assert rows(engine) == {1: ("from select", stale.token), 2: ("newer", newer)}
    stale.release()


# --------------------------------- INSERT forms that failed to compile when fenced


@pytest.mark.parametrize("form", ["multi-values", "from-select", "from-union"])
def test_multi_row_and_insert_select_inserts_write_the_token_on_every_row(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    front: tuple[str, Send, Any],
    form: str,
) -> None:
    """Both raised InvalidRequestError inside the rewrite (values() refuses to mix
    forms, and an INSERT ... SELECT takes no values())."""
    _, send, target = front
    if form == "multi-values":
        stmt: Any = insert(target).values([{"id": 1, "result": "a"}, {"id": 2, "result": "b"}])
    else:
        one = sa.select(sa.literal(1).label("id"), sa.literal("a").label("result"))
        two = sa.select(sa.literal(2).label("id"), sa.literal("b").label("result"))
        source: Any = sa.union_all(one, two) if form == "from-union" else one
        stmt = insert(target).from_select(["id", "result"], source)
    with fencer.acquire("job:1", 5) as lease:
        send(lease, stmt, None)
    expected = {1: ("a", lease.token), 2: ("b", lease.token)}
    if form == "from-select":
        del expected[2]
    assert rows(engine) == expected


def test_an_insert_select_that_names_the_fence_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    source = sa.select(sa.literal(1), sa.literal("x"), sa.literal(2**63 - 1))
    stmt = insert(jobs).from_select(["id", "result", "fence"], source)
    with (
        fencer.acquire("job:1", 5) as lease,
        pytest.raises(sa_fence.FencingConfigError, match=r"sets jobs\.fence itself"),
    ):
        _session_sender(make_session)(lease, stmt, None)
    assert rows(engine) == {}


# --------------------------------------------------------- a guarded table


@pytest.fixture(scope="module")
def guarded() -> Iterator[sa.Engine]:
    with fresh_database("upsert_guard") as engine:
        upgrade_demo_schema(engine)  # job_steps has a "reject" guard: every writer presents
        yield engine


def test_fenced_upserts_pass_a_guard_trigger_and_a_stale_one_is_refused(
    guarded: sa.Engine, redis_client: Any, key_prefix: str
) -> None:
    fencer = sa_fence.Fencer(redis_client, guarded, key_prefix=key_prefix)
    make = sa_fence.install(sessionmaker(guarded))
    table: Any = DemoStep.__table__

    def demo_upsert(output: str) -> Any:
        stmt = insert(DemoStep).values(job_id=1, step=1, output=output)
        return stmt.on_conflict_do_update(
            index_elements=["job_id", "step"], set_={"output": stmt.excluded.output}
        )

    try:
        stale = fencer.acquire("job:1", 5)
        with fencer.acquire("newer", 5) as newer:
            for result in ("inserted", "updated"):
                _session_sender(make)(newer, demo_upsert(result), None)
        with guarded.connect() as conn:
            found = conn.execute(sa.text(f"SELECT output, fence FROM {table.name}")).all()
        assert [tuple(r) for r in found] == [("updated", newer.token)]
        with pytest.raises(sa_fence.StaleTokenError):
            _session_sender(make)(stale, demo_upsert("stale"), None)
        with guarded.connect() as conn:
            found = conn.execute(sa.text(f"SELECT output, fence FROM {table.name}")).all()
        assert [tuple(r) for r in found] == [("updated", newer.token)]
        stale.release()
    finally:
        fencer.close()


def test_without_the_token_presented_in_the_comparison_the_guard_refuses_a_repeat_upsert(
    guarded: sa.Engine, redis_client: Any, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pair of the guarded upserts: the DO UPDATE's comparison presents the token
    (set_config) before the trigger runs; compared bare, the holder's second upsert
    of its own row (the fence unchanged, so no token in it) is refused by the guard."""
    monkeypatch.setattr(
        _rewrite, "fence_predicate", lambda col, token: sa.func.coalesce(col, 0) <= token
    )
    fencer = sa_fence.Fencer(redis_client, guarded, key_prefix=key_prefix)
    make = sa_fence.install(sessionmaker(guarded))
    stmt = insert(DemoStep).values(job_id=2, step=1, output="x")
    stmt = stmt.on_conflict_do_update(
        index_elements=["job_id", "step"], set_={"output": stmt.excluded.output}
    )
    try:
        with fencer.acquire("job:2", 5) as lease:
            _session_sender(make)(lease, stmt, None)  # the INSERT: its fence is its token
            with pytest.raises(sa_fence.UnfencedWriteError):
                _session_sender(make)(lease, stmt, None)
    finally:
        fencer.close()
